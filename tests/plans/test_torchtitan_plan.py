"""torchtitan's names get torchtitan's TP plan, even beside a transformers config.json (which describes the model
they map to), and every name of every torchtitan version has a rule."""

from __future__ import annotations

import pytest
from fixtures.shapes import llama_config

from reshard.config import ModelConfig
from reshard.geometry import Replicate, Shard, Vocab
from reshard.plans import detect_family, select_plan

NAMES = [
    "tok_embeddings.weight",
    "layers.0.attention.wq.weight",
    "layers.0.attention.qkv_linear.wk.weight",
    "layers.0.attention.qkv_linear.wqkv.weight",
    "layers.0.attention.wo.weight",
    "layers.0.feed_forward.w1.weight",
    "layers.0.feed_forward.w3.weight",
    "layers.0.feed_forward.w2.weight",
    "layers.0.attention_norm.weight",
    "layers.0.ffn_norm.weight",
    "norm.weight",
    "output.weight",
    "lm_head.weight",
    "freqs_cis",
]


@pytest.mark.parametrize("config", [None, ModelConfig(llama_config())], ids=["no-config", "llama-config-json"])
def test_torchtitan_names_get_torchtitan_s_plan(config) -> None:
    assert detect_family(config, NAMES[:2]).name == "torchtitan"
    assert detect_family(config, ["model.layers.0.self_attn.q_proj.weight"]).name == "llama"


def test_every_torchtitan_name_is_split_as_parallelize_llama_splits_it() -> None:
    config = ModelConfig(llama_config())  # head_dim 8
    plan = select_plan(None, NAMES)
    partitions = {name: plan.match(name).resolve(config) for name in NAMES}
    assert (
        partitions["tok_embeddings.weight"] == Vocab(0) == partitions["lm_head.weight"] == partitions["output.weight"]
    )
    assert partitions["layers.0.attention.wq.weight"] == Shard(0, unit=8)
    assert partitions["layers.0.attention.qkv_linear.wk.weight"] == Shard(0, unit=8)
    assert partitions["layers.0.attention.qkv_linear.wqkv.weight"] == Shard(0)
    assert partitions["layers.0.attention.wo.weight"] == Shard(1, unit=8)
    assert partitions["layers.0.feed_forward.w1.weight"] == Shard(0) == partitions["layers.0.feed_forward.w3.weight"]
    assert partitions["layers.0.feed_forward.w2.weight"] == Shard(1)
    assert {partitions[n] for n in NAMES[8:11] + ["freqs_cis"]} == {Replicate()}
