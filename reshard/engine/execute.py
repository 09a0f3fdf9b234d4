"""Moving the bytes of a planned conversion: read, gather, hash, split and write on worker threads.

Why it is shaped like this:

* **One buffer per tensor.** The rank slices are read into their place in one buffer of the
  gathered (padded) tensor: a dim-0 piece is one read of its byte range, a column block one read
  of the slice scattered over the block's rows; only packed parts off dim 0 and rows under 1 KB go
  through a temporary. The canonical tensor, and every target piece of a ``shard``/``grouped``/
  ``vocab``/``replicate`` tensor, is then a view of that buffer, written from its rows: nothing is
  gathered twice. Pad rows for a bigger target vocab are zeroed in the buffer, not concatenated.
  Buffers are reused for the next tensor of the same size (:class:`BufferPool`): fresh memory costs
  a page fault and zeroing per page.
* **The disk busy, the page cache left alone.** Reads and writes go through :mod:`reshard.io.direct`:
  ``O_DIRECT`` in 8 MB blocks, every block of a tensor (all its rank slices, all its target pieces)
  in flight at once. A conversion does not fill the page cache with a checkpoint it will not read
  again, and does not pay for fresh page-cache pages, which cost the most on a VM (4 GB, tp 8 -> 4,
  on the 2-core bench machine: sys time 10-13 s with buffered reads and writes, 2-3 s with neither).
  Where a file system refuses ``O_DIRECT``, reads go through the page cache; then a :class:`ReadAhead`
  thread asks the OS for the coming slices, and each slice's pages are dropped once read (``evict``).
* **Overlap, bounded by bytes.** ``jobs`` threads prepare tensors (read, gather, sha256, finite check:
  all release the GIL) and, when the writer is :attr:`~reshard.layouts.base.CheckpointWriter.concurrent`
  (every safetensors-based writer: each tensor's offset is known from the header), write them too,
  at their offsets: a thread waiting for the disk leaves the core to another one's hashing. Other
  writers get the tensors in plan order from the calling thread. A tensor is only started when the
  bytes of every prepared-but-unwritten tensor plus its own fit in the budget (``2 x`` the largest
  tensor), or when nothing else is in flight; the buffers kept for reuse count in the same budget.
  So memory stays near ``2 x`` the largest tensor whatever the size of the checkpoint.
* **Same bytes as the one-at-a-time path.** The gather here is :func:`reshard.partition.gather`
  done in place; ``tests/test_stream.py`` checks both agree on every partition kind.
"""

from __future__ import annotations

import contextlib
import gc
import math
import sys
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from reshard.cli.output import quiet_unless
from reshard.errors import ReshardError, ShapeMismatchError
from reshard.io.direct import Batch
from reshard.layouts.base import CheckpointWriter, TensorRef
from reshard.partition import Grouped, Packed, Replicate, Shard, Vocab, split_sizes
from reshard.slicing import bitwise_equal, check_replica, split

if TYPE_CHECKING:
    from collections.abc import Callable

    from reshard.engine.planner import ConversionPlan, TensorPlan

MIN_BUDGET = 64 << 20
MAX_PENDING = 256
Shape = tuple[int, ...]


@dataclass(frozen=True)
class Copy:
    """Rows ``[src, src + length)`` along the split dim of rank ``rank``'s slice go to ``[dst, dst + length)``."""

    rank: int
    src: int
    dst: int
    length: int


def copy_plan(
    partition: Shard | Grouped | Vocab | Packed, shapes: Sequence[Shape], *, uneven: bool
) -> tuple[list[Copy], int]:
    """Where every piece of every rank slice lands in the gathered buffer, and the buffer's size along dim.

    Pure: the in-place equivalent of the ``cat`` in :func:`reshard.partition.gather`.
    """
    dim = partition.dim % len(shapes[0])
    sizes = [shape[dim] for shape in shapes]
    if isinstance(partition, Packed):
        per_part = [split_sizes(part, len(shapes), uneven=uneven) for part in partition.parts]
        copies, part_start = [], 0
        src = [0] * len(shapes)
        for part, pieces in zip(partition.parts, per_part, strict=True):
            dst = part_start
            for rank, length in enumerate(pieces):
                copies.append(Copy(rank, src[rank], dst, length))
                src[rank] += length
                dst += length
            part_start += part
        return copies, part_start
    offsets = [sum(sizes[:r]) for r in range(len(sizes))]
    return [Copy(r, 0, offsets[r], sizes[r]) for r in range(len(sizes))], sum(sizes)


