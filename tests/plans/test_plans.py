"""Plans: the Llama table, family detection, plan files, and inference for names no rule covers."""

from __future__ import annotations

import pytest

from reshard.config import ModelConfig
from reshard.errors import AmbiguousPartitionError, ReshardError
from reshard.partition import Replicate, ReplicatedHeads, Shard, Vocab
from reshard.plans import detect_family, infer_partition, load_plan_file, select_plan
from reshard.plans.llama import LLAMA_PLAN

CONFIG = ModelConfig(
    {
        "model_type": "llama",
        "vocab_size": 1001,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
    }
)


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


def test_family_from_model_type_then_names():
    assert detect_family(CONFIG, []).name == "llama"
    assert detect_family(None, ["model.layers.0.self_attn.q_proj.weight"]).name == "llama"
    assert detect_family(None, ["transformer.h.0.attn.c_attn.weight"]) is None


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_plan_file_rules_come_first(tmp_path, suffix):
    path = tmp_path / f"plan{suffix}"
    if suffix == ".toml":
        path.write_text('extends = "llama"\n[[rules]]\npattern = "lm_head"\nkind = "replicate"\n')
    else:
        path.write_text('{"extends": "llama", "rules": [{"pattern": "lm_head", "kind": "replicate"}]}')
    plan = select_plan(None, [], plan_file=path)
    assert plan.match("lm_head.weight").resolve(None) == Replicate()
    assert plan.match("model.embed_tokens.weight").resolve(None) == Vocab(0)


def test_bad_plan_file_names_the_rule(tmp_path):
    path = tmp_path / "plan.toml"
    path.write_text('[[rules]]\npattern = "x"\nkind = "colwise"\n')
    with pytest.raises(ReshardError, match=r"plan.toml: rule 1 .* is invalid: unknown partition kind 'colwise'"):
        load_plan_file(path)


def infer(shapes, *, equal, target_tp=1, vocab=1001):
    return infer_partition(shapes, CONFIG, vocab_size=vocab, target_tp=target_tp, replicas_equal=lambda: equal)


def test_inference_rules():
    assert infer([(5, 32)] * 2, equal=False)[0] == Shard(1)  # 32 + 32 = hidden_size
    assert infer([(64, 5)] * 2, equal=False)[0] == Shard(0)  # rows add up to intermediate_size
    assert infer([(504, 3)] * 2, equal=False)[0] == Vocab(0)  # 1008 rows: the vocab padded
    assert infer([(64,)] * 2, equal=True)[0] == Replicate()
    assert infer([(1008, 64)], equal=True)[0] == Vocab(0)  # a full padded table
    assert infer([(7, 5)], equal=True)[0] == Replicate()  # tp 1 -> 1: kept whole
    partition, reason = infer([(66, 64), (62, 64)], equal=False)
    assert partition == Shard(0) and "uneven" in reason


@pytest.mark.parametrize(
    ("shapes", "equal", "target_tp", "message"),
    [
        ([(3, 5)] * 2, False, 1, "no dim of [3, 5] adds up to a config size"),
        ([(7, 5)], True, 2, "a full tensor of shape [7, 5] with no rule cannot be split"),
        ([(3, 5), (4, 6)], False, 1, "differ in more than one dim"),
        ([(64, 32)] * 2, False, 1, "config sizes along several dims"),
    ],
)
def test_inference_refuses_to_guess(shapes, equal, target_tp, message):
    with pytest.raises(AmbiguousPartitionError, match=message.replace("[", r"\[").replace("]", r"\]")):
        infer(shapes, equal=equal, target_tp=target_tp)
