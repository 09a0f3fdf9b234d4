"""How one tensor is cut across tensor-parallel ranks: the partition types and their shape arithmetic.

A :data:`Partition` says how the full (canonical) tensor ``T`` relates to the ``tp`` rank slices:

* :class:`Replicate` - every rank holds all of ``T``.
* :class:`Shard` - an even split of ``T`` along ``dim`` (column-parallel: dim 0, row-parallel: dim 1).
* :class:`Grouped` - like ``Shard``, over a dim made of ``groups`` equal blocks (Megatron's query groups
  of a fused QKV): each rank holds whole groups, or each group is spread evenly over ``tp / groups`` ranks.
* :class:`Vocab` - like ``Shard``, but ``T`` was padded along ``dim`` to a multiple before the split;
  the pad rows are not data and are cut off when gathering.
* :class:`Packed` - ``T`` is the concatenation along ``dim`` of parts (q, k, v; gate, up); each part is
  split on its own and a rank holds the concatenation of its piece of every part.
* :class:`Heads` - ``T`` is ``heads`` equal heads along ``dim``, whatever their width (``head_dim``, or multi-latent
  attention's ``qk_head_dim`` / ``v_head_dim``): split in whole heads, only at a tp that divides them.
* :class:`ReplicatedHeads` - ``T`` is ``heads`` heads along ``dim`` (the KV heads of grouped-query attention):
  split in whole heads while ``tp`` divides them, and when ``tp`` is a multiple of them each head is copied onto
  the ``tp / heads`` ranks whose query heads use it (vLLM's ``QKVParallelLinear``).

Pure shape arithmetic (no torch, no file: ``check`` plans from headers with it); which rows of the canonical tensor
each rank holds is :mod:`reshard.geometry.cut`, the tensor functions are :mod:`reshard.geometry.tensors`. Validation
raises :class:`~reshard.errors.ShapeMismatchError` saying what does not add up; callers add the file and tensor name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from reshard.errors import ShapeMismatchError
from reshard.geometry.padding import MAX_VOCAB_PAD_PER_RANK, padded_size

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the whole tensor (norms, row-parallel biases, LoRA A of a column layer, ...)."""

    def describe(self) -> str:
        return "replicate"


@dataclass(frozen=True)
class Shard:
    """Even split along ``dim``. ``unit`` is the size of an indivisible block (a head, a query group).

    ``whole``: the unit is a quantization block, group or packing, cut by no split: ``--uneven`` splits it in
    whole units, and at a tp above 1 the dim must be whole units (at tp 1 nothing is cut: an fp8 scale grid
    may end on a partial block).
    """

    dim: int
    unit: int = 1
    whole: bool = False

    def describe(self) -> str:
        text = f"shard(dim={self.dim}" + (f", unit={self.unit}" if self.unit != 1 else "")
        return text + (", whole units)" if self.whole else ")")


@dataclass(frozen=True)
class Grouped:
    """Even split along ``dim`` of ``groups`` equal blocks (fused QKV query groups): valid when every rank holds
    whole groups or every group is spread evenly over ``tp / groups`` ranks (Megatron core stores a contiguous
    ``1/tp`` row chunk then, and each rank all-gathers and picks its group); any other tp is refused."""

    dim: int
    groups: int

    def describe(self) -> str:
        return f"grouped(dim={self.dim}, groups={self.groups})"


@dataclass(frozen=True)
class Vocab:
    """Split along ``dim`` after padding that dim to a multiple; pad rows are dropped on gather."""

    dim: int

    def describe(self) -> str:
        return f"vocab(dim={self.dim})"


