# make demo: install into .venv and convert the sample checkpoint.  make test: install, lint, type-check, run every test.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SAMPLE := sample_ckpts/tiny-llama-tp2

.PHONY: install demo test typecheck lint clean

$(BIN)/reshard: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test,oracle]'
	touch $@

install: $(BIN)/reshard

demo: install
	rm -rf demo-out
	$(BIN)/reshard inspect $(SAMPLE)
	$(BIN)/reshard convert $(SAMPLE) --tp 1 -o demo-out/full
	$(BIN)/reshard convert demo-out/full --tp 4 -o demo-out/tp4
	$(BIN)/reshard fix sample_ckpts/tiny-llama-65535-tp2 --vocab 65535 -o demo-out/fixed

typecheck: install
	$(BIN)/mypy

test: install
	$(BIN)/ruff check .
	$(MAKE) typecheck
	$(BIN)/python -m pytest -q

clean:
	rm -rf demo-out .pytest_cache .hypothesis .mypy_cache
