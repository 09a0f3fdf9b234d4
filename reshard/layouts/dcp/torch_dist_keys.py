"""Where each tensor of a Megatron-Core GPT goes in ``torch_dist``: its global key, global shape and chunk box.

Pure planning from names and shapes, following what Megatron-Core 0.16.1's ``sharded_state_dict`` produces
(reference notes ``dcp-torchdist-deepspeed.md`` 2.2, checked against checkpoints it writes in the oracle):

* **Layers stacked** (``TransformerBlock``, homogeneous layers): ``decoder.layers.{i}.<rest>`` is the chunk
  ``(i, 0, ...)`` of ``decoder.layers.<rest>`` of shape ``[num_layers, *shape]``, one chunk per layer, global
  layer numbers (pipeline stages need nothing more).
* **Experts stacked after the layer**: ``decoder.layers.{i}.mlp.experts.local_experts.{e}.<rest>`` is the
  chunk ``(i, e, 0, ...)`` of ``decoder.layers.mlp.experts.experts.<rest>`` ``[num_layers, num_experts, ...]``.
* **Non-homogeneous layers** (``moe_layer_freq`` other than 1, heterogeneous specs, or layers that differ):
  keys keep their layer number, ``decoder.layers.{i}.<rest>``, with no layer axis; experts keep theirs.
* **Norms under Transformer Engine's names** (the layer's ``sharded_state_dict_keys_map``): ``input_layernorm.``
  becomes ``self_attention.linear_qkv.layer_norm_``, and ``pre_mlp_layernorm.`` becomes
  ``mlp.linear_fc1.layer_norm_`` in dense layers, and in MoE layers of the local spec only (a Transformer
  Engine MoE layer keeps its separate ``pre_mlp_layernorm``, ahead of the router). A multi-latent attention layer
  keeps its ``input_layernorm`` (both specs build it apart), and in the local spec its ``pre_mlp_layernorm`` too
  (its local spec has no keys map).
* **``_extra_state``** objects: ``<key>/shard_<offsets>_<shape>`` (``ShardedObject.unique_key``), offsets and
  shape along the stacked axes (``0`` of ``1`` when there are none).

Every other tensor (embedding, final norm, output layer) is one chunk covering the whole of it. The
canonical forms reshard gathers at tp 1 are Megatron's global forms already (QKV interleaved per query
group, SwiGLU fc1 ``[gate; up]``, the vocab padded): nothing is reordered here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.dtypes import TensorHeader
from reshard.errors import ReshardError, ShapeMismatchError
from reshard.layouts.dcp.distcp_files import Chunk, GlobalTensor

Shape = tuple[int, ...]
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_MOE = ("mlp.router.", "mlp.experts.")
_GROUPED = re.compile(r"\.mlp\.experts\.(linear_fc[12]\.(weight|bias)\d+|weight[12])$")
EXTRA = "._extra_state"
# Modules with an ``_extra_state`` a loader asks for: the linears of both the local and the Transformer Engine
# spec, and Transformer Engine's norms (its RMSNorm is an op with FP8 state; the local spec's are torch's).
_EXTRA_LINEARS = frozenset(
    "linear_qkv linear_proj linear_fc1 linear_fc2 linear_q_proj linear_q_down_proj linear_q_up_proj "
    "linear_kv_down_proj linear_kv_up_proj".split()
)
_EXTRA_NORMS = frozenset("final_layernorm pre_mlp_layernorm q_layernorm k_layernorm input_layernorm".split())
_MLA = "self_attention.linear_kv_down_proj."


@dataclass(frozen=True)
class GlobalPlan:
    """What a ``torch_dist`` output holds: global tensors in first-seen order, objects, and the names skipped."""

    tensors: list[GlobalTensor]
    objects: dict[str, Any]
    skipped: tuple[str, ...] = ()
    homogeneous: bool = True


@dataclass(frozen=True)
class _Place:
    key: str
    index: Shape  # along the prepended axes
    axes: Shape  # their sizes


def check_names(names: list[str], path: Path | None = None) -> None:
    """Refuse what this writer cannot place: names that are not Megatron-Core's (legacy ``language_model.*``), and
    grouped-GEMM experts (``experts.linear_fc1.weight0``, ``experts.weight1``: no oracle runs them to check how
    Megatron-Core stores them).

    Raises:
        ReshardError: naming the first such tensor.
    """
    legacy = [name for name in names if not name.startswith(("embedding.", "decoder.", "output_layer."))]
    if legacy:
        raise ReshardError(
            f"torch_dist holds Megatron-Core's names (embedding., decoder., output_layer.), not {legacy[0]} "
            f"and {len(legacy) - 1} more",
            path=path,
            tensor=legacy[0],
            hint="load the legacy model in Megatron-LM and save it again, or convert to --layout hf first",
        )
    grouped = [name for name in names if _GROUPED.search(name)]
    if grouped:
        raise ReshardError(
            "grouped-GEMM experts (--moe-grouped-gemm) cannot be written as torch_dist by reshard yet",
            path=path,
            tensor=grouped[0],
            hint="save the model with SequentialMLP experts (local_experts.N) in Megatron, or convert to --layout hf",
        )


def plan_global(
    headers: Mapping[str, TensorHeader],
    extras: Mapping[str, Any],
    *,
    layers: int | None,
    experts: int | None,
    local_spec: bool,
    homogeneous: bool = True,
    tied: bool = False,
) -> GlobalPlan:
    """Plan the global tensors and objects of ``headers`` (incoming names, in order) and ``extras`` (the source's
    ``_extra_state`` values, by name).

    ``layers``/``experts``: the model's counts (None: from the names); ``local_spec``: the model uses Megatron's
    local (non-Transformer-Engine) layers; ``homogeneous``: the args allow stacked layers; ``tied``: the output
    layer shares the embedding (an ``output_layer.weight`` given anyway is skipped, as Megatron does).

    Raises:
        ReshardError: layers or experts missing from a stacked tensor, or one that differs between layers.
    """
    layer_rests = [(int(m.group(1)), m.group(2)) for name in headers if (m := _LAYER.match(name))]
    layers = layers or 1 + max((i for i, _ in layer_rests), default=-1)
    experts = experts or 1 + max(
        (int(e.group(1)) for _, rest in layer_rests if (e := _EXPERT.match(rest))), default=-1
    )
    absent = sorted(set(range(layers)) ^ {i for i, _ in layer_rests})
    if absent:
        raise ReshardError(
            f"the model has {layers} layers, but layer {absent[0]} is {'missing' if absent[0] < layers else 'extra'}",
            tensor=f"decoder.layers.{absent[0]}",
            hint="every layer the args count must be present",
        )
    rename = _Renamer(list(headers), local_spec)
    skipped = ("output_layer.weight",) if tied and "output_layer.weight" in headers else ()
    names = {rename(name): name for name in headers if name not in skipped}  # written name -> incoming name
    homogeneous = homogeneous and _regular(list(names), layers)
    place = _Placer(layers, experts, homogeneous)
    tensors: dict[str, GlobalTensor] = {}
    for name, original in names.items():
        header, where = headers[original], place(name)
        shape = where.axes + tuple(header.shape)
        tensor = tensors.setdefault(where.key, GlobalTensor(where.key, header.code, shape, where.axes))
        if (tensor.shape, tensor.code) != (shape, header.code):
            raise ShapeMismatchError(
                f"is {header.code} {list(header.shape)}, another layer's {tensor.code} "
                f"{list(tensor.shape[len(where.axes) :])}: torch_dist stacks them into {where.key}",
                tensor=original,
            )
        zeros = (0,) * len(header.shape)
        tensor.chunks.append(Chunk(original, where.index + zeros, (1,) * len(where.index) + tuple(header.shape)))
    for tensor in tensors.values():
        _check_complete(tensor)
    with_extra = _EXTRA_LINEARS if local_spec else _EXTRA_LINEARS | _EXTRA_NORMS
    # Modules with a weight of their own (a norm stored in a linear's keys, ``layer_norm_weight``, is not one).
    modules = [name.removesuffix(".weight") for name in names if name.endswith(".weight")]
    wanted = {f"{module}{EXTRA}": None for module in modules if module.rsplit(".", 1)[-1] in with_extra}
    given = {
        rename(n): value for n, value in extras.items() if n.endswith(EXTRA) and not n.startswith("output_layer.")
    }
    objects = {}
    for name, value in (wanted | given).items():
        where = place(name)
        offsets, shape = where.index or (0,), where.axes or (1,)
        objects[f"{where.key}/shard_{'.'.join(map(str, offsets))}_{'.'.join(map(str, shape))}"] = value
    return GlobalPlan(list(tensors.values()), objects, skipped, homogeneous)


class _Renamer:
    """The layer's ``sharded_state_dict_keys_map`` (idempotent: a stored name stays as it is)."""

    def __init__(self, names: list[str], local_spec: bool) -> None:
        layers = [match.groups() for name in names if (match := _LAYER.match(name))]
        self._moe_layers = {int(layer) for layer, rest in layers if rest.startswith(_MOE)}
        self._mla_layers = {int(layer) for layer, rest in layers if rest.startswith(_MLA)}
        self._local = local_spec

    def __call__(self, name: str) -> str:
        match = _LAYER.match(name)
        if not match:
            return name
        layer, rest = match.groups()
        mla = int(layer) in self._mla_layers
        if rest.startswith("input_layernorm.") and not mla:
            rest = "self_attention.linear_qkv.layer_norm_" + rest.removeprefix("input_layernorm.")
        elif rest.startswith("pre_mlp_layernorm.") and (
            (self._local and not mla) or (not self._local and int(layer) not in self._moe_layers)
        ):
            rest = "mlp.linear_fc1.layer_norm_" + rest.removeprefix("pre_mlp_layernorm.")
        return f"decoder.layers.{layer}.{rest}"