@dataclass(frozen=True)
class Work:
    """One tensor to move: its plan, the gathered buffer's shape, and the bytes it may hold at once."""

    tensor: TensorPlan
    buffer_shape: Shape
    cost: int


def plan_work(tensor: TensorPlan, *, target_tp: int) -> Work:
    """The buffer for one tensor and an upper bound of the bytes held while it is prepared and written."""
    source = tensor.source
    partition = source.partition
    itemsize = source.dtype.itemsize
    shape = tuple(source.shape)
    slice_bytes = max(ref.header.nbytes for ref in source.refs)
    if isinstance(partition, Replicate):
        return Work(tensor, shape, 2 * tensor.nbytes if len(source.refs) > 1 else tensor.nbytes)
    dim = partition.dim % len(shape)
    gathered = sum(ref.shape[dim] for ref in source.refs)
    rows = gathered
    if isinstance(partition, Vocab):
        rows = max(gathered, sum(s[dim] for s in tensor.target_shapes))
    buffer_shape = shape[:dim] + (max(rows, shape[dim]),) + shape[dim + 1 :]
    cost = math.prod(buffer_shape) * itemsize
    if math.prod(shape[:dim]) != 1:
        cost += slice_bytes  # packed parts, or short rows, go through one slice-sized temporary
    if target_tp > 1 and isinstance(partition, Packed):
        cost += tensor.nbytes  # split() concatenates each target rank's parts
    return Work(tensor, buffer_shape, cost)


def _gather_into(
    work: Work,
    buffer: torch.Tensor,
    *,
    vocab_size: int | None,
    uneven: bool,
    allow_divergent: bool,
    divergent: set[str] | None = None,
) -> torch.Tensor:
    """Read every rank slice into ``buffer``; returns it (the canonical tensor is a view of it).

    A replicated tensor that differs between ranks raises, unless ``allow_divergent``: then rank 0's
    copy is taken and, when ``divergent`` is given, the tensor's name is added to it.
    """
    source = work.tensor.source
    refs: tuple[TensorRef, ...] = source.refs
    partition = source.partition
    if isinstance(partition, Replicate):
        with Batch():
            refs[0].read_into(buffer)
        if len(refs) > 1 and not (allow_divergent and divergent is None):
            other = torch.empty_like(buffer)
            for rank, ref in enumerate(refs[1:], start=1):
                with Batch():
                    ref.read_into(other)
                if not allow_divergent:
                    check_replica(buffer, other, rank)
                elif not bitwise_equal(buffer, other):
                    divergent.add(source.name)
                    break
        return buffer
    dim = partition.dim % buffer.dim()
    copies, _ = copy_plan(partition, [ref.shape for ref in refs], uneven=uneven)
    contiguous = math.prod(buffer.shape[:dim]) == 1  # pieces along dim are contiguous in file and buffer
    with Batch():  # every rank's blocks in flight at once
        for rank, ref in enumerate(refs):
            mine = [c for c in copies if c.rank == rank and c.length]
            if contiguous:
                row_bytes = math.prod(ref.shape[dim + 1 :]) * buffer.element_size()
                for c in mine:
                    ref.read_into(buffer.narrow(dim, c.dst, c.length), start=c.src * row_bytes)
                continue
            if not mine:
                continue
            if len(mine) == 1 and mine[0].length == ref.shape[dim]:  # the whole slice: read into its block
                ref.read_into(buffer.narrow(dim, mine[0].dst, mine[0].length))
                continue
            whole = torch.empty(ref.shape, dtype=buffer.dtype)
            with Batch():
                ref.read_into(whole)
            for c in mine:
                buffer.narrow(dim, c.dst, c.length).copy_(whole.narrow(dim, c.src, c.length))
            del whole
    return buffer


