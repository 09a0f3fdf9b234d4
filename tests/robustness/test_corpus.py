"""Every broken or hostile checkpoint of the corpus through every command: the documented exit code, no traceback,
one line naming the file (and the tensor or key), no output or temporary file left, the input unchanged, no
payload run."""

from __future__ import annotations

from pathlib import Path

import pytest
from bases import ARGS, copy_base
from corpus import CASES, Case
from harness import COMMANDS, Workspace, clear_outputs, judge, run, snapshot


def test_the_corpus_is_large_and_covers_every_layout() -> None:
    assert len(CASES) >= 60
    assert {c.base for c in CASES} == set(ARGS)


@pytest.mark.parametrize("base", sorted(ARGS))
def test_every_base_passes_every_command(bases: dict[str, Path], tmp_path: Path, base: str) -> None:
    ws = Workspace(tmp_path)
    copy_base(bases[base], ws.ckpt)
    before = snapshot(ws.ckpt)
    for command in COMMANDS:
        outcome = run(command, ws.ckpt, ARGS[base][command], ws)
        assert judge(outcome, ws, before, exit_code=0) == []
        clear_outputs(ws)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_damaged_checkpoint(bases: dict[str, Path], tmp_path: Path, case: Case) -> None:
    ws = Workspace(tmp_path)
    copy_base(bases[case.base], ws.ckpt)
    case.damage(ws.ckpt, ws.marker)
    before = snapshot(ws.ckpt)
    broken = []
    for command in COMMANDS:
        outcome = run(command, ws.ckpt, ARGS[case.base][command], ws)
        expected = case.exit_code(command)
        broken += judge(outcome, ws, before, exit_code=expected, names=case.names, several=case.several)
        clear_outputs(ws)
    assert broken == []
