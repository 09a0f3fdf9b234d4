"""Moving the bytes of a planned conversion: read, gather, hash, split and write on worker threads.

Why it is shaped like this (the gather itself is :mod:`reshard.engine.move.gather`):

* **The disk busy, the page cache left alone.** Reads and writes go through :mod:`reshard.io.direct`:
  ``O_DIRECT`` in 8 MB blocks, every block of a tensor (all its rank slices, all its target pieces)
  in flight at once. A conversion does not fill the page cache with a checkpoint it will not read
  again, and does not pay for fresh page-cache pages, which cost the most on a VM (measured:
  docs/performance.md).
  Where a file system refuses ``O_DIRECT``, reads go through the page cache; then a :class:`ReadAhead`
  thread asks the OS for the coming slices, and each slice's pages are dropped once read (``evict``).
* **Overlap, bounded by bytes.** ``jobs`` threads prepare tensors (read, gather, hash, finite check:
  all release the GIL) and, when the writer is :attr:`~reshard.layouts.base.CheckpointWriter.concurrent`
  (every safetensors-based writer: each tensor's offset is known from the header), write them too,
  at their offsets: a thread waiting for the disk leaves the core to another one's hashing. Other
  writers get the tensors in plan order from the calling thread. Buffers are reused for the next tensor
  of the same size, and what is in flight stays within a byte budget (:mod:`reshard.engine.move.buffers`).
* **No gather, no torch, where bytes are only moved.** A tensor kept as it is can skip the gather buffer: it
  streams through a small one, block by block (:mod:`reshard.engine.move.stream`). When every unit of a conversion
  streams (re-slicing safetensors, DeepSpeed's fp32 masters to safetensors), torch is never imported: its import
  alone costs more than moving a small model's bytes (docs/performance.md). When the source files and the
  output live in memory (tmpfs), the units that stream do so beside the gathered ones (a transform, copies of a
  replicated head to compare, :mod:`reshard.engine.move.gathered`); on a disk, a conversion with one gathered unit
  gathers all of them, as the gather's direct reads of a whole tensor keep more of the disk busy.
* **The largest tensors first.** A tensor is hashed while its slices are written, so the last one's hash
  ends after every byte has gone to the disk. Plan order is by name, which ends a Megatron checkpoint on
  ``output_layer.weight``, hashed with the disk idle. Concurrent writers get the tensors of the largest size
  first, then the rest in plan order (which repeats each layer's sizes, so the pooled buffers are reused);
  sorting every tensor by size would end the run a little sooner but needs fresh buffers for each size class
  (measured: docs/performance.md).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from reshard.engine.move.buffers import Budget, budget_for
from reshard.engine.move.stream import RowBlocks, Streamed, in_memory_unit, stream, stream_plan, streams_to
from reshard.engine.move.work import Work, check_fits, plan_work
from reshard.io.progress import progress_bar
from reshard.layouts.base import CheckpointWriter, TensorRef

if TYPE_CHECKING:
    from reshard.engine.move.gathered import GatherJobs, Written
    from reshard.engine.plan.planner import ConversionPlan, TensorPlan

MAX_PENDING = 256
# Each unit's buffers and stream plan (None: gathered), by the unit's name: planned once a conversion (plan_moves).
Moves = dict[str, tuple[Work, Streamed | RowBlocks | None]]


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
            for ref in _refs(work):
                ref.prefetch()
            ahead += _source_bytes(work)


def _refs(work: Work) -> list[TensorRef]:
    return [ref for source in work.tensor.sources for ref in source.refs]


def _source_bytes(work: Work) -> int:
    return sum(ref.header.nbytes for ref in _refs(work))


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


def execute(
    conversion: ConversionPlan,
    writer: CheckpointWriter,
    *,
    jobs: int = 1,
    finite: dict[str, bool | None] | None = None,
    allow_divergent: bool = False,
    divergent: set[str] | None = None,
    progress: bool = True,
    budget: Budget | None = None,
    on_hashed: Callable[[TensorPlan, str, str, bool | None], None] | None = None,
    moves: Moves | None = None,
) -> dict[str, str]:
    """Stream every tensor through gather -> hash -> split -> writer; returns ``{name: digest}``
    (``"blake3:<hex>"``, :func:`~reshard.engine.move.digest.digest_of`).

    ``jobs`` threads read, gather, hash and (for :attr:`~CheckpointWriter.concurrent` writers) write
    tensors, several at once; other writers get them in plan order from this thread. When ``finite`` is
    given it is filled with ``{name: no NaN/Inf in the canonical tensor}``, for the manifest. With
    ``allow_divergent``, replicated tensors that differ between ranks are taken from rank 0 and, when
    ``divergent`` is given, named in it (the manifest records them). ``on_hashed(plan, name, digest, finite)``
    is called, in this thread, for every target tensor once it is hashed and handed to the writer (a resumable
    run journals it). Torch is imported only when a unit is gathered (see the module's docstring). ``moves``: the
    units' buffers and streams as :func:`plan_moves` planned them for the whole conversion (``conversion`` may be the
    part of it this process writes); planned here when not given.
    """
    moves = moves if moves is not None else plan_moves(conversion)
    works = [moves[t.name][0] for t in conversion.tensors]
    check_fits(works)  # before the first buffer: a declared size larger than memory is one line, not the allocator's
    if writer.concurrent:  # the largest first (see above); the others' write() calls follow plan order
        largest = max((work.tensor.nbytes for work in works), default=0)
        works.sort(key=lambda work: work.tensor.nbytes != largest)
    budget = budget or Budget(budget_for(works))
    streamed = _streamed(works, [moves[work.tensor.name][1] for work in works], writer)
    gathers = None
    if any(plan is None for plan in streamed):
        from reshard.engine.move.gathered import GatherJobs  # imports torch

        gathers = GatherJobs(
            writer,
            budget.limit,
            allow_divergent=allow_divergent,
            divergent=divergent,
            finite=finite is not None,
        )

    move = functools.partial(
        move_unit,
        writer=writer,
        gathers=gathers,
        finite=finite is not None,
        allow_divergent=allow_divergent,
        divergent=divergent,
    )

    hashes: dict[str, str] = {}
    total = sum(t.nbytes for t in conversion.tensors)
    pending: deque[tuple[Work, Future]] = deque()
    with (
        _frozen_gc(),
        ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="reshard-read") as pool,
        progress_bar(progress, total=total, unit="B", unit_scale=True, desc="tensors", leave=False) as bar,
        gathers.mode() if gathers is not None else contextlib.nullcontext(),
        ReadAhead(works, budget.limit) as read_ahead,
    ):
        queue = deque(zip(works, streamed, strict=True))
        try:
            while queue or pending:
                while queue and len(pending) < MAX_PENDING and budget.take(queue[0][0].cost):
                    work, plan = queue.popleft()
                    pending.append((work, pool.submit(move, work, plan)))
                    read_ahead.started(work)
                work, future = pending.popleft()
                written, raws = future.result()
                for name, digest, is_finite, pieces in written:
                    hashes[name] = digest
                    if finite is not None:
                        finite[name] = is_finite
                    if not writer.concurrent:
                        writer.write(name, pieces)
                    if on_hashed is not None:
                        on_hashed(work.tensor, name, digest, is_finite)
                del written, pieces, future
                if raws and gathers is not None:  # only gathered units hold buffers
                    gathers.release(raws)
                budget.give(work.cost)
                bar.update(work.tensor.nbytes)
        except BaseException:
            for _, future in pending:
                future.cancel()
            raise
    return hashes


def move_unit(
    work: Work,
    plan: Streamed | RowBlocks | None,
    *,
    writer: CheckpointWriter,
    gathers: GatherJobs | None,
    finite: bool,
    allow_divergent: bool,
    divergent: set[str] | None,
) -> tuple[list[Written], list[Any]]:
    """Move one unit's bytes, on a worker thread: streamed by ``plan``, or gathered when it has none. Its targets
    (name, digest, finite, slices still to write) and the gather buffers to give back once they are written."""
    if plan is None:
        if gathers is None:
            raise ValueError(f"{work.tensor.name}: a unit to gather, and no GatherJobs to gather it")
        return gathers.run(work)
    digest, is_finite = stream(work, plan, writer, finite=finite, allow_divergent=allow_divergent, divergent=divergent)
    for ref in _refs(work):  # read through the page cache where direct reads are refused: not needed again
        ref.evict()
    return [(work.tensor.targets[0].name, digest, is_finite, [])], []


def plan_moves(conversion: ConversionPlan) -> Moves:
    """Each unit's buffers and, when it can stream (into a writer that takes byte ranges), its stream plan, by the
    unit's name: planned once per conversion, before staging (:func:`needs_torch`) and for :func:`execute`."""
    moves = {}
    for tensor in conversion.tensors:
        work = plan_work(tensor, target_tp=conversion.target_tp)
        moves[tensor.name] = (work, stream_plan(work))
    return moves


def needs_torch(moves: Moves) -> bool:
    """Whether some unit must be gathered, which imports torch (the engine starts its import early then). Pure."""
    return any(streamed is None for _, streamed in moves.values())


def _streamed(
    works: Sequence[Work], plans: Sequence[Streamed | RowBlocks | None], writer: CheckpointWriter
) -> Sequence[Streamed | RowBlocks | None]:
    """Per unit, its stream (None: gathered): every unit's when all of them stream, else those in memory."""
    if not streams_to(writer):
        return [None] * len(works)
    if all(plan is not None for plan in plans):
        return plans
    return [
        plan if plan is not None and in_memory_unit(work, writer) else None
        for work, plan in zip(works, plans, strict=True)
    ]