def prepare(
    work: Work,
    *,
    target_tp: int,
    vocab_size: int | None,
    uneven: bool,
    allow_divergent: bool,
    divergent: set[str] | None = None,
    buffer: torch.Tensor | None = None,
) -> tuple[str, torch.Tensor, list[torch.Tensor]]:
    """Gather one tensor (into ``buffer`` of ``work.buffer_shape``, or a new one); return its name, the
    canonical tensor and the target rank slices (views of the buffer, but for ``packed``)."""
    tensor = work.tensor
    source = tensor.source
    if buffer is None:
        buffer = torch.empty(work.buffer_shape, dtype=source.dtype)
    try:
        with torch.inference_mode():
            buffer = _gather_into(
                work,
                buffer,
                vocab_size=vocab_size,
                uneven=uneven,
                allow_divergent=allow_divergent,
                divergent=divergent,
            )
            partition = source.partition
            if isinstance(partition, Replicate):
                return tensor.name, buffer, [buffer] * target_tp
            dim = partition.dim % buffer.dim()
            canonical = buffer.narrow(dim, 0, source.shape[dim])
            if isinstance(partition, Vocab):
                sizes = [s[dim] for s in tensor.target_shapes]
                target = sum(sizes)
                if target > source.shape[dim]:
                    buffer.narrow(dim, source.shape[dim], target - source.shape[dim]).zero_()
                return tensor.name, canonical, list(torch.split(buffer.narrow(dim, 0, target), sizes, dim=dim))
            return tensor.name, canonical, split(canonical, partition, target_tp, uneven=uneven)
    except ReshardError as err:
        if err.path:
            raise
        raise type(err)(err.detail, path=source.refs[0].file, tensor=source.name, hint=err.hint) from err


