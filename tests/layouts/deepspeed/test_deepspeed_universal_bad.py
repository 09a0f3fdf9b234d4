"""What ``--layout deepspeed`` refuses before any output exists: one line, exit 2, nothing left behind. (A refusal
that needs a source with a training state is in ``test_deepspeed_resume.py``.)"""

from __future__ import annotations

import pytest
from fixtures.models import tiny_llama


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("ds-bad") / "hf"
    tiny_llama(folder, vocab=1001)
    return folder


@pytest.mark.parametrize(("args", "match"), [
    ((), "a DeepSpeed checkpoint is written only with its optimizer state"),
    (("--with-optimizer",), "holds no training state reshard reads"),
    (("--with-optimizer", "--pp", 2), "the deepspeed layout has no pipeline stages"),
], ids=["weights-only", "no-training-state", "pp"])  # fmt: skip
def test_refused_in_one_line(hf_source, cli, tmp_path, args, match):
    out = tmp_path / "out"
    result = cli("convert", hf_source, "--tp", 1, "--layout", "deepspeed", *args, "-o", out, "-q")
    assert result.exit_code == 2, result.output
    assert match in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert not out.exists() and list(tmp_path.iterdir()) == []
