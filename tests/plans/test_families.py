"""The built-in family plans on real transformers models: detected from their config, taken through tp 1 -> 2 ->
4 -> 8 -> 1 bit-exact, and, where reshard splits a layer other than transformers does, each rank computing its
own heads (the layout is runnable, not only reversible)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from fixtures.families import SPECS, VOCAB, build
from fixtures.hf import load_folder
from fixtures.models import logits
from safetensors.torch import load_file

PLANS = {
    "deepseek_v2": "deepseek",
    "deepseek_v3": "deepseek",
    "mixtral": "moe",
    "qwen2_moe": "moe",
    "qwen3_moe": "moe",
    "phi3": "phi3",
    "gemma2": "gemma",
    "gemma3_text": "gemma",
    "gemma3": "gemma",
    "glm4": "glm4",
    "qwen2_5_vl": "qwen2_vl",
    "qwen3_5": "qwen3_5",
}


def rank_state(folder, rank):
    return load_file(folder / f"rank_{rank:02d}" / "model.safetensors")


@pytest.mark.parametrize("family", sorted(SPECS))
def test_round_trip_1_2_4_8_1_is_bit_exact(cli, tmp_path, family):
    import transformers

    model = build(family, tmp_path / "tp1")
    original = load_folder(tmp_path / "tp1")
    inspected = json.loads(cli("inspect", tmp_path / "tp1", "--json").stdout)
    assert inspected["plan"] == PLANS[family] and inspected["problems"] == []
    previous = tmp_path / "tp1"
    for tp in (2, 4, 8, 1):
        out = tmp_path / f"to{tp}"
        result = cli("convert", previous, "--tp", tp, "-o", out, "-q")
        assert result.exit_code == 0, result.output
        previous = out
    back = load_folder(previous)
    assert back.keys() == original.keys()
    assert [k for k in original if not torch.equal(back[k], original[k])] == []
    reloaded = getattr(transformers, type(model).__name__).from_pretrained(previous).eval()
    assert torch.equal(logits(reloaded, VOCAB), logits(model, VOCAB))


def test_deepseek_mla_splits_heads_and_keeps_the_latent_projections_whole(cli, tmp_path):
    build("deepseek_v3", tmp_path / "full")
    full = load_folder(tmp_path / "full")
    assert cli("convert", tmp_path / "full", "--tp", 4, "-o", tmp_path / "tp4", "-q").exit_code == 0
    attn = "model.layers.1.self_attn."
    for rank in range(4):
        state = rank_state(tmp_path / "tp4", rank)
        for name in ("q_a_proj.weight", "kv_a_proj_with_mqa.weight", "q_a_layernorm.weight", "kv_a_layernorm.weight"):
            assert torch.equal(state[attn + name], full[attn + name])
        # 8 heads: q_b_proj rows of qk_nope + qk_rope = 16 per head, kv_b_proj rows of qk_nope + v = 16 per head
        assert torch.equal(state[attn + "q_b_proj.weight"], full[attn + "q_b_proj.weight"][32 * rank : 32 * rank + 32])
        assert torch.equal(
            state[attn + "kv_b_proj.weight"], full[attn + "kv_b_proj.weight"][32 * rank : 32 * rank + 32]
        )
        assert torch.equal(state[attn + "o_proj.weight"], full[attn + "o_proj.weight"][:, 16 * rank : 16 * rank + 16])
        expert = "model.layers.1.mlp.experts.2."
        assert torch.equal(
            state[expert + "gate_proj.weight"], full[expert + "gate_proj.weight"][8 * rank : 8 * rank + 8]
        )
        assert torch.equal(
            state[expert + "down_proj.weight"], full[expert + "down_proj.weight"][:, 8 * rank : 8 * rank + 8]
        )
        for name in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"):
            assert torch.equal(state[name], full[name])


def test_fused_projections_are_split_part_by_part(cli, tmp_path):
    """Phi-3's qkv_proj: rank r holds its q heads, then its k and v heads; gate_up_proj its gate, then its up rows."""
    build("phi3", tmp_path / "full")
    full = load_folder(tmp_path / "full")
    assert cli("convert", tmp_path / "full", "--tp", 4, "-o", tmp_path / "tp4", "-q").exit_code == 0
    qkv, gate_up = full["model.layers.0.self_attn.qkv_proj.weight"], full["model.layers.0.mlp.gate_up_proj.weight"]
    q, k, v = qkv.split([64, 64, 64])
    gate, up = gate_up.split([64, 64])
    for rank in range(4):
        state = rank_state(tmp_path / "tp4", rank)
        rows = slice(16 * rank, 16 * rank + 16)
        assert torch.equal(state["model.layers.0.self_attn.qkv_proj.weight"], torch.cat([q[rows], k[rows], v[rows]]))
        assert torch.equal(state["model.layers.0.mlp.gate_up_proj.weight"], torch.cat([gate[rows], up[rows]]))


