"""Qwen3.5 / Qwen3.5-MoE: hybrid Gated DeltaNet (``linear_attn``) and gated full attention.

Every rank holds exactly the heads it computes (the vLLM / Megatron layout), so head counts that do
not divide by tp are reported instead of being split mid-head:

- ``linear_attn.in_proj_qkv`` ``[conv_dim, H]`` and the depthwise ``conv1d.weight`` ``[conv_dim, 1, K]``
  that filters its output are ``packed`` in ``[key_dim, key_dim, value_dim]``, in whole key / value
  heads (key_dim = linear_num_key_heads * linear_key_head_dim, value_dim likewise for values);
- ``in_proj_z`` (value_dim rows), ``in_proj_b`` / ``in_proj_a`` / ``A_log`` / ``dt_bias`` (one entry per
  value head) split on dim 0; ``out_proj`` on dim 1 in whole value heads; the gated ``norm`` replicated;
- full attention: ``q_proj`` holds query and gate per head (``2 * head_dim`` rows a head), ``k_proj`` /
  ``v_proj`` by KV heads (copied onto several ranks past their count, as vLLM runs Qwen3-Next's 2 KV heads at
  tp 4 and 8), ``o_proj`` on dim 1, ``q_norm`` / ``k_norm`` replicated;
- MoE: router and shared-expert gate replicated, experts (one tensor per expert, or transformers'
  fused ``experts.gate_up_proj`` ``[E, 2I, H]`` / ``experts.down_proj`` ``[E, H, I]``) column/row-parallel.

The vision tower of ``Qwen3_5ForConditionalGeneration`` follows the Qwen2-VL vision rules.
"""

from __future__ import annotations

from reshard.config import ModelConfig
from reshard.geometry import Packed, Replicate, Shard, Vocab
from reshard.plans.base import Plan, Rule
from reshard.plans.llama import kv_heads
from reshard.plans.qwen2_vl import VISION_RULES

MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
SIGNATURE = r"linear_attn\.in_proj_qkv\.weight$"


def config_int(config: ModelConfig | None, key: str) -> int:
    value = config.get(key) if config else None
    return int(value) if value else 0


def linear_sizes(config: ModelConfig | None) -> tuple[int, int, int, int]:
    """``(key_dim, value_dim, linear_key_head_dim, linear_value_head_dim)`` of the Gated DeltaNet."""
    d_k, d_v = config_int(config, "linear_key_head_dim"), config_int(config, "linear_value_head_dim")
    n_k, n_v = config_int(config, "linear_num_key_heads"), config_int(config, "linear_num_value_heads")
    return n_k * d_k, n_v * d_v, d_k, d_v


def qkv_packed(config: ModelConfig | None) -> Packed:
    """``[Q | K | V]`` channels of ``in_proj_qkv`` and of the depthwise ``conv1d`` after it."""
    key_dim, value_dim, d_k, d_v = linear_sizes(config)
    return Packed(0, (key_dim, key_dim, value_dim), units=(d_k or 1, d_k or 1, d_v or 1))


def value_heads(dim: int):
    """Split along ``dim`` in whole value heads of ``linear_value_head_dim``."""

    def partition(config: ModelConfig | None) -> Shard:
        return Shard(dim, unit=linear_sizes(config)[3] or 1)

    return partition


def heads(dim: int, factor: int = 1):
    """Split along ``dim`` in whole attention heads of ``factor * head_dim`` (Qwen3.5 ``q_proj``: 2)."""

    def partition(config: ModelConfig | None) -> Shard:
        return Shard(dim, unit=factor * (config.head_dim if config and config.head_dim else 1))

    return partition


def fused_gate_up(config: ModelConfig | None) -> Packed | Shard:
    """transformers' in-memory ``experts.gate_up_proj`` ``[E, 2I, H]``: gate and up split on their own."""
    size = config_int(config, "moe_intermediate_size")
    return Packed(1, (size, size)) if size else Shard(1)


LINEAR_ATTENTION_RULES = (
    Rule(r"linear_attn\.(in_proj_qkv\.weight|conv1d\.weight)$", qkv_packed),
    Rule(r"linear_attn\.conv1d\.bias$", qkv_packed),
    Rule(r"linear_attn\.in_proj_z\.weight$", value_heads(0)),
    Rule(r"linear_attn\.(in_proj_b\.weight|in_proj_a\.weight|A_log|dt_bias)$", Shard(0)),
    Rule(r"linear_attn\.out_proj\.weight$", value_heads(1)),
    Rule(r"linear_attn\.norm\.weight$", Replicate()),
)

GATED_ATTENTION_RULES = (
    Rule(r"self_attn\.q_proj\.(weight|bias)$", heads(0, factor=2)),
    Rule(r"self_attn\.[kv]_proj\.(weight|bias)$", kv_heads(0)),
    Rule(r"self_attn\.o_proj\.weight$", heads(1)),
    Rule(r"self_attn\.(o_proj\.bias|[qk]_norm\.weight)$", Replicate()),
)

MLP_RULES = (
    Rule(r"(^|\.)embed_tokens\.weight$", Vocab(0)),
    Rule(r"(^|\.)lm_head\.weight$", Vocab(0)),
    Rule(r"mlp\.gate\.weight$", Replicate()),  # MoE router
    Rule(r"mlp\.shared_expert_gate\.weight$", Replicate()),
    Rule(r"mlp\.experts\.gate_up_proj$", fused_gate_up),
    Rule(r"mlp\.experts\.down_proj$", Shard(2)),
    Rule(r"mlp\.(experts\.\d+\.|shared_expert\.)?(gate|up)_proj\.weight$", Shard(0)),
    Rule(r"mlp\.(experts\.\d+\.|shared_expert\.)?down_proj\.weight$", Shard(1)),
    Rule(r"(norm|layernorm)\.weight$", Replicate()),
    Rule(r"rotary_emb\.inv_freq$", Replicate()),
)

QWEN3_5_PLAN = Plan("qwen3_5", VISION_RULES + LINEAR_ATTENTION_RULES + GATED_ATTENTION_RULES + MLP_RULES)
