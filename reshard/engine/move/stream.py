"""Units whose target slices are runs of their source slices' bytes, moved through one small buffer.

Why: with the checkpoint and the output in memory (tmpfs), what a conversion costs is CPU, and gathering a
tensor into a buffer of its own size costs it three times over: the buffer's fresh pages are faulted in and
zeroed, the buffer is read from memory again to be hashed and checked for NaN/Inf, and again to be written
(measured: docs/performance.md). A tensor kept as it is (no transform) need not be gathered whole:

* split along its first dim (the column-parallel weights, the embedding, the head: three quarters of a Llama's
  bytes), or held whole by one source rank, its canonical bytes are byte ranges of its source slices one after
  the other, and each target slice is one or more ranges of those (:class:`Streamed`);
* split along a later dim (the row-parallel weights), a block of its first dim's rows is, in each source slice,
  one range of bytes, and those blocks gathered make a block of the canonical tensor (:class:`RowBlocks`);
* replicated on several source ranks, the first rank's copy is streamed and every other one compared with it,
  block by block.

Such a unit is moved block by block: each block (about :data:`BLOCK_BYTES`) is read into this thread's reusable
buffer, hashed and checked for NaN/Inf while it is in the cache (:class:`~reshard.engine.move.digest.RunningDigest`),
and its bytes written to each target slice (:meth:`~reshard.layouts.base.CheckpointWriter.write_part`). No
buffer the size of the tensor, no fresh page, every byte read from memory once, and a peak memory of a few
blocks instead of a tensor (docs/performance.md).

All of it is numpy and byte views, no torch: a conversion whose every unit streams never imports torch (an import
that costs more than a small model's bytes), so it streams on a disk too, each block on the 4 KB phase of where it
is written, ending at that file's page boundary (written with ``O_DIRECT`` straight from memory). Beside gathered
units it streams only in memory (:func:`in_memory_unit`). The byte ranges come from the same record as the gather's,
each tensor's :class:`~reshard.geometry.Cut` (the source's placed runs, the target's runs), so both paths write the
same bytes; ``tests/engine/move/test_stream.py`` checks them against each other.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from reshard.dtypes import itemsize_of
from reshard.engine.move.digest import ALGORITHM, RunningDigest, checked_without_torch
from reshard.engine.move.work import Work, plan_work
from reshard.engine.plan.planner import SourceTensor, TargetTensor, TensorPlan
from reshard.errors import ReshardError
from reshard.io.direct import ALIGN, Batch, in_memory
from reshard.io.scratch import scratch_bytes
from reshard.layouts.base import CheckpointWriter, TensorRef

# Bytes per block: small enough to stay in a core's cache between the read, the hash, the check and the writes,
# large enough that the Python calls per block are few (4 MB against 1 MB: docs/performance.md).
BLOCK_BYTES = 4 << 20
Range = tuple[int, int]
Runs = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Run:
    """Bytes ``[start, start + length)`` of one source rank slice."""

    ref: TensorRef
    start: int
    length: int


@dataclass(frozen=True)
class Streamed:
    """A unit's canonical bytes as source runs in order, and each target rank's slice as canonical byte ranges;
    ``copies``: the other ranks' copies of a replicated tensor, each block compared with the first's; ``pads``:
    the zero rows a bigger target vocab adds, as ``(rank, byte in its slice, length)``."""

    runs: tuple[Run, ...]
    targets: tuple[tuple[Range, ...], ...]
    copies: tuple[TensorRef, ...] = ()
    pads: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class RowBlocks:
    """A unit split after its first dim (the row-parallel weights), moved ``rows`` rows of that first dim at a
    time: those rows of each source slice are one run of its bytes, gathered into a small buffer as the gather
    places them (the source's cut), hashed and checked there, then cut as the gather splits (``targets``: each
    target rank's runs along the split dim, the target's cut) and written."""

    rows: int
    targets: tuple[Runs, ...]


def streams_to(writer: CheckpointWriter) -> bool:
    """Whether units may be streamed into ``writer``: it writes byte ranges, from worker threads."""
    return writer.concurrent and writer.takes_parts


def in_memory_unit(work: Work, writer: CheckpointWriter) -> bool:
    """Whether a unit's source files and the output are all in memory (tmpfs): there the stream is the cheaper
    path even beside units that are gathered; on a disk, only when no unit needs the gather (then torch is never
    imported), since the gather's direct reads keep more of the disk busy."""
    return in_memory(writer.out_dir) and all(in_memory(ref.file) for ref in work.tensor.sources[0].refs)