@dataclass(frozen=True)
class Packed:
    """Concatenation of ``parts`` (full sizes along ``dim``), each part split on its own.

    ``units`` gives, per part, the size of an indivisible block (a head); ``None`` means 1 for all.
    """

    dim: int
    parts: tuple[int, ...]
    units: tuple[int, ...] | None = None
    whole: bool = False  # units never cut, as Shard's

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", tuple(int(p) for p in self.parts))
        if self.units is not None:
            object.__setattr__(self, "units", tuple(int(u) for u in self.units))
            if len(self.units) != len(self.parts):
                raise ValueError(f"packed: {len(self.parts)} parts but {len(self.units)} units")

    def describe(self) -> str:
        return f"packed(dim={self.dim}, parts={list(self.parts)}" + (", whole units)" if self.whole else ")")

    def part_units(self) -> tuple[int, ...]:
        return self.units if self.units is not None else (1,) * len(self.parts)


@dataclass(frozen=True)
class Heads:
    """``heads`` equal heads along ``dim``, each ``size / heads`` wide: split in whole heads, so a tp must divide
    them (``--uneven``: ``torch.chunk`` rows, what transformers' TP loader holds). A size that is not ``heads``
    equal heads is refused rather than cut in rows. Recorded as the ``Shard`` in units of one head (:func:`at_tp`).
    """

    dim: int
    heads: int

    def describe(self) -> str:
        return f"heads(dim={self.dim}, heads={self.heads})"


@dataclass(frozen=True)
class ReplicatedHeads:
    """``heads`` equal heads along ``dim``. At a tp that is a larger multiple of ``heads``, rank r holds head
    ``r // (tp / heads)``, as vLLM replicates KV heads (``num_kv_head_replicas``, ``tp_rank // replicas``);
    at any other tp it is the plain split in whole heads, and is recorded as that ``Shard`` (:func:`at_tp`)."""

    dim: int
    heads: int

    def describe(self) -> str:
        return f"replicated_heads(dim={self.dim}, heads={self.heads})"


Partition = Replicate | Shard | Grouped | Vocab | Packed | Heads | ReplicatedHeads


# ---------------------------------------------------------------- (de)serialisation, the string boundary


def partition_to_dict(partition: Partition) -> dict[str, Any]:
    """The manifest / plan-file form, e.g. ``{"kind": "shard", "dim": 0}``."""
    match partition:
        case Replicate():
            return {"kind": "replicate"}
        case Shard(dim, unit, whole):
            return {"kind": "shard", "dim": dim} | ({"unit": unit} if unit != 1 else {}) | _whole(whole)
        case Vocab(dim):
            return {"kind": "vocab", "dim": dim}
        case Grouped(dim, groups):
            return {"kind": "grouped", "dim": dim, "groups": groups}
        case Packed(dim, parts, units, whole):
            units_field = {"units": list(units)} if units else {}
            return {"kind": "packed", "dim": dim, "parts": list(parts)} | units_field | _whole(whole)
        case Heads(dim, heads):
            return {"kind": "heads", "dim": dim, "heads": heads}
        case ReplicatedHeads(dim, heads):
            return {"kind": "replicated_heads", "dim": dim, "heads": heads}
    raise TypeError(f"not a partition: {partition!r}")


def _whole(whole: bool) -> dict[str, bool]:
    return {"whole": True} if whole else {}


def _whole_from(data: dict[str, Any]) -> bool:
    whole = data.get("whole", False)
    if not isinstance(whole, bool):
        raise ValueError(f"whole is {type(whole).__name__}, not true or false")
    return whole


def partition_from_dict(data: dict[str, Any]) -> Partition:
    """Parse :func:`partition_to_dict` output; ``ValueError`` names what is wrong."""
    kind = data.get("kind")
    try:
        match kind:
            case "replicate":
                return Replicate()
            case "shard":
                return Shard(int(data["dim"]), int(data.get("unit", 1)), _whole_from(data))
            case "vocab":
                return Vocab(int(data["dim"]))
            case "grouped":
                return Grouped(int(data["dim"]), int(data["groups"]))
            case "packed":
                units = data.get("units")
                units = None if units is None else tuple(units)
                return Packed(int(data["dim"]), tuple(data["parts"]), units, _whole_from(data))
            case "heads":
                return Heads(int(data["dim"]), int(data["heads"]))
            case "replicated_heads":
                return ReplicatedHeads(int(data["dim"]), int(data["heads"]))
    except KeyError as err:
        raise ValueError(f"partition {kind!r} needs the field {err.args[0]!r}") from err
    raise ValueError(
        f"unknown partition kind {kind!r} (replicate, shard, grouped, vocab, packed, heads or replicated_heads)"
    )


