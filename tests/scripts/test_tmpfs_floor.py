"""bench/tmpfs_floor.py runs every way on a small file, prints one line each and leaves no scratch file behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "tmpfs_floor.py"


def test_every_way_runs_and_cleans_up(tmp_path: Path) -> None:
    source = tmp_path / "source.bin"
    source.write_bytes(bytes(range(256)) * (5 << 12))  # 5 MB: a whole 4 MB block and a partial one
    out = tmp_path / "out"
    out.mkdir()
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(source), str(out), "1"], capture_output=True, text=True, check=True
    )
    ways = [line.split()[0] for line in result.stdout.splitlines()]
    assert ways == ["pread", "pread-huge", "mmap", "mmap-populate", "fallocate", "copy_file_range", "pwrite-only"]
    assert list(out.iterdir()) == []