def stream_plan(work: Work) -> Streamed | RowBlocks | None:
    """The runs of a unit that can be streamed (see the module's docstring); None for any other unit (a
    transform, copies of a replicated head to compare, pad rows to add along a later dim, a source not read
    straight from its file, a dtype whose NaN/Inf check needs torch), which is gathered."""
    tensor = work.tensor
    if tensor.transform is not None:
        return None
    (source,) = tensor.sources
    refs = source.refs
    if not refs or any(ref.position is None for ref in refs) or not checked_without_torch(source.code):
        return None
    (target,) = tensor.targets
    cut = source.cut
    shape = cut.shape
    if cut.dim is None:
        whole = ((0, refs[0].header.nbytes),)
        return Streamed((Run(refs[0], 0, refs[0].header.nbytes),), (whole,) * target.cut.tp, refs[1:])
    if cut.replicas > 1:  # copies of a head are compared (gather_into)
        return None
    targets = tuple(target.cut.rank_rows(rank) for rank in range(target.cut.tp))
    if not cut.rows_contiguous():
        return _row_blocks(work, cut.dim, targets)
    row = cut.row_bytes(itemsize_of(source.code))
    rows = shape[cut.dim]
    runs = _source_runs(source, row, rows)
    ranges = tuple(
        tuple((start * row, min(start + length, rows) * row) for start, length in rank if start < rows and length)
        for rank in targets
    )
    pads = tuple(  # only a vocab's runs reach past the canonical rows (one run a rank)
        (rank, (rows - start) * row if start < rows else 0, (start + length - max(start, rows)) * row)
        for rank, rank_runs in enumerate(targets)
        for start, length in rank_runs
        if start + length > rows
    )
    return Streamed(runs, ranges, pads=pads)


