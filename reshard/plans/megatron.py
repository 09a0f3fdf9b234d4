"""Megatron-LM GPT models, under both the mcore names and the legacy ``language_model.*`` names.

* Vocab-parallel (dim 0, padded): ``word_embeddings`` and the untied ``output_layer``.
* Fused QKV (``linear_qkv`` / ``query_key_value``): rows interleaved per query group,
  ``[q heads of group g | k_g | v_g]`` for g in order. Ranks hold contiguous row chunks, so a tp change
  is a plain concatenate / re-chunk, allowed while every rank holds whole groups or every group is
  spread evenly over ``tp / groups`` ranks (:class:`~reshard.geometry.Grouped`).
* ``linear_fc1`` / ``dense_h_to_4h`` with SwiGLU: each rank holds ``[gate_r; up_r]``, so it is
  ``Packed(0, (F, F))`` (re-pairs the halves; plain concatenation would mix gate and up rows).
* Multi-latent attention (DeepSeek-V3): ``linear_q_proj``, ``linear_q_up_proj``, ``linear_kv_up_proj`` in whole
  heads on dim 0; ``linear_q_down_proj`` / ``linear_kv_down_proj`` are split on dim 0 by the local spec (which
  gathers their outputs) and whole on every rank under Transformer Engine (``transformer_impl`` in the args).
* A learnable softmax offset (``core_attention.softmax_offset``, one per head): dim 0.
* Row-parallel (dim 1): ``linear_proj`` / ``dense`` (in whole heads), ``linear_fc2`` / ``dense_4h_to_h``.
* MoE: every expert's (and the shared experts') fc1/fc2 like the dense MLP's, sized by
  ``moe_ffn_hidden_size`` / ``moe_shared_expert_intermediate_size`` (expert tensor parallelism is the tp);
  the router and the shared-expert gate replicated.
* Replicated: norms (``*.layer_norm_weight`` fused by Transformer Engine included), row-parallel biases,
  position embeddings, tensor-valued ``_extra_state``.

The table stays here rather than in :mod:`reshard.megatron` because it is one of the plans' ``FAMILIES`` (one
module per family, listed in ``plans/__init__.py``) and is built of :mod:`reshard.plans.base` rules, a layer the
domain package may not import; what it knows of Megatron's args (the config's ``model_type``) comes from there.
"""

from __future__ import annotations

from reshard.config import ModelConfig
from reshard.errors import AmbiguousPartitionError
from reshard.geometry import Grouped, Packed, Partition, Replicate, Shard, Vocab
from reshard.megatron.model import MODEL_TYPE
from reshard.plans.base import Plan, Rule

MODEL_TYPES = (MODEL_TYPE,)
SIGNATURE = (
    r"(^|\.)(decoder|encoder|transformer)\.layers\.\d+\.self_attention\."
    r"(linear_qkv|query_key_value|linear_q_proj|linear_q_down_proj|linear_kv_down_proj)\.weight$"
)

_QKV = r"\.(linear_qkv|query_key_value)\.(weight|bias)$"
_PROJ = r"(\.linear_proj|self_attention\.dense)"
# Multi-latent attention: column-parallel in the local spec (the down projections too: the layer gathers them).
_MLA = r"\.linear_(q|q_up|kv_up)_proj\.weight$"
_MLA_DOWN = r"\.linear_(q_down|kv_down)_proj\.weight$"
_FC1 = r"\.(linear_fc1|dense_h_to_4h)\.(weight|bias)$"
_FC2 = r"\.(linear_fc2|dense_4h_to_h)"


def _need(config: ModelConfig | None, key: str, what: str) -> int:
    value = config.get(key) if config is not None else None
    if not isinstance(value, int) or value <= 0:
        raise AmbiguousPartitionError(f"{what} needs {key} from the Megatron args (or --config)")
    return value


def qkv_partition(config: ModelConfig | None) -> Partition:
    """Contiguous dim-0 chunks over ``num_query_groups`` interleaved groups."""
    return Grouped(0, _need(config, "num_key_value_heads", "the fused QKV (num_query_groups)"))


def proj_partition(config: ModelConfig | None) -> Partition:
    """Dim 1 in whole heads of ``kv_channels``: Megatron needs num_attention_heads to divide by tp."""
    return Shard(1, unit=_need(config, "head_dim", "linear_proj (kv_channels)"))


def down_partition(config: ModelConfig | None) -> Partition:
    """MLA's down projections: column-parallel in the local spec, replicated under Transformer Engine."""
    return Shard(0) if config is not None and config.get("transformer_impl") == "local" else Replicate()


def fc1_of(key: str, what: str):
    """``[gate; up]`` of an MLP whose FFN size is the config's ``key``, split part by part under SwiGLU, a
    plain dim-0 shard otherwise."""

    def partition(config: ModelConfig | None) -> Partition:
        if config is not None and config.get("swiglu"):
            ffn = _need(config, key, f"the SwiGLU {what}")
            return Packed(0, (ffn, ffn))
        return Shard(0)

    return partition


fc1_partition = fc1_of("intermediate_size", "linear_fc1 (ffn_hidden_size)")


MEGATRON_PLAN = Plan(
    "megatron",
    (
        Rule(r"(^|\.)word_embeddings(_for_head)?\.weight$", Vocab(0)),
        Rule(r"(^|\.)output_layer\.weight$", Vocab(0)),
        Rule(r"(^|\.)position_embeddings\.weight$", Replicate()),
        Rule(r"layer_?norm_(weight|bias)$", Replicate()),
        Rule(r"(norm|layernorm)\.(weight|bias)$", Replicate()),
        Rule(_QKV, qkv_partition),
        Rule(_MLA_DOWN, down_partition),
        Rule(_MLA, Shard(0)),
        Rule(_PROJ + r"\.weight$", proj_partition),
        Rule(_PROJ + r"\.bias$", Replicate()),
        Rule(
            r"\.experts\.local_experts\.\d+" + _FC1,
            fc1_of("moe_intermediate_size", "expert fc1 (moe_ffn_hidden_size)"),
        ),
        Rule(
            r"\.shared_experts" + _FC1,
            fc1_of("shared_expert_intermediate_size", "shared expert fc1 (moe_shared_expert_intermediate_size)"),
        ),
        Rule(r"\.core_attention\.softmax_offset$", Shard(0)),  # softmax_type learnable: one sink per head
        Rule(r"\.mlp\.router\.(weight|bias|expert_bias)$", Replicate()),
        Rule(r"\.shared_experts\.gate_weight$", Replicate()),
        Rule(_FC1, fc1_partition),
        Rule(_FC2 + r"\.weight$", Shard(1)),
        Rule(_FC2 + r"\.bias$", Replicate()),
        Rule(r"(^|\.)_extra_state$", Replicate()),
        Rule(r"rotary_pos_emb\.inv_freq$", Replicate()),
    ),
)
