"""Where Megatron-Core's distributed optimizer keeps each parameter in its flat buffers (the ``dp_reshardable``
format), worked out again from the parameters' shapes: pure, no torch, no file.

Megatron-Core 0.19 (``optimizer/distrib_optimizer.py`` ``_compute_per_buffer_param_layout``,
``optimizer/param_layout.py``, ``distributed/distributed_data_parallel.py``; Megatron-LM's
``training/training.py`` ``resolve_ddp_bucket_size``) lays one tp/pp rank's trainable parameters of one dtype into
one buffer, in the REVERSE order of ``model.parameters()`` (the order of the backward pass): each parameter's
local shard, flattened, starts at a multiple of 64 elements; a bucket closes once it holds ``bucket_size`` elements
or more (a single bucket when ``bucket_size`` is None), its end padded to a multiple of ``lcm(dp, 128)`` (with
``pad_buckets_for_high_nccl_busbw``, ``lcm(dp, 128, 65536)``). The checkpoint stores each bucket without that end
padding (``per_bucket_numel_unpadded`` elements), the 64-element gaps left as they were.

Nothing here is taken on trust: the caller compares what this computes with what the checkpoint records
(``per_bucket_numel``, ``per_bucket_numel_unpadded``, the stored buckets' sizes and the boundaries of the pieces
Megatron-Core saved each parameter as) and refuses, with both numbers, where they differ.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from reshard.geometry.padding import round_up
from reshard.megatron.model import arg

PARAM_ALIGN = 64  # param_layout.pad_param_start
BUCKET_ALIGN = 128  # param_layout.bucket_end_divisor, beside the data-parallel size
HIGH_NCCL_BUSBW_ALIGN = 1 << 16
DEFAULT_BUCKET = 40_000_000  # resolve_ddp_bucket_size: max(40M, 1M x the data-parallel size)
DEFAULT_BUCKET_PER_RANK = 1_000_000
# Megatron-LM's args that size the buckets (``get_megatron_ddp_config``, ``resolve_ddp_bucket_size``).
BUCKET_ARGS = (
    "overlap_grad_reduce",
    "overlap_param_gather_with_optimizer_step",
    "ddp_bucket_size",
    "ddp_num_buckets",
    "ddp_pad_buckets_for_high_nccl_busbw",
)

# The parameters of a Megatron-Core GPTModel in the order ``model.parameters()`` lists them (the order their modules
# are registered in): the embedding, each layer, the final norm, the output layer. A layer registers its input
# norm, its attention (``linear_proj`` before ``linear_qkv``, whose Transformer Engine form holds the fused norm
# first, then ``q_layernorm`` / ``k_layernorm``), its pre-MLP norm and its MLP (``linear_fc1``, with Transformer
# Engine's fused norm first, then ``linear_fc2``). Names are reshard's (``decoder.layers.{i}.``, the ``torch``
# format's); a weight before its bias.
MODEL_HEAD = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
LAYER = tuple(
    f"{module}.{param}"
    for module, params in (
        ("input_layernorm", ("weight", "bias")),
        ("self_attention.linear_proj", ("weight", "bias")),
        ("self_attention.linear_qkv", ("layer_norm_weight", "layer_norm_bias", "weight", "bias")),
        ("self_attention.q_layernorm", ("weight", "bias")),
        ("self_attention.k_layernorm", ("weight", "bias")),
        ("pre_mlp_layernorm", ("weight", "bias")),
        ("mlp.linear_fc1", ("layer_norm_weight", "layer_norm_bias", "weight", "bias")),
        ("mlp.linear_fc2", ("weight", "bias")),
    )
    for param in params
)
MODEL_TAIL = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight")
LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def parameter_order(names: Sequence[str]) -> tuple[list[str], list[str]]:
    """``names`` in the order Megatron-Core's ``model.parameters()`` lists them, and the names whose place in it
    reshard does not know (a module outside :data:`LAYER`: experts, MLA, ...)."""
    keyed: list[tuple[tuple[int, int, int], str]] = []
    unknown: list[str] = []
    for name in names:
        match = LAYER_NAME.match(name)
        if name in MODEL_HEAD:
            keyed.append(((0, 0, MODEL_HEAD.index(name)), name))
        elif match and match[2] in LAYER:
            keyed.append(((1, int(match[1]), LAYER.index(match[2])), name))
        elif name in MODEL_TAIL:
            keyed.append(((2, 0, MODEL_TAIL.index(name)), name))
        else:
            unknown.append(name)
    return [name for _, name in sorted(keyed)], unknown


@dataclass(frozen=True)
class Bucket:
    """One bucket of a buffer: each parameter's ``(start, end)`` in the bucket as stored (its first element at 0),
    the bucket's size as Megatron-Core holds it (``numel``) and as the checkpoint stores it (``numel_unpadded``)."""

    params: dict[str, tuple[int, int]]
    numel: int
    numel_unpadded: int


