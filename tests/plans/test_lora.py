"""LoRA tensors take their partition from their base layer: names, the rule table, and peft on hf-ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import load_folder
from safetensors.torch import save_file

from reshard import ConvertOptions, convert
from reshard.config import ModelConfig
from reshard.errors import AmbiguousPartitionError
from reshard.partition import Packed, Replicate, Shard, Vocab
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
        ("m.layers.0.self_attn.q_proj.lora_A.default.weight", LoraName("m.layers.0.self_attn.q_proj", "A")),
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
    ],
)
def test_lora_follows_its_base(base, lora: LoraName, expected) -> None:
    assert lora_partition(base, lora) == expected


@pytest.mark.parametrize(
    ("base", "lora", "match"),
    [
        (QKV, LoraName("x", "B", 3), "3 packed parts"),
        (Shard(0), LoraName("x", "B", 1), "matrix_B.1"),
        (Vocab(0), LoraName("x", "A"), "vocab"),
    ],
)
def test_lora_without_a_rule_is_an_error(base, lora: LoraName, match: str) -> None:
    with pytest.raises(AmbiguousPartitionError, match=match):
        lora_partition(base, lora)


LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 8,
}


def test_plan_derives_peft_partitions_from_llama_rules() -> None:
    plan = select_plan(ModelConfig(LLAMA), [])
    p = "base_model.model.model.layers.0."
    resolve = {
        n: plan.match(p + n).resolve(ModelConfig(LLAMA))
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


# name -> (shape, how the test splits it: "rep", "col" (dim 0), "row" (dim 1))
def peft_llama() -> dict[str, tuple[tuple[int, ...], str]]:
    h, i, v, r = 32, 64, 1000, 4
    t = {
        "base_model.model.model.embed_tokens.weight": ((v, h), "col"),
        "base_model.model.lm_head.weight": ((v, h), "col"),
        "base_model.model.model.norm.weight": ((h,), "rep"),
    }
    p = "base_model.model.model.layers.0."
    t |= {p + "input_layernorm.weight": ((h,), "rep"), p + "post_attention_layernorm.weight": ((h,), "rep")}
    for name, (out, inp, kind) in {
        "self_attn.q_proj": (h, h, "col"),
        "self_attn.k_proj": (h, h, "col"),
        "self_attn.v_proj": (h, h, "col"),
        "self_attn.o_proj": (h, h, "row"),
        "mlp.gate_proj": (i, h, "col"),
        "mlp.up_proj": (i, h, "col"),
        "mlp.down_proj": (h, i, "row"),
    }.items():
        t[p + name + ".base_layer.weight"] = ((out, inp), kind)
        t[p + name + ".lora_A.default.weight"] = ((r, inp), "row" if kind == "row" else "rep")
        t[p + name + ".lora_B.default.weight"] = ((out, r), "col" if kind == "col" else "rep")
    return t


def split(full: torch.Tensor, kind: str, tp: int, rank: int) -> torch.Tensor:
    if kind == "rep":
        return full
    return full.chunk(tp, 0 if kind == "col" else 1)[rank]


@pytest.fixture
def peft_full(tmp_path: Path):
    tensors = {}
    for n, (name, (shape, _)) in enumerate(peft_llama().items()):
        numel = torch.Size(shape).numel()
        values = torch.arange(numel, dtype=torch.float32)
        # LoRA factors are small integers, so every product in a merge is exact in float32
        values = (values + n) % 7 - 3 if ".lora_" in name else values + 10_000 * n
        tensors[name] = values.reshape(shape)
    folder = tmp_path / "full"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder, tensors


@pytest.mark.parametrize("tp", [2, 4])
def test_peft_lora_on_hf_ranks_round_trips(peft_full, tmp_path: Path, tp: int) -> None:
    folder, full = peft_full
    kinds = peft_llama()
    ranks = tmp_path / f"tp{tp}"
    convert(folder, ranks, ConvertOptions(tp=tp, layout="hf-ranks", progress=False))
    for rank in range(tp):
        state = load_folder(ranks / f"rank_{rank:02d}")
        assert set(state) == set(full)
        for name, tensor in state.items():
            assert torch.equal(tensor, split(full[name], kinds[name][1], tp, rank)), (name, rank)
    other = 4 if tp == 2 else 2
    convert(ranks, tmp_path / "other", ConvertOptions(tp=other, layout="hf-ranks", progress=False))
    convert(tmp_path / "other", tmp_path / "back", ConvertOptions(tp=1, layout="hf", progress=False))
    back = load_folder(tmp_path / "back")
    assert back.keys() == full.keys()
    assert all(torch.equal(back[n], full[n]) for n in full)


def test_peft_merge_writes_plain_weights(peft_full, tmp_path: Path) -> None:
    folder, full = peft_full
    convert(folder, tmp_path / "tp2", ConvertOptions(tp=2, layout="hf-ranks", progress=False))
    options = ConvertOptions(tp=1, layout="hf", merge_lora=True, lora_alpha=8.0, progress=False)
    convert(tmp_path / "tp2", tmp_path / "merged", options)
    merged = load_folder(tmp_path / "merged")
    assert not any("lora_" in n or "base_layer" in n for n in merged)
    p = "base_model.model.model.layers.0.self_attn.q_proj."
    a, b = full[p + "lora_A.default.weight"], full[p + "lora_B.default.weight"]
    want = full[p + "base_layer.weight"] + 8.0 / 4 * (b @ a)
    assert torch.equal(merged[p + "weight"], want)


def test_merge_without_base_weight_is_refused(tmp_path: Path, cli) -> None:
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA))
    p = "base_model.model.model.layers.0.self_attn.q_proj."
    adapter = {p + "lora_A.weight": torch.ones(4, 32), p + "lora_B.weight": torch.ones(32, 4)}
    save_file(adapter, folder / "model.safetensors")
    result = cli("convert", folder, "--tp", 1, "--merge-lora", "-o", tmp_path / "out")
    assert result.exit_code == 2
    assert "without its base weight" in result.stderr and p + "lora_" in result.stderr
    assert not (tmp_path / "out").exists()


def test_family_is_found_from_peft_names_without_a_config() -> None:
    names = ["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
    plan = select_plan(None, names)
    assert plan.name == "llama"
    assert plan.match("base_model.model.model.layers.0.self_attn.o_proj.lora_A.default.weight").resolve(None) == Shard(
        1
    )


def test_merge_with_unpaired_parts_is_refused(peft_full, tmp_path: Path, cli) -> None:
    folder, full = peft_full
    p = "base_model.model.model.layers.0.self_attn.q_proj."
    state = {n: t for n, t in full.items() if n != p + "lora_B.default.weight"}
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps(LLAMA))
    save_file(state, broken / "model.safetensors")
    result = cli("convert", broken, "--tp", 2, "--merge-lora", "-o", tmp_path / "out")
    assert result.exit_code == 2
    assert "1 A and 0 B tensors do not pair up" in result.stderr and p.rstrip(".") in result.stderr
    assert not (tmp_path / "out").exists()
