"""Megatron-Core's ``dp_reshardable`` optimizer state (Megatron-LM's default ``torch_dist`` format) read as each
parameter's master and moments in model space, as the weights are.

The checkpoint holds, per tp x pp rank (``dp_group_idx_{r}``, the rank in the tensor x pipeline group), grad buffer,
dtype and bucket, one flat tensor per state (``param``, the fp32 master; ``exp_avg``; ``exp_avg_sq``): the bucket
of :mod:`reshard.layouts.dcp.torch_dist_buckets`, its data-parallel shards put back together by DCP. A parameter's
state is a view: each tp rank's local shard lies flattened at its place in that rank's bucket, and is the rank's
box (boxes: a SwiGLU ``linear_fc1`` holds its gate and its up rows) of the global tensor, the same boxes the
weight is saved as. :class:`~reshard.layouts.dcp.bucket_reader.BucketReader` reads them into the parameter's global
shape, so the engine re-slices the state exactly as the weight.

Pipeline stages hold the layers split evenly (the embedding on the first, the output layer on the last; the
rank in the tensor x pipeline group is ``pp_rank * tp + tp_rank``), their buckets off past the first stage.

Refused by name, never guessed: an uneven or virtual pipeline split, embeddings tied across pipeline stages,
several distributed-optimizer instances, a parameter reshard cannot place in Megatron-Core's order
(:data:`~reshard.layouts.dcp.torch_dist_buckets.LAYER`), buckets the args do not size, more than one buffer, and
any disagreement between the layout reshard computes and what the checkpoint records (``per_bucket_numel``,
``per_bucket_numel_unpadded``, the stored buckets' sizes and the edges of the pieces they were saved as), named
with both numbers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.formats.boxes import Box
from reshard.formats.dcp_metadata.read import StoredTensor
from reshard.layouts.dcp.boxed_reader import BoxedReader, BoxView, StackedView
from reshard.layouts.dcp.bucket_reader import BucketReader, Shard
from reshard.layouts.dcp.torch_dist_buckets import (
    LAYER_NAME,
    Bucket,
    boundaries,
    bucket_layout,
    bucket_size_of,
    parameter_order,
)
from reshard.layouts.refs import TensorRef
from reshard.layouts.training import state_name
from reshard.megatron.model import arg

PREFIX = "optimizer.distributed.dp_group_idx_"
BUCKET = re.compile(
    r"^optimizer\.distributed\.dp_group_idx_(?P<group>\d+)\.gbuf_idx_(?P<gbuf>\d+)\.dtype_(?P<dtype>.+)"
    r"\.bucket_idx_(?P<bucket>\d+)\.(?P<slot>param|exp_avg|exp_avg_sq)$"
)
SLOT = {"param": "master", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
REQUIRED = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "data_parallel_size",
    "num_distributed_optimizer_instances",
)
GATED = (".mlp.linear_fc1.weight", ".mlp.linear_fc1.bias")  # [gate; up], each tp rank holding a share of both

# Megatron-LM's args that split the layers other than evenly over the pipeline stages.
UNEVEN = (
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "pipeline_model_parallel_layout",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)

Views = Mapping[str, BoxView | StackedView]


@dataclass(frozen=True)
class _Model:
    """What the buckets are computed from: the parallel sizes, the bucketing, each parameter with each tp rank's
    boxes of it (one list alone: every rank holds it whole), and each pipeline stage's parameters in
    ``model.parameters()`` order."""

    tp: int
    dp: int
    bucket_size: int | None
    high_nccl_busbw: bool
    params: dict[str, list[list[Box]]]
    stages: list[list[str]]

    def boxes(self, name: str, rank: int) -> tuple[Box, ...]:
        shards = self.params[name]
        return tuple(shards[0] if len(shards) == 1 else shards[rank])

    def layout(self, tp_rank: int, stage: int) -> list[Bucket]:
        """The buckets of tp rank ``tp_rank`` of pipeline stage ``stage`` (bucketing is off past the first stage:
        Megatron-LM's ``per_chunk_bucket_sizes``)."""
        local = [(name, sum(b.numel for b in self.boxes(name, tp_rank))) for name in self.stages[stage]]
        size = self.bucket_size if stage == 0 else None
        return bucket_layout(local, bucket_size=size, dp=self.dp, high_nccl_busbw=self.high_nccl_busbw)


def bucket_refs(
    args: Any, objects: Mapping[str, Any], stored: Mapping[str, StoredTensor], weights: Views, folder: Path
) -> dict[str, TensorRef] | str:
    """Each weight's state tensors (:func:`state_name`) read from the buckets, or why they cannot be placed.

    Args:
        args: Megatron's args (parallel sizes, the DDP bucketing flags).
        objects: the checkpoint's ``optimizer.distributed.*`` objects by key (``per_bucket_numel``, ...).
        stored: the checkpoint's ``optimizer.distributed.*`` tensors, chunks located.
        weights: the model's views by name; their stored chunks are each tp rank's boxes.
        folder: the checkpoint folder.
    """
    model = _model(args, weights)
    if isinstance(model, str):
        return model
    found: dict[tuple[int, int], dict[str, StoredTensor]] = {}  # (tp x pp rank, bucket) -> slot -> tensor
    problem = _stored(stored, model.tp * len(model.stages), found)
    placed: dict[str, dict[str, list[Shard]]] = {}  # slot -> name -> shards
    for stage in range(len(model.stages)):
        for tp_rank in range(model.tp):
            group = stage * model.tp + tp_rank  # the rank in the tensor x pipeline group: tp first
            layout = model.layout(tp_rank, stage)
            problem = problem or _check(group, layout, objects, found, model.dp)
            if problem:
                return problem
            for index, bucket in enumerate(layout):
                for name, (begin, end) in bucket.params.items():
                    if tp_rank and len(model.params[name]) == 1:
                        continue  # held whole by every tp rank: read from the first
                    for slot, tensor in found[(group, index)].items():
                        flat = BoxView(tensor, Box((begin,), (end - begin,)), (end - begin,))
                        shard = Shard(model.boxes(name, tp_rank), flat)
                        placed.setdefault(slot, {}).setdefault(name, []).append(shard)
    buckets = BoxedReader(folder, {t.name: BoxView.whole(t) for t in stored.values()})
    refs: dict[str, TensorRef] = {}
    for slot, by_name in placed.items():
        keys = {state_name(name, slot): tuple(s) for name, s in by_name.items()}
        reader = BucketReader(folder, keys, {state_name(n, slot): weights[n].shape for n in by_name}, buckets)
        refs |= {key: TensorRef(key, 0, reader, key, reader.headers[key]) for key in keys}
    return refs


def _model(args: Any, weights: Views) -> _Model | str:
    """The sizes and parameters the buckets are computed from, or why the checkpoint does not tell them."""
    missing = [name for name in REQUIRED if arg(args, name) is None]
    if missing:
        return f"the args record no {missing[0]}, which decides the optimizer's buckets"
    tp, dp = int(arg(args, "tensor_model_parallel_size")), int(arg(args, "data_parallel_size"))
    dp *= int(arg(args, "context_parallel_size", 1))
    if int(arg(args, "num_distributed_optimizer_instances")) != 1:
        return "several distributed-optimizer instances (--num-distributed-optimizer-instances)"
    size, high, why = bucket_size_of(args, dp)
    if why:
        return why
    order, unknown = parameter_order(list(weights))
    if unknown:
        return f"{unknown[0]} and {len(unknown) - 1} more: reshard does not know their place in the buckets"
    stages = _stages(args, order)
    if isinstance(stages, str):
        return stages
    params: dict[str, list[list[Box]]] = {}
    for name in order:
        boxes = _tp_boxes(name, weights[name], tp)
        if isinstance(boxes, str):
            return f"{name}: {boxes}"
        params[name] = boxes
    return _Model(tp, dp, size, high, params, stages)


def _stages(args: Any, order: list[str]) -> list[list[str]] | str:
    """Each pipeline stage's parameters (``order`` kept): the layers split evenly, the embedding on the first
    stage, the final norm and the output layer on the last; or why the split is not that one."""
    pp = int(arg(args, "pipeline_model_parallel_size"))
    if pp == 1:
        return [order]
    uneven = [name for name in UNEVEN if arg(args, name)]
    if uneven or arg(args, "virtual_pipeline_model_parallel_size"):
        return f"pipeline stages split by --{(uneven or ['virtual-pipeline'])[0].replace('_', '-')}"
    if "output_layer.weight" not in order:
        return "embeddings tied across pipeline stages (the last stage's copy of the embedding is not saved)"
    layers = int(arg(args, "num_layers", 0))
    if layers <= 0 or layers % pp:
        return f"{layers} layers over {pp} pipeline stages"
    stages: list[list[str]] = [[] for _ in range(pp)]
    for name in order:
        match = LAYER_NAME.match(name)
        stage = int(match[1]) * pp // layers if match else 0 if name.startswith("embedding.") else pp - 1
        stages[stage].append(name)
    return stages


def _tp_boxes(name: str, view: BoxView | StackedView, tp: int) -> list[list[Box]] | str:
    """Each tp rank's boxes of the parameter (in the parameter's coordinates), from the chunks its weight is saved
    as: one chunk held whole by every rank, ``tp`` chunks along one axis (rank ``r`` the ``r``-th), or for a
    SwiGLU ``linear_fc1`` ``2 x tp`` along dim 0 (rank ``r`` the ``r``-th of the gate and of the up half)."""
    parts = view.parts if isinstance(view, StackedView) else (view,)
    per_part, rows = [], 0
    for part in parts:
        per_part.append([Box((b.offsets[0] + rows, *b.offsets[1:]), b.sizes) for b in _chunks_of(part)])
        rows += part.shape[0]
    boxes = [box for chunks in per_part for box in chunks]
    if len(boxes) == 1:
        return [boxes]
    if len(parts) == 2 and all(len(chunks) == tp for chunks in per_part) and name.endswith(GATED):
        return [[per_part[0][r], per_part[1][r]] for r in range(tp)]
    if len(parts) == 1 and len(boxes) == tp:
        return [[box] for box in boxes]
    if len(parts) == 1 and len(boxes) == 2 * tp and name.endswith(GATED):
        return [[boxes[r], boxes[tp + r]] for r in range(tp)]
    return f"its weight is saved as {len(boxes)} pieces, which reshard cannot tell apart among {tp} tp ranks"


def _chunks_of(view: BoxView) -> list[Box]:
    """The stored chunks inside the view's box, in the view's coordinates (the stacked axes it fixes dropped),
    in C order of their offsets."""
    fixed = len(view.tensor.shape) - len(view.shape)
    inner = [common.within(view.box) for c in view.tensor.chunks if (common := c.box.intersect(view.box))]
    return sorted((Box(b.offsets[fixed:], b.sizes[fixed:]) for b in inner), key=lambda b: b.offsets)


def _stored(
    stored: Mapping[str, StoredTensor], groups: int, found: dict[tuple[int, int], dict[str, StoredTensor]]
) -> str:
    """Sort the bucket tensors by (tensor x pipeline rank, bucket) and slot, for ``groups`` such ranks; why they are
    not one buffer per rank, if so."""
    dtypes: set[str] = set()
    for fqn, tensor in stored.items():
        match = BUCKET.match(fqn)
        if match is None:
            return f"{fqn}: a tensor of the distributed optimizer reshard does not know"
        if int(match["group"]) >= groups:
            return f"{fqn}: a tensor x pipeline rank past the {groups} the args make"
        if int(match["gbuf"]) != 0:
            return f"{fqn}: more than one grad buffer per rank (several dtypes, or experts) is not read"
        dtypes.add(match["dtype"])
        found.setdefault((int(match["group"]), int(match["bucket"])), {})[SLOT[match["slot"]]] = tensor
    if len(dtypes) > 1:
        return f"buffers of several dtypes ({', '.join(sorted(dtypes))}) are not read"
    slots = {tuple(sorted(by_slot)) for by_slot in found.values()}
    if len(slots) > 1:
        return f"buckets hold different states: {sorted(slots)}"
    return ""


def _check(
    rank: int, layout: list[Bucket], objects: Mapping[str, Any], found: Mapping[tuple[int, int], Any], dp: int
) -> str:
    """Why the layout computed for tp rank ``rank`` is not the one its checkpoint records, if it is not."""
    where = f"{PREFIX}{rank}"
    for key, computed in (
        ("per_bucket_numel", [b.numel for b in layout]),
        ("per_bucket_numel_unpadded", [b.numel_unpadded for b in layout]),
    ):
        recorded = _numels(objects.get(f"{where}.{key}"))
        if recorded != computed:
            return f"{where}.{key}: the checkpoint records {recorded}, reshard computes {computed} from the model"
    stored_buckets = sorted(b for r, b in found if r == rank)
    if stored_buckets != list(range(len(layout))):
        return f"{where}: {len(stored_buckets)} bucket(s) stored, {len(layout)} computed from the model's shapes"
    for index, bucket in enumerate(layout):
        for tensor in found[(rank, index)].values():
            if tensor.shape != (bucket.numel_unpadded,):
                return f"{tensor.name}: stored as {list(tensor.shape)}, computed [{bucket.numel_unpadded}]"
            edges = {e for c in tensor.chunks for e in (c.box.offsets[0], c.box.offsets[0] + c.box.sizes[0])}
            if edges != boundaries(bucket, dp):
                odd = sorted(edges ^ boundaries(bucket, dp))[:4]
                return f"{tensor.name}: saved in pieces whose edges differ from the computed layout's at {odd}"
    return ""


def _numels(recorded: Any) -> list[int] | None:
    """The numbers a ``per_bucket_numel*`` object records for the one buffer: ``[{(dtype, grad dtype): [numel,
    ...]}]``, one dict per grad buffer."""
    if isinstance(recorded, list) and len(recorded) == 1 and isinstance(recorded[0], Mapping):
        (buffer,) = recorded
        if len(buffer) == 1:
            (numels,) = buffer.values()
            if isinstance(numels, list) and all(type(n) is int for n in numels):
                return numels
    return None
