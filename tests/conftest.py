"""Shared fixtures: an offline, quiet environment and a CLI runner.

pytest puts ``tests/`` (this file's folder, which has no ``__init__.py``) on ``sys.path``, so every test module
imports the checkpoint builders of ``tests/fixtures/`` as ``fixtures``. The test folders have no ``__init__.py``
either: test module basenames are unique across them.
"""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner, Result
from hub.fixture import hub  # noqa: F401 - the local Hugging Face Hub server (tests/hub/)
from oracles import keep_megatron_out_of_process, mcore_oracle  # noqa: F401 - the Megatron-Core oracle fixture

from reshard.cli import main

# tqdm reads TQDM_DISABLE once, when it is first imported, and test modules that import huggingface_hub at
# collection import it before any fixture runs: set it here too, not only in the autouse fixture below.
os.environ.setdefault("TQDM_DISABLE", "1")
# Megatron-Core is installed for the oracle (tests/oracles/), which runs it in subprocesses; importing it here would
# change what torch.load returns for every later test.
keep_megatron_out_of_process()


@pytest.fixture(scope="session", autouse=True)
def _reshard_cache(tmp_path_factory: pytest.TempPathFactory):
    """reshard's cache (``RESHARD_CACHE_DIR``) in the session's temporary folder, never the user's home: set before
    any fixture of a wider scope runs a command, shared by every test (and the subprocesses they start)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RESHARD_CACHE_DIR", str(tmp_path_factory.mktemp("reshard_cache")))
        yield


@pytest.fixture(autouse=True)
def _offline_quiet(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """No test reaches the network or the user's caches; progress bars stay off."""
    home = tmp_path_factory.mktemp("hf_home")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "200")


@pytest.fixture
def cli():
    """Run ``reshard ARGS...`` in-process; unexpected exceptions propagate as tracebacks."""
    runner = CliRunner()

    def run(*args: object) -> Result:
        return runner.invoke(main, [str(a) for a in args], catch_exceptions=False)

    return run
