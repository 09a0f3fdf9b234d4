"""Where a DTensor's local tensor lies in its global tensor: pure arithmetic on the pickled spec (no torch).

A DTensor on a mesh of sizes ``(m_0, ..., m_k)`` has one placement per mesh dim. Walking the mesh dims in order,
``Shard(d)`` cuts the piece held so far along tensor dim ``d`` into ``m_i`` pieces as ``torch.chunk`` does (each of
``ceil(n / m_i)`` rows but the last ones, which may be shorter or empty) and keeps the one at the rank's coordinate
on that dim; ``Replicate()`` keeps it whole (torch's ``compute_local_shape_and_global_offset`` for the default shard
order). ``_StridedShard`` (interleaved pieces) and ``Partial`` (pending sums) are refused by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from reshard.formats.boxes import Box
from reshard.formats.safe_pickle import Partial, Replicate, Shard, StridedShard


class PlacementError(ValueError):
    """A spec that cannot be placed: the message says why (the caller names file and tensor)."""


def local_box(shape: Sequence[int], sizes: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any]) -> Box:
    """The box of the global tensor of ``shape`` that the rank at ``coordinate`` of a mesh of ``sizes`` holds.

    Raises:
        PlacementError: a placement that is not ``Shard`` / ``Replicate``, or that does not fit the shape or mesh.

    Example:
        >>> local_box((5, 4), (2,), (1,), [shard(0)])
        Box(offsets=(3, 0), sizes=(2, 4))
    """
    if not (len(sizes) == len(coordinate) == len(placements)):
        raise PlacementError(
            f"{len(placements)} placements for a mesh of {len(sizes)} dims at coordinate {tuple(coordinate)}"
        )
    offsets, lengths = [0] * len(shape), list(shape)
    for size, at, placement in zip(sizes, coordinate, placements, strict=True):
        if not (type(size) is int and type(at) is int and 0 <= at < size):
            raise PlacementError(f"mesh coordinate {tuple(coordinate)} outside a mesh of {tuple(sizes)}")
        if isinstance(placement, StridedShard):
            raise PlacementError(
                "placement _StridedShard (interleaved shards, FSDP over tensor parallelism) is not read"
            )
        if isinstance(placement, Partial):
            raise PlacementError("placement Partial (a pending reduction, not a stored value) is not read")
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, Shard) or type(placement.dim) is not int:
            raise PlacementError(f"placement {placement!r} is not Shard(dim) or Replicate()")
        dim = placement.dim + len(shape) if placement.dim < 0 else placement.dim
        if not 0 <= dim < len(shape):
            raise PlacementError(f"Shard({placement.dim}) of a tensor of {len(shape)} dims")
        start, length = chunk(lengths[dim], size, at)
        offsets[dim] += start
        lengths[dim] = length
    return Box(tuple(offsets), tuple(lengths))


def chunk(length: int, pieces: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of piece ``index`` when ``torch.chunk`` cuts ``length`` rows into ``pieces``
    (``Shard._local_shard_size_and_offset``): pieces of ``ceil(length / pieces)``, the last ones shorter or empty."""
    full = -(-length // pieces)
    start = min(length, full * index)
    return start, max(0, min(length, start + full) - start)


def shard(dim: int) -> Shard:
    """A ``Shard(dim)`` stand-in, as the unpickler makes it (for examples and tests)."""
    placement = Shard()
    placement.__setstate__({"dim": dim})
    return placement
