"""The one record of how a tensor is cut across ranks: per rank, the runs of the canonical tensor's rows its slice
joins, in order.

A :class:`Cut` answers both directions with the same numbers: a gather reads each rank's runs into their place in
the canonical tensor (:meth:`Cut.placed`: the first copy of every row; the other copies of replicated KV heads are
compared with it, :meth:`Cut.copies`), and a split cuts the canonical tensor into each rank's runs
(:attr:`Cut.runs`). The gather (:mod:`reshard.engine.move.gather`), the byte stream
(:mod:`reshard.engine.move.stream`), ``verify``'s rank check and the tensor functions (:mod:`reshard.geometry.tensors`)
all read a ``Cut``; none works out a cut of its own, so a source slice and a target slice, or a weight and its
optimizer state, can never be cut two ways. Runs are in rows along the partition's dim; a row's bytes are the product
of the later dims times the item size (:meth:`Cut.row_bytes`), so where the earlier dims are 1 the runs are byte ranges
too, as DCP's ``ReadItem`` pairs ``storage_offsets`` with ``dest_offsets`` and ``lengths``.

Pure arithmetic on shapes, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from reshard.errors import ShapeMismatchError
from reshard.geometry.partition import (
    Packed,
    Partition,
    Replicate,
    ReplicatedHeads,
    Vocab,
    head_replicas,
    norm_dim,
    packed_piece_sizes,
    rank_shapes,
)

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Run:
    """Rows ``[start, start + length)`` along the cut dim of rank ``rank``'s slice are rows ``[at, at + length)`` of
    the canonical tensor (padded: a vocab's pad rows follow its data rows)."""

    rank: int
    start: int
    at: int
    length: int


@dataclass(frozen=True)
class Cut:
    """How one tensor of canonical ``shape`` is cut into rank slices of ``shapes``.

    Attributes:
        partition: the partition kind it follows.
        shape: the canonical (unpadded) shape.
        shapes: each rank's slice shape.
        dim: the dim it is cut along; None for a replicated tensor (every rank holds it whole).
        rows: the canonical rows along ``dim`` the slices cover, pad rows included (0 when replicated).
        runs: per rank, its runs in the order its slice joins them.
        replicas: how many ranks hold each run (KV heads copied over ranks; ``tp`` when replicated, else 1).
    """

    partition: Partition
    shape: Shape
    shapes: tuple[Shape, ...]
    dim: int | None
    rows: int
    runs: tuple[tuple[Run, ...], ...]
    replicas: int

    @property
    def tp(self) -> int:
        return len(self.shapes)

    @property
    def axis(self) -> int:
        """``dim``, of a tensor cut along one (every partition but :class:`Replicate`)."""
        if self.dim is None:
            raise TypeError(f"a {self.partition.describe()} tensor is cut along no dim")
        return self.dim

    @property
    def data_rows(self) -> int:
        """Canonical rows along ``dim`` that are data (a vocab's pad rows are not)."""
        return 0 if self.dim is None else self.shape[self.dim]

    def placed(self) -> list[Run]:
        """The runs a gather reads, in canonical order: every non-empty run of the first rank holding it (copies are
        compared with it). They tile rows ``[0, rows)`` one after the other."""
        if self.dim is None:
            return []
        runs = [run for rank in self.runs[:: self.replicas] for run in rank if run.length]
        return sorted(runs, key=lambda run: run.at)

    def copies(self) -> list[tuple[int, int]]:
        """``(rank, first rank)`` of every rank whose slice is a copy of an earlier rank's."""
        return [(rank, rank - rank % self.replicas) for rank in range(self.tp) if rank % self.replicas]

    def rank_rows(self, rank: int) -> tuple[tuple[int, int], ...]:
        """Rank ``rank``'s runs as ``(first canonical row, length)``."""
        return tuple((run.at, run.length) for run in self.runs[rank])

    def row_bytes(self, itemsize: int) -> int:
        """Bytes of one row along ``dim`` (everything after it)."""
        return math.prod(self.shape[(self.dim or 0) + 1 :]) * itemsize

    def rows_contiguous(self) -> bool:
        """Whether a run of rows is one run of bytes, in the slice and in the canonical tensor (the dims before
        ``dim`` are 1)."""
        return self.dim is not None and math.prod(self.shape[: self.dim]) == 1

    def own_slices(self) -> bool:
        """Whether each rank's piece of this cut is its own slice, each row once: split along a dim, no copies."""
        return self.dim is not None and self.replicas == 1


def split_cut(
    partition: Partition, full_shape: Sequence[int], tp: int, *, padded: int | None = None, uneven: bool = False
) -> Cut:
    """The cut of a canonical tensor of ``full_shape`` into ``tp`` rank slices (for a :class:`Vocab`, padded to
    ``padded`` rows along its dim; ``uneven``: ``torch.chunk``'s pieces).

    Raises:
        ShapeMismatchError: the dim (a part, whole blocks, heads) does not split ``tp`` ways.

    Example:
        >>> [split_cut(Packed(0, (4, 2)), (6, 3), 2).rank_rows(r) for r in range(2)]
        [((0, 2), (4, 1)), ((2, 2), (5, 1))]
    """
    full_shape = tuple(full_shape)
    shapes = tuple(rank_shapes(partition, full_shape, tp, padded=padded, uneven=uneven))  # validates
    if isinstance(partition, Replicate):
        return Cut(partition, full_shape, shapes, None, 0, ((),) * tp, tp)
    dim = norm_dim(partition.dim, len(full_shape))
    sizes = [shape[dim] for shape in shapes]
    replicas = head_replicas(partition, tp)
    if isinstance(partition, Packed) and tp > 1:
        pieces = packed_piece_sizes(partition, tp, uneven=uneven)
        starts = [sum(partition.parts[:i]) for i in range(len(partition.parts))]
        rows = [
            tuple((start + sum(part[:r]), part[r]) for start, part in zip(starts, pieces, strict=True))
            for r in range(tp)
        ]
    elif replicas > 1:  # every copy of a head is the same rows
        rows = [(((r // replicas) * sizes[r], sizes[r]),) for r in range(tp)]
    else:
        rows = [((sum(sizes[:r]), sizes[r]),) for r in range(tp)]
    runs = tuple(_runs(rank, rank_runs) for rank, rank_runs in enumerate(rows))
    total = partition.heads * sizes[0] if isinstance(partition, ReplicatedHeads) and replicas > 1 else sum(sizes)
    return Cut(partition, full_shape, shapes, dim, total, runs, replicas)


def slices_cut(partition: Partition, full_shape: Sequence[int], shapes: Sequence[Sequence[int]]) -> Cut:
    """The cut that gives rank slices of ``shapes`` from a canonical tensor of ``full_shape`` (a vocab's slices
    padded to the rows they hold): what a gather of those slices places where.

    The arithmetic needs no ``--uneven``: an even split is the ``torch.chunk`` split of sizes that divide, so the
    slices' shapes alone tell, and they are checked against the cut.

    Raises:
        ShapeMismatchError: the shapes are no cut of ``partition``.
    """
    shapes = tuple(tuple(shape) for shape in shapes)
    padded = None
    if isinstance(partition, Vocab):
        padded = sum(shape[norm_dim(partition.dim, len(shape))] for shape in shapes)
    cut = split_cut(partition, full_shape, len(shapes), padded=padded, uneven=True)
    if cut.shapes != shapes:
        raise ShapeMismatchError(
            f"rank shapes {[list(s) for s in shapes]} are not a {partition.describe()} cut of {list(full_shape)} "
            f"(expected {[list(s) for s in cut.shapes]})"
        )
    return cut


def _runs(rank: int, rows: Sequence[tuple[int, int]]) -> tuple[Run, ...]:
    """A rank's ``(canonical row, length)`` runs as :class:`Run` s, each starting in the slice where the last ended."""
    out, start = [], 0
    for at, length in rows:
        out.append(Run(rank, start, at, length))
        start += length
    return tuple(out)
