"""One unit of a conversion before any byte moves: the buffers it needs, where they start in a page, and the memory
it may hold. Pure and torch-free: where each rank slice lands is its tensors' :class:`~reshard.geometry.Cut`; the
byte stream (:mod:`reshard.engine.move.stream`) plans from this without importing torch, the gather
(:mod:`reshard.engine.move.gather`) fills the buffers it sizes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

from reshard.dtypes import itemsize_of
from reshard.engine.plan.planner import SourceTensor, TargetTensor, TensorPlan
from reshard.errors import ReshardError
from reshard.geometry import Packed, Replicate, Vocab
from reshard.io.direct import ALIGN

Shape = tuple[int, ...]


def read_phase(source: SourceTensor) -> int:
    """Where in a 4 KB page the gather buffer of ``source`` should start so that its first rank slice's
    whole blocks are read straight into it (:meth:`reshard.io.direct.DirectSource.read`): the phase of that
    slice's file offset less its place in the buffer. Rank files written alike put every slice of a dim-0
    split on that phase too. 0 when the offset is unknown or the slice is not one contiguous run."""
    ref = source.refs[0]
    if ref.position is None or not ref.shape:
        return 0
    place = 0
    cut = source.cut
    if cut.dim is not None:
        if not cut.rows_contiguous():
            return 0
        first = next((run for run in cut.placed() if run.rank == 0), None)
        if first is None:
            return 0
        place = (first.at - first.start) * cut.row_bytes(itemsize_of(source.code))
    phase = (ref.position - place) % ALIGN
    return phase if phase % itemsize_of(source.code) == 0 else 0


def write_phase(target: TargetTensor, position: int | None) -> int:
    """Where in a 4 KB page the memory a transform writes ``target`` into should start so that the target is written
    straight from it (:meth:`reshard.io.direct.DirectFile.write`): the phase of ``position``, where rank 0's slice
    starts in its file (:meth:`~reshard.layouts.base.CheckpointWriter.position`), when that slice is the target's
    first bytes in one run (the whole target, a replicated one, or one split along its first dim); else 0."""
    if position is None or not target.shape:
        return 0
    partition, shape = target.partition, tuple(target.shape)
    if not (
        isinstance(partition, Replicate)
        or tuple(target.rank_shapes[:1]) in ((), (shape,))  # the whole target
        or math.prod(shape[: partition.dim % len(shape)]) == 1  # split along its first dim
    ):
        return 0
    phase = position % ALIGN
    return phase if phase % itemsize_of(target.code) == 0 else 0


@dataclass(frozen=True)
class Work:
    """One unit to move: its plan, the gather buffer of each source tensor, and the bytes it may hold at once."""

    tensor: TensorPlan
    buffer_shapes: tuple[Shape, ...]
    cost: int


def memory_available() -> int | None:
    """Bytes of memory this process may still take (``MemAvailable``, else the free pages); None if unknown."""
    try:
        with open("/proc/meminfo", "rb") as meminfo:
            for line in meminfo:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def check_fits(works: Sequence[Work]) -> None:
    """Refuse, before any buffer is allocated, a tensor whose gather alone needs more memory than is available
    (a declared size the allocator would fail on, or that would push the machine into swap)."""
    available = memory_available()
    if available is None:
        return
    for work in works:
        if work.cost > available:
            source = work.tensor.sources[0]
            shape = source.shape or ()  # every planned source has its shape
            elements = math.prod(shape)
            raise ReshardError(
                f"needs {work.cost:,} bytes of memory to gather ({elements:,} elements, shape {list(shape)}), "
                f"more than the {available:,} bytes available",
                path=source.refs[0].file if source.refs else None,
                tensor=work.tensor.name,
                hint="check the checkpoint's declared sizes, or run on a machine with more memory",
            )


def plan_work(tensor: TensorPlan, *, target_tp: int) -> Work:
    """The buffers of one unit and an upper bound of the bytes held while it is prepared and written."""
    if tensor.transform is None:
        (source,), (target,) = tensor.sources, tensor.targets
        shape, cost = _buffer(source, target.rank_shapes, target_tp)
        return Work(tensor, (shape,), cost)
    buffers = [_buffer(source, (), target_tp) for source in tensor.sources]
    # the transform's outputs may be copies, and splitting a vocab or packed target copies again
    cost = sum(c for _, c in buffers) + 2 * tensor.nbytes
    return Work(tensor, tuple(shape for shape, _ in buffers), cost)


def _buffer(source: SourceTensor, target_shapes: Sequence[Shape], target_tp: int) -> tuple[Shape, int]:
    """The gather buffer of one source tensor (room for the target's pad rows when it is kept as it is) and
    the bytes it costs."""
    partition, cut = source.partition, source.cut
    itemsize = itemsize_of(source.code)
    shape = cut.shape
    nbytes = math.prod(shape) * itemsize
    slice_bytes = max(ref.header.nbytes for ref in source.refs)
    if cut.dim is None:
        return shape, ALIGN + (2 * nbytes if len(source.refs) > 1 else nbytes)
    dim = cut.dim
    rows = cut.rows  # every slice's rows; of copied heads one copy each, the others through one temporary
    if isinstance(partition, Vocab) and target_shapes:
        rows = max(rows, sum(s[dim] for s in target_shapes))
    buffer_shape = shape[:dim] + (max(rows, shape[dim]),) + shape[dim + 1 :]
    cost = math.prod(buffer_shape) * itemsize + ALIGN  # and the slack for its phase (BufferPool.get)
    if not cut.rows_contiguous() or cut.replicas > 1:
        cost += slice_bytes  # packed parts, short rows or copies of a head go through one slice-sized temporary
    if target_tp > 1 and isinstance(partition, Packed) and not (target_shapes and joins(partition, len(shape))):
        cost += nbytes  # split() concatenates each target rank's parts
    return buffer_shape, cost


def joins(partition: Packed, ndim: int) -> bool:
    """Whether a kept packed tensor's target slices are :class:`Joined` views of its buffer (packed along dim 0:
    each part of a slice is one run of rows), not copies."""
    return partition.dim % ndim == 0
