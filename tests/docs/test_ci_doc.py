"""The examples of docs/ci.md ("Use reshard in CI"), extracted and run as written."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest
import yaml
from fixtures import ROOT
from fixtures.models import tiny_llama

CI_DOC = ROOT / "docs" / "ci.md"


def ci_section() -> str:
    return CI_DOC.read_text()


def code_block(language: str) -> str:
    [block] = re.findall(rf"```{language}\n(.*?)```", ci_section(), flags=re.DOTALL)
    return block


def load_example(tmp_path: Path):
    """The pytest example as the module a user would save under the name its first line gives."""
    source = code_block("python")
    assert source.startswith("# tests/test_checkpoint.py\n")
    path = tmp_path / "test_checkpoint.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("readme_test_checkpoint", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_tests(module) -> list[str]:
    names = [name for name in vars(module) if name.startswith("test_")]
    for name in names:
        getattr(module, name)()
    return names


def test_pytest_example_passes_on_a_real_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tiny_llama(tmp_path / "ckpt", vocab=1001)
    monkeypatch.setenv("CKPT", str(tmp_path / "ckpt"))
    module = load_example(tmp_path)
    assert run_tests(module) == ["test_checkpoint_reslices_without_losing_a_bit", "test_tp2_export_is_the_same_model"]


def test_pytest_example_fails_on_a_model_that_cannot_be_split(tmp_path: Path, monkeypatch) -> None:
    tiny_llama(tmp_path / "ckpt", vocab=1001, hidden_size=48, num_attention_heads=6, num_key_value_heads=2)  # 6 heads
    monkeypatch.setenv("CKPT", str(tmp_path / "ckpt"))
    module = load_example(tmp_path)
    with pytest.raises(AssertionError, match=r"round trip through tp=4: 4 difference\(s\)"):
        module.test_checkpoint_reslices_without_losing_a_bit()


def test_github_actions_job_runs(cli, tmp_path: Path) -> None:
    job = yaml.safe_load(code_block("yaml"))["jobs"]["checkpoint"]
    runs = [step["run"] for step in job["steps"] if "run" in step]
    assert "pytest tests/test_checkpoint.py" in runs  # the file the python example is saved as
    commands = [shlex.split(run) for run in runs if run.startswith("reshard ")]
    assert commands
    tiny_llama(tmp_path / "ckpt", vocab=1001)
    env = {"CKPT": str(tmp_path / "ckpt")}
    for argv in commands:
        args = [env.get(a[1:], a) if a.startswith("$") else a for a in argv[1:]]  # the shell's "$CKPT"
        result = cli(*args)
        assert result.exit_code == 0, result.output
        assert '"ok": true' in result.stdout
    assert job["env"]["CKPT"] == "checkpoints/latest"
