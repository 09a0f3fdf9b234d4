"""A quantized linear's stored tensors cut with its weight: the plan's rule for ``M.weight`` through the table.

The model's plan says how the linear ``M`` is cut (``M.weight`` ``[out, in]``: column-parallel on ``out``,
row-parallel on ``in``, fused parts, heads). :func:`companion_partition` gives each stored tensor of ``M`` that
cut on its own dims (:mod:`reshard.quantization.rules`): packed int4 in units of 8 on its packed dim, scales and
zeros in units of the group or block, per-channel scales whole on a row-parallel layer, ``weight_shape`` and
global scales whole. The tensor holding the weights is cut in whole units of what its rank must hold (the
block, the group, the packing: :func:`~reshard.quantization.rules.alignment`), so a split that would break one
is refused at planning, ``--uneven`` or not, naming the rule. Pure: names, shapes and the config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import lcm

from reshard.config import ModelConfig
from reshard.errors import AmbiguousPartitionError
from reshard.geometry import Heads, Packed, Partition, Replicate, ReplicatedHeads, Shard, head_replicas, norm_dim
from reshard.plans.base import Plan
from reshard.quantization.rules import (
    IN,
    OUT,
    WHOLE,
    Companion,
    alignment,
    companions,
    per_element,
    runtime_rule,
)
from reshard.quantization.scheme import QuantScheme

Shape = tuple[int, ...]
AXIS_NAMES = {OUT: "output rows", IN: "input columns"}


@dataclass(frozen=True)
class QuantizedLinear:
    """A quantized linear found in a checkpoint: its module name and the sizes of its weight ``[out, in]`` on rank 0
    of the checkpoint's ``ranks``."""

    module: str
    out: int
    inp: int
    ranks: int = 1

    def size(self, axis: int) -> int:
        return self.out if axis == OUT else self.inp

    def head_size(self, base: Heads | ReplicatedHeads) -> int | None:
        """One head's size along ``base``'s axis (``None``: the sizes are not whole heads): rank 0 holds one copied
        head, or its share of the heads."""
        rows = self.size(norm_dim(base.dim, 2))
        if head_replicas(base, self.ranks) > 1:
            return rows
        return rows * self.ranks // base.heads if rows * self.ranks % base.heads == 0 else None


def split_name(name: str) -> tuple[str, str]:
    module, _, suffix = name.rpartition(".")
    return module, suffix


def quantized_linears(
    scheme: QuantScheme, shapes: Mapping[str, Shape], *, ranks: int = 1
) -> dict[str, QuantizedLinear]:
    """The linears ``shapes`` (rank 0's of ``ranks``) stores quantized: the tensor holding the weights beside at
    least one scale, with the linear's sizes read from that tensor's shape (a packed dim times 8)."""
    table = companions(scheme)
    holder = table[0]
    others = [c.suffix for c in table[1:] if c.dims]
    found = {}
    for name, shape in shapes.items():
        module, suffix = split_name(name)
        if suffix != holder.suffix or not any(f"{module}.{o}" in shapes for o in others) or len(shape) != 2:
            continue
        sizes: dict[int | None, int] = {OUT: 0, IN: 0}
        for dim, size in zip(holder.dims, shape, strict=True):
            sizes[dim.axis] = size * (dim.per if isinstance(dim.per, int) else 1)
        found[module] = QuantizedLinear(module, sizes[OUT], sizes[IN], ranks)
    return found


def companion_of(scheme: QuantScheme, name: str, linears: Mapping[str, QuantizedLinear]) -> Companion | None:
    """The table's entry for ``name`` when it is a stored tensor of a quantized linear, else ``None``."""
    module, suffix = split_name(name)
    if module not in linears:
        return None
    return next((c for c in companions(scheme) if c.suffix == suffix), None)


def companion_partition(
    scheme: QuantScheme,
    name: str,
    plan: Plan,
    config: ModelConfig | None,
    linears: Mapping[str, QuantizedLinear],
) -> tuple[Partition, str] | None:
    """The cut of ``name``, a stored tensor of a quantized linear, and why; ``None`` for any other tensor.

    Raises:
        AmbiguousPartitionError: the plan has no rule for the linear's ``weight``, or cuts it in a way a
            quantized linear cannot be cut (vocab-parallel, Megatron query groups).
    """
    companion = companion_of(scheme, name, linears)
    if companion is None:
        return None
    module, _ = split_name(name)
    base_name = f"{module}.weight"
    rule = plan.match(base_name)
    if rule is None:
        raise AmbiguousPartitionError(
            f"a {scheme.method} tensor of {module}: no rule of {plan.name} covers its weight"
        )
    base = rule.resolve(config)
    reason = f"{runtime_rule(scheme)}; {companion.suffix} of {base_name}, rule '{rule.pattern}' ({plan.name})"
    return cut(scheme, companion, base, linears[module]), reason


def cut(scheme: QuantScheme, companion: Companion, base: Partition, linear: QuantizedLinear) -> Partition:
    """``base`` (the cut of the linear's ``weight`` ``[out, in]``) as it cuts ``companion``'s stored dims."""
    if not companion.dims or isinstance(base, Replicate):
        return Replicate()
    if not isinstance(base, (Shard, Packed, Heads, ReplicatedHeads)):
        raise AmbiguousPartitionError(f"{base.describe()} of a {scheme.method} linear is not planned")
    axis = norm_dim(base.dim, 2)
    dim = next((d for d, a in enumerate(companion.dims) if a.axis == axis), None)
    if dim is None or companion.dims[dim].per == WHOLE:
        return Replicate()  # one scale for the whole axis: every rank needs it
    full = linear.size(axis)
    per = per_element(companion.dims[dim].per, scheme, full)
    step = alignment(scheme, axis, full)  # a rank's share of the axis is whole multiples of it
    head = (linear.head_size(base) or 0) if isinstance(base, (Heads, ReplicatedHeads)) else 0
    match base:
        case Shard(_, unit):
            return Shard(dim, lcm(step, unit) // per, whole=True)
        case Heads() | ReplicatedHeads() if head % step and base.heads > 1:
            # A head is not whole blocks (head_dim 64, 128-row blocks): the runtime's rule is a rank's rows, not a
            # head's (vLLM checks each partition's size): whole heads and whole blocks, so a KV head copied alone
            # on a rank (half a block) is refused, and two heads of 64 on a rank (one block) are not. A single
            # head is the whole tensor, its partial last block with it: copied whole, as below.
            return Shard(dim, lcm(step, head) // per, whole=True)
        case Heads(_, heads):  # each head whole blocks: the grid's heads are whole rows of it
            return Heads(dim, heads)
        case ReplicatedHeads(_, heads):
            return ReplicatedHeads(dim, heads)
        case Packed(_, parts, _):
            units = tuple(lcm(step, u) for u in base.part_units())
            if any(p % u for p, u in zip(parts, units, strict=True)):
                raise AmbiguousPartitionError(
                    f"fused parts {list(parts)} of the {AXIS_NAMES[axis]} are not whole units of {step} "
                    f"({scheme.describe()})"
                )
            return Packed(dim, tuple(p // per for p in parts), tuple(u // per for u in units), whole=True)
    raise AssertionError(base)


def linear_partition(plan: Plan, module: str, config: ModelConfig | None) -> Partition:
    """The plan's cut of the linear ``module``'s weight ``[out, in]`` (what its dequantized weight is cut by)."""
    rule = plan.match(f"{module}.weight")
    if rule is None:
        raise AmbiguousPartitionError(f"no rule of {plan.name} covers {module}.weight")
    return rule.resolve(config)
