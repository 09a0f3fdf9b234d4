"""Units whose target slices are runs of their source slices' bytes, moved through one small buffer.

Why: with the checkpoint and the output in memory (tmpfs), what a conversion costs is CPU, and gathering a
tensor into a buffer of its own size costs it three times over: the buffer's fresh pages are faulted in and
zeroed, the buffer is read from memory again to be hashed and checked for NaN/Inf, and again to be written
(4.17 GB hf-ranks tp 8 -> 4 on the 2-core bench VM: 0.46 CPU-s of faults, 1.0 of BLAKE3 and 0.36 of the check
reading cold memory; docs/performance.md). A tensor kept as it is (no transform) need not be gathered whole:

* split along its first dim (the column-parallel weights, the embedding, the head: three quarters of a Llama's
  bytes), or held whole by one source rank, its canonical bytes are byte ranges of its source slices one after
  the other, and each target slice is one or more ranges of those (:class:`Streamed`);
* split along a later dim (the row-parallel weights), a block of its first dim's rows is, in each source slice,
  one range of bytes, and those blocks gathered make a block of the canonical tensor (:class:`RowBlocks`).

Such a unit is moved block by block: each block (about :data:`BLOCK_BYTES`) is read into this thread's reusable
buffer, hashed and checked for NaN/Inf while it is in the cache (:class:`~reshard.engine.digest.RunningDigest`),
and its bytes written to each target slice (:meth:`~reshard.layouts.base.CheckpointWriter.write_part`). No
buffer the size of the tensor, no fresh page, every byte read from memory once; the peak memory of a 4.17 GB
conversion drops from ~800 to ~280 MB.

Only where the source files and the output are in memory (:func:`reshard.io.direct.in_memory`): on a disk, the
direct reads and writes with many blocks in flight (:mod:`reshard.io.direct`) are what keep it busy, and one
synchronous block at a time would not. The byte ranges come from the same functions as the gather's
(:func:`~reshard.engine.gather.copy_plan` for the sources, the gather's own split of the canonical tensor for
the targets, run on a tensor of row numbers), so both paths write the same bytes; ``tests/engine/test_stream.py``
checks them against each other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from reshard.dtypes import dtype_from_code
from reshard.engine.digest import RunningDigest
from reshard.engine.gather import Work, copy_plan, kept_slices
from reshard.io.direct import Batch, in_memory
from reshard.io.joined import Joined
from reshard.io.scratch import scratch
from reshard.layouts.base import CheckpointWriter, TensorRef
from reshard.partition import Partition, Replicate, Vocab, head_replicas

# Bytes per block: small enough to stay in a core's cache between the read, the hash, the check and the writes,
# large enough that the Python calls per block are few (paired runs of a 4.17 GB tp 8 -> 4 in tmpfs on the bench
# VM: 4 MB blocks took 0.95 x the CPU of 1 MB ones, user 0.91 x).
BLOCK_BYTES = 4 << 20
Range = tuple[int, int]


@dataclass(frozen=True)
class Run:
    """Bytes ``[start, start + length)`` of one source rank slice."""

    ref: TensorRef
    start: int
    length: int


@dataclass(frozen=True)
class Streamed:
    """A unit's canonical bytes as source runs in order, and each target rank's slice as canonical byte ranges."""

    runs: tuple[Run, ...]
    targets: tuple[tuple[Range, ...], ...]


@dataclass(frozen=True)
class RowBlocks:
    """A unit split after its first dim (the row-parallel weights), moved ``rows`` rows of that first dim at a
    time: those rows of each source slice are one run of its bytes, gathered into a small buffer as the gather
    places them (:func:`copy_plan`), hashed and checked there, then split as the gather splits and written."""

    rows: int


def streams_to(writer: CheckpointWriter) -> bool:
    """Whether units may be streamed into ``writer``: it writes byte ranges, from worker threads, into memory."""
    return writer.concurrent and getattr(writer, "takes_parts", False) and in_memory(writer.out_dir)


def stream_plan(work: Work, *, target_tp: int, uneven: bool) -> Streamed | RowBlocks | None:
    """The runs of a unit that can be streamed (see the module's docstring); None for any other unit (a
    transform, copies of a replicated tensor to compare, a split after the first dim, pad rows to add, a source
    not read straight from a file in memory), which is gathered."""
    tensor = work.tensor
    if tensor.transform is not None:
        return None
    (source,), _ = tensor.sources, tensor.targets
    refs = source.refs
    if not refs or any(ref.position is None or not in_memory(ref.file) for ref in refs):
        return None
    partition, shape = source.partition, tuple(source.shape)
    if isinstance(partition, Replicate):
        if len(refs) != 1:  # every rank's copy is compared with the first (gather_into)
            return None
        whole = ((0, refs[0].header.nbytes),)
        return Streamed((Run(refs[0], 0, refs[0].header.nbytes),), (whole,) * target_tp)
    dim = partition.dim % len(shape)
    if head_replicas(partition, len(refs)) > 1:  # copies of a head are compared (gather_into)
        return None
    if math.prod(shape[:dim]) != 1:
        return _row_blocks(work, dim)
    row = math.prod(shape[dim + 1 :]) * source.dtype.itemsize
    runs = _source_runs(source.refs, partition, shape[dim], row, uneven=uneven)
    targets = _target_ranges(work, dim, row, target_tp, uneven=uneven)
    if runs is None or targets is None:
        return None
    return Streamed(runs, targets)


def _row_blocks(work: Work, dim: int) -> RowBlocks | None:
    """How many first-dim rows go in a block, for a unit split along ``dim`` > 0; None when its canonical block
    would not be contiguous (pad rows along ``dim``) or a slice needs pad rows the source lacks."""
    (source,), (target,) = work.tensor.sources, work.tensor.targets
    if work.buffer_shapes[0][dim] != source.shape[dim] or any(ref.shape[0] != source.shape[0] for ref in source.refs):
        return None
    if isinstance(source.partition, Vocab) and sum(s[dim] for s in target.rank_shapes) > source.shape[dim]:
        return None
    row = math.prod(source.shape[1:]) * source.dtype.itemsize
    return RowBlocks(max(1, BLOCK_BYTES // max(1, row)))


def _source_runs(
    refs: Sequence[TensorRef], partition: Partition, rows: int, row: int, *, uneven: bool
) -> tuple[Run, ...] | None:
    """The canonical tensor's ``rows`` rows (of ``row`` bytes) as runs of the rank slices, in order (the gather's
    own placement, :func:`copy_plan`; pad rows past ``rows`` left out)."""
    copies, _ = copy_plan(partition, [ref.shape for ref in refs], uneven=uneven)
    runs, at = [], 0
    for copy in sorted((c for c in copies if c.length), key=lambda c: c.dst):
        if at == rows:
            break
        if copy.dst != at:
            return None
        length = min(copy.length, rows - at)
        runs.append(Run(refs[copy.rank], copy.src * row, length * row))
        at += length
    return tuple(runs) if at == rows else None


def _target_ranges(
    work: Work, dim: int, row: int, target_tp: int, *, uneven: bool
) -> tuple[tuple[Range, ...], ...] | None:
    """Each target rank's slice as canonical byte ranges: the gather's split (:func:`kept_slices`) of a tensor of
    row numbers shaped like the gather buffer along ``dim``; None when a slice needs pad rows the source lacks."""
    (source,), (target,) = work.tensor.sources, work.tensor.targets
    rows = source.shape[dim]
    if isinstance(source.partition, Vocab) and sum(s[dim] for s in target.rank_shapes) > rows:
        return None  # zero rows to append: the gather zeroes them in its buffer
    numbers_shape = [1] * len(source.shape)
    numbers_shape[dim] = work.buffer_shapes[0][dim]
    numbers = torch.arange(numbers_shape[dim], dtype=torch.int64).view(numbers_shape)
    canonical = numbers.narrow(dim, 0, rows)
    _, pieces = kept_slices(source, (canonical, numbers), target, target_tp, uneven=uneven)
    ranges = []
    for piece, shape in zip(pieces, target.rank_shapes, strict=True):
        parts = piece.parts if isinstance(piece, Joined) else (piece,)
        order = np.concatenate([part.reshape(-1).numpy() for part in parts])
        if len(order) != shape[dim] or np.any(order >= rows):
            return None
        consecutive = np.split(order, np.flatnonzero(np.diff(order) != 1) + 1)
        ranges.append(tuple((int(run[0]) * row, (int(run[-1]) + 1) * row) for run in consecutive if len(run)))
    return tuple(ranges)


def stream(
    work: Work,
    streamed: Streamed | RowBlocks,
    writer: CheckpointWriter,
    *,
    target_tp: int,
    uneven: bool,
    finite: bool,
) -> tuple[str, bool | None]:
    """Move one unit block by block (see the module's docstring); its digest and, when ``finite``, whether every
    value is finite (else None)."""
    if isinstance(streamed, RowBlocks):
        return _stream_rows(work, streamed.rows, writer, target_tp=target_tp, uneven=uneven, finite=finite)
    (source,), (target,) = work.tensor.sources, work.tensor.targets
    digest = RunningDigest(source.dtype, finite=finite)
    places = []  # (target rank, canonical range, where the range starts in the rank's slice)
    for rank, ranges in enumerate(streamed.targets):
        offset = 0
        for first, end in ranges:
            places.append((rank, first, end, offset))
            offset += end - first
    writer.begin_parts(target.name, target.rank_shapes, dtype_from_code(target.code))
    largest = max(run.length for run in streamed.runs)
    with scratch(torch.empty(min(BLOCK_BYTES, largest), dtype=torch.uint8, device="meta")) as buffer:
        view = memoryview(buffer.numpy())
        at = 0
        for run in streamed.runs:
            for start in range(0, run.length, BLOCK_BYTES):
                size = min(BLOCK_BYTES, run.length - start)
                with Batch():
                    run.ref.read_into(buffer[:size], start=run.start + start)
                digest.update(view[:size])
                for rank, first, end, offset in places:
                    low, high = max(first, at), min(end, at + size)
                    if low < high:
                        writer.write_part(target.name, rank, [view[low - at : high - at]], offset + low - first)
                at += size
    writer.end_parts(target.name)
    return digest.result()


def _stream_rows(
    work: Work, rows: int, writer: CheckpointWriter, *, target_tp: int, uneven: bool, finite: bool
) -> tuple[str, bool | None]:
    """:func:`stream` of a :class:`RowBlocks` unit: one area of this thread's scratch holds a block of every source
    slice, the gathered block and one target slice's block copied out of it when it is not contiguous there."""
    (source,), (target,) = work.tensor.sources, work.tensor.targets
    refs, dtype, itemsize = source.refs, source.dtype, source.dtype.itemsize
    dim = source.partition.dim % len(source.shape)
    copies, _ = copy_plan(source.partition, [ref.shape for ref in refs], uneven=uneven)
    copies = [c for c in copies if c.length]
    needed = sorted({c.rank for c in copies})
    tail = tuple(work.buffer_shapes[0][1:])
    source_row = [math.prod(ref.shape[1:]) * itemsize for ref in refs]
    block_row = math.prod(tail) * itemsize
    target_row = [math.prod(shape[1:]) * itemsize for shape in target.rank_shapes]
    places, at = {}, 0
    for rank in needed:
        places[rank] = at
        at += rows * source_row[rank]
    block_at, out_at = at, at + rows * block_row
    digest = RunningDigest(dtype, finite=finite)
    writer.begin_parts(target.name, target.rank_shapes, dtype_from_code(target.code))
    with scratch(torch.empty(out_at + rows * max(target_row), dtype=torch.uint8, device="meta")) as area:
        view = memoryview(area.numpy())
        for first in range(0, source.shape[0], rows):
            count = min(rows, source.shape[0] - first)
            slices = {}
            for rank in needed:
                start = places[rank]
                part = area[start : start + count * source_row[rank]].view(dtype).view(count, *refs[rank].shape[1:])
                with Batch():
                    refs[rank].read_into(part, start=first * source_row[rank])
                slices[rank] = part
            block = area[block_at : block_at + count * block_row].view(dtype).view(count, *tail)
            for c in copies:
                block.narrow(dim, c.dst, c.length).copy_(slices[c.rank].narrow(dim, c.src, c.length))
            digest.update(view[block_at : block_at + count * block_row])
            _, pieces = kept_slices(source, (block, block), target, target_tp, uneven=uneven)
            for rank, piece in enumerate(pieces):
                size = piece.numel() * itemsize
                inside = piece.untyped_storage().data_ptr() == area.untyped_storage().data_ptr()
                if piece.is_contiguous() and inside:  # a view of the block: written from where it is
                    start = piece.data_ptr() - area.data_ptr()
                else:
                    area[out_at : out_at + size].view(dtype).view(piece.shape).copy_(piece)
                    start = out_at
                writer.write_part(target.name, rank, [view[start : start + size]], first * target_row[rank])
    writer.end_parts(target.name)
    return digest.result()
