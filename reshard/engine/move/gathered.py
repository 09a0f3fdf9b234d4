"""The job of one gathered unit, on a worker thread: its rank slices read into a pooled buffer, the transform run,
the targets hashed, checked for NaN/Inf and (for a concurrent writer) written.

The units :mod:`reshard.engine.move.stream` cannot move as runs of bytes come here: transforms, copies of a replicated
head to compare, pad rows to add along a later dim, and, on a disk, every unit of a conversion that has one such
unit (the direct reads of a whole tensor keep more of the disk busy than a stream's one block at a time). This
module imports torch; the scheduler (:mod:`reshard.engine.move.execute`) imports it only when a unit needs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from reshard.dtypes import dtype_from_code
from reshard.engine.move.buffers import BufferPool
from reshard.engine.move.digest import all_finite_in_blocks, digest_of
from reshard.engine.move.gather import gather_and_split, writes_into
from reshard.engine.move.work import Work, read_phase, write_phase
from reshard.errors import ShapeMismatchError
from reshard.io.direct import Batch
from reshard.io.joined import Joined
from reshard.layouts.base import CheckpointWriter

Shape = tuple[int, ...]
# What a job hands back per target tensor: name, digest, finite, and the slices left to write (if any).
Written = tuple[str, str, bool | None, list[torch.Tensor | Joined]]


class GatherJobs:
    """Gathers units into buffers reused across them (:class:`~reshard.engine.move.buffers.BufferPool`, within
    ``limit`` bytes): :meth:`run` on worker threads, :meth:`release` of a unit's buffers once it is written."""

    def __init__(
        self,
        writer: CheckpointWriter,
        limit: int,
        *,
        allow_divergent: bool,
        divergent: set[str] | None,
        finite: bool,
    ) -> None:
        self._writer = writer
        self._buffers = BufferPool(limit)
        self._finite = finite
        self._allow_divergent = allow_divergent
        self._divergent = divergent

    @contextlib.contextmanager
    def mode(self) -> Iterator[None]:
        """The calling thread's context while units are written from it (no autograd records)."""
        with torch.inference_mode():
            yield

    def run(self, work: Work) -> tuple[list[Written], list[torch.Tensor]]:
        """Gather, transform, hash and check one unit; its targets (with the slices still to write, for a writer
        that is not concurrent) and the raw buffers to :meth:`release` once those are written."""
        writer, buffers = self._writer, self._buffers
        held = [
            buffers.get(shape, source.dtype, phase=read_phase(source))
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
            allow_divergent=self._allow_divergent,
            divergent=self._divergent,
        )
        held += outputs
        for source in work.tensor.sources:
            for ref in source.refs:
                ref.evict()
        written = []
        for (name, canonical, pieces), target in zip(pieces_of, work.tensor.targets, strict=True):
            pieces = _exact(pieces, target.rank_shapes)
            with Batch():
                if writer.concurrent:  # write here, every target rank's blocks in flight while this thread hashes
                    writer.write_unordered(name, pieces)
                    pieces = []
                digest = digest_of(canonical)
                if not self._finite:
                    is_finite = None
                else:
                    is_finite = name in known_finite or all_finite_in_blocks(canonical)
            written.append((name, digest, is_finite, pieces))
        del pieces_of
        return written, [raw for raw, _ in held]

    def release(self, raws: Sequence[torch.Tensor]) -> None:
        for raw in raws:
            self._buffers.put(raw)


def _exact(pieces: Sequence[torch.Tensor | Joined], shapes: Sequence[Shape]) -> list[torch.Tensor | Joined]:
    for piece, shape in zip(pieces, shapes, strict=True):
        if tuple(piece.shape) != shape:
            raise ShapeMismatchError(f"split produced {tuple(piece.shape)}, planned {shape}")
    return list(pieces)
