"""Phi-3 / Phi-3.5 / Phi-4 (``model_type`` phi3): the Llama layers with fused projections.

``self_attn.qkv_proj`` [(heads + 2 kv_heads) * head_dim, H] is ``packed`` in ``[q | k | v]``, each part split
in whole heads (vLLM's ``QKVParallelLinear`` reads the fused tensor so); ``mlp.gate_up_proj`` [2I, H] is
``packed`` in ``[gate | up]``. ``o_proj`` and ``down_proj`` are row-parallel. Part sizes come from the config
and are refused without one. KV heads copied onto several ranks are not supported inside a fused qkv.

transformers' plan (``colwise_gather_output``) splits the fused tensors as contiguous rows and gathers the
output after the matmul, so its per-rank slices are storage, not each rank's heads.
"""

from __future__ import annotations

from reshard.config import ModelConfig
from reshard.errors import AmbiguousPartitionError
from reshard.geometry import Packed
from reshard.plans.base import Plan, Rule
from reshard.plans.llama import LLAMA_PLAN

MODEL_TYPES = ("phi3",)
SIGNATURE = r"self_attn\.qkv_proj\.weight$"


def qkv_packed(config: ModelConfig | None) -> Packed:
    heads, kv, head_dim = (
        (config.num_attention_heads, config.num_key_value_heads, config.head_dim) if config else (0,) * 3
    )
    if not (heads and kv and head_dim):
        raise AmbiguousPartitionError("the fused qkv_proj needs num_attention_heads and head sizes from config.json")
    return Packed(0, (heads * head_dim, kv * head_dim, kv * head_dim), units=(head_dim,) * 3)


def gate_up_packed(config: ModelConfig | None) -> Packed:
    """``[gate | up]`` rows of a fused ``mlp.gate_up_proj``, each half split on its own."""
    size = config.get("intermediate_size") if config else None
    if not isinstance(size, int) or size <= 0:
        raise AmbiguousPartitionError("the fused gate_up_proj needs intermediate_size from config.json")
    return Packed(0, (size, size))


PHI3_PLAN = Plan(
    "phi3",
    (
        Rule(r"self_attn\.qkv_proj\.weight$", qkv_packed),
        Rule(r"mlp\.gate_up_proj\.weight$", gate_up_packed),
        *LLAMA_PLAN.rules,
    ),
)
