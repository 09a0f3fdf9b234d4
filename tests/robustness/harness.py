"""Running a reshard command on a damaged checkpoint and checking what must hold whatever the damage.

Shared by the corpus tests and ``fuzz_unseen.py``: every command runs in-process (``CliRunner``), and
:func:`judge` lists every broken promise: the exit code, a traceback, the error line, an output or a
temporary file left behind, a changed input byte, a payload that ran.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from click.testing import CliRunner

from reshard.cli import main

# What each command is given besides the checkpoint: OUT is the output folder (convert, fix).
COMMANDS = ("inspect", "check", "convert", "fix", "verify")


@dataclass
class Outcome:
    command: str
    args: list[str]
    exit_code: int
    stdout: str
    stderr: str
    exception: BaseException | None = None  # an exception that escaped the command (a traceback)


@dataclass
class Workspace:
    """Where one case runs: the damaged checkpoint, an empty folder for outputs, an empty $TMPDIR, and the
    file a hostile payload would create."""

    root: Path
    ckpt: Path = field(init=False)
    outs: Path = field(init=False)
    tmp: Path = field(init=False)
    marker: Path = field(init=False)

    def __post_init__(self) -> None:
        self.ckpt = self.root / "ckpt"
        self.outs = self.root / "outs"
        self.tmp = self.root / "tmp"
        self.marker = self.root / "PAYLOAD-RAN"
        self.outs.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(parents=True, exist_ok=True)


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` (symlinks not followed): kind, mode and sha256 (or link target)."""
    entries: dict[str, tuple] = {}
    for folder, dirs, files in os.walk(root, followlinks=False):
        for name in [*dirs, *files]:
            path = Path(folder) / name
            info = path.lstat()
            key = str(path.relative_to(root))
            if stat.S_ISLNK(info.st_mode):
                entries[key] = ("link", os.readlink(path))
            elif stat.S_ISDIR(info.st_mode):
                entries[key] = ("dir", stat.S_IMODE(info.st_mode))
            else:
                entries[key] = ("file", stat.S_IMODE(info.st_mode), _digest(path), info.st_mtime_ns)
    return entries


def _digest(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as err:
        return f"unreadable: {err.errno}"


@contextmanager
def temporary_dir(folder: Path):
    """``tempfile`` (verify --roundtrip's temporary folders) under ``folder`` for the duration."""
    before, env = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir = str(folder)
    os.environ["TMPDIR"] = str(folder)
    try:
        yield
    finally:
        tempfile.tempdir = before
        if env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = env


def run(command: str, ckpt: Path, extra: Sequence[str], ws: Workspace) -> Outcome:
    """``reshard COMMAND CKPT EXTRA...`` in-process; an escaping exception is kept, not raised."""
    args = [command, str(ckpt), *extra]
    if command in ("convert", "fix"):
        args += ["-o", str(ws.outs / "out"), "-q"]
    if command == "verify":
        args += ["--json"]  # a finding (exit 1) is reported there, naming the file
    with temporary_dir(ws.tmp):
        result = CliRunner().invoke(main, args, catch_exceptions=True)
    escaped = result.exception if not isinstance(result.exception, SystemExit) else None
    return Outcome(command, args, result.exit_code, result.stdout, result.stderr, escaped)


def judge(
    outcome: Outcome,
    ws: Workspace,
    before: dict[str, tuple],
    *,
    exit_code: int,
    names: Sequence[str] = (),
    several: bool = False,
) -> list[str]:
    """Every promise ``outcome`` broke. ``names``: fragments the error line (or, for exit 1, the report) must
    contain; ``several``: a list of problems (``N problems:`` and one line each) is allowed."""
    broken = []
    what = " ".join(outcome.args[:1] + outcome.args[2:])
    if outcome.exception is not None:
        broken.append(f"{what}: traceback: {type(outcome.exception).__name__}: {outcome.exception}")
    if "Traceback" in outcome.stderr or "Traceback" in outcome.stdout:
        broken.append(f"{what}: a traceback was printed")
    if outcome.exit_code != exit_code:
        broken.append(f"{what}: exit {outcome.exit_code}, expected {exit_code}: {outcome.stderr.strip()[:300]}")
    if exit_code == 2:
        lines = outcome.stderr.strip().splitlines()
        one = len(lines) == 1 and lines[0].startswith("Error: ")
        listed = several and lines and lines[0].startswith("Error: ") and all(x.startswith("  ") for x in lines[1:])
        if not (one or listed):
            broken.append(f"{what}: not one error line: {outcome.stderr.strip()[:300]!r}")
        if outcome.stdout:
            broken.append(f"{what}: printed to stdout on error: {outcome.stdout[:200]!r}")
    text = outcome.stderr if exit_code == 2 else outcome.stdout + outcome.stderr
    for name in names if exit_code != 0 else ():
        if name not in text:
            broken.append(f"{what}: {name!r} is not named in: {text.strip()[:300]!r}")
    left = sorted(p.name for p in ws.outs.iterdir()) if exit_code != 0 else []
    if left:
        broken.append(f"{what}: left in the output folder: {left}")
    temporary = sorted(p.name for p in ws.tmp.iterdir())
    if temporary:
        broken.append(f"{what}: left in $TMPDIR: {temporary}")
    after = snapshot(ws.ckpt)
    if after != before:
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        broken.append(f"{what}: the input changed: {changed[:5]}")
    if ws.marker.exists():
        broken.append(f"{what}: a hostile payload ran")
    return broken


def clear_outputs(ws: Workspace) -> None:
    """Empty the output folder after a command that was meant to write (exit 0)."""
    import shutil

    for child in ws.outs.iterdir():
        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
