"""``scripts/model_coverage.py``: every causal-LM and image-text-to-text model type of the installed transformers is
checked at tp 2, 4 and 8 without a traceback, and ``docs/model-coverage.md`` is the table it writes today.

The whole run takes about 40 s of CPU on the bench machine (270 model types built on the meta device, 6 checks
each), so it runs once, here, for both properties.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def coverage():
    sys.path.insert(0, str(SCRIPTS))
    import model_coverage

    return model_coverage


@pytest.fixture(scope="module")
def verdicts(coverage):
    return [coverage.judge(model_type) for model_type in coverage.model_types()]


def test_no_model_type_gives_a_traceback(verdicts):
    assert {v.model_type: v.tracebacks for v in verdicts if v.tracebacks} == {}
    assert len(verdicts) > 200 and all(len(v.builtin) == len(v.transformers) == 3 for v in verdicts)


def test_the_table_in_the_docs_is_current(coverage, verdicts):
    def table(text: str) -> list[str]:  # all but the timing, which is the machine's
        return [line for line in text.splitlines() if not line.startswith(f"{len(verdicts)} model types:")]

    written = coverage.OUTPUT.read_text()
    assert table(coverage.render(verdicts, 0)) == table(written), "run python scripts/model_coverage.py"


def test_the_families_reshard_has_plans_for_split_at_2_4_and_8(verdicts):
    by_type = {v.model_type: v for v in verdicts}
    for model_type, plan in [
        ("llama", "llama"),
        ("deepseek_v3", "deepseek"),
        ("qwen3_moe", "moe"),
        ("mixtral", "moe"),
        ("gemma3", "gemma"),
        ("glm4", "glm4"),
        ("qwen3_5", "qwen3_5"),
        ("qwen3_next", "qwen3_next"),
        ("qwen2_moe", "moe"),
        ("phi3", "phi3"),
        ("qwen2_vl", "qwen2_vl"),
    ]:
        verdict = by_type[model_type]
        assert verdict.plan == plan and verdict.builtin == {2: "splits", 4: "splits", 8: "splits"}, verdict
    # Qwen2.5-VL-7B's vision MLP is 3420 wide: whole at tp 8 it is not, and the table says so
    assert (
        by_type["qwen2_5_vl"].builtin[8] == "cannot split: shard(dim=0) cannot be split 8 ways: size 3420 does not "
        "divide by tp=8"
    )
