"""``reshard.engine.move.gather``: the in-place gather and split of rank slices read from files agrees with the plain
``reshard.geometry.tensors`` gather / split on every partition kind, and names a divergent replica's rank and file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixtures.tp import arange
from safetensors.torch import save_file

from reshard.engine.move import gather as engine_gather
from reshard.engine.move.buffers import BufferPool
from reshard.engine.move.digest import digest_of
from reshard.engine.move.work import plan_work, read_phase
from reshard.engine.plan.planner import SourceTensor, TargetTensor, TensorPlan
from reshard.errors import DivergentReplicaError
from reshard.formats.readers import SafetensorsReader, TorchReader
from reshard.formats.safetensors.writer import byte_chunks, tensor_bytes
from reshard.geometry import Packed, Replicate, Shard, Vocab, rank_shapes
from reshard.geometry.tensors import gather, split
from reshard.io import direct as direct_io
from reshard.layouts.base import TensorRef


def one_tensor(source: SourceTensor, rank_shapes: tuple) -> TensorPlan:
    """The plan of one tensor kept under its name and partition, with the given target rank shapes."""
    target = TargetTensor(source.name, source.shape, source.code, source.partition, tuple(rank_shapes))
    return TensorPlan((source,), (target,))


def _refs(tmp_path: Path, slices: list[torch.Tensor], fmt: str) -> tuple[TensorRef, ...]:
    """Rank slices written to one file per rank, in the given format, read back lazily."""
    refs = []
    for rank, piece in enumerate(slices):
        if fmt == "safetensors":
            path = tmp_path / f"rank{rank}.safetensors"
            save_file({"w": piece.contiguous()}, path)
            reader = SafetensorsReader(path)
        else:
            path = tmp_path / f"rank{rank}.pt"
            torch.save({"w": piece.contiguous()}, path)
            reader = TorchReader(path)
        refs.append(TensorRef("w", rank, reader, "w", reader.headers["w"]))
    return tuple(refs)


CASES = {
    "shard0": (Shard(0), (8, 6), 2, 4, {}),
    "shard1": (Shard(1), (6, 8), 4, 2, {}),
    "shard1-3d": (Shard(1), (3, 8, 5), 2, 4, {}),
    "shard1-long-rows": (Shard(1), (5, 1024), 2, 4, {}),  # rows >= 1 KB: read and written row by row
    "shard2-long-rows": (Shard(2), (2, 3, 1024), 4, 2, {}),
    "vocab1-long-rows": (Vocab(1), (3, 1001), 2, 4, {"vocab": 1001}),
    "vocab0-pad-more": (Vocab(0), (13, 4), 2, 4, {"vocab": 13}),
    "vocab0-pad-less": (Vocab(0), (13, 4), 4, 1, {"vocab": 13}),
    "vocab1": (Vocab(1), (3, 10), 4, 2, {"vocab": 10}),
    "packed0": (Packed(0, (8, 8)), (16, 3), 4, 2, {}),
    "packed1": (Packed(1, (4, 8)), (3, 12), 2, 4, {}),
    "packed0-to-1": (Packed(0, (4, 4, 8)), (16, 2), 4, 1, {}),
    "replicate": (Replicate(), (5, 3), 4, 2, {}),
    "uneven": (Shard(0), (10, 3), 3, 4, {"uneven": True}),
}


def _source_slices(partition, full: torch.Tensor, tp: int, vocab: int | None, uneven: bool) -> list[torch.Tensor]:
    padded = None
    if isinstance(partition, Vocab):
        padded = -(-vocab // tp) * tp
        if tp == 4:
            padded += tp  # a source padded further than needed: the extra rows are not data
    return split(full, partition, tp, padded=padded, uneven=uneven)


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_prepare_matches_gather_then_split(tmp_path: Path, case: str, fmt: str) -> None:
    partition, shape, source_tp, target_tp, extra = CASES[case]
    vocab, uneven = extra.get("vocab"), extra.get("uneven", False)
    full = arange(shape, torch.bfloat16 if fmt == "torch" else torch.float32)
    slices = _source_slices(partition, full, source_tp, vocab, uneven)
    refs = _refs(tmp_path, slices, fmt)
    target_padded = -(-vocab // target_tp) * target_tp if vocab else None
    targets = tuple(rank_shapes(partition, full.shape, target_tp, padded=target_padded, uneven=uneven))
    plan = one_tensor(SourceTensor("w", refs, partition, "test", tuple(full.shape)), targets)

    work = plan_work(plan, target_tp=target_tp)
    ((name, canonical, pieces),) = engine_gather.gather_and_split(work, allow_divergent=False)

    expected_full = gather([s.contiguous() for s in slices], partition, vocab_size=vocab, uneven=uneven)
    assert name == "w"
    assert torch.equal(canonical, full) and torch.equal(expected_full, full)
    expected = split(full, partition, target_tp, padded=target_padded, uneven=uneven)
    assert [tuple(p.shape) for p in pieces] == list(targets)
    for got, want in zip(pieces, expected, strict=True):  # the bytes the writers take
        assert b"".join(bytes(chunk) for chunk in byte_chunks(got)) == bytes(tensor_bytes(want))
    assert digest_of(canonical) == digest_of(full.contiguous())
    if isinstance(partition, Packed) and partition.dim == 0 and target_tp > 1:  # views of the buffer, no copy
        storage = canonical.untyped_storage().data_ptr()
        assert all(p.untyped_storage().data_ptr() == storage for piece in pieces for p in piece.parts)
        assert work.cost == full.nbytes + direct_io.ALIGN  # so the budget holds no copy for them either


def test_divergent_replica_names_the_rank_and_file(tmp_path: Path) -> None:
    same = arange((4, 3))
    other = same.clone()
    other[1, 2] += 0.5
    refs = _refs(tmp_path, [same, same, other], "safetensors")
    plan = one_tensor(SourceTensor("w", refs, Replicate(), "test", (4, 3)), ((4, 3),))
    work = plan_work(plan, target_tp=1)
    with pytest.raises(DivergentReplicaError, match=r"rank0\.safetensors.*w.*between rank 0 and rank 2.*0\.5"):
        engine_gather.gather_and_split(work, allow_divergent=False)
    ((_, canonical, _),) = engine_gather.gather_and_split(work, allow_divergent=True)
    assert torch.equal(canonical, same)


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
@pytest.mark.parametrize("partition", [Shard(0), Shard(1), Replicate()], ids=["rows", "columns", "replicated"])
def test_slices_are_read_into_a_buffer_on_their_files_phase(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, partition: Shard | Replicate
) -> None:
    """The gather buffer starts on the 4 KB phase of rank 0's slice in its file (rank files alike put every
    slice of a dim-0 split on it), and so do the blocks of a column split's rows: every whole block is read
    straight into place, only the partial blocks at the slices' ends go through the staging buffers."""
    full = arange((64, 1024))  # float32: 256 KB, 4 KB a row
    slices = [full] * 4 if isinstance(partition, Replicate) else list(full.chunk(4, dim=partition.dim))
    source = SourceTensor("w", _refs(tmp_path, slices, fmt), partition, "test", tuple(full.shape))
    if not direct_io.DirectSource(source.refs[0].file).direct:
        pytest.skip("this file system has no O_DIRECT")
    copied: list[int] = []
    real = direct_io.copy_bytes
    monkeypatch.setattr(direct_io, "copy_bytes", lambda to, what: copied.append(len(what)) or real(to, what))
    pool = BufferPool(1 << 30)
    _, buffer = pool.get(full.shape, full.dtype, phase=read_phase(source))
    gathered = engine_gather.gather_into(source, buffer, allow_divergent=True)
    assert torch.equal(gathered, full)
    if not (isinstance(partition, Shard) and partition.dim == 1):  # column blocks: each block on its own phase
        assert (buffer.data_ptr() - source.refs[0].position) % direct_io.ALIGN == 0
    assert 0 < sum(copied) <= 2 * direct_io.ALIGN * len(source.refs)
