"""The Llama plan: the partition each tensor name gets, with head sizes from the config."""

from __future__ import annotations

import pytest
from fixtures.shapes import llama_config

from reshard.config import ModelConfig
from reshard.geometry import Replicate, ReplicatedHeads, Shard, Vocab
from reshard.plans.llama import LLAMA_PLAN

CONFIG = ModelConfig(llama_config(num_key_value_heads=2))  # hidden 64, 8 heads of 8, 2 KV heads, vocab 1001


@pytest.mark.parametrize(
    ("name", "partition"),
    [
        ("model.embed_tokens.weight", Vocab(0)),
        ("lm_head.weight", Vocab(0)),
        ("model.layers.3.self_attn.q_proj.weight", Shard(0, unit=8)),
        ("model.layers.3.self_attn.k_proj.bias", ReplicatedHeads(0, heads=2)),  # 2 KV heads
        ("model.layers.3.self_attn.o_proj.weight", Shard(1, unit=8)),
        ("model.layers.3.mlp.gate_proj.weight", Shard(0)),
        ("model.layers.3.mlp.down_proj.weight", Shard(1)),
        ("model.layers.3.input_layernorm.weight", Replicate()),
        ("model.layers.3.self_attn.q_norm.weight", Replicate()),
        ("model.norm.weight", Replicate()),
    ],
)
def test_llama_plan(name, partition):
    rule = LLAMA_PLAN.match(name)
    assert rule is not None and rule.resolve(CONFIG) == partition