def _sum_of_ranks(module_class, config, layer, out, prefix, x, tp, *, extra=None, **fewer):
    """Rank modules with 1/tp of the heads, fed the rank files, summed (the row-parallel all-reduce)."""
    local = copy.deepcopy(config)
    for key, value in fewer.items():
        setattr(local, key, value)
    total = 0
    for rank in range(tp):
        module = module_class(local, layer).eval()
        state = {k.removeprefix(prefix): v for k, v in rank_state(out, rank).items() if k.startswith(prefix)}
        module.load_state_dict(state)
        total = total + module(x, **(extra or {}))[0]
    return total


@pytest.mark.parametrize("family", ["deepseek_v3", "phi3"])
def test_each_rank_computes_its_own_heads(cli, tmp_path, family):
    """Where transformers keeps a layer whole (DeepSeek-V3 attention) or splits it as storage (Phi-3's fused
    qkv), reshard's rank slices still run: 1/tp of the heads per rank, outputs summed, equal the layer."""
    module = __import__(f"transformers.models.{family}.modeling_{family}", fromlist=["_"])
    prefix_cls = {"deepseek_v3": "DeepseekV3", "phi3": "Phi3"}[family]
    model = build(family, tmp_path / "full")
    assert cli("convert", tmp_path / "full", "--tp", 4, "-o", tmp_path / "tp4", "-q").exit_code == 0
    config = model.config
    x = torch.randn(2, 9, config.hidden_size, generator=torch.Generator().manual_seed(3))
    rotary = getattr(module, f"{prefix_cls}RotaryEmbedding")(config)
    position = rotary(x, torch.arange(9)[None].expand(2, -1))
    fewer = {"num_attention_heads": 2, "num_key_value_heads": config.num_key_value_heads // 4}
    if family == "phi3":
        fewer["head_dim"] = 8
    with torch.no_grad():
        attention = model.model.layers[1].self_attn
        expected = attention(x, position_embeddings=position, attention_mask=None)[0]
        total = _sum_of_ranks(
            getattr(module, f"{prefix_cls}Attention"),
            config,
            1,
            tmp_path / "tp4",
            "model.layers.1.self_attn.",
            x,
            4,
            extra={"position_embeddings": position, "attention_mask": None},
            **fewer,
        )
    torch.testing.assert_close(total, expected, rtol=0, atol=1e-5)


def test_composite_sizes_come_from_each_sub_config(cli, tmp_path):
    """Qwen3.5 with its vision tower: the language model split by text_config heads, the tower by vision_config's."""
    build("qwen3_5", tmp_path / "full")
    full = load_folder(tmp_path / "full")
    assert cli("convert", tmp_path / "full", "--tp", 8, "-o", tmp_path / "tp8", "-q").exit_code == 0
    manifest = json.loads((tmp_path / "tp8" / "reshard.json").read_text())["tensors"]
    qkv = manifest["model.visual.blocks.0.attn.qkv.weight"]["partition"]
    assert qkv == {"kind": "packed", "dim": 0, "parts": [32, 32, 32], "units": [4, 4, 4]}  # 8 vision heads of 4
    assert manifest["model.language_model.layers.1.self_attn.k_proj.weight"]["partition"]["kind"] == "replicated_heads"
    q, k, v = full["model.visual.blocks.0.attn.qkv.weight"].split([32, 32, 32])
    for rank in range(8):
        state = rank_state(tmp_path / "tp8", rank)
        rows = slice(4 * rank, 4 * rank + 4)
        assert torch.equal(state["model.visual.blocks.0.attn.qkv.weight"], torch.cat([q[rows], k[rows], v[rows]]))
