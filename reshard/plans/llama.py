"""The Llama family as transformers names it: Llama, Mistral, Qwen2, Qwen3 (dense), SmolLM3, GraniteSWA.

Column-parallel (dim 0): q/k/v/gate/up; row-parallel (dim 1): o/down; vocab-parallel (dim 0, padded):
``embed_tokens`` and ``lm_head``; replicated: norms (including Qwen3's ``q_norm``/``k_norm``), row-parallel
biases and rotary buffers; GraniteSWA's ``sinks`` (one per query head) as the query heads. Attention weights are
split by whole heads (``unit = head_dim``), so a head is never cut; k/v are the KV heads, copied onto several ranks
when the tp is a larger multiple of their count (:func:`kv_heads`), and any other tp that does not divide the heads
is reported.
"""

from __future__ import annotations

from reshard.config import ModelConfig
from reshard.geometry import Replicate, ReplicatedHeads, Shard, Vocab
from reshard.plans.base import Plan, Rule

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "granite_swa")
# A name present in every model of the family, for checkpoints without a config.json.
SIGNATURE = r"layers\.\d+\.self_attn\.q_proj\.weight$"


def by_heads(dim: int, factor: int = 1):
    """Split along ``dim`` in whole heads of ``factor * head_dim`` (1 when the config does not say)."""

    def partition(config: ModelConfig | None) -> Shard:
        return Shard(dim, unit=factor * (config.head_dim if config and config.head_dim else 1))

    return partition


def kv_heads(dim: int = 0):
    """The ``num_key_value_heads`` KV heads along ``dim``: split in whole heads, and at a tp that is a larger
    multiple of them each copied onto the ranks whose query heads use it (as vLLM runs grouped-query
    attention); whole heads of ``head_dim`` when the config does not give the count."""

    def partition(config: ModelConfig | None) -> ReplicatedHeads | Shard:
        heads = config.num_key_value_heads if config else None
        return ReplicatedHeads(dim, heads) if heads else by_heads(dim)(config)

    return partition


LLAMA_PLAN = Plan(
    "llama",
    (
        Rule(r"(^|\.)embed_tokens\.weight$", Vocab(0)),
        Rule(r"(^|\.)lm_head\.weight$", Vocab(0)),
        Rule(r"self_attn\.q_proj\.(weight|bias)$", by_heads(0)),
        Rule(r"self_attn\.[kv]_proj\.(weight|bias)$", kv_heads(0)),
        Rule(r"self_attn\.o_proj\.weight$", by_heads(1)),
        Rule(r"self_attn\.o_proj\.bias$", Replicate()),
        Rule(r"self_attn\.sinks$", Shard(0)),
        Rule(r"mlp\.(gate|up)_proj\.(weight|bias)$", Shard(0)),
        Rule(r"mlp\.down_proj\.weight$", Shard(1)),
        Rule(r"mlp\.down_proj\.bias$", Replicate()),
        Rule(r"(norm|layernorm)\.(weight|bias)$", Replicate()),
        Rule(r"rotary_emb\.inv_freq$", Replicate()),
    ),
)
