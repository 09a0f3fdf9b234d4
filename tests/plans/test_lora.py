"""``reshard.plans.lora``: LoRA tensors take their partition from their base layer: names, the rule table, and
peft on hf-ranks (merging is in ``tests/engine/test_lora_merge.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixtures.hf import load_folder, load_rank, peft_llama_state, write_hf
from fixtures.shapes import PEFT_LLAMA, peft_llama
from fixtures.tp import rank_piece

from reshard import ConvertOptions, convert
from reshard.config import ModelConfig
from reshard.errors import AmbiguousPartitionError
from reshard.geometry import Grouped, Packed, Replicate, Shard, Vocab
from reshard.plans import select_plan
from reshard.plans.lora import LoraName, lora_partition, parse_lora_name


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "t.layers.0.attention.query_key_value.original.weight",
            LoraName("t.layers.0.attention.query_key_value", "base"),
        ),
        ("a.dense.original.bias", LoraName("a.dense", "base", None, "bias")),
        ("a.query_key_value.matrix_A.2", LoraName("a.query_key_value", "A", 2)),
        ("a.key_value.matrix_B.1", LoraName("a.key_value", "B", 1)),
        (
            "m.layers.0.self_attn.q_proj.lora_A.default.weight",
            LoraName("m.layers.0.self_attn.q_proj", "A", adapter="default"),
        ),
        ("m.embed_tokens.lora_embedding_A.x", LoraName("m.embed_tokens", "A", adapter="x", embedding=True)),
        ("m.embed_tokens.lora_embedding_B", LoraName("m.embed_tokens", "B", embedding=True)),
        ("m.o_proj.lora_magnitude_vector.default.weight", LoraName("m.o_proj", "magnitude", adapter="default")),
        ("m.o_proj.lora_magnitude_vector", LoraName("m.o_proj", "magnitude")),
        ("m.layers.0.self_attn.q_proj.lora_B.weight", LoraName("m.layers.0.self_attn.q_proj", "B")),
        ("m.layers.0.self_attn.q_proj.base_layer.weight", LoraName("m.layers.0.self_attn.q_proj", "base")),
        ("m.layers.0.self_attn.q_proj.weight", None),
        ("transformer.layers.0.attention.dense.weight", None),
    ],
)
def test_parse_lora_name(name: str, expected: LoraName | None) -> None:
    assert parse_lora_name(name) == expected


QKV = Packed(0, (32, 16, 16), (2, 2, 2))


@pytest.mark.parametrize(
    ("base", "lora", "expected"),
    [
        (Shard(0, 8), LoraName("x", "A"), Replicate()),
        (Shard(0, 8), LoraName("x", "B"), Shard(0, 8)),
        (Shard(0), LoraName("x", "B", 0), Shard(0)),
        (Shard(1, 8), LoraName("x", "A", 0), Shard(1, 8)),
        (Shard(1, 8), LoraName("x", "B", 0), Replicate()),
        (QKV, LoraName("x", "A", 1), Replicate()),
        (QKV, LoraName("x", "B", 0), Shard(0, 2)),
        (QKV, LoraName("x", "B", 2), Shard(0, 2)),
        (QKV, LoraName("x", "B"), QKV),  # one peft B over a fused layer: packed like the base's rows
        (Replicate(), LoraName("x", "B", 0), Replicate()),
        (QKV, LoraName("x", "base"), QKV),
        (Vocab(0), LoraName("x", "A"), Replicate()),  # a LoRA lm_head: A [r, hidden], B [vocab, r]
        (Vocab(0), LoraName("x", "B"), Vocab(0)),
        (Vocab(0), LoraName("x", "A", embedding=True), Vocab(1)),  # PEFT's embedding A [r, vocab]
        (Vocab(0), LoraName("x", "B", embedding=True), Replicate()),
        (Shard(1, 8), LoraName("x", "B", embedding=True), Shard(0, 8)),
        (Shard(0, 8), LoraName("x", "magnitude"), Shard(0, 8)),  # DoRA's magnitude: one per output row
        (Shard(1, 8), LoraName("x", "magnitude"), Replicate()),
        (Grouped(0, 2), LoraName("x", "A"), Replicate()),  # peft on Megatron's fused, grouped linear_qkv
        (Grouped(0, 2), LoraName("x", "B"), Grouped(0, 2)),
    ],
)
def test_lora_follows_its_base(base, lora: LoraName, expected) -> None:
    assert lora_partition(base, lora) == expected


@pytest.mark.parametrize(
    ("base", "lora", "match"),
    [
        (QKV, LoraName("x", "B", 3), "3 packed parts"),
        (Shard(0), LoraName("x", "B", 1), "matrix_B.1"),
        (Vocab(1), LoraName("x", "A"), "vocab"),
    ],
)
def test_lora_without_a_rule_is_an_error(base, lora: LoraName, match: str) -> None:
    with pytest.raises(AmbiguousPartitionError, match=match):
        lora_partition(base, lora)


def test_plan_derives_peft_partitions_from_llama_rules() -> None:
    plan = select_plan(ModelConfig(PEFT_LLAMA), [])
    p = "base_model.model.model.layers.0."
    resolve = {
        n: plan.match(p + n).resolve(ModelConfig(PEFT_LLAMA))
        for n in [
            "self_attn.q_proj.base_layer.weight",
            "self_attn.q_proj.lora_A.default.weight",
            "self_attn.q_proj.lora_B.default.weight",
            "self_attn.o_proj.lora_A.default.weight",
            "self_attn.o_proj.lora_B.default.weight",
            "mlp.down_proj.lora_A.default.weight",
        ]
    }
    assert resolve == {
        "self_attn.q_proj.base_layer.weight": Shard(0, 8),
        "self_attn.q_proj.lora_A.default.weight": Replicate(),
        "self_attn.q_proj.lora_B.default.weight": Shard(0, 8),
        "self_attn.o_proj.lora_A.default.weight": Shard(1, 8),
        "self_attn.o_proj.lora_B.default.weight": Replicate(),
        "mlp.down_proj.lora_A.default.weight": Shard(1),
    }


@pytest.fixture
def peft_full(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A peft LoRA-wrapped Llama saved as one HF folder: the folder and its tensors."""
    state = peft_llama_state(PEFT_LLAMA)
    return write_hf(tmp_path / "full", PEFT_LLAMA, state), state


