"""Qwen2-VL / Qwen2.5-VL: the language model as the Llama family, plus the vision tower.

Vision blocks: ``attn.qkv`` is ``[Q | K | V]`` rows, each part split by whole vision heads;
``attn.proj`` is row-parallel (dim 1, by heads); the block MLP is column/row-parallel (``fc1``/``fc2``,
``gate/up/down_proj`` in 2.5-VL, ``linear_fc1/fc2`` in Qwen3.5's tower). Everything else under
``visual.`` (patch embedding, norms, merger MLP, position embeddings) is replicated. Names are matched
by suffix, so both ``visual.`` (saved files) and ``model.visual.`` (transformers 5 in memory) work.
"""

from __future__ import annotations

from reshard.config import ModelConfig
from reshard.geometry import Packed, Replicate, Shard
from reshard.plans.base import Plan, Rule
from reshard.plans.llama import LLAMA_PLAN

MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen2_vl_text", "qwen2_5_vl_text")
SIGNATURE = r"visual\.blocks\.\d+\.attn\.qkv\.weight$"


def vision_sizes(config: ModelConfig | None) -> tuple[int, int]:
    """``(embed_dim, head_dim)`` of the vision tower, from its ``vision_config`` (``(0, 1)`` when there is none).

    Qwen2-VL names the tower's width ``embed_dim`` (its ``hidden_size`` is the language model's), Qwen2.5-VL
    and Qwen3.5 name it ``hidden_size``.
    """
    vision = config.for_tensor("visual.") if config is not None else None
    if vision is None or not vision.scope.endswith("vision_config"):
        return 0, 1
    embed = vision.get("embed_dim") or vision.get("hidden_size") or 0
    heads = vision.get("num_heads") or 0
    return int(embed), int(embed // heads) if embed and heads else 1


def vision_qkv(config: ModelConfig | None) -> Packed | Shard:
    """``[Q | K | V]`` of the vision attention, each part split in whole heads."""
    embed, head_dim = vision_sizes(config)
    if not embed:
        return Shard(0, unit=head_dim)
    return Packed(0, (embed, embed, embed), units=(head_dim,) * 3)


def vision_proj(config: ModelConfig | None) -> Shard:
    return Shard(1, unit=vision_sizes(config)[1])


VISION_RULES = (
    Rule(r"visual\.blocks\.\d+\.attn\.qkv\.(weight|bias)$", vision_qkv),
    Rule(r"visual\.blocks\.\d+\.attn\.proj\.weight$", vision_proj),
    Rule(r"visual\.blocks\.\d+\.mlp\.(fc1|linear_fc1|gate_proj|up_proj)\.(weight|bias)$", Shard(0)),
    Rule(r"visual\.blocks\.\d+\.mlp\.(fc2|linear_fc2|down_proj)\.weight$", Shard(1)),
    Rule(r"(^|\.)visual\.", Replicate()),  # patch embedding, norms, merger, biases of row-parallel layers
)

QWEN2_VL_PLAN = Plan("qwen2_vl", VISION_RULES + LLAMA_PLAN.rules)
