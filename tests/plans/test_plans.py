"""``reshard.plans``: which family's plan a checkpoint gets, from its config or from its tensor names."""

from __future__ import annotations

from fixtures.shapes import llama_config

from reshard.config import ModelConfig
from reshard.plans import detect_family

CONFIG = ModelConfig(llama_config(num_key_value_heads=2))  # hidden 64, 8 heads of 8, 2 KV heads, vocab 1001


def test_family_from_model_type_then_names():
    assert detect_family(CONFIG, []).name == "llama"
    assert detect_family(None, ["model.layers.0.self_attn.q_proj.weight"]).name == "llama"
    assert detect_family(None, ["transformer.h.0.attn.c_attn.weight"]) is None
