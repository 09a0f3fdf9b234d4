"""The ``reshard`` console script (``reshard.cli:run``) ends with ``os._exit``: its output must still be
complete on a pipe and its exit codes those of the command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from fixtures import SAMPLES


def reshard(*args: object) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", "from reshard.cli import run; run()", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, check=False)


def test_a_report_on_a_pipe_is_complete_and_the_exit_code_kept() -> None:
    done = reshard("check", SAMPLES / "tiny-llama-tp2", "--tp", 3, "--json")  # 8 heads: cannot split 3 ways
    assert done.returncode == 1
    report = json.loads(done.stdout)
    assert not report["ok"] and len(report["tensors"]) == 21


def test_a_converted_checkpoint_is_whole_when_the_process_ends(tmp_path: Path) -> None:
    done = reshard("convert", SAMPLES / "tiny-llama-tp2", "--tp", 1, "-o", tmp_path / "full", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tp"] == 1
    assert reshard("verify", tmp_path / "full", "-q").returncode == 0


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    done = reshard("inspect", tmp_path / "empty")
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "empty" in done.stderr
