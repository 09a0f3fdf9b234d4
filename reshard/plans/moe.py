"""Mixture-of-experts MLPs: Mixtral, Qwen2-MoE, Qwen3-MoE; attention as the Llama family.

Every expert is split as a dense MLP, gate/up on their rows and down on its columns, so each rank runs a
slice of every expert (tensor parallelism, as vLLM and transformers' ``moe_tp_experts`` do); the router
(``gate``, DeepSeek's ``e_score_correction_bias``) and Qwen2-MoE's ``shared_expert_gate`` are replicated.
Both forms are planned: one tensor per expert as ``save_pretrained`` writes them (Mixtral's
``block_sparse_moe.experts.N.w1/w3`` [I, H] and ``w2`` [H, I]; Qwen's ``mlp.experts.N.gate/up/down_proj``),
and transformers 5's fused in-memory ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate and up halves, each
split on its own) and ``mlp.experts.down_proj`` [E, H, I].
"""

from __future__ import annotations

from reshard.config import ModelConfig
from reshard.errors import AmbiguousPartitionError
from reshard.geometry import Packed, Replicate, Shard
from reshard.plans.base import Plan, Rule
from reshard.plans.llama import LLAMA_PLAN

MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
SIGNATURE = r"(mlp|block_sparse_moe)\.experts\.(\d+\.|gate_up_proj$)"


def expert_size(config: ModelConfig | None) -> int:
    """One expert's intermediate size: ``moe_intermediate_size`` (Qwen, DeepSeek), else ``intermediate_size``
    (Mixtral's experts are as wide as its dense MLP would be)."""
    size = config.get("moe_intermediate_size") or config.get("intermediate_size") if config else None
    if not isinstance(size, int) or size <= 0:
        raise AmbiguousPartitionError("the fused experts.gate_up_proj needs moe_intermediate_size from config.json")
    return size


def fused_gate_up(config: ModelConfig | None) -> Packed:
    """``experts.gate_up_proj`` [E, 2I, H]: the gate and up halves of every expert, each split on its own."""
    size = expert_size(config)
    return Packed(1, (size, size))


EXPERT_RULES = (
    Rule(r"(mlp|block_sparse_moe)\.gate\.(weight|e_score_correction_bias)$", Replicate()),  # the router
    Rule(r"mlp\.shared_expert_gate\.weight$", Replicate()),
    Rule(r"mlp\.experts\.gate_up_proj$", fused_gate_up),
    Rule(r"mlp\.experts\.down_proj$", Shard(2)),
    Rule(r"\.experts\.\d+\.(gate_proj|up_proj|w1|w3)\.weight$", Shard(0)),
    Rule(r"\.experts\.\d+\.(down_proj|w2)\.weight$", Shard(1)),
    Rule(r"mlp\.shared_experts?\.(gate|up)_proj\.weight$", Shard(0)),
    Rule(r"mlp\.shared_experts?\.down_proj\.weight$", Shard(1)),
)

MOE_PLAN = Plan("moe", EXPERT_RULES + LLAMA_PLAN.rules)
