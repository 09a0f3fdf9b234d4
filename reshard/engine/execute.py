"""Moving the bytes of a planned conversion: read, gather, hash, split and write on worker threads.

Why it is shaped like this (the gather itself is :mod:`reshard.engine.gather`):

* **The disk busy, the page cache left alone.** Reads and writes go through :mod:`reshard.io.direct`:
  ``O_DIRECT`` in 8 MB blocks, every block of a tensor (all its rank slices, all its target pieces)
  in flight at once. A conversion does not fill the page cache with a checkpoint it will not read
  again, and does not pay for fresh page-cache pages, which cost the most on a VM (4 GB, tp 8 -> 4,
  on the 2-core bench machine: sys time 10-13 s with buffered reads and writes, 2-3 s with neither).
  Where a file system refuses ``O_DIRECT``, reads go through the page cache; then a :class:`ReadAhead`
  thread asks the OS for the coming slices, and each slice's pages are dropped once read (``evict``).
* **Overlap, bounded by bytes.** ``jobs`` threads prepare tensors (read, gather, hash, finite check:
  all release the GIL) and, when the writer is :attr:`~reshard.layouts.base.CheckpointWriter.concurrent`
  (every safetensors-based writer: each tensor's offset is known from the header), write them too,
  at their offsets: a thread waiting for the disk leaves the core to another one's hashing. Other
  writers get the tensors in plan order from the calling thread. Buffers are reused for the next tensor
  of the same size, and what is in flight stays within a byte budget (:mod:`reshard.engine.buffers`).
* **In memory, no gather.** When the source files and the output live in memory (tmpfs), a tensor kept as it
  is skips the buffer: it streams through a small one, block by block (:mod:`reshard.engine.stream`), and only
  the others (a transform, copies of a replicated tensor to compare) are gathered.
* **The largest tensors first.** A tensor is hashed while its slices are written, so the last one's hash
  ends after every byte has gone to the disk. Plan order is by name, which ends a Megatron checkpoint on
  ``output_layer.weight``: 0.24 s of hashing 262 MB with the disk idle, at the end of a 4 GB tp 8 -> 4 on
  the bench VM. Concurrent writers get the tensors of the largest size first, then the rest in plan order
  (which repeats each layer's sizes, so the pooled buffers are reused): the run then ends 0.05-0.08 s after
  its last direct write. Sorting every tensor by size ends it 0.02 s after, but each size class then needs
  fresh buffers: 517,000 minor faults instead of 344,000, 100 MB more memory.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from reshard.dtypes import dtype_from_code
from reshard.engine.buffers import Budget, BufferPool, budget_for
from reshard.engine.digest import all_finite_in_blocks, digest_of
from reshard.engine.gather import (
    Work,
    check_fits,
    gather_and_split,
    plan_work,
    read_phase,
    write_phase,
    writes_into,
)
from reshard.engine.stream import stream, stream_plan, streams_to
from reshard.errors import ShapeMismatchError
from reshard.io.direct import Batch
from reshard.layouts.base import CheckpointWriter, TensorRef
from reshard.progress import quiet_unless

if TYPE_CHECKING:
    from reshard.engine.planner import ConversionPlan, TensorPlan

MAX_PENDING = 256
Shape = tuple[int, ...]
# What a job hands back per target tensor: name, digest, finite, and the slices left to write (if any).
Written = tuple[str, str, bool | None, list["torch.Tensor"]]


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
    finite: dict[str, bool] | None = None,
    allow_divergent: bool = False,
    divergent: set[str] | None = None,
    progress: bool = True,
    budget: Budget | None = None,
    on_hashed: Callable[[TensorPlan, str, str, bool | None], None] | None = None,
) -> dict[str, str]:
    """Stream every tensor through gather -> hash -> split -> writer; returns ``{name: digest}``
    (``"blake3:<hex>"``, :func:`~reshard.engine.digest.digest_of`).

    ``jobs`` threads read, gather, hash and (for :attr:`~CheckpointWriter.concurrent` writers) write
    tensors, several at once; other writers get them in plan order from this thread. When ``finite`` is
    given it is filled with ``{name: no NaN/Inf in the canonical tensor}``, for the manifest. With
    ``allow_divergent``, replicated tensors that differ between ranks are taken from rank 0 and, when
    ``divergent`` is given, named in it (the manifest records them). ``on_hashed(plan, name, digest, finite)``
    is called, in this thread, for every target tensor once it is hashed and handed to the writer (a resumable
    run journals it).
    """
    works = [plan_work(t, target_tp=conversion.target_tp) for t in conversion.tensors]
    check_fits(works)  # before the first buffer: a declared size larger than memory is one line, not the allocator's
    if writer.concurrent:  # the largest first (see above); the others' write() calls follow plan order
        largest = max((work.tensor.nbytes for work in works), default=0)
        works.sort(key=lambda work: work.tensor.nbytes != largest)
    budget = budget or Budget(budget_for(works))
    options = {
        "target_tp": conversion.target_tp,
        "uneven": conversion.uneven,
        "allow_divergent": allow_divergent,
        "divergent": divergent,
    }

    buffers = BufferPool(budget.limit)
    streams = streams_to(writer)

    def job(work: Work) -> tuple[list[Written], list[torch.Tensor]]:
        streamed = stream_plan(work, target_tp=conversion.target_tp, uneven=conversion.uneven) if streams else None
        if streamed is not None:  # runs of source bytes, through a small buffer (engine/stream.py)
            digest, is_finite = stream(
                work,
                streamed,
                writer,
                target_tp=conversion.target_tp,
                uneven=conversion.uneven,
                finite=finite is not None,
            )
            return [(work.tensor.targets[0].name, digest, is_finite, [])], []
        held = [
            buffers.get(shape, source.dtype, phase=read_phase(source, uneven=conversion.uneven))
            for shape, source in zip(work.buffer_shapes, work.tensor.sources, strict=True)
        ]
        into = writes_into(work.tensor)  # the transform's output in pooled memory too
        outputs = (  # on the phase of where they are written: written without a staging copy
            [
                buffers.get(t.shape, dtype_from_code(t.code), phase=write_phase(t, writer.position(t.name)))
                for t in work.tensor.targets
            ]
            if into
            else []
        )
        known_finite: set[str] = set()  # targets a transform knows to be finite from its inputs
        pieces_of = gather_and_split(
            work,
            buffers=[buffer for _, buffer in held],
            outputs=[out for _, out in outputs] or None,
            known_finite=known_finite,
            **options,
        )
        held += outputs
        for ref in _refs(work):
            ref.evict()
        written = []
        for (name, canonical, pieces), target in zip(pieces_of, work.tensor.targets, strict=True):
            pieces = _exact(pieces, target.rank_shapes)
            with Batch():
                if writer.concurrent:  # write here, every target rank's blocks in flight while this thread hashes
                    writer.write_unordered(name, pieces)
                    pieces = []
                digest = digest_of(canonical)
                if finite is None:
                    is_finite = None
                else:
                    is_finite = name in known_finite or all_finite_in_blocks(canonical)
            written.append((name, digest, is_finite, pieces))
        del pieces_of
        return written, [raw for raw, _ in held]

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
                for raw in raws:
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
