"""The tensor functions of the geometry: split a canonical tensor into rank slices by its
:class:`~reshard.geometry.Cut`, gather rank slices back (unpadding the vocab), pad and unpad, and the bitwise
replica check.

Tensors in, tensors out; no file is opened. Shapes are validated by :mod:`reshard.geometry.partition` first, and
which rows go where is the cut's (:mod:`reshard.geometry.cut`), as for every byte path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from reshard.errors import DivergentReplicaError, ShapeMismatchError
from reshard.geometry.cut import Cut, slices_cut, split_cut
from reshard.geometry.padding import cut_pad_rows
from reshard.geometry.partition import Partition, Replicate, Vocab, canonical_shape, norm_dim, with_size


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
        >>> from reshard.geometry import Packed
        >>> [t.tolist() for t in split(torch.arange(4), Packed(0, (2, 2)), 2)]
        [[0, 2], [1, 3]]
    """
    return cut_slices(full, split_cut(partition, full.shape, tp, padded=padded, uneven=uneven))


def cut_slices(full: torch.Tensor, cut: Cut) -> list[torch.Tensor]:
    """Each rank's slice of ``full`` by ``cut`` (pad rows added as zeros): a view when it is one run of rows,
    else the concatenation of its runs."""
    return [parts[0] if len(parts) == 1 else torch.cat(parts, dim=cut.axis) for parts in cut_parts(full, cut)]


def cut_parts(full: torch.Tensor, cut: Cut) -> list[list[torch.Tensor]]:
    """Per rank, the views of ``full`` its slice joins along the cut's dim, in order (``[full]`` when replicated;
    ``full`` padded with zero rows first when the cut covers more rows than it has)."""
    if cut.dim is None:
        return [[full]] * cut.tp
    full = pad(full, cut.dim, max(cut.rows, full.shape[cut.dim]))
    return [[full.narrow(cut.dim, run.at, run.length) for run in runs] for runs in cut.runs]


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
        >>> from reshard.geometry import Packed
        >>> gather([torch.tensor([0, 2]), torch.tensor([1, 3])], Packed(0, (2, 2))).tolist()
        [0, 1, 2, 3]
    """
    full_shape = canonical_shape(partition, [s.shape for s in slices], vocab_size=vocab_size, uneven=uneven)
    if isinstance(partition, Replicate):
        if not allow_divergent:
            check_replicas(slices)
        return slices[0]
    cut = slices_cut(partition, full_shape, [s.shape for s in slices])
    if not allow_divergent:
        for rank, first in cut.copies():
            what = f"replicated KV head {rank // cut.replicas}"
            check_replica(slices[first], slices[rank], rank, first_rank=first, what=what)
    dim = cut.axis
    pieces = [slices[run.rank].narrow(dim, run.start, run.length) for run in cut.placed()]
    joined = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)
    return unpad(joined, dim, full_shape[dim]) if isinstance(partition, Vocab) else joined


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (NaNs with equal bits compare equal, unlike ``torch.equal``)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    left, right = (t.contiguous().reshape(-1).view(torch.uint8).numpy() for t in (a, b))
    # compared as the widest integers that tile the bytes, on one core: torch.equal of bytes compares one byte at a
    # time on every core, and its OpenMP threads spin after each call (measured: docs/performance.md)
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
