"""Qwen3-Next: Qwen3.5's layers, with the Gated DeltaNet input projections fused per key-head group.

``linear_attn.in_proj_qkvz`` ``[n_k * (2 d_k + 2 d_v n_v / n_k), H]`` and ``in_proj_ba``
``[n_k * 2 n_v / n_k, H]`` are laid out group by group (one group per key head: its q, k, the values
and z of its value heads; see ``fix_query_key_value_ordering``), so a plain dim-0 shard in whole groups
gives each rank its own heads. The depthwise ``conv1d`` filters the re-ordered ``[Q | K | V]`` channels
and is packed exactly as in Qwen3.5. Everything else follows the Qwen3.5 plan.
"""

from __future__ import annotations

from reshard.config import ModelConfig
from reshard.geometry import Shard
from reshard.plans.base import Plan, Rule
from reshard.plans.qwen3_5 import QWEN3_5_PLAN, config_int, linear_sizes

MODEL_TYPES = ("qwen3_next",)
SIGNATURE = r"linear_attn\.in_proj_qkvz\.weight$"


def _groups(config: ModelConfig | None) -> tuple[int, int]:
    """``(n_k, n_v // n_k)``: key-head groups and value heads per group."""
    n_k, n_v = config_int(config, "linear_num_key_heads"), config_int(config, "linear_num_value_heads")
    return n_k, (n_v // n_k if n_k else 0)


def qkvz_groups(config: ModelConfig | None) -> Shard:
    _, per_group = _groups(config)
    _, _, d_k, d_v = linear_sizes(config)
    return Shard(0, unit=(2 * d_k + 2 * d_v * per_group) or 1)


def ba_groups(config: ModelConfig | None) -> Shard:
    return Shard(0, unit=(2 * _groups(config)[1]) or 1)


QWEN3_NEXT_PLAN = Plan(
    "qwen3_next",
    (
        Rule(r"linear_attn\.in_proj_qkvz\.weight$", qkvz_groups),
        Rule(r"linear_attn\.in_proj_ba\.weight$", ba_groups),
        *QWEN3_5_PLAN.rules,
    ),
)
