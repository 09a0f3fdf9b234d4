"""Mapping tables: every Megatron name finds its transformers names, and what does not add up is refused."""

from __future__ import annotations

import pytest

from reshard.config import ModelConfig
from reshard.errors import PlanError
from reshard.mappings.megatron.gpt import megatron_to_hf
from reshard.mappings.transforms import Chunk, FuseGroupedQKV, Rename, SplitGroupedQKV

CONFIG = ModelConfig({"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 4})
H, F = 32, 48


def megatron_shapes(layers: int = 2, *, te: bool = True) -> dict[str, tuple[int, ...]]:
    shapes = {"embedding.word_embeddings.weight": (100, H), "decoder.final_layernorm.weight": (H,)}
    for i in range(layers):
        p = f"decoder.layers.{i}."
        norms = (
            {p + "self_attention.linear_qkv.layer_norm_weight": (H,), p + "mlp.linear_fc1.layer_norm_weight": (H,)}
            if te
            else {p + "input_layernorm.weight": (H,), p + "pre_mlp_layernorm.weight": (H,)}
        )
        shapes |= norms | {
            p + "self_attention.linear_qkv.weight": (48, H),
            p + "self_attention.linear_proj.weight": (H, H),
            p + "mlp.linear_fc1.weight": (2 * F, H),
            p + "mlp.linear_fc2.weight": (H, F),
        }
    return shapes | {"output_layer.weight": (100, H)}


@pytest.mark.parametrize("te", [True, False], ids=["te-names", "local-names"])
def test_every_megatron_tensor_finds_its_transformers_names(te: bool) -> None:
    groups, dropped = megatron_to_hf("llama").plan(megatron_shapes(te=te), CONFIG)
    by_source = {g.sources[0]: g for g in groups}
    qkv = by_source["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert qkv.targets == tuple(f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv")
    assert qkv.shapes == ((32, H), (8, H), (8, H)) and qkv.transform == SplitGroupedQKV(2, 4, 4)
    fc1 = by_source["decoder.layers.0.mlp.linear_fc1.weight"]
    assert fc1.targets == ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight")
    assert fc1.transform == Chunk(2) and fc1.shapes == ((F, H), (F, H))
    targets = sorted(t for g in groups for t in g.targets)
    assert len(targets) == 2 + 2 * 9 + 1 and dropped == []
    assert "model.layers.0.post_attention_layernorm.weight" in targets and "lm_head.weight" in targets


def test_the_inverse_table_maps_transformers_names_back() -> None:
    forward, _ = megatron_to_hf("llama").plan(megatron_shapes(), CONFIG)
    shapes = {t: s for g in forward for t, s in zip(g.targets, g.shapes, strict=True)}
    backward, _ = megatron_to_hf("llama").inverse().plan(shapes, CONFIG)
    assert sorted(t for g in backward for t in g.targets) == sorted(megatron_shapes())
    fused = next(g for g in backward if g.targets == ("decoder.layers.0.self_attention.linear_qkv.weight",))
    assert fused.transform == FuseGroupedQKV(2, 4, 4) and fused.shapes == ((48, H),)


def test_moe_experts_and_router() -> None:
    p = "decoder.layers.0.mlp."
    shapes = {p + "router.weight": (4, H), "decoder.layers.0.pre_mlp_layernorm.weight": (H,)}
    shapes |= {p + f"experts.local_experts.{e}.linear_fc1.weight": (16, H) for e in range(4)}
    shapes |= {p + f"experts.local_experts.{e}.linear_fc2.weight": (H, 8) for e in range(4)}
    groups, _ = megatron_to_hf("mixtral").plan(shapes, CONFIG)
    targets = {t for g in groups for t in g.targets}
    assert "model.layers.0.block_sparse_moe.gate.weight" in targets
    assert {f"model.layers.0.block_sparse_moe.experts.3.w{i}.weight" for i in (1, 2, 3)} <= targets
    groups, _ = megatron_to_hf("qwen3_moe").plan(shapes, CONFIG)
    assert "model.layers.0.mlp.experts.2.up_proj.weight" in {t for g in groups for t in g.targets}


def test_unknown_names_partial_groups_and_clashes_are_refused_together() -> None:
    shapes = megatron_shapes(1) | {"decoder.layers.0.self_attention.mystery.weight": (3, 3)}
    shapes["decoder.layers.0.input_layernorm.weight"] = (H,)  # a second source for input_layernorm
    with pytest.raises(PlanError) as caught:
        megatron_to_hf("llama").plan(shapes, CONFIG)
    messages = [p.one_line() for p in caught.value.problems]
    assert any("does not know: decoder.layers.0.self_attention.mystery.weight" in m for m in messages)
    assert any("map to model.layers.0.input_layernorm.weight" in m for m in messages)

    partial = {"model.layers.0.self_attn.q_proj.weight": (32, H), "model.layers.0.self_attn.k_proj.weight": (8, H)}
    with pytest.raises(PlanError, match=r"other part\(s\) are missing: model.layers.0.self_attn.v_proj.weight"):
        megatron_to_hf("llama").inverse().plan(partial, CONFIG)


def test_transformer_engine_state_is_dropped_by_name() -> None:
    shapes = megatron_shapes(1) | {"decoder.layers.0.self_attention.linear_qkv._extra_state": (10,)}
    groups, dropped = megatron_to_hf("llama").plan(shapes, CONFIG)
    assert dropped == ["decoder.layers.0.self_attention.linear_qkv._extra_state"]
    assert all(isinstance(g.transform, Rename | SplitGroupedQKV | Chunk) for g in groups)