def bucket_layout(
    params: Sequence[tuple[str, int]], *, bucket_size: int | None, dp: int, high_nccl_busbw: bool
) -> list[Bucket]:
    """The buckets of one buffer (``_compute_per_buffer_param_layout``), ``params`` being ``(name, local numel)`` in
    ``model.parameters()`` order (laid out in reverse). Parameters shared between pipeline stages
    (``shared_embedding``) are not modelled: the caller refuses pipeline parallelism.

    Example:
        >>> [(b.params, b.numel) for b in bucket_layout([("a", 3), ("b", 100)], bucket_size=None, dp=1,
        ...                                             high_nccl_busbw=False)]
        [({'b': (0, 100), 'a': (128, 131)}, 256)]
    """
    divisor = math.lcm(dp, BUCKET_ALIGN, HIGH_NCCL_BUSBW_ALIGN) if high_nccl_busbw else math.lcm(dp, BUCKET_ALIGN)
    buckets: list[Bucket] = []
    members: dict[str, tuple[int, int]] = {}
    bucket_start = start = end = 0

    def close(end: int) -> int:
        padded = round_up(end, divisor)
        buckets.append(Bucket(dict(members), padded - bucket_start, end - bucket_start))
        members.clear()
        return padded

    for name, numel in reversed(params):
        start = round_up(start, PARAM_ALIGN)
        end = start + numel
        members[name] = (start - bucket_start, end - bucket_start)
        if bucket_size is not None and end - bucket_start >= bucket_size:
            bucket_start = start = close(end)
        else:
            start = end
    if members:
        close(end)
    return buckets


def boundaries(bucket: Bucket, dp: int) -> set[int]:
    """The edges of the pieces Megatron-Core saves a stored bucket as (``sharded_param_state_dp_reshardable``): each
    data-parallel rank's share of the bucket cut at its parameters' ends, the gaps between them saved too."""
    share = bucket.numel // dp
    edges = {0, bucket.numel_unpadded}
    edges |= {rank * share for rank in range(1, dp) if rank * share < bucket.numel_unpadded}
    edges |= {edge for span in bucket.params.values() for edge in span}
    return edges


def bucket_size_of(args: Any, dp: int) -> tuple[int | None, bool, str | None]:
    """The bucket size Megatron-LM gave its buffers (``resolve_ddp_bucket_size``; None: one bucket) and whether
    their ends are padded for NCCL's bus bandwidth, or why the args do not tell."""
    missing = [name for name in BUCKET_ARGS if not _has(args, name)]
    if missing:
        return None, False, f"the args record no {missing[0]}, which decides the optimizer's buckets"
    high = bool(arg(args, "ddp_pad_buckets_for_high_nccl_busbw"))
    if not arg(args, "overlap_grad_reduce") or arg(args, "overlap_param_gather_with_optimizer_step"):
        return None, high, None
    if arg(args, "ddp_num_buckets") is not None:
        return (
            None,
            high,
            (
                f"--ddp-num-buckets {arg(args, 'ddp_num_buckets')} sizes the buckets from the parameter count of the "
                "whole model chunk, which reshard does not reconstruct"
            ),
        )
    size = arg(args, "ddp_bucket_size")
    return (max(DEFAULT_BUCKET, DEFAULT_BUCKET_PER_RANK * dp) if size is None else int(size)), high, None


def _has(args: Any, name: str) -> bool:
    return name in args if isinstance(args, dict) else hasattr(args, name)