# ---------------------------------------------------------------- sizes


def head_replicas(partition: Partition, tp: int) -> int:
    """How many ranks hold each head: ``tp / heads`` for replicated heads at a tp that is a larger multiple of
    them, else 1 (every rank holds its own slice)."""
    if isinstance(partition, ReplicatedHeads) and tp > partition.heads > 0 and tp % partition.heads == 0:
        return tp // partition.heads
    return 1


def at_tp(partition: Partition, full_shape: Sequence[int], tp: int) -> Partition:
    """The partition as it cuts a tensor of ``full_shape`` at ``tp``: heads, and replicated heads that are not
    replicated there, are a plain split in whole heads (what a manifest records and a report shows)."""
    if not isinstance(partition, (Heads, ReplicatedHeads)) or head_replicas(partition, tp) > 1:
        return partition
    try:
        unit = _head_size(full_shape[norm_dim(partition.dim, len(full_shape))], partition.heads, "the dim")
    except ShapeMismatchError:
        return partition  # sizes that do not fit are reported by rank_shapes
    return Shard(partition.dim, unit=unit)


def _head_size(size: int, heads: int, what: str) -> int:
    if heads < 1 or size % heads:
        raise ShapeMismatchError(f"{what} size {size} is not {heads} equal heads")
    return size // heads


