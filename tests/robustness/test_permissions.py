"""Unreadable inputs and an unwritable output folder, through every command: one line naming the file, exit 2,
nothing left, nothing changed. Run in a process that permission bits apply to (root without the capabilities
that bypass them), since root ignores ``chmod``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from permission_cases import CASES

HERE = Path(__file__).parent


def test_permission_errors(bases: dict[str, Path], tmp_path: Path) -> None:
    command = [
        sys.executable,
        str(HERE / "permission_cases.py"),
        str(next(iter(bases.values())).parent),
        str(tmp_path),
    ]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: permission bits cannot be made to apply")
        command = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--", *command]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(report) == sorted(CASES)
    assert {name: broken for name, broken in report.items() if broken} == {}
