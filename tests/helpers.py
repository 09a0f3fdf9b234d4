"""Builders of tiny real checkpoints for the tests (importable as ``helpers``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=64)


def tiny_llama(
    path: Path, *, vocab: int = 1001, tie: bool = False, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides
):
    """A random tiny ``LlamaForCausalLM`` (8 heads of 8), saved with ``save_pretrained``; returns it in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    heads = dict(num_attention_heads=8, num_key_value_heads=8)
    config = LlamaConfig(vocab_size=vocab, tie_word_embeddings=tie, **(TINY | heads | overrides))
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.save_pretrained(path)
    return model


def tiny_qwen3(path: Path, *, vocab: int = 1001, seed: int = 0, **overrides):
    """A random tiny ``Qwen3ForCausalLM`` with grouped KV heads (16 query heads, 8 KV heads of 8)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    sizes = TINY | {"num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 8} | overrides
    config = Qwen3Config(vocab_size=vocab, tie_word_embeddings=False, **sizes)
    model = Qwen3ForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def load_folder(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder (single or sharded safetensors)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(folder / name))
    return state


def logits(model, vocab: int, *, seed: int = 1) -> torch.Tensor:
    """The model's logits on a fixed random batch."""
    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


LINEAR = dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8)


def tiny_qwen3_5(path: Path, *, vocab: int = 1001, seed: int = 0, **overrides):
    """A random tiny ``Qwen3_5ForCausalLM``: one Gated DeltaNet layer, one gated full-attention layer."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    heads = dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16)
    config = Qwen3_5TextConfig(
        vocab_size=vocab,
        layer_types=["linear_attention", "full_attention"],
        tie_word_embeddings=False,
        **(TINY | LINEAR | heads | overrides),
    )
    model = Qwen3_5ForCausalLM(config).eval()
    _randomize_small_params(model)
    model.save_pretrained(path)
    return model


def tiny_qwen3_next(path: Path, *, vocab: int = 1001, seed: int = 0, **overrides):
    """A random tiny ``Qwen3NextForCausalLM`` (MoE with 4 experts and a shared expert), layers as Qwen3.5's."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    config = Qwen3NextConfig(
        vocab_size=vocab,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention"],
        tie_word_embeddings=False,
        **(TINY | LINEAR | overrides),
    )
    model = Qwen3NextForCausalLM(config).eval()
    _randomize_small_params(model)
    model.save_pretrained(path)
    return model


def tiny_qwen2_vl(path: Path, *, vocab: int = 1001, seed: int = 0):
    """A random tiny ``Qwen2VLForConditionalGeneration`` (one vision block of 4 heads, two text layers)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=vocab,
            num_attention_heads=4,
            num_key_value_heads=4,
            tie_word_embeddings=False,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
            **TINY,
        ),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, spatial_merge_size=2),
        tie_word_embeddings=False,
    )
    model = Qwen2VLForConditionalGeneration(config).eval()
    model.save_pretrained(path)
    return model


def _randomize_small_params(model) -> None:
    """Norms, ``A_log`` and ``dt_bias`` start as constants: make them random so a misplaced row shows."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.copy_(torch.rand_like(param) + 0.5)