def split_sizes(total: int, tp: int, *, uneven: bool = False) -> list[int]:
    """Sizes of ``tp`` pieces of ``total``.

    Even splits need ``total % tp == 0``. ``uneven=True`` uses ``torch.chunk``'s convention (as the
    transformers TP loader does): every piece ``ceil(total / tp)`` long, the last ones shorter or empty.
    """
    if uneven:
        step = -(-total // tp)
        return [max(0, min(step, total - r * step)) for r in range(tp)]
    if total % tp:
        raise ShapeMismatchError(f"size {total} does not divide by tp={tp}")
    return [total // tp] * tp


def norm_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise ShapeMismatchError(f"dim {dim} is out of range for a {ndim}-d tensor")
    return dim % ndim


def with_size(shape: Sequence[int], dim: int, size: int) -> Shape:
    out = list(shape)
    out[dim] = size
    return tuple(out)


def _check_divisible_units(size: int, unit: int, tp: int, what: str) -> None:
    if size % unit:
        raise ShapeMismatchError(f"{what} size {size} is not a whole number of blocks of {unit}")
    if (size // unit) % tp:
        raise ShapeMismatchError(f"{what} has {size // unit} blocks of {unit}, which do not divide by tp={tp}")


def _check_groups(size: int, groups: int, tp: int, what: str) -> None:
    if groups < 1 or size % groups:
        raise ShapeMismatchError(f"{what} size {size} is not {groups} equal groups")
    if groups % tp and tp % groups:
        raise ShapeMismatchError(
            f"{what} holds {groups} groups: tp={tp} neither divides them (whole groups per rank) nor is a "
            f"multiple of them (each group spread over tp/groups ranks)"
        )


def rank_shapes(
    partition: Partition, full_shape: Sequence[int], tp: int, *, padded: int | None = None, uneven: bool = False
) -> list[Shape]:
    """Per-rank shapes of a full tensor of ``full_shape`` split ``tp`` ways.

    Args:
        partition: how the tensor is split.
        full_shape: the canonical (unpadded) shape.
        tp: number of ranks.
        padded: for :class:`Vocab`, the padded size of the vocab dim (defaults to the full size).
        uneven: allow ``torch.chunk``-style uneven pieces instead of requiring divisibility.

    Raises:
        ShapeMismatchError: the dim (or a part, or whole blocks) does not divide by ``tp``.
    """
    full_shape = tuple(full_shape)
    match partition:
        case Replicate():
            return [full_shape] * tp
        case Shard(dim, unit, whole):
            dim = norm_dim(dim, len(full_shape))
            sizes = _unit_sizes(full_shape[dim], unit, tp, whole=whole, uneven=uneven, what=f"dim {dim}")
            return [with_size(full_shape, dim, s) for s in sizes]
        case Grouped(dim, groups):
            dim = norm_dim(dim, len(full_shape))
            _check_groups(full_shape[dim], groups, tp, f"dim {dim}")
            return [with_size(full_shape, dim, s) for s in split_sizes(full_shape[dim], tp)]
        case Vocab(dim):
            dim = norm_dim(dim, len(full_shape))
            size = full_shape[dim] if padded is None else padded
            if size < full_shape[dim]:
                raise ShapeMismatchError(f"padded size {size} is smaller than the vocab {full_shape[dim]}")
            return [with_size(full_shape, dim, s) for s in split_sizes(size, tp, uneven=uneven)]
        case Packed(dim, parts, _):
            dim = norm_dim(dim, len(full_shape))
            if sum(parts) != full_shape[dim]:
                raise ShapeMismatchError(f"packed parts {list(parts)} add up to {sum(parts)}, not {full_shape[dim]}")
            per_part = packed_piece_sizes(partition, tp, uneven=uneven)
            return [with_size(full_shape, dim, sum(p[r] for p in per_part)) for r in range(tp)]
        case Heads(dim, heads):
            dim = norm_dim(dim, len(full_shape))
            unit = _head_size(full_shape[dim], heads, f"dim {dim}")
            if heads % tp and not uneven:
                raise ShapeMismatchError(
                    f"dim {dim} holds {heads} heads, which tp={tp} does not divide: a head would be cut"
                )
            return rank_shapes(Shard(dim, unit), full_shape, tp, uneven=uneven)
        case ReplicatedHeads(dim, heads):
            dim = norm_dim(dim, len(full_shape))
            unit = _head_size(full_shape[dim], heads, f"dim {dim}")
            if head_replicas(partition, tp) > 1:
                return [with_size(full_shape, dim, unit)] * tp
            if heads % tp and not uneven:
                raise ShapeMismatchError(
                    f"dim {dim} holds {heads} heads: tp={tp} neither divides them nor is a multiple of them "
                    "(each head copied onto tp/heads ranks)"
                )
            return rank_shapes(Shard(dim, unit), full_shape, tp, uneven=uneven)
    raise TypeError(f"not a partition: {partition!r}")


def packed_piece_sizes(partition: Packed, tp: int, *, uneven: bool) -> list[list[int]]:
    """For each part, the sizes of its ``tp`` pieces."""
    out = []
    for i, (part, unit) in enumerate(zip(partition.parts, partition.part_units(), strict=True)):
        try:
            out.append(_unit_sizes(part, unit, tp, whole=partition.whole, uneven=uneven, what=f"part {i}"))
        except ShapeMismatchError as err:
            if unit != 1:
                raise
            raise ShapeMismatchError(f"packed part {i} of size {part} does not divide by tp={tp}") from err
    return out


def _unit_sizes(size: int, unit: int, tp: int, *, whole: bool, uneven: bool, what: str) -> list[int]:
    """The ``tp`` pieces of ``size`` in units of ``unit``; ``whole`` units are never cut, ``--uneven`` or not."""
    if whole and tp > 1:  # even, whatever --uneven says: runtimes load a quantized layer only so
        if size % unit or (size // unit) % tp:
            raise ShapeMismatchError(
                f"{what} size {size} is {size / unit:g} units of {unit} (a quantization block, group or packed "
                f"word), which tp={tp} ranks cannot hold whole and equal"
            )
        return [size // tp] * tp
    if whole:
        return [size]
    if not uneven and unit != 1:
        _check_divisible_units(size, unit, tp, what)
    return split_sizes(size, tp, uneven=uneven)


def canonical_shape(
    partition: Partition, shapes: Sequence[Sequence[int]], *, vocab_size: int | None = None, uneven: bool = False
) -> Shape:
    """The full, unpadded shape that rank slices of ``shapes`` gather into, after checking they fit.

    Args:
        partition: how the tensor was split.
        shapes: one shape per rank, in rank order.
        vocab_size: for :class:`Vocab`, the true vocab size to unpad to (``None`` keeps every row).
        uneven: accept ``torch.chunk``-style uneven pieces.

    Raises:
        ShapeMismatchError: ranks disagree, sizes do not add up, or the padded total is below ``vocab_size``.
    """
    given = [tuple(s) for s in shapes]
    tp = len(given)
    first = given[0]
    if any(len(s) != len(first) for s in given):
        raise ShapeMismatchError(f"ranks have different numbers of dims: {given}")
    if isinstance(partition, Replicate):
        if any(s != first for s in given):
            raise ShapeMismatchError(f"a replicated tensor has different shapes on different ranks: {given}")
        return first
    dim = norm_dim(partition.dim, len(first))
    others = {with_size(s, dim, 0) for s in given}
    if len(others) != 1:
        raise ShapeMismatchError(f"rank shapes {given} differ outside dim {dim}")
    total = sum(s[dim] for s in given)
    full = with_size(first, dim, total)
    if isinstance(partition, ReplicatedHeads) and head_replicas(partition, tp) > 1:
        full = with_size(first, dim, partition.heads * first[dim])  # one copy of every head is the full tensor
    padded = None
    if isinstance(partition, Vocab):
        full = with_size(first, dim, total if vocab_size is None else vocab_size)
        if vocab_size is not None and total < vocab_size:
            raise ShapeMismatchError(f"ranks hold {total} rows along dim {dim}, fewer than the vocab {vocab_size}")
        if vocab_size is not None and total - vocab_size >= MAX_VOCAB_PAD_PER_RANK * tp:
            raise ShapeMismatchError(  # more than any framework pads with: a wrong vocab size, or an extra rank
                f"{total} rows for a vocab of {vocab_size}: dropping {total - vocab_size} rows is more than padding "
                "(check --vocab)"
            )
        padded = total
    sizes = [s[dim] for s in given]
    what = f"rank sizes {sizes} along dim {dim} are not a {partition.describe()} split of {total} over tp={tp}"
    try:
        expected = rank_shapes(partition, full, tp, padded=padded, uneven=uneven)
    except ShapeMismatchError as err:
        raise ShapeMismatchError(f"{what} ({err.detail})") from err
    if expected != given:
        raise ShapeMismatchError(f"{what} (expected {[e[dim] for e in expected]})")
    return full


def tps_that_split(
    tensors: Sequence[tuple[Partition, Sequence[int]]],
    *,
    vocab_rows: int | None,
    pad_multiple: int | None = None,
    uneven: bool = False,
    limit: int = 64,
) -> list[int]:
    """Every tp up to ``limit`` that splits each ``(partition, canonical shape)`` of ``tensors``: the one search for
    the tp sizes that work, for ``check`` and for a conversion's refusal alike. A vocab is padded from
    ``vocab_rows`` (None: its own rows) to a multiple of ``pad_multiple`` (default: the tp), as a target would be.

    Example:
        >>> tps_that_split([(Shard(0), (12, 4)), (Vocab(0), (10, 4))], vocab_rows=10, limit=6)
        [1, 2, 3, 4, 6]
    """
    works = []
    for tp in range(1, limit + 1):
        try:
            for partition, shape in tensors:
                padded = None
                if isinstance(partition, Vocab):
                    rows = shape[norm_dim(partition.dim, len(shape))] if vocab_rows is None else vocab_rows
                    padded = padded_size(rows, pad_multiple or tp, uneven=uneven)
                rank_shapes(partition, shape, tp, padded=padded, uneven=uneven)
        except ShapeMismatchError:
            continue
        works.append(tp)
    return works
