"""The Llama family as transformers names it: Llama, Mistral, Qwen2, Qwen3 (dense).

Column-parallel (dim 0): q/k/v/gate/up; row-parallel (dim 1): o/down; vocab-parallel (dim 0, padded):
``embed_tokens`` and ``lm_head``; replicated: norms (including Qwen3's ``q_norm``/``k_norm``), row-parallel
biases and rotary buffers. Attention weights are split by whole heads (``unit = head_dim``), so a
model with fewer KV heads than ranks is reported instead of being cut mid-head.
"""

from __future__ import annotations

from reshard.config import ModelConfig
from reshard.partition import Replicate, Shard, Vocab
from reshard.plans.base import Plan, Rule

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# A name present in every model of the family, for checkpoints without a config.json.
SIGNATURE = r"layers\.\d+\.self_attn\.q_proj\.weight$"


def by_heads(dim: int):
    """Split along ``dim`` in whole heads of ``head_dim`` (1 when the config does not say)."""

    def partition(config: ModelConfig | None) -> Shard:
        return Shard(dim, unit=(config.head_dim if config and config.head_dim else 1))

    return partition


LLAMA_PLAN = Plan(
    "llama",
    (
        Rule(r"(^|\.)embed_tokens\.weight$", Vocab(0)),
        Rule(r"(^|\.)lm_head\.weight$", Vocab(0)),
        Rule(r"self_attn\.[qkv]_proj\.(weight|bias)$", by_heads(0)),
        Rule(r"self_attn\.o_proj\.weight$", by_heads(1)),
        Rule(r"self_attn\.o_proj\.bias$", Replicate()),
        Rule(r"mlp\.(gate|up)_proj\.(weight|bias)$", Shard(0)),
        Rule(r"mlp\.down_proj\.weight$", Shard(1)),
        Rule(r"mlp\.down_proj\.bias$", Replicate()),
        Rule(r"(norm|layernorm)\.(weight|bias)$", Replicate()),
        Rule(r"rotary_emb\.inv_freq$", Replicate()),
    ),
)
