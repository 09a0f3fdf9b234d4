"""The Megatron plan: the partition each mcore and legacy name gets, with sizes from the args (no files)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest
from fixtures.megatron import TINY, megatron_args

from reshard.geometry import Grouped, Packed, Replicate, Shard, Vocab
from reshard.megatron.model import config_from_args
from reshard.plans import detect_family
from reshard.plans.megatron import MEGATRON_PLAN

# hidden 32, 8 heads of 4 in 2 query groups, SwiGLU ffn 48, vocab padded to 1024 at tp 8
ARGS = megatron_args(replace(TINY, multiple=128), 8)
CONFIG = config_from_args(ARGS, Path("model_optim_rng.pt"))


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("embedding.word_embeddings.weight", Vocab(0)),
        ("output_layer.weight", Vocab(0)),
        ("language_model.embedding.word_embeddings.weight", Vocab(0)),
        ("language_model.output_layer.weight", Vocab(0)),
        ("word_embeddings_for_head.weight", Vocab(0)),
        ("decoder.layers.3.self_attention.linear_qkv.weight", Grouped(0, 2)),
        ("decoder.layers.3.self_attention.linear_qkv.bias", Grouped(0, 2)),
        ("language_model.encoder.layers.0.self_attention.query_key_value.weight", Grouped(0, 2)),
        ("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight", Replicate()),
        ("decoder.layers.3.self_attention.linear_proj.weight", Shard(1, unit=4)),
        ("language_model.encoder.layers.0.self_attention.dense.weight", Shard(1, unit=4)),
        ("decoder.layers.3.self_attention.linear_proj.bias", Replicate()),
        ("decoder.layers.3.mlp.linear_fc1.weight", Packed(0, (48, 48))),
        ("language_model.encoder.layers.0.mlp.dense_h_to_4h.bias", Packed(0, (48, 48))),
        ("decoder.layers.3.mlp.linear_fc1.layer_norm_bias", Replicate()),
        ("decoder.layers.3.mlp.linear_fc2.weight", Shard(1)),
        ("language_model.encoder.layers.0.mlp.dense_4h_to_h.weight", Shard(1)),
        ("decoder.layers.3.mlp.linear_fc2.bias", Replicate()),
        ("decoder.layers.3.input_layernorm.weight", Replicate()),
        ("decoder.layers.3.pre_mlp_layernorm.weight", Replicate()),
        ("language_model.encoder.layers.0.input_norm.weight", Replicate()),
        ("language_model.encoder.layers.0.post_attention_norm.weight", Replicate()),
        ("language_model.encoder.final_norm.weight", Replicate()),
        ("decoder.final_layernorm.weight", Replicate()),
        ("decoder.layers.3.self_attention.linear_qkv._extra_state", Replicate()),
    ],
)
def test_rules(name: str, expected: object) -> None:
    rule = MEGATRON_PLAN.match(name)
    assert rule is not None and rule.resolve(CONFIG) == expected


def test_without_swiglu_fc1_is_a_plain_shard_and_mha_has_one_group_per_head() -> None:
    args = argparse.Namespace(**{**vars(ARGS), "swiglu": False, "group_query_attention": False})
    config = config_from_args(args, None)
    assert MEGATRON_PLAN.match("decoder.layers.0.mlp.linear_fc1.weight").resolve(config) == Shard(0)
    assert MEGATRON_PLAN.match("decoder.layers.0.self_attention.linear_qkv.weight").resolve(config) == Grouped(0, 8)


def test_family_detected_from_names_without_config() -> None:
    assert detect_family(None, ["decoder.layers.0.self_attention.linear_qkv.weight"]).name == "megatron"
    assert detect_family(None, ["language_model.encoder.layers.0.self_attention.query_key_value.weight"]).name == (
        "megatron"
    )
