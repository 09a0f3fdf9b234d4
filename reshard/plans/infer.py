"""Inference of a partition from rank shapes and the config, for names no plan rule covers.

The rules (DESIGN.md section 1): a dim whose rank sizes add up to a config size is a shard; a sum
just above the vocab size is a padded vocab; equal shapes with equal bytes on every rank are
replicated. Anything else is an :class:`AmbiguousPartitionError` that asks for a plan rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from reshard.config import ModelConfig
from reshard.errors import AmbiguousPartitionError
from reshard.geometry import Partition, Replicate, Shard, Vocab, is_padded_vocab

Shape = tuple[int, ...]


def infer_partition(
    shapes: Sequence[Shape],
    config: ModelConfig | None,
    *,
    vocab_size: int | None,
    target_tp: int,
    replicas_equal: Callable[[], bool],
) -> tuple[Partition, str]:
    """Guess-free inference: returns ``(partition, reason)`` or raises.

    Args:
        shapes: the tensor's shape on each source rank.
        config: the model config, for the sizes dims may add up to.
        vocab_size: the true vocab size, if known.
        target_tp: the tp the tensor will be split for (a tp=1 source can only be copied whole to tp=1).
        replicas_equal: reads the rank slices and says whether they are bitwise equal (called only
            when shapes alone cannot decide).

    Raises:
        AmbiguousPartitionError: with a message saying what was considered.
    """
    tp = len(shapes)
    sizes = config.named_sizes() if config else {}
    first = shapes[0]
    varying = [d for d in range(len(first)) if len({s[d] for s in shapes}) > 1]
    if len({len(s) for s in shapes}) > 1 or len(varying) > 1:
        raise AmbiguousPartitionError(f"rank shapes {list(shapes)} differ in more than one dim")
    totals = {d: sum(s[d] for s in shapes) for d in range(len(first))}
    vocab_dims = [d for d, total in totals.items() if is_padded_vocab(total, vocab_size, tp)]
    shard_dims = {
        d: name
        for d, total in totals.items()
        for name, size in sizes.items()
        if size == total and name != "vocab_size" and d not in vocab_dims
    }
    if varying:  # uneven pieces: only a shard or a vocab along the varying dim can explain them
        (dim,) = varying
        if dim in vocab_dims:
            return Vocab(dim), f"inferred: ranks add up to {totals[dim]} rows along dim {dim}, the vocab"
        if dim in shard_dims:
            return Shard(dim), f"inferred: uneven ranks add up to {shard_dims[dim]}={totals[dim]} along dim {dim}"
        raise AmbiguousPartitionError(f"uneven rank shapes {list(shapes)} add up to no config size")
    if tp == 1:
        if len(vocab_dims) == 1:
            dim = vocab_dims[0]
            return Vocab(dim), f"inferred: dim {dim} of size {totals[dim]} is the vocab ({vocab_size}, padded)"
        if target_tp == 1 or not first:
            return Replicate(), "inferred: kept whole (tp 1 -> 1)" if first else "inferred: a scalar"
        raise AmbiguousPartitionError(f"a full tensor of shape {list(first)} with no rule cannot be split")
    if len(vocab_dims) == 1 and not replicas_equal():
        dim = vocab_dims[0]
        return Vocab(dim), f"inferred: ranks add up to {totals[dim]} rows along dim {dim}, the vocab ({vocab_size})"
    plausible_full = all(size in sizes.values() for size in first) if first else True
    if replicas_equal():
        if not shard_dims or plausible_full:
            return Replicate(), "inferred: identical on every rank"
        raise AmbiguousPartitionError(
            f"identical on every rank, yet dim {min(shard_dims)} adds up to {shard_dims[min(shard_dims)]}"
        )
    if len(shard_dims) == 1:
        ((dim, name),) = shard_dims.items()
        return Shard(dim), f"inferred: ranks add up to {name}={totals[dim]} along dim {dim}"
    if shard_dims:
        raise AmbiguousPartitionError(f"ranks add up to config sizes along several dims: {shard_dims}")
    raise AmbiguousPartitionError(f"differs between ranks and no dim of {list(first)} adds up to a config size")
