"""``reshard.plans.sat``: which rule each CogAgent tensor name gets, with part sizes from model_config.json."""

from __future__ import annotations

import pytest
from fixtures.sat import sat_config

from reshard.config import ModelConfig
from reshard.errors import AmbiguousPartitionError
from reshard.geometry import Packed, Replicate, Shard
from reshard.plans import detect_family, select_plan

L = "transformer.layers.3."
E = "mixins.eva.vit_model.transformer.layers.0."
CFG = ModelConfig(sat_config())  # hidden 32, 16 heads of 2, 8 KV groups; cross 32 = 16 x 2; EVA 16 = 8 x 2


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("transformer.word_embeddings.weight", Shard(0)),
        ("mixins.lm.lm_head.weight", Shard(0)),
        (L + "attention.query_key_value.weight", Packed(0, (32, 16, 16), (2, 2, 2))),
        (L + "attention.query_key_value.bias", Packed(0, (32, 16, 16), (2, 2, 2))),
        ("mixins.rotary.vision_query_key_value_list.3.weight", Packed(0, (32, 16, 16), (2, 2, 2))),
        (L + "attention.dense.weight", Shard(1, 2)),
        (L + "attention.dense.bias", Replicate()),
        ("mixins.rotary.vision_dense_list.3.weight", Shard(1, 2)),
        (L + "cross_attention.query.weight", Shard(0, 2)),
        (L + "cross_attention.key_value.weight", Packed(0, (32, 32), (2, 2))),
        (L + "cross_attention.dense.weight", Shard(1, 2)),
        (L + "cross_attention.dense.bias", Replicate()),
        (L + "mlp.dense_h_to_4h.weight", Shard(0)),
        (L + "mlp.dense_h_to_4h_gate.weight", Shard(0)),
        ("mixins.mlp.gate_proj.3.weight", Shard(0)),
        ("mixins.mlp.vision_gate_proj.3.weight", Shard(0)),
        ("mixins.mlp.vision_dense_h_to_4h_list.3.weight", Shard(0)),
        (L + "mlp.dense_4h_to_h.weight", Shard(1)),
        ("mixins.mlp.vision_dense_4h_to_h_list.3.weight", Shard(1)),
        (L + "mlp.dense_4h_to_h.bias", Replicate()),
        (L + "input_layernorm.weight", Replicate()),
        ("mixins.eva.vit_model.transformer.word_embeddings.weight", Replicate()),  # EVA vocab 1 < 1000
        (E + "attention.query_key_value.weight", Packed(0, (16, 16, 16), (2, 2, 2))),
        (E + "attention.dense.weight", Shard(1, 2)),
        (E + "mlp.dense_h_to_4h.bias", Shard(0)),
        ("mixins.eva.linear_proj.dense_h_to_4h.weight", Replicate()),  # CogAgent's GLU is a plain nn.Linear
        ("mixins.eva.linear_proj.gate_proj.weight", Replicate()),
        ("mixins.encoder.vit.model.blocks.0.attn.qkv.weight", Replicate()),
        (L + "attention.query_key_value.original.weight", Packed(0, (32, 16, 16), (2, 2, 2))),
        (L + "attention.query_key_value.matrix_B.1", Shard(0, 2)),
        (L + "cross_attention.key_value.matrix_A.1", Replicate()),
        (E + "attention.dense.matrix_A.0", Shard(1, 2)),
    ],
)
def test_sat_rules(name: str, expected) -> None:
    plan = select_plan(CFG, [L + "attention.query_key_value.weight"])
    assert plan.name == "sat"
    assert plan.match(name).resolve(CFG) == expected


def test_multi_head_qkv_has_three_equal_parts() -> None:
    cfg = ModelConfig(sat_config(multi_query_heads=0))
    plan = select_plan(cfg, [L + "attention.query_key_value.weight"])
    assert plan.match(L + "attention.query_key_value.weight").resolve(cfg) == Packed(0, (32, 32, 32), (2, 2, 2))


def test_small_vocab_embedding_is_replicated() -> None:
    cfg = ModelConfig(sat_config() | {"vocab_size": 999})
    plan = select_plan(cfg, [L + "attention.query_key_value.weight"])
    assert plan.match("transformer.word_embeddings.weight").resolve(cfg) == Replicate()


def test_sat_family_is_found_from_names_with_lora() -> None:
    family = detect_family(None, ["transformer.layers.0.attention.query_key_value.original.weight"])
    assert family is not None and family.name == "sat"


def test_packed_sizes_need_the_model_config() -> None:
    plan = select_plan(None, [L + "attention.query_key_value.weight"])
    with pytest.raises(AmbiguousPartitionError, match="model_config.json"):
        plan.match(L + "attention.query_key_value.weight").resolve(None)
    with pytest.raises(AmbiguousPartitionError, match="eva_args"):
        plan.match(E + "attention.query_key_value.weight").resolve(ModelConfig({"hidden_size": 32}))