class _Placer:
    def __init__(self, layers: int, experts: int, homogeneous: bool) -> None:
        self._layers, self._experts, self._homogeneous = layers, experts, homogeneous

    def __call__(self, name: str) -> _Place:
        match = _LAYER.match(name)
        if not match:
            return _Place(name, (), ())
        layer, rest = int(match.group(1)), match.group(2)
        index: tuple[int, ...]
        axes: tuple[int, ...]
        index, axes = ((layer,), (self._layers,)) if self._homogeneous else ((), ())
        prefix = "decoder.layers." if self._homogeneous else f"decoder.layers.{layer}."
        expert = _EXPERT.match(rest)
        if expert:
            index, axes = index + (int(expert.group(1)),), axes + (self._experts,)
            rest = "mlp.experts.experts." + expert.group(2)
        return _Place(prefix + rest, index, axes)


def _regular(names: list[str], layers: int) -> bool:
    """Whether every layer holds the same tensors (what stacking needs)."""
    per_layer: dict[int, set[str]] = {i: set() for i in range(layers)}
    for name in names:
        match = _LAYER.match(name)
        if match and int(match.group(1)) in per_layer:
            per_layer[int(match.group(1))].add(match.group(2))
    return len({frozenset(rests) for rests in per_layer.values()}) <= 1


def _check_complete(tensor: GlobalTensor) -> None:
    """Every box of the stacked axes present once (the layers and experts the model has)."""
    expected = math.prod(tensor.axes)
    seen = {chunk.offsets[: len(tensor.axes)] for chunk in tensor.chunks}
    if len(seen) != len(tensor.chunks) or len(seen) != expected:
        raise ReshardError(
            f"has {len(seen)} of the {expected} layer/expert pieces torch_dist stacks into {list(tensor.shape)}",
            tensor=tensor.key,
            hint="every layer (and expert) the args count must be present",
        )
