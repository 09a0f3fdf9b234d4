"""DeepSeek-V2 / V3: multi-head latent attention (MLA) and DeepSeek-MoE, as transformers names them.

MLA, split as vLLM does: the down-projections ``q_a_proj`` and ``kv_a_proj_with_mqa`` (and their norms) are
small and replicated; ``q_b_proj`` (``q_proj`` without a q LoRA rank) holds ``qk_nope + qk_rope`` rows per
head and ``kv_b_proj`` ``qk_nope + v_head_dim`` rows per head, both split in whole heads; ``o_proj`` on its
columns in heads of ``v_head_dim``. Experts, shared experts and the router as :mod:`reshard.plans.moe`; the
first dense layers, embeddings and norms as the Llama family. The multi-token-prediction layer of V3
checkpoints: ``eh_proj`` replicated, ``shared_head.head`` vocab-parallel.

transformers' own plan differs: V3's leaves the whole attention replicated, V2's splits it as here.
"""

from __future__ import annotations

from reshard.config import ModelConfig
from reshard.geometry import Replicate, Shard, Vocab
from reshard.plans.base import Plan, Rule
from reshard.plans.llama import LLAMA_PLAN
from reshard.plans.moe import EXPERT_RULES

MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
SIGNATURE = r"self_attn\.kv_a_proj_with_mqa\.weight$"


def _size(config: ModelConfig | None, key: str) -> int:
    value = config.get(key) if config else None
    return value if isinstance(value, int) and value > 0 else 0


def mla_heads(dim: int, *keys: str):
    """Split along ``dim`` in whole heads of the sum of ``keys`` (1 when the config does not say)."""

    def partition(config: ModelConfig | None) -> Shard:
        return Shard(dim, unit=sum(_size(config, k) for k in keys) or 1)

    return partition


DEEPSEEK_PLAN = Plan(
    "deepseek",
    (
        Rule(r"self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.(weight|bias)$", Replicate()),
        Rule(r"self_attn\.(q_proj|q_b_proj)\.weight$", mla_heads(0, "qk_nope_head_dim", "qk_rope_head_dim")),
        Rule(r"self_attn\.kv_b_proj\.weight$", mla_heads(0, "qk_nope_head_dim", "v_head_dim")),
        Rule(r"self_attn\.o_proj\.weight$", mla_heads(1, "v_head_dim")),
        Rule(r"(^|\.)eh_proj\.weight$", Replicate()),
        Rule(r"(^|\.)shared_head\.head\.weight$", Vocab(0)),
        *EXPERT_RULES,
        *LLAMA_PLAN.rules,
    ),
)
