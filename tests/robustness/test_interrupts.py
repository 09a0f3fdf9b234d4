"""SIGINT and SIGTERM during convert, fix and verify --roundtrip: exit 128 + the signal, one line saying so, and
no output, staged folder, lock or temporary folder left. The signal is sent by the process to itself from inside
the run (a hashed tensor, a publish), so each case stops at a known point."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from bases import ARGS, copy_base
from harness import Workspace, judge, run, snapshot

import reshard.engine.move.execute as execute_module
import reshard.io.interrupts as interrupts
import reshard.io.staging as staging_module


def signal_at_call(monkeypatch: pytest.MonkeyPatch, module: object, name: str, signum: int, *, at: int) -> list[int]:
    """Make ``module.name`` send ``signum`` to this process on its ``at``-th call (once), then carry on."""
    real, calls = getattr(module, name), [0]

    def wrapper(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        if calls[0] == at:
            os.kill(os.getpid(), signum)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def interrupted(outcome, ws: Workspace, before, signum: int) -> list[str]:
    name = signal.Signals(signum).name
    broken = judge(outcome, ws, before, exit_code=128 + signum)
    expected = f"Error: interrupted by {name}: no partial output or temporary files were left"
    if outcome.stderr.strip() != expected:
        broken.append(f"stderr is {outcome.stderr.strip()!r}")
    if signal.getsignal(signum) is interrupts._handler:
        broken.append(f"the {name} handler was not restored")
    return broken


@pytest.mark.parametrize(
    ("base", "command", "extra", "signum", "at"),
    [
        ("hf_ranks", "convert", ["--tp", "4"], signal.SIGTERM, 3),
        ("hf_ranks", "convert", ["--tp", "4", "--jobs", "1"], signal.SIGINT, 6),
        ("hf", "convert", ["--tp", "2", "--layout", "megatron"], signal.SIGTERM, 4),  # torch files, main thread
        ("megatron", "convert", ["--tp", "2"], signal.SIGINT, 2),
        ("loose", "fix", [], signal.SIGTERM, 2),
        ("hf_ranks", "verify", ["--roundtrip", "4"], signal.SIGTERM, 16),  # inside the conversion back
        ("dcp", "verify", ["--roundtrip", "2"], signal.SIGINT, 1),
    ],
    ids=[
        "convert-term",
        "convert-int-one-job",
        "convert-torch-writer",
        "megatron-int",
        "fix-term",
        "roundtrip-back",
        "roundtrip-int",
    ],
)
def test_signal_while_writing(bases, tmp_path: Path, monkeypatch, base, command, extra, signum, at) -> None:
    ws = Workspace(tmp_path)
    copy_base(bases[base], ws.ckpt)
    before = snapshot(ws.ckpt)
    calls = signal_at_call(monkeypatch, execute_module, "move_unit", signum, at=at)
    outcome = run(command, ws.ckpt, [*ARGS[base][command], *extra] if command != "verify" else extra, ws)
    assert calls[0] >= at, "the run ended before the signal was sent"
    assert interrupted(outcome, ws, before, signum) == []


def test_signal_while_publishing_is_held_until_the_output_is_complete(bases, tmp_path: Path, monkeypatch) -> None:
    """A signal during the rename into place is delivered after it: the output is whole, nothing else is left."""
    ws = Workspace(tmp_path)
    copy_base(bases["hf_ranks"], ws.ckpt)
    before = snapshot(ws.ckpt)
    signal_at_call(monkeypatch, staging_module, "_publish", signal.SIGTERM, at=1)
    outcome = run("convert", ws.ckpt, ["--tp", "1"], ws)
    assert outcome.exit_code == 143 and outcome.exception is None
    assert sorted(p.name for p in ws.outs.iterdir()) == ["out"]
    assert {p.name for p in (ws.outs / "out").iterdir()} == {"model.safetensors", "config.json", "reshard.json"}
    assert snapshot(ws.ckpt) == before and not list(ws.tmp.iterdir())


def test_signal_before_writing_leaves_nothing(bases, tmp_path: Path, monkeypatch) -> None:
    import reshard.engine.plan.open as open_module

    ws = Workspace(tmp_path)
    copy_base(bases["sat"], ws.ckpt)
    before = snapshot(ws.ckpt)
    signal_at_call(monkeypatch, open_module, "plan_sources", signal.SIGINT, at=1)
    outcome = run("convert", ws.ckpt, ARGS["sat"]["convert"], ws)
    assert interrupted(outcome, ws, before, signal.SIGINT) == []


def test_a_signal_during_the_cleanup_of_a_failed_run_does_not_cut_it_short(bases, tmp_path: Path, monkeypatch) -> None:
    """A run fails (not by a signal), and SIGTERM comes while its staged folder is being removed (torchrun stopping
    the survivors of a dead worker): the removal finishes, then the signal ends the run, saying so after a look."""
    from reshard.errors import ReshardError

    ws = Workspace(tmp_path)
    copy_base(bases["hf_ranks"], ws.ckpt)
    before = snapshot(ws.ckpt)

    def failing(*args: object, **kwargs: object):
        raise ReshardError("a worker was lost (Connection closed by peer)")

    monkeypatch.setattr(execute_module, "move_unit", failing)
    removals = signal_at_call(monkeypatch, staging_module.shutil, "rmtree", signal.SIGTERM, at=1)
    outcome = run("convert", ws.ckpt, ["--tp", "4"], ws)
    assert removals[0] >= 1
    assert interrupted(outcome, ws, before, signal.SIGTERM) == []


def test_the_message_says_what_was_left_when_a_removal_fails(bases, tmp_path: Path, monkeypatch) -> None:
    """'Nothing was left' is the result of a look: a staged folder that could not be removed is named."""
    ws = Workspace(tmp_path)
    copy_base(bases["hf_ranks"], ws.ckpt)
    signal_at_call(monkeypatch, execute_module, "move_unit", signal.SIGTERM, at=2)
    monkeypatch.setattr(staging_module.shutil, "rmtree", lambda path, ignore_errors=False: None)
    outcome = run("convert", ws.ckpt, ["--tp", "4"], ws)
    left = [p for p in ws.outs.iterdir() if p.name.endswith(".reshard-tmp")]
    assert outcome.exit_code == 143 and len(left) == 1
    assert outcome.stderr.strip() == f"Error: interrupted by SIGTERM: left behind: {left[0]} (remove it)"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_removal_of_the_roundtrip_folder_does_not_cut_it_short(
    bases, tmp_path: Path, monkeypatch, signum
) -> None:
    """verify --roundtrip's temporary folder is removed with the signals held off, as a staged output is: a signal
    that comes while it is being removed ends the run after the removal, and the message says so after a look."""
    ws = Workspace(tmp_path)
    copy_base(bases["hf_ranks"], ws.ckpt)
    before = snapshot(ws.ckpt)
    removals = signal_at_call(monkeypatch, staging_module.shutil, "rmtree", signum, at=1)
    outcome = run("verify", ws.ckpt, ["--roundtrip", "2"], ws)
    assert removals[0] >= 1
    assert interrupted(outcome, ws, before, signum) == []
