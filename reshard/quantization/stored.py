"""The tensors a quantized checkpoint of a model would store, from the model's plain shapes: what ``check
CONFIG`` checks when the config carries a ``quantization_config``.

Every linear the plan splits (column- or row-parallel, fused parts, heads) and the ignore list does not name
is stored quantized, as the libraries write it: each quantized linear's companions, one per expert for
mixture-of-experts layers (transformers builds experts fused, ``experts.gate_up_proj`` ``[E, 2I, H]`` and
``experts.down_proj`` ``[E, H, I]``; quantized checkpoints store ``experts.N.gate_proj`` and the rest).
Pure: names and shapes in, names and shapes out.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from reshard.config import ModelConfig
from reshard.errors import AmbiguousPartitionError
from reshard.geometry import Heads, Packed, ReplicatedHeads, Shard
from reshard.plans.base import Plan
from reshard.quantization.rules import companions, per_element
from reshard.quantization.scheme import QuantScheme

Shape = tuple[int, ...]
_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def stored_shapes(
    scheme: QuantScheme, shapes: Mapping[str, Shape], plan: Plan, config: ModelConfig | None
) -> dict[str, Shape]:
    """``shapes`` (a model's parameters) as a checkpoint quantized by ``scheme`` stores them."""
    out: dict[str, Shape] = {}
    for name, shape in _per_expert(shapes).items():
        module, _, suffix = name.rpartition(".")
        if suffix != "weight" or len(shape) != 2 or scheme.ignores(module) or not _split(plan, name, config):
            out[name] = shape
            continue
        for companion in companions(scheme):
            if companion.dims:
                sizes: dict[int | None, int] = {0: shape[0], 1: shape[1]}
                out[f"{module}.{companion.suffix}"] = tuple(
                    -(-sizes[d.axis] // per_element(d.per, scheme, sizes[d.axis])) for d in companion.dims
                )
    return out


def _split(plan: Plan, name: str, config: ModelConfig | None) -> bool:
    """Whether the plan cuts ``name`` as a linear (the layers a quantized checkpoint stores quantized)."""
    rule = plan.match(name)
    if rule is None:
        return False
    try:
        partition = rule.resolve(config.for_tensor(name) if config is not None else None)
    except AmbiguousPartitionError:
        return False
    return isinstance(partition, (Shard, Packed, Heads, ReplicatedHeads))


def _per_expert(shapes: Mapping[str, Shape]) -> dict[str, Shape]:
    """Fused ``experts.gate_up_proj`` / ``experts.down_proj`` as one ``gate_proj``, ``up_proj``, ``down_proj``
    weight per expert; every other parameter as it is."""
    out: dict[str, Shape] = {}
    for name, shape in shapes.items():
        fused = _FUSED_EXPERTS.match(name)
        if fused is None or len(shape) != 3:
            out[name] = shape
            continue
        experts, rows, columns = shape
        for e in range(experts):
            base = f"{fused['prefix']}.{e}"
            if fused["proj"] == "down_proj":
                out[f"{base}.down_proj.weight"] = (rows, columns)
            else:
                out[f"{base}.gate_proj.weight"] = (rows // 2, columns)
                out[f"{base}.up_proj.weight"] = (rows // 2, columns)
    return out
