"""A tensor whose declared size needs more memory than the machine has: refused by name, with the bytes it needs
and the bytes available, before any buffer is allocated (the allocator's RuntimeError is not a message)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from bases import ARGS, copy_base
from harness import Workspace, judge, run, snapshot

import reshard.engine.move.gather as gather_module
import reshard.engine.move.work as work_module
from reshard.engine.move.work import check_fits
from reshard.errors import ReshardError
from reshard.plans import built_family


def test_a_tensor_of_2_to_the_40_elements_is_refused_with_its_size_and_the_memory_available(monkeypatch) -> None:
    monkeypatch.setattr(work_module, "memory_available", lambda: 64 << 30)
    source = SimpleNamespace(shape=(2**20, 2**20), refs=[SimpleNamespace(file=Path("ckpt/__0_0.distcp"))])
    work = SimpleNamespace(cost=2**40 * 2, tensor=SimpleNamespace(name="model.embed_tokens.weight", sources=[source]))
    expected = (
        r"ckpt/__0_0.distcp: model.embed_tokens.weight: needs 2,199,023,255,552 bytes of memory to gather "
        r"\(1,099,511,627,776 elements, shape \[1048576, 1048576\]\), more than the 68,719,476,736 bytes available"
    )
    with pytest.raises(ReshardError, match=expected):
        check_fits([work])


@pytest.mark.parametrize("command", ["convert", "fix", "verify"])
def test_commands_that_read_bytes_refuse_before_allocating(bases, tmp_path: Path, monkeypatch, command: str) -> None:
    """The same through the command line, with the memory made smaller than the checkpoint's largest tensor. The
    family check's model, built on the ``meta`` device (no memory), is left out: ``torch.empty`` is counted here."""
    allocations: list[object] = []
    monkeypatch.setattr(built_family, "start", lambda config, names: None)
    monkeypatch.setattr(work_module, "memory_available", lambda: 4096)
    monkeypatch.setattr(gather_module.torch, "empty", lambda *a, **k: allocations.append(a) or pytest.fail("alloc"))
    ws = Workspace(tmp_path)
    copy_base(bases["dcp"], ws.ckpt)
    before = snapshot(ws.ckpt)
    outcome = run(command, ws.ckpt, ARGS["dcp"][command], ws)
    assert judge(outcome, ws, before, exit_code=2, names=("bytes of memory to gather", "4,096 bytes available")) == []
    assert allocations == []
