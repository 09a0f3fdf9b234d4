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
