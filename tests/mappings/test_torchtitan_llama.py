"""The torchtitan Llama 3 table: every torchtitan naming finds transformers' names, the RoPE permutation is the one
torchtitan's ``Llama3StateDictAdapter`` applies, and transformers -> torchtitan -> transformers is bit-exact."""

from __future__ import annotations

import pytest
import torch
from fixtures.models import tiny_llama

from reshard.errors import PlanError
from reshard.mappings.base import Mapping
from reshard.mappings.torchtitan_llama import torchtitan_to_hf
from reshard.mappings.transforms import Chain, Rename, RopePermute, RopeUnpermute

HEADS, KV, HD, DIM = 8, 4, 8, 64  # tiny_llama(num_key_value_heads=4): 8 heads of 8, hidden 64


def _permute(w: torch.Tensor, n_heads: int, dim1: int | None = None, dim2: int | None = None) -> torch.Tensor:
    """torchtitan's ``Llama3StateDictAdapter._permute`` (transformers' conversion script), copied as the reference."""
    dim1, dim2 = dim1 or w.shape[0], dim2 or w.shape[1]
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2).clone()


def _reverse_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    dim1, dim2 = w.shape
    return w.view(n_heads, 2, dim1 // n_heads // 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def _separate_to_fused_qkv(wq, wk, wv, n_heads: int, n_kv_heads: int, head_dim: int) -> torch.Tensor:
    """torchtitan's ``StateDictAdapter.separate_to_fused_qkv`` (ad7a8653), copied as the reference."""
    hpk, dim = n_heads // n_kv_heads, wq.shape[1]
    q = wq.view(n_kv_heads, hpk, head_dim, dim)
    k, v = wk.view(n_kv_heads, 1, head_dim, dim), wv.view(n_kv_heads, 1, head_dim, dim)
    return torch.cat([q, k, v], dim=1).reshape(n_kv_heads * (hpk + 2) * head_dim, dim)


def apply(mapping: Mapping, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the engine does with a table, on whole tensors."""
    groups, _ = mapping.plan({n: tuple(t.shape) for n, t in state.items()}, None)
    out = {}
    for group in groups:
        tensors = group.transform.apply([state[s] for s in group.sources])
        assert [tuple(t.shape) for t in tensors] == list(group.shapes)
        out.update(zip(group.targets, tensors, strict=True))
    return out


@pytest.fixture(scope="module")
def hf_state(tmp_path_factory) -> dict[str, torch.Tensor]:
    model = tiny_llama(tmp_path_factory.mktemp("hf"), num_key_value_heads=KV)
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def test_the_permutation_is_torchtitan_s() -> None:
    wq, wk = torch.arange(HEADS * HD * DIM).reshape(HEADS * HD, DIM), torch.arange(KV * HD * DIM).reshape(-1, DIM)
    assert torch.equal(RopePermute(HEADS).apply([wq])[0], _permute(wq, HEADS))
    assert torch.equal(RopePermute(KV).apply([wk])[0], _permute(wk, KV, KV * HD, DIM))
    assert torch.equal(RopeUnpermute(HEADS).apply([wq])[0], _reverse_permute(wq, HEADS))


def test_transformers_to_torchtitan_writes_head_names_and_back_is_bit_exact(hf_state) -> None:
    table = torchtitan_to_hf(HEADS, KV, HD)
    titan = apply(table.inverse(), hf_state)
    layer = "layers.1.attention."
    assert sorted(titan) == sorted(
        ["tok_embeddings.weight", "norm.weight", "lm_head.weight"]
        + [f"layers.{i}.attention.qkv_linear.{w}.weight" for i in range(2) for w in ("wq", "wk", "wv")]
        + [f"layers.{i}.attention.wo.weight" for i in range(2)]
        + [f"layers.{i}.feed_forward.{w}.weight" for i in range(2) for w in ("w1", "w2", "w3")]
        + [f"layers.{i}.{n}.weight" for i in range(2) for n in ("attention_norm", "ffn_norm")]
    )
    hf = "model.layers.1."
    assert torch.equal(
        titan[layer + "qkv_linear.wq.weight"], _reverse_permute(hf_state[hf + "self_attn.q_proj.weight"], 8)
    )
    assert torch.equal(
        titan[layer + "qkv_linear.wk.weight"], _reverse_permute(hf_state[hf + "self_attn.k_proj.weight"], 4)
    )
    assert torch.equal(titan[layer + "qkv_linear.wv.weight"], hf_state[hf + "self_attn.v_proj.weight"])
    assert torch.equal(titan["layers.1.feed_forward.w1.weight"], hf_state[hf + "mlp.gate_proj.weight"])
    assert torch.equal(titan["layers.1.feed_forward.w3.weight"], hf_state[hf + "mlp.up_proj.weight"])
    assert torch.equal(titan["layers.1.ffn_norm.weight"], hf_state[hf + "post_attention_layernorm.weight"])
    back = apply(table, titan)
    assert sorted(back) == sorted(hf_state)
    assert all(torch.equal(back[n], t) for n, t in hf_state.items())


@pytest.mark.parametrize("naming", ["v0.1", "fused"])
def test_older_namings_map_to_the_same_transformers_tensors(hf_state, naming: str) -> None:
    table = torchtitan_to_hf(HEADS, KV, HD)
    titan = apply(table.inverse(), hf_state)
    older = {}
    for name, tensor in titan.items():
        if naming == "v0.1":
            name = name.replace("qkv_linear.", "").replace("lm_head", "output")
        older[name] = tensor
    if naming == "fused":
        for i in range(2):
            p = f"layers.{i}.attention.qkv_linear."
            parts = [older.pop(f"{p}{w}.weight") for w in ("wq", "wk", "wv")]
            older[f"{p}wqkv.weight"] = _separate_to_fused_qkv(*parts, HEADS, KV, HD)
    groups, _ = table.plan({n: tuple(t.shape) for n, t in older.items()}, None)
    fused = [g for g in groups if g.sources[0].endswith("wqkv.weight")]
    assert len(fused) == (2 if naming == "fused" else 0)
    assert all(isinstance(g.transform, Chain) and len(g.targets) == 3 for g in fused)
    back = apply(table, older)
    assert sorted(back) == sorted(hf_state) and all(torch.equal(back[n], t) for n, t in hf_state.items())


def test_tied_embeddings_drop_the_output_layer_and_freqs_cis_is_dropped() -> None:
    shapes = {"tok_embeddings.weight": (100, DIM), "lm_head.weight": (100, DIM), "freqs_cis": (128, HD // 2)}
    groups, dropped = torchtitan_to_hf(HEADS, KV, HD, tied=True).plan(shapes, None)
    assert [g.targets for g in groups] == [("model.embed_tokens.weight",)]
    assert sorted(dropped) == ["freqs_cis", "lm_head.weight"]
    groups, dropped = torchtitan_to_hf(HEADS, KV, HD).plan(shapes, None)
    assert sorted(t for g in groups for t in g.targets) == ["lm_head.weight", "model.embed_tokens.weight"]
    assert dropped == ["freqs_cis"]


def test_unknown_names_partial_fused_groups_and_two_output_layers_are_refused() -> None:
    shapes = {
        "layers.0.attention.wq.weight": (HEADS * HD, DIM),
        "layers.0.attention.mystery.weight": (3, 3),
        "output.weight": (100, DIM),
        "lm_head.weight": (100, DIM),
        "layers.0.attention.qkv_linear.wqkv.weight": (99, DIM),
    }
    with pytest.raises(PlanError) as caught:
        torchtitan_to_hf(HEADS, KV, HD).plan(shapes, None)
    messages = [p.one_line() for p in caught.value.problems]
    assert any("does not know: layers.0.attention.mystery.weight" in m for m in messages)
    assert any("both output.weight and lm_head.weight map to lm_head.weight" in m for m in messages)
    assert any(
        "both layers.0.attention.wq.weight and layers.0.attention.qkv_linear.wqkv.weight map to" in m for m in messages
    )
    assert any("layers.0.attention.qkv_linear.wqkv.weight: fused QKV has 99 rows, not 4 groups" in m for m in messages)


def test_v_and_the_rest_are_renamed_only() -> None:
    groups, _ = torchtitan_to_hf(HEADS, KV, HD).plan(
        {"layers.3.attention.qkv_linear.wv.weight": (KV * HD, DIM), "layers.3.feed_forward.w2.weight": (DIM, 96)}, None
    )
    assert {g.targets: g.transform for g in groups} == {
        ("model.layers.3.self_attn.v_proj.weight",): Rename(),
        ("model.layers.3.mlp.down_proj.weight",): Rename(),
    }