@pytest.mark.parametrize("tp", [2, 4])
def test_peft_lora_on_hf_ranks_round_trips(peft_full, tmp_path: Path, tp: int) -> None:
    folder, full = peft_full
    kinds = peft_llama(PEFT_LLAMA)
    ranks = tmp_path / f"tp{tp}"
    convert(folder, ranks, ConvertOptions(tp=tp, layout="hf-ranks", progress=False))
    for rank in range(tp):
        state = load_rank(ranks, rank)
        assert set(state) == set(full)
        for name, tensor in state.items():
            assert torch.equal(tensor, rank_piece(full[name], kinds[name][1], tp, rank)), (name, rank)
    other = 4 if tp == 2 else 2
    convert(ranks, tmp_path / "other", ConvertOptions(tp=other, layout="hf-ranks", progress=False))
    convert(tmp_path / "other", tmp_path / "back", ConvertOptions(tp=1, layout="hf", progress=False))
    back = load_folder(tmp_path / "back")
    assert back.keys() == full.keys()
    assert all(torch.equal(back[n], full[n]) for n in full)


def test_family_is_found_from_peft_names_without_a_config() -> None:
    names = ["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
    plan = select_plan(None, names)
    assert plan.name == "llama"
    assert plan.match("base_model.model.model.layers.0.self_attn.o_proj.lora_A.default.weight").resolve(None) == Shard(
        1
    )
