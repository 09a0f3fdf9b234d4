"""The Megatron plan and the Grouped partition, on shapes and small tensors (no files)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from reshard.errors import ShapeMismatchError
from reshard.layouts.base import SourceCheckpoint
from reshard.layouts.megatron_args import config_from_args
from reshard.layouts.megatron_writer import MegatronWriter
from reshard.partition import (
    Grouped,
    Packed,
    Replicate,
    Shard,
    Vocab,
    partition_from_dict,
    partition_to_dict,
    rank_shapes,
)
from reshard.plans import detect_family
from reshard.plans.megatron import MEGATRON_PLAN
from reshard.slicing import gather, split

ARGS = argparse.Namespace(
    hidden_size=32,
    num_attention_heads=8,
    group_query_attention=True,
    num_query_groups=2,
    kv_channels=4,
    ffn_hidden_size=48,
    swiglu=True,
    make_vocab_size_divisible_by=128,
    padded_vocab_size=1024,
    tensor_model_parallel_size=8,
    num_layers=2,
)
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


def test_config_from_args() -> None:
    assert CONFIG.model_type == "megatron" and CONFIG.vocab_size is None  # no true vocab in these args
    assert CONFIG.num_key_value_heads == 2 and CONFIG.head_dim == 4 and CONFIG.get("intermediate_size") == 48
    with_vocab = config_from_args(argparse.Namespace(**{**vars(ARGS), "vocab_size": 1000}), None)
    assert with_vocab.vocab_size == 1000


def test_family_detected_from_names_without_config() -> None:
    assert detect_family(None, ["decoder.layers.0.self_attention.linear_qkv.weight"]).name == "megatron"
    assert detect_family(None, ["language_model.encoder.layers.0.self_attention.query_key_value.weight"]).name == (
        "megatron"
    )


def test_grouped_splits_whole_groups_or_spreads_each_group() -> None:
    # 2 groups of 6 rows (4 query heads + k + v, head dim 1): rows 0-5 group 0, rows 6-11 group 1
    full = torch.arange(12)
    assert [t.tolist() for t in split(full, Grouped(0, 2), 2)] == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    # tp 4 > 2 groups: each group spread over 2 ranks, as Megatron core stores it
    assert [t.tolist() for t in split(full, Grouped(0, 2), 4)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert torch.equal(gather(split(full, Grouped(0, 2), 4), Grouped(0, 2)), full)


@pytest.mark.parametrize(("groups", "tp"), [(2, 3), (4, 6), (6, 4)])
def test_grouped_refuses_tp_that_mixes_groups(groups: int, tp: int) -> None:
    with pytest.raises(ShapeMismatchError, match=f"holds {groups} groups: tp={tp} neither divides"):
        rank_shapes(Grouped(0, groups), (groups * 12, 8), tp)


def test_grouped_round_trips_through_its_dict_form() -> None:
    assert partition_to_dict(Grouped(0, 2)) == {"kind": "grouped", "dim": 0, "groups": 2}
    assert partition_from_dict({"kind": "grouped", "dim": 0, "groups": 2}) == Grouped(0, 2)


def test_swiglu_fc1_re_pairs_gate_and_up() -> None:
    gate, up = torch.arange(8), torch.arange(100, 108)
    tp8 = [torch.cat([gate[r : r + 1], up[r : r + 1]]) for r in range(8)]  # Megatron: [gate_r; up_r]
    full = gather(tp8, Packed(0, (8, 8)))
    assert torch.equal(full, torch.cat([gate, up]))
    assert not torch.equal(torch.cat(tp8), full)  # plain concatenation would interleave gate and up
    tp4 = split(full, Packed(0, (8, 8)), 4)
    assert [t.tolist() for t in tp4] == [[2 * r, 2 * r + 1, 100 + 2 * r, 101 + 2 * r] for r in range(4)]


def test_pad_multiple_is_megatron_s() -> None:
    source = SourceCheckpoint(Path("x"), "megatron", [], meta={"megatron": True, "args": ARGS})
    assert MegatronWriter.pad_multiple(4, source, {}) == 512
    assert MegatronWriter.pad_multiple(1, source, {}) == 128
