"""Outputs that cannot be written, and outputs two runs want: a full disk (a real small tmpfs where this runs as
root, else ENOSPC injected at the system call), a read-only folder, a folder another run holds, a finished output
another run published first. Each is one line and leaves nothing behind; no run replaces a finished output."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from bases import copy_base
from harness import Workspace, judge, run, snapshot

import reshard.engine.move.execute as execute_module

ROOT = os.geteuid() == 0


@contextmanager
def tmpfs(where: Path, *options: str) -> Iterator[Path]:
    """A small tmpfs mounted at ``where`` (root only), unmounted afterwards."""
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def refused(outcome, ws: Workspace, before, out_parent: Path, *fragments: str) -> list[str]:
    broken = judge(outcome, ws, before, exit_code=2, names=fragments)
    left = sorted(p.name for p in out_parent.iterdir()) if out_parent.is_dir() else []
    return broken + ([f"left beside the output: {left}"] if left else [])


def convert_to(ws: Workspace, out: Path, *extra: str):
    """``reshard convert`` of the workspace's checkpoint to ``out`` (not the workspace's own output folder)."""
    from click.testing import CliRunner
    from harness import Outcome, temporary_dir

    from reshard.cli import main

    args = ["convert", str(ws.ckpt), "--tp", "1", "-o", str(out), "-q", *extra]
    with temporary_dir(ws.tmp):
        result = CliRunner().invoke(main, args, catch_exceptions=True)
    escaped = result.exception if not isinstance(result.exception, SystemExit) else None
    return Outcome("convert", args, result.exit_code, result.stdout, result.stderr, escaped)


@pytest.mark.skipif(not ROOT, reason="mounting a small tmpfs needs root; test_full_disk_injected covers ENOSPC")
def test_full_disk_on_a_real_file_system(bases, tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    copy_base(bases["hf_ranks"], ws.ckpt)
    before = snapshot(ws.ckpt)
    with tmpfs(tmp_path / "small", "size=256k") as small:
        outcome = convert_to(ws, small / "out")
        assert refused(outcome, ws, before, small, "out", "No space left on device") == []


def test_full_disk_injected(bases, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC from the write system calls once some bytes are written, as a full disk answers."""
    ws = Workspace(tmp_path)
    copy_base(bases["hf_ranks"], ws.ckpt)
    before = snapshot(ws.ckpt)
    budget = [200_000]

    def full(call):
        def write(fd, data, *args):
            size = sum(len(b) for b in data) if isinstance(data, list) else len(data)
            budget[0] -= size
            if budget[0] < 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return call(fd, data, *args)

        return write

    monkeypatch.setattr(os, "pwritev", full(os.pwritev))
    monkeypatch.setattr(os, "pwrite", full(os.pwrite))
    outcome = run("convert", ws.ckpt, ["--tp", "1"], ws)
    assert budget[0] < 0, "the injected disk never filled"
    assert judge(outcome, ws, before, exit_code=2, names=["out", "No space left on device"]) == []


def test_read_only_output_folder(bases, tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    copy_base(bases["hf"], ws.ckpt)
    before = snapshot(ws.ckpt)
    if ROOT:  # permission bits do not stop root: a read-only file system does
        with tmpfs(tmp_path / "ro", "size=1m", "ro") as folder:
            outcome = convert_to(ws, folder / "out")
            assert refused(outcome, ws, before, folder, "out", "Read-only file system") == []
    else:
        folder = tmp_path / "ro"
        folder.mkdir(mode=0o555)
        outcome = convert_to(ws, folder / "out")
        assert refused(outcome, ws, before, folder, "out", "Permission denied") == []


def test_a_run_holding_the_output_makes_a_second_fail_at_once(bases, tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    copy_base(bases["hf"], ws.ckpt)
    before = snapshot(ws.ckpt)
    lock = ws.outs / ".out.reshard-lock"
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # what a first run holds while it writes
        outcome = run("convert", ws.ckpt, ["--tp", "1"], ws)
    lock.unlink()
    assert judge(outcome, ws, before, exit_code=2, names=["out", "another reshard run is writing this output"]) == []


def test_a_finished_output_is_never_replaced(bases, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another run (that took no lock) publishes while this one writes: this one's publish refuses to replace it."""
    ws = Workspace(tmp_path)
    copy_base(bases["hf"], ws.ckpt)
    before = snapshot(ws.ckpt)
    theirs = ws.outs / "out"
    real, once = execute_module.move_unit, threading.Lock()

    def publish_theirs(*args: object, **kwargs: object):
        with once:  # worker threads hash at once
            if not theirs.exists():
                theirs.mkdir()
                (theirs / "theirs.txt").write_text("finished first")
        return real(*args, **kwargs)

    monkeypatch.setattr(execute_module, "move_unit", publish_theirs)
    outcome = run("convert", ws.ckpt, ["--tp", "1"], ws)
    assert outcome.exit_code == 2 and "another run finished this output first" in outcome.stderr
    assert sorted(p.name for p in ws.outs.iterdir()) == ["out"] and os.listdir(theirs) == ["theirs.txt"]
    assert snapshot(ws.ckpt) == before and not list(ws.tmp.iterdir())


def test_a_stale_lock_of_a_killed_run_does_not_block(bases, tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    copy_base(bases["hf"], ws.ckpt)
    (ws.outs / ".out.reshard-lock").write_text("")  # left by a run killed with SIGKILL (its flock died with it)
    outcome = run("convert", ws.ckpt, ["--tp", "1"], ws)
    assert outcome.exit_code == 0, outcome.stderr
    assert sorted(p.name for p in ws.outs.iterdir()) == ["out"]


def test_two_concurrent_runs_cannot_both_publish(bases, tmp_path: Path) -> None:
    """Two real processes convert to one output at once: one publishes, the other fails in one line."""
    ws = Workspace(tmp_path)
    copy_base(bases["hf_ranks"], ws.ckpt)
    reshard = str(Path(sys.executable).with_name("reshard"))
    command = [reshard, "convert", str(ws.ckpt), "--tp", "2", "-o", str(ws.outs / "out"), "--json"]
    env = {**os.environ, "TMPDIR": str(ws.tmp)}
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) for _ in "ab"]
    results = [(p.returncode, out.decode(), err.decode()) for p in runs for out, err in [p.communicate()]]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], results
    _, stdout, _ = next(r for r in results if r[0] == 0)
    _, _, stderr = next(r for r in results if r[0] == 2)
    assert len(stderr.strip().splitlines()) == 1 and str(ws.outs / "out") in stderr, stderr
    assert sorted(p.name for p in ws.outs.iterdir()) == ["out"] and not list(ws.tmp.iterdir())
    manifest = json.loads((ws.outs / "out" / "reshard.json").read_text())
    assert manifest["target"] == {"layout": "hf-ranks", "tp": 2}
    assert json.loads(stdout)["output"] == str(ws.outs / "out")
    assert run("verify", ws.outs / "out", [], ws).exit_code == 0
