"""The pure tensor functions of the partitions: split a canonical tensor into rank slices, gather rank
slices back (unpadding the vocab), pad and unpad, and the bitwise replica check.

Tensors in, tensors out; no file is opened. Shapes are validated by :mod:`reshard.partition` first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from reshard.errors import DivergentReplicaError, ShapeMismatchError
from reshard.partition import (
    Grouped,
    Heads,
    Packed,
    Partition,
    Replicate,
    ReplicatedHeads,
    Shard,
    Vocab,
    canonical_shape,
    head_replicas,
    norm_dim,
    packed_piece_sizes,
    rank_rows,
    rank_shapes,
    with_size,
)
from reshard.vocab import cut_pad_rows


def pad(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """Append zero rows along ``dim`` up to ``size`` (no copy when nothing is added)."""
    dim = norm_dim(dim, tensor.dim())
    missing = size - tensor.shape[dim]
    if missing < 0:
        raise ShapeMismatchError(f"cannot pad dim {dim} of size {tensor.shape[dim]} down to {size}")
    if missing == 0:
        return tensor
    zeros = tensor.new_zeros(with_size(tensor.shape, dim, missing))
    return torch.cat([tensor, zeros], dim=dim)


def unpad(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """A view of the first ``size`` entries along ``dim``: the pad rows are not data."""
    return cut_pad_rows(tensor, norm_dim(dim, tensor.dim()), size)


def split(
    full: torch.Tensor, partition: Partition, tp: int, *, padded: int | None = None, uneven: bool = False
) -> list[torch.Tensor]:
    """Cut a canonical tensor into ``tp`` rank slices (views where the layout allows).

    Example:
        >>> [t.tolist() for t in split(torch.arange(4), Packed(0, (2, 2)), 2)]
        [[0, 2], [1, 3]]
    """
    if isinstance(partition, Replicate):
        return [full] * tp
    if isinstance(partition, Packed) and tp == 1:  # one rank holds every part whole, in order: the tensor itself
        rank_shapes(partition, full.shape, tp, uneven=uneven)  # validates
        return [full]
    rows = rank_rows(partition, full.shape, tp, padded=padded, uneven=uneven)
    if isinstance(partition, Vocab):
        full = pad(full, partition.dim, sum(length for ((_, length),) in rows))
    dim = norm_dim(partition.dim, full.dim())
    return [_joined(full, dim, runs) for runs in rows]


def _joined(full: torch.Tensor, dim: int, runs: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Rows ``runs`` of ``full`` along ``dim``: a view when they are one run, else their concatenation."""
    if len(runs) == 1:
        return full.narrow(dim, *runs[0])
    return torch.cat([full.narrow(dim, start, length) for start, length in runs], dim=dim)


def packed_parts(full: torch.Tensor, partition: Packed, tp: int, *, uneven: bool = False) -> list[list[torch.Tensor]]:
    """Per rank, the views of a packed tensor's parts that its slice joins along ``partition.dim``, in order."""
    dim = norm_dim(partition.dim, full.dim())
    return [
        [full.narrow(dim, start, length) for start, length in runs]
        for runs in rank_rows(partition, full.shape, tp, uneven=uneven)
    ]


def gather(
    slices: Sequence[torch.Tensor],
    partition: Partition,
    *,
    vocab_size: int | None = None,
    uneven: bool = False,
    allow_divergent: bool = False,
) -> torch.Tensor:
    """Join rank slices into the canonical tensor: the inverse of :func:`split`.

    Args:
        slices: one tensor per rank, in rank order.
        partition: how they were split.
        vocab_size: for :class:`Vocab`, the true size to cut the padded dim back to.
        uneven: accept ``torch.chunk``-style uneven pieces.
        allow_divergent: for :class:`Replicate` (and the copies of :class:`ReplicatedHeads`), take the first
            copy even when ranks differ.

    Raises:
        ShapeMismatchError: the slices do not fit the partition.
        DivergentReplicaError: a replicated tensor (or a replicated head) differs between ranks (the message
            gives the max absolute difference and the ranks).

    Example:
        >>> gather([torch.tensor([0, 2]), torch.tensor([1, 3])], Packed(0, (2, 2))).tolist()
        [0, 1, 2, 3]
    """
    full_shape = canonical_shape(partition, [s.shape for s in slices], vocab_size=vocab_size, uneven=uneven)
    match partition:
        case Replicate():
            if not allow_divergent:
                check_replicas(slices)
            return slices[0]
        case Shard(dim, _) | Grouped(dim, _) | Heads(dim, _):
            return slices[0] if len(slices) == 1 else torch.cat(list(slices), dim=dim)
        case Vocab(dim):
            joined = slices[0] if len(slices) == 1 else torch.cat(list(slices), dim=dim)
            return unpad(joined, dim, full_shape[dim])
        case Packed(dim, _, _):
            per_part = packed_piece_sizes(partition, len(slices), uneven=uneven)
            rank_pieces = [torch.split(s, [sizes[r] for sizes in per_part], dim=dim) for r, s in enumerate(slices)]
            return torch.cat(
                [torch.cat([pieces[i] for pieces in rank_pieces], dim=dim) for i in range(len(per_part))], dim=dim
            )
        case ReplicatedHeads(dim, heads):
            replicas = head_replicas(partition, len(slices))
            if replicas == 1:
                return slices[0] if len(slices) == 1 else torch.cat(list(slices), dim=dim)
            if not allow_divergent:
                for rank, other in enumerate(slices):
                    first, what = rank - rank % replicas, f"replicated KV head {rank // replicas}"
                    if rank != first:
                        check_replica(slices[first], other, rank, first_rank=first, what=what)
            return torch.cat([slices[h * replicas] for h in range(heads)], dim=dim)
    raise TypeError(f"not a partition: {partition!r}")


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (NaNs with equal bits compare equal, unlike ``torch.equal``)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    left, right = (t.contiguous().reshape(-1).view(torch.uint8).numpy() for t in (a, b))
    # compared as the widest integers that tile the bytes, on one core: torch.equal of bytes compares one byte at a
    # time on every core (64 MB on the bench VM: 64 CPU-ms, and its OpenMP threads spin after each call; numpy on
    # 8-byte words: 9 CPU-ms)
    width = next(w for w in (8, 4, 2, 1) if len(left) % w == 0)
    return bool(np.array_equal(left.view(f"i{width}"), right.view(f"i{width}")))


def check_replicas(slices: Sequence[torch.Tensor]) -> None:
    """Raise :class:`DivergentReplicaError` unless every slice equals the first, bit for bit."""
    for rank, other in enumerate(slices[1:], start=1):
        check_replica(slices[0], other, rank)


def check_replica(
    first: torch.Tensor, other: torch.Tensor, rank: int, *, first_rank: int = 0, what: str = "replicated tensor"
) -> None:
    """Raise :class:`DivergentReplicaError` unless rank ``rank``'s copy ``other`` equals rank ``first_rank``'s
    ``first``; ``what`` names the copy (``head 1 of`` a tensor with replicated heads)."""
    if not bitwise_equal(first, other):
        diff = (first.double() - other.double()).abs().max().item() if first.is_floating_point() else math.nan
        raise DivergentReplicaError(
            f"{what} differs between rank {first_rank} and rank {rank} (max abs diff {diff:.3g})",
            hint=f"pass --allow-divergent-replicas to take rank {first_rank}",
        )
