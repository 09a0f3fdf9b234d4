"""The Qwen3.5, Qwen3-Next and Qwen2-VL plans: real transformers models split for TP 2 and 4 and back, bit-exact,
each rank holding (and computing) exactly its heads."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from fixtures.hf import load_folder, load_rank
from fixtures.models import logits, tiny_qwen2_vl, tiny_qwen3_5, tiny_qwen3_next
from fixtures.tp import rank_piece

BUILDERS = {"qwen3_5": tiny_qwen3_5, "qwen3_next": tiny_qwen3_next, "qwen2_vl": tiny_qwen2_vl}


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_round_trip_tp2_tp4_bit_exact_and_logits(cli, tmp_path, family):
    import transformers

    model = BUILDERS[family](tmp_path / "full")
    original = load_folder(tmp_path / "full")
    for tp in (2, 4):
        assert cli("convert", tmp_path / "full", "--tp", tp, "-o", tmp_path / f"tp{tp}", "-q").exit_code == 0
        manifest = json.loads((tmp_path / f"tp{tp}" / "reshard.json").read_text())
        assert manifest["tensors"], "the manifest records every tensor"
        assert cli("convert", tmp_path / f"tp{tp}", "--tp", 1, "-o", tmp_path / f"back{tp}", "-q").exit_code == 0
        back = load_folder(tmp_path / f"back{tp}")
        assert back.keys() == original.keys()
        assert all(torch.equal(back[k], original[k]) for k in original)
    cls = getattr(transformers, type(model).__name__)
    reloaded = cls.from_pretrained(tmp_path / "back4").eval()
    assert torch.equal(logits(reloaded, 1001), logits(model, 1001))


def independent_split(full, parts, tp):
    """Each of Q, K, V cut into tp contiguous pieces; rank r holds its piece of each, in order."""
    return [rank_piece(full, ("packed", parts), tp, r) for r in range(tp)]


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_gated_deltanet_slices_hold_each_ranks_heads(cli, tmp_path, family):
    BUILDERS[family](tmp_path / "full")
    full = load_folder(tmp_path / "full")
    assert cli("convert", tmp_path / "full", "--tp", 4, "-o", tmp_path / "tp4", "-q").exit_code == 0
    ranks = [load_rank(tmp_path / "tp4", r) for r in range(4)]
    key_dim, value_dim = 4 * 8, 8 * 8  # tiny models: 4 key heads, 8 value heads, heads of 8
    prefix = "model.layers.0.linear_attn."
    conv = full[prefix + "conv1d.weight"]
    assert conv.shape == (2 * key_dim + value_dim, 1, 4)
    for r, expected in enumerate(independent_split(conv, (key_dim, key_dim, value_dim), 4)):
        assert torch.equal(ranks[r][prefix + "conv1d.weight"], expected)
    if family == "qwen3_5":
        qkv = full[prefix + "in_proj_qkv.weight"]
        for r, expected in enumerate(independent_split(qkv, (key_dim, key_dim, value_dim), 4)):
            assert torch.equal(ranks[r][prefix + "in_proj_qkv.weight"], expected)
    else:  # one group per key head: [q(8) k(8) v(2*8) z(2*8)] rows; rank r holds key head r's group
        qkvz = full[prefix + "in_proj_qkvz.weight"].view(4, 48, -1)
        for r in range(4):
            assert torch.equal(ranks[r][prefix + "in_proj_qkvz.weight"], qkvz[r])
    for name in ("A_log", "dt_bias"):
        for r in range(4):
            assert torch.equal(ranks[r][prefix + name], full[prefix + name][2 * r : 2 * r + 2])
    out = full[prefix + "out_proj.weight"]
    for r in range(4):
        assert torch.equal(ranks[r][prefix + "out_proj.weight"], out[:, 16 * r : 16 * r + 16])
        assert torch.equal(ranks[r][prefix + "norm.weight"], full[prefix + "norm.weight"])


def test_qwen3_5_gated_query_split_by_whole_heads(cli, tmp_path):
    tiny_qwen3_5(tmp_path / "full")
    q = load_folder(tmp_path / "full")["model.layers.1.self_attn.q_proj.weight"]
    assert q.shape[0] == 4 * 2 * 16  # query and gate per head
    assert cli("convert", tmp_path / "full", "--tp", 2, "-o", tmp_path / "tp2", "-q").exit_code == 0
    for r in range(2):
        assert torch.equal(
            load_rank(tmp_path / "tp2", r)["model.layers.1.self_attn.q_proj.weight"], q[64 * r : 64 * r + 64]
        )


def test_qwen2_vl_vision_qkv_packed_and_tower_rest_replicated(cli, tmp_path):
    tiny_qwen2_vl(tmp_path / "full")
    full = load_folder(tmp_path / "full")
    assert cli("convert", tmp_path / "full", "--tp", 2, "-o", tmp_path / "tp2", "-q").exit_code == 0
    ranks = [load_rank(tmp_path / "tp2", r) for r in range(2)]
    qkv = full["visual.blocks.0.attn.qkv.weight"]
    for r, expected in enumerate(independent_split(qkv, (32, 32, 32), 2)):
        assert torch.equal(ranks[r]["visual.blocks.0.attn.qkv.weight"], expected)
        assert torch.equal(ranks[r]["visual.merger.mlp.0.weight"], full["visual.merger.mlp.0.weight"])
        assert torch.equal(ranks[r]["visual.patch_embed.proj.weight"], full["visual.patch_embed.proj.weight"])
        assert torch.equal(
            ranks[r]["visual.blocks.0.attn.proj.weight"],
            full["visual.blocks.0.attn.proj.weight"][:, 16 * r : 16 * r + 16],
        )


def local_module(cls, config, layer, prefix, state, **fewer):
    """``cls`` built with this rank's head counts, holding this rank's slices."""
    local = copy.deepcopy(config)
    for key, tp in fewer.items():
        setattr(local, key, getattr(config, key) // tp)
    module = cls(local, layer).eval()
    module.load_state_dict({k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)})
    return module


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_each_rank_computes_exactly_its_heads(cli, tmp_path, family):
    """Rank modules with 1/tp of the heads, fed the rank files, sum (the row-parallel all-reduce) to the layer."""
    module = __import__(f"transformers.models.{family}.modeling_{family}", fromlist=["_"])
    prefix_cls = {"qwen3_5": "Qwen3_5", "qwen3_next": "Qwen3Next"}[family]
    model = BUILDERS[family](tmp_path / "full")
    assert cli("convert", tmp_path / "full", "--tp", 4, "-o", tmp_path / "tp4", "-q").exit_code == 0
    states = [load_rank(tmp_path / "tp4", r) for r in range(4)]
    config, x = model.config, torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(3))
    rotary = getattr(module, f"{prefix_cls}TextRotaryEmbedding", None) or getattr(
        module, f"{prefix_cls}RotaryEmbedding"
    )
    position = rotary(config)(x, torch.arange(9)[None].expand(2, -1))
    with torch.no_grad():
        gdn = getattr(module, f"{prefix_cls}GatedDeltaNet")
        expected = model.model.layers[0].linear_attn(x)
        ranks = [
            local_module(
                gdn, config, 0, "model.layers.0.linear_attn.", s, linear_num_key_heads=4, linear_num_value_heads=4
            )(x)
            for s in states
        ]
        torch.testing.assert_close(sum(ranks), expected, rtol=0, atol=1e-5)
        attention = getattr(module, f"{prefix_cls}Attention")
        expected, _ = model.model.layers[1].self_attn(x, position_embeddings=position, attention_mask=None)
        ranks = [
            local_module(
                attention, config, 1, "model.layers.1.self_attn.", s, num_attention_heads=4, num_key_value_heads=4
            )(x, position_embeddings=position, attention_mask=None)[0]
            for s in states
        ]
        torch.testing.assert_close(sum(ranks), expected, rtol=0, atol=1e-5)


def test_qwen2_vl_vision_ranks_compute_their_heads(cli, tmp_path):
    """Vision attention with 1/tp of the heads per rank, fed the rank files, sums to the full block's attention."""
    model = tiny_qwen2_vl(tmp_path / "full")
    assert cli("convert", tmp_path / "full", "--tp", 2, "-o", tmp_path / "tp2", "-q").exit_code == 0
    full = model.model.visual.blocks[0].attn
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(4))
    angles = torch.randn(8, 8, generator=torch.Generator().manual_seed(5))
    kwargs = dict(cu_seqlens=torch.tensor([0, 8], dtype=torch.int32), position_embeddings=(angles.cos(), angles.sin()))
    total = 0
    with torch.no_grad():
        for r in range(2):
            state = load_rank(tmp_path / "tp2", r)
            local = copy.deepcopy(full)
            local.num_heads = 2
            local.qkv = torch.nn.Linear(32, 48)
            local.proj = torch.nn.Linear(16, 32)
            prefix = "visual.blocks.0.attn."
            local.load_state_dict({k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)})
            total = total + local(x, **kwargs) - (local.proj.bias if r else 0)  # the row-parallel bias is added once
        torch.testing.assert_close(total, full(x, **kwargs), rtol=0, atol=1e-5)