def _row_blocks(work: Work, dim: int, targets: tuple[Runs, ...]) -> RowBlocks | None:
    """How many first-dim rows go in a block, for a unit split along ``dim`` > 0; None when its canonical block
    would not be contiguous (pad rows along ``dim``)."""
    (source,) = work.tensor.sources
    shape = source.cut.shape
    if work.buffer_shapes[0][dim] != shape[dim] or any(ref.shape[0] != shape[0] for ref in source.refs):
        return None
    if any(start + length > shape[dim] for rank in targets for start, length in rank):
        return None  # zero rows to append along dim: gathered
    row = math.prod(shape[1:]) * itemsize_of(source.code)
    return RowBlocks(max(1, BLOCK_BYTES // max(1, row)), targets)


def _source_runs(source: SourceTensor, row: int, rows: int) -> tuple[Run, ...]:
    """The canonical tensor's ``rows`` (of ``row`` bytes) as runs of the rank slices, in order: the gather's own
    placement (its cut's :meth:`~reshard.geometry.Cut.placed`, which tiles the rows), pad rows past ``rows`` left
    out."""
    runs: list[Run] = []
    for run in source.cut.placed():
        length = min(run.length, rows - run.at)
        if length <= 0:
            break
        runs.append(Run(source.refs[run.rank], run.start * row, length * row))
    return tuple(runs)


def stream(
    work: Work,
    streamed: Streamed | RowBlocks,
    writer: CheckpointWriter,
    *,
    finite: bool,
    allow_divergent: bool = False,
    divergent: set[str] | None = None,
    algorithm: str = ALGORITHM,
) -> tuple[str, bool | None]:
    """Move one unit block by block (see the module's docstring); its digest (by ``algorithm``) and, when
    ``finite``, whether every value is finite (else None). The copies of a replicated tensor are compared with the
    first as the gather compares them (:func:`~reshard.engine.move.gather.gather_into`): ``allow_divergent`` and
    ``divergent`` alike."""
    if isinstance(streamed, RowBlocks):
        return _stream_rows(work, streamed, writer, finite=finite, algorithm=algorithm)
    (source,), (target,) = work.tensor.sources, work.tensor.targets
    copies = Copies(source, streamed.copies, allow_divergent=allow_divergent, divergent=divergent)
    digest = RunningDigest(source.code, finite=finite, algorithm=algorithm)
    places = []  # (target rank, canonical range, where the range starts in the rank's slice)
    for rank, ranges in enumerate(streamed.targets):
        offset = 0
        for first, end in ranges:
            places.append((rank, first, end, offset))
            offset += end - first
    writer.begin_parts(target.name, target.rank_shapes, target.code)
    phase = _file_phases(places, [writer.position(target.name, rank) for rank in range(len(streamed.targets))])
    cuts = sorted({edge for _, first, end, _ in places for edge in (first, end)})
    room = min(BLOCK_BYTES, max(run.length for run in streamed.runs)) + ALIGN
    with scratch_bytes(room * (2 if copies else 1)) as buffer:
        view = buffer.data
        at = 0
        for run in streamed.runs:
            end = at + run.length
            while at < end:
                lead = phase(at)  # the block sits in memory on the phase of its file offset: written in place
                cut = bisect.bisect_right(cuts, at)  # blocks end where a target rank's range does
                size = min(BLOCK_BYTES - lead % BLOCK_BYTES, end - at, (cuts[cut] if cut < len(cuts) else end) - at)
                block = view[lead : lead + size]
                start = run.start + run.length - (end - at)
                with Batch():
                    run.ref.read_bytes(block, start=start)
                copies.compare(buffer[lead : lead + size], buffer[room + lead : room + lead + size], start=start)
                digest.update(block)
                for rank, first, last, offset in places:
                    low, high = max(first, at), min(last, at + size)
                    if low < high:
                        writer.write_part(target.name, rank, [block[low - at : high - at]], offset + low - first)
                at += size
    for rank, start, length in streamed.pads:
        zeros = np.zeros(min(length, BLOCK_BYTES), dtype=np.uint8)
        for offset in range(0, length, len(zeros)):
            writer.write_part(target.name, rank, [zeros.data[: length - offset]], start + offset)
    writer.end_parts(target.name)
    return digest.result()


def _file_phases(places: Sequence[tuple[int, int, int, int]], positions: Sequence[int | None]) -> Callable[[int], int]:
    """The 4 KB phase in its file of each canonical byte, as written by the first target rank that holds it (its
    slice's ``position`` in its file, when the writer knows it); 0 where none is known. Blocks end at those files'
    page boundaries, so every block but a tensor's first is written straight from memory, not through staging
    and a buffered head and tail (:class:`~reshard.io.direct.DirectFile`)."""

    def phase(at: int) -> int:
        for rank, first, end, offset in places:
            if first <= at < end and (position := positions[rank]) is not None:
                return (position + offset + at - first) % ALIGN
        return 0

    return phase


class Copies:
    """The other ranks' copies of a replicated tensor, compared with the first block by block. At the first block
    that differs: raise naming both ranks, as the gather does (both copies then read whole, with torch, for the
    error's max difference), or, with ``allow_divergent``, add the tensor's name to ``divergent`` and stop
    comparing. With ``allow_divergent`` and no ``divergent`` to fill, nothing is compared."""

    def __init__(
        self, source: SourceTensor, refs: Sequence[TensorRef], *, allow_divergent: bool, divergent: set[str] | None
    ) -> None:
        self._source = source
        self._refs = [] if allow_divergent and divergent is None else list(refs)
        self._allow = allow_divergent
        self._divergent = divergent

    def __bool__(self) -> bool:
        return bool(self._refs)

    def compare(self, first: np.ndarray, room: np.ndarray, *, start: int) -> None:
        """Compare bytes ``first`` (from byte ``start`` of the first copy) with the same bytes of every other copy,
        each read into ``room``."""
        for ref in self._refs:
            with Batch():
                ref.read_bytes(room.data, start=start)
            if np.array_equal(first, room):
                continue
            if not self._allow:
                _raise_divergent(self._source, ref)
            if self._divergent is not None:
                self._divergent.add(self._source.name)
            self._refs = []
            return


def _raise_divergent(source: SourceTensor, other: TensorRef) -> None:
    """The gather's error for a copy that differs from the first (:func:`reshard.geometry.tensors.check_replica`, with
    the rank's place among the source's slices), naming the first copy's file as the gather does."""
    from reshard.geometry.tensors import check_replica

    first = source.refs[0]
    try:
        check_replica(first.read(), other.read(), source.refs.index(other))
    except ReshardError as err:
        raise type(err)(err.detail, path=first.file, tensor=source.name, hint=err.hint) from err


def _stream_rows(
    work: Work, blocks: RowBlocks, writer: CheckpointWriter, *, finite: bool, algorithm: str
) -> tuple[str, bool | None]:
    """:func:`stream` of a :class:`RowBlocks` unit: one area of this thread's scratch holds a block of every source
    slice, the gathered block and one target slice's block cut out of it, as arrays of the dtype's width (the
    bytes are moved, never read as values)."""
    (source,), (target,) = work.tensor.sources, work.tensor.targets
    refs, rows, itemsize = source.refs, blocks.rows, itemsize_of(source.code)
    width = np.dtype(f"u{itemsize}")
    dim = source.cut.axis
    copies = source.cut.placed()
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
    digest = RunningDigest(source.code, finite=finite, algorithm=algorithm)
    writer.begin_parts(target.name, target.rank_shapes, target.code)
    with scratch_bytes(out_at + rows * max(target_row)) as area:
        view = area.data
        for first in range(0, source.cut.shape[0], rows):
            count = min(rows, source.cut.shape[0] - first)
            slices = {}
            for rank in needed:
                start, size = places[rank], count * source_row[rank]
                with Batch():
                    refs[rank].read_bytes(view[start : start + size], start=first * source_row[rank])
                slices[rank] = area[start : start + size].view(width).reshape(count, *refs[rank].shape[1:])
            block = area[block_at : block_at + count * block_row].view(width).reshape(count, *tail)
            for c in copies:
                block[_along(dim, c.at, c.length)] = slices[c.rank][_along(dim, c.start, c.length)]
            digest.update(view[block_at : block_at + count * block_row])
            for rank, runs in enumerate(blocks.targets):
                size = count * target_row[rank]
                if runs == ((0, tail[dim - 1]),):  # the whole block: written from where it is
                    start = block_at
                else:
                    piece = area[out_at : out_at + size].view(width).reshape(count, *target.rank_shapes[rank][1:])
                    placed = 0
                    for low, length in runs:
                        piece[_along(dim, placed, length)] = block[_along(dim, low, length)]
                        placed += length
                    start = out_at
                writer.write_part(target.name, rank, [view[start : start + size]], first * target_row[rank])
    writer.end_parts(target.name)
    return digest.result()


def _along(dim: int, start: int, length: int) -> tuple[slice, ...]:
    """The index of ``length`` entries from ``start`` along ``dim`` (all of every dim before it)."""
    return (slice(None),) * dim + (slice(start, start + length),)


def canonical_digest(source: SourceTensor, *, finite: bool, algorithm: str) -> tuple[str, bool | None] | None:
    """The digest (by ``algorithm``) of a source tensor's canonical bytes and, when ``finite``, whether every value
    is finite, streamed from its slices as a conversion to one rank would stream them (:func:`stream`), without a
    buffer of its size or torch; None when it does not stream (:func:`stream_plan`), to be gathered instead.
    ``verify`` checks a manifest's digests with it (the same bytes and per-block digest as the conversion's), and
    compares two checkpoints' tensors and a replicated tensor's copies.

    Raises:
        DivergentReplicaError: copies of a replicated tensor differ.
    """
    partition, shape = source.planned
    whole = TargetTensor(source.name, shape, source.code, partition, (tuple(shape),))
    work = plan_work(TensorPlan((source,), (whole,)), target_tp=1)
    plan = stream_plan(work)
    if plan is None:
        return None
    return stream(work, plan, _Discard(), finite=finite, algorithm=algorithm)


class _Discard(CheckpointWriter):
    """A writer that keeps no byte: :func:`canonical_digest` needs the stream's digest, not its output."""

    concurrent = True
    takes_parts = True

    def __init__(self) -> None:  # no folder, no plan: nothing is written
        pass

    def begin_parts(self, name: str, shapes: Sequence[tuple[int, ...]], code: str) -> None:
        pass

    def write_part(self, name: str, rank: int, views: Sequence[memoryview], start: int) -> None:
        pass

    def end_parts(self, name: str) -> None:
        pass