class BufferPool:
    """Hands out gather buffers and takes them back once written, to hand them out again.

    Fresh memory costs a page fault and the zeroing of every page, about as much as reading the
    bytes; and the same sizes come again and again (every layer has the same shapes, and the plan
    orders tensors by size). Buffers are kept by byte size; free ones are dropped when keeping them
    would take the memory held (in use or free) over ``limit``.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free: dict[int, list[torch.Tensor]] = {}
        self._held = 0
        self.peak = 0
        self._lock = threading.Lock()

    def get(self, shape: Shape, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A raw byte buffer (give it back with :meth:`put`) and a tensor of ``shape`` and ``dtype`` on it."""
        nbytes = math.prod(shape) * dtype.itemsize
        raw = None
        with self._lock:
            if self._free.get(nbytes):
                raw = self._free[nbytes].pop()
            else:
                while self._held + nbytes > self.limit and any(self._free.values()):
                    size = max(size for size, free in self._free.items() if free)
                    self._free[size].pop()
                    self._held -= size
                self._held += nbytes
                self.peak = max(self.peak, self._held)
        if raw is None:
            raw = torch.empty(nbytes, dtype=torch.uint8)
        return raw, raw.view(dtype).view(shape)

    def put(self, raw: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault(raw.numel(), []).append(raw)


class Budget:
    """Bytes held by tensors started but not yet written. Used from one thread only."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.peak = 0

    def take(self, cost: int) -> bool:
        """Hold ``cost`` bytes if they fit, or if nothing is held (a tensor larger than the budget runs alone)."""
        if self.held and self.held + cost > self.limit:
            return False
        self.held += cost
        self.peak = max(self.peak, self.held)
        return True

    def give(self, cost: int) -> None:
        self.held -= cost


def budget_for(works: Sequence[Work]) -> int:
    """Twice the largest tensor: one being written while the next is read."""
    largest = max((w.tensor.nbytes for w in works), default=0)
    return max(2 * largest, MIN_BUDGET)


class ReadAhead:
    """A thread asking the OS to read the source slices of the coming tensors (``posix_fadvise`` WILLNEED).

    It stays at most ``window`` source bytes ahead of the tensors the workers have started, so the disk
    is kept busy while the workers hash; what it reads lands in the page cache, not in this process.
    """

    def __init__(self, works: Sequence[Work], window: int) -> None:
        self._works = works
        self._window = window
        self._started = 0
        self._stop = False
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="reshard-readahead", daemon=True)

    def __enter__(self) -> ReadAhead:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join()

    def started(self, work: Work) -> None:
        with self._wake:
            self._started += _source_bytes(work)
            self._wake.notify()

    def _loop(self) -> None:
        ahead = 0
        for work in self._works:
            with self._wake:
                while not self._stop and ahead > self._started + self._window:
                    self._wake.wait()
                if self._stop:
                    return
            for ref in work.tensor.source.refs:
                ref.prefetch()
            ahead += _source_bytes(work)


def _source_bytes(work: Work) -> int:
    return sum(ref.header.nbytes for ref in work.tensor.source.refs)


@contextlib.contextmanager
def _frozen_gc() -> Iterator[None]:
    """Keep the collector off the objects alive before the run, for the run only.

    The loop allocates many small tracked objects (a memoryview per row of a column block), which
    triggers collections that walk every object of torch and the interpreter: a few % of the CPU.
    Frozen objects are skipped by the collector; the new ones are still collected.
    """
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run(
    conversion: ConversionPlan,
    writer: CheckpointWriter,
    *,
    jobs: int,
    hasher: Callable[[torch.Tensor], str],
    finite_of: Callable[[torch.Tensor], bool] | None = None,
    finite: dict[str, bool] | None = None,
    allow_divergent: bool = False,
    divergent: set[str] | None = None,
    progress: bool = True,
    budget: Budget | None = None,
) -> dict[str, str]:
    """Prepare tensors on ``jobs`` threads, write them in plan order here; returns ``{name: sha256}``.

    With ``finite_of``, ``finite`` is filled with ``{name: finite_of(canonical tensor)}``; with
    ``allow_divergent``, ``divergent`` (if given) gets the replicated tensors whose ranks differed.
    """
    works = [plan_work(t, target_tp=conversion.target_tp) for t in conversion.tensors]
    budget = budget or Budget(budget_for(works))
    options = {
        "target_tp": conversion.target_tp,
        "vocab_size": conversion.vocab.original,
        "uneven": conversion.uneven,
        "allow_divergent": allow_divergent,
        "divergent": divergent,
    }

    buffers = BufferPool(budget.limit)

    def job(work: Work) -> tuple[str, str, bool | None, list[torch.Tensor], torch.Tensor]:
        raw, buffer = buffers.get(work.buffer_shape, work.tensor.source.dtype)
        name, canonical, pieces = prepare(work, buffer=buffer, **options)
        for ref in work.tensor.source.refs:
            ref.evict()
        digest, is_finite = hasher(canonical), finite_of(canonical) if finite_of else None
        if writer.concurrent:  # write here, every target rank's blocks in flight at once
            with Batch():
                writer.write_unordered(name, _exact(pieces, work.tensor.target_shapes))
            pieces = []
        return name, digest, is_finite, pieces, raw

    hashes: dict[str, str] = {}
    total = sum(t.nbytes for t in conversion.tensors)
    pending: deque[tuple[Work, Future]] = deque()
    with (
        _frozen_gc(),
        ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="reshard-read") as pool,
        tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            desc="tensors",
            file=sys.stderr,
            leave=False,
            **quiet_unless(progress),
        ) as bar,
        torch.inference_mode(),
        ReadAhead(works, budget.limit) as read_ahead,
    ):
        queue = deque(works)
        try:
            while queue or pending:
                while queue and len(pending) < MAX_PENDING and budget.take(queue[0].cost):
                    work = queue.popleft()
                    pending.append((work, pool.submit(job, work)))
                    read_ahead.started(work)
                work, future = pending.popleft()
                name, digest, is_finite, pieces, raw = future.result()
                hashes[name] = digest
                if finite is not None:
                    finite[name] = is_finite
                if not writer.concurrent:
                    writer.write(name, _exact(pieces, work.tensor.target_shapes))
                del pieces, future
                buffers.put(raw)
                budget.give(work.cost)
                bar.update(work.tensor.nbytes)
        except BaseException:
            for _, future in pending:
                future.cancel()
            raise
    return hashes


def _exact(pieces: Sequence[torch.Tensor], shapes: Sequence[Shape]) -> list[torch.Tensor]:
    for piece, shape in zip(pieces, shapes, strict=True):
        if tuple(piece.shape) != shape:
            raise ShapeMismatchError(f"split produced {tuple(piece.shape)}, planned {shape}")
    return list(pieces)
