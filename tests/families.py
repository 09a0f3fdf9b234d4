"""Tiny random models of the families reshard has built-in plans for, made with the real transformers classes
and saved with ``save_pretrained`` (importable as ``families``).

Sizes let tp 1, 2, 4 and 8 split every head count (8 query heads; KV heads fewer, so tp 8 copies them) and
keep the vocab a multiple of 8, so transformers' ``torch.chunk`` and reshard's vocab split agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 256
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
MLA = dict(
    num_key_value_heads=8,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    first_k_dense_replace=1,
)
MLA_MOE = dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32)
MLA_MOE |= dict(n_group=1, topk_group=1)


def _qwen_vision(**extra: Any) -> dict[str, Any]:
    return dict(depth=1, hidden_size=32, num_heads=8, intermediate_size=64, out_hidden_size=64, **extra)


def _rope(section: list[int]) -> dict[str, Any]:
    return {"rope_type": "default", "mrope_section": section, "rope_theta": 10000.0}


# family -> (config class, config arguments, model class); composite configs nest their sub-configs.
SPECS: dict[str, tuple[str, dict[str, Any], str]] = {
    "deepseek_v2": ("DeepseekV2Config", TEXT | MLA | MLA_MOE | dict(q_lora_rank=None), "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", TEXT | MLA | MLA_MOE | dict(q_lora_rank=16), "DeepseekV3ForCausalLM"),
    "mixtral": ("MixtralConfig", TEXT | dict(num_local_experts=4, num_experts_per_tok=2), "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", TEXT | MOE | dict(shared_expert_intermediate_size=32), "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", TEXT | MOE | dict(head_dim=8), "Qwen3MoeForCausalLM"),
    "phi3": ("Phi3Config", TEXT | dict(num_key_value_heads=8), "Phi3ForCausalLM"),  # no KV copies in a fused qkv
    "gemma2": ("Gemma2Config", TEXT | dict(head_dim=8), "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", TEXT | dict(head_dim=8), "Gemma3ForCausalLM"),
    "glm4": ("Glm4Config", TEXT | dict(head_dim=8), "Glm4ForCausalLM"),
    "gemma3": (
        "Gemma3Config",
        dict(
            text_config=TEXT | dict(head_dim=8),
            vision_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=4,
                image_size=28,
                patch_size=14,
                vision_use_head=False,
            ),
            mm_tokens_per_image=4,
        ),
        "Gemma3ForConditionalGeneration",
    ),
    "qwen2_5_vl": (
        "Qwen2_5_VLConfig",
        dict(text_config=TEXT | dict(rope_parameters=_rope([2, 1, 1])), vision_config=_qwen_vision()),
        "Qwen2_5_VLForConditionalGeneration",
    ),
    "qwen3_5": (
        "Qwen3_5Config",
        dict(
            text_config=TEXT
            | dict(
                head_dim=8,
                layer_types=["linear_attention", "full_attention"],
                linear_num_key_heads=8,
                linear_num_value_heads=8,
                linear_key_head_dim=8,
                linear_value_head_dim=8,
            ),
            vision_config=_qwen_vision(num_position_embeddings=16),
        ),
        "Qwen3_5ForConditionalGeneration",
    ),
}


def build(family: str, path: Path, *, seed: int = 0):
    """A random tiny model of ``family`` saved at ``path``; returns it in eval mode."""
    import transformers

    config_class, arguments, model_class = SPECS[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**arguments, tie_word_embeddings=family.startswith("gemma"))
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for param in model.parameters():  # norms and biases start constant: a misplaced row must show
            if param.dim() == 1:
                param.copy_(torch.rand_like(param) + 0.5)
    model.save_pretrained(path)
    return model
