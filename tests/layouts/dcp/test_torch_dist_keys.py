"""``reshard.layouts.dcp.torch_dist_keys``: Megatron-Core's global keys, shapes and chunk boxes, from names and
shapes.

The expected keys are those Megatron-Core 0.16.1 writes (the oracle test compares whole checkpoints); here each
rule is pinned on a few names.
"""

from __future__ import annotations

import pytest

from reshard.dtypes import TensorHeader
from reshard.errors import ReshardError, ShapeMismatchError
from reshard.layouts.dcp.torch_dist_keys import check_names, plan_global


def headers(shapes: dict[str, tuple[int, ...]], code: str = "BF16") -> dict[str, TensorHeader]:
    return {name: TensorHeader(shape, code) for name, shape in shapes.items()}


def dense(layers: int = 2, *, local_norms: bool = False) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (128, 8)}
    for i in range(layers):
        p = f"decoder.layers.{i}."
        if local_norms:
            shapes |= {p + "input_layernorm.weight": (8,), p + "pre_mlp_layernorm.weight": (8,)}
        else:
            shapes |= {
                p + "self_attention.linear_qkv.layer_norm_weight": (8,),
                p + "mlp.linear_fc1.layer_norm_weight": (8,),
            }
        shapes |= {
            p + "self_attention.linear_qkv.weight": (16, 8),
            p + "self_attention.linear_proj.weight": (8, 8),
            p + "mlp.linear_fc1.weight": (24, 8),
            p + "mlp.linear_fc2.weight": (8, 12),
        }
    return shapes | {"decoder.final_layernorm.weight": (8,), "output_layer.weight": (128, 8)}


def moe(layers: int = 2, experts: int = 3) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for i in range(layers):
        p = f"decoder.layers.{i}."
        shapes |= {p + "self_attention.linear_qkv.weight": (16, 8), p + "pre_mlp_layernorm.weight": (8,)}
        shapes[p + "mlp.router.weight"] = (experts, 8)
        for e in range(experts):
            shapes |= {p + f"mlp.experts.local_experts.{e}.linear_fc1.weight": (6, 8)}
    return shapes


def test_layers_stack_on_a_leading_axis_one_chunk_per_layer() -> None:
    plan = plan_global(headers(dense(3)), {}, layers=None, experts=None, local_spec=False)
    tensors = {t.key: t for t in plan.tensors}
    qkv = tensors["decoder.layers.self_attention.linear_qkv.weight"]
    assert (qkv.shape, qkv.axes, qkv.code) == ((3, 16, 8), (3,), "BF16")
    assert [(c.name, c.offsets, c.sizes) for c in qkv.chunks] == [
        (f"decoder.layers.{i}.self_attention.linear_qkv.weight", (i, 0, 0), (1, 16, 8)) for i in range(3)
    ]
    emb = tensors["embedding.word_embeddings.weight"]
    assert (emb.shape, [(c.offsets, c.sizes) for c in emb.chunks]) == ((128, 8), [((0, 0), (128, 8))])
    assert list(tensors)[:2] == [
        "embedding.word_embeddings.weight",
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
    ]
    assert plan.homogeneous and plan.skipped == ()


def test_transformer_engine_spec_objects_cover_linears_and_norms() -> None:
    plan = plan_global(headers(dense(2)), {}, layers=2, experts=None, local_spec=False)
    assert sorted(plan.objects) == sorted(
        [
            f"decoder.layers.{m}._extra_state/shard_{i}_2"
            for m in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
            for i in range(2)
        ]
        + ["decoder.final_layernorm._extra_state/shard_0_1"]
    )
    assert set(plan.objects.values()) == {None}


def test_local_spec_norms_take_transformer_engine_names_and_carry_no_object() -> None:
    """The local spec's sharded_state_dict_keys_map: input_layernorm and pre_mlp_layernorm move into the linears' keys;
    its torch norms have no extra state, its linears do (and the source's values are kept)."""
    extras = {"decoder.layers.1.self_attention.linear_qkv._extra_state": b"fp8", "output_layer._extra_state": None}
    plan = plan_global(headers(dense(2, local_norms=True)), extras, layers=None, experts=None, local_spec=True)
    keys = {t.key for t in plan.tensors}
    assert {
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.mlp.linear_fc1.layer_norm_weight",
    } <= keys
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in keys)
    assert len(plan.objects) == 8 and "decoder.final_layernorm._extra_state/shard_0_1" not in plan.objects
    assert plan.objects["decoder.layers.self_attention.linear_qkv._extra_state/shard_1_2"] == b"fp8"
    assert not any(k.startswith("output_layer") for k in plan.objects)  # GPTModel drops the output layer's


@pytest.mark.parametrize("local_spec", [True, False])
def test_experts_stack_after_the_layer_axis(local_spec: bool) -> None:
    plan = plan_global(headers(moe(2, 3)), {}, layers=2, experts=3, local_spec=local_spec)
    tensors = {t.key: t for t in plan.tensors}
    fc1 = tensors["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert (fc1.shape, fc1.axes) == ((2, 3, 6, 8), (2, 3))
    assert [c.offsets for c in fc1.chunks] == [(i, e, 0, 0) for i in range(2) for e in range(3)]
    assert all(c.sizes == (1, 1, 6, 8) for c in fc1.chunks)
    assert "decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_1.2_2.3" in plan.objects
    # A MoE layer's pre-MLP norm: the local spec renames it as in dense layers, Transformer Engine keeps its own.
    norm = (
        "decoder.layers.mlp.linear_fc1.layer_norm_weight" if local_spec else "decoder.layers.pre_mlp_layernorm.weight"
    )
    assert norm in tensors
    assert ("decoder.layers.pre_mlp_layernorm._extra_state/shard_0_2" in plan.objects) is not local_spec


def test_layers_that_differ_keep_their_numbers() -> None:
    """A dense first layer before MoE layers: Megatron's non-homogeneous form, no layer axis, experts still stacked."""
    shapes = {k: v for k, v in moe(2, 2).items() if not k.startswith("decoder.layers.0.mlp.")}
    shapes["decoder.layers.0.mlp.linear_fc1.weight"] = (24, 8)
    plan = plan_global(headers(shapes), {}, layers=2, experts=2, local_spec=True)
    tensors = {t.key: t for t in plan.tensors}
    assert not plan.homogeneous
    assert tensors["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (16, 8)
    fc1 = tensors["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"]
    assert (fc1.shape, [c.offsets for c in fc1.chunks]) == ((2, 6, 8), [(0, 0, 0), (1, 0, 0)])
    assert "decoder.layers.1.mlp.experts.experts.linear_fc1._extra_state/shard_1_2" in plan.objects
    assert "decoder.layers.0.mlp.linear_fc1._extra_state/shard_0_1" in plan.objects


def test_args_that_ask_for_numbered_layers_are_followed() -> None:
    plan = plan_global(headers(dense(2)), {}, layers=2, experts=None, local_spec=False, homogeneous=False)
    assert "decoder.layers.1.mlp.linear_fc2.weight" in {t.key for t in plan.tensors}


def test_tied_embeddings_write_no_output_layer() -> None:
    plan = plan_global(headers(dense(1)), {}, layers=1, experts=None, local_spec=False, tied=True)
    assert plan.skipped == ("output_layer.weight",)
    assert "output_layer.weight" not in {t.key for t in plan.tensors}


def test_a_missing_layer_or_a_layer_of_another_shape_is_refused() -> None:
    with pytest.raises(ReshardError, match=r"the model has 3 layers, but layer 2 is missing"):
        plan_global(headers(dense(2)), {}, layers=3, experts=None, local_spec=False)
    no_expert = {k: v for k, v in moe(2, 3).items() if "1.mlp.experts.local_experts.2" not in k}
    with pytest.raises(ReshardError, match=r"linear_fc1.weight: has 2 of the 3 layer/expert pieces"):
        plan_global(headers(no_expert), {}, layers=2, experts=3, local_spec=False)
    shapes = dense(2) | {"decoder.layers.1.mlp.linear_fc2.weight": (8, 16)}
    with pytest.raises(ShapeMismatchError, match=r"decoder.layers.1.mlp.linear_fc2.weight.*\[8, 16\].*\[8, 12\]"):
        plan_global(headers(shapes), {}, layers=2, experts=None, local_spec=False)
    mixed = {**headers(dense(2)), "decoder.layers.1.mlp.linear_fc2.weight": TensorHeader((8, 12), "F32")}
    with pytest.raises(ShapeMismatchError, match="F32"):
        plan_global(mixed, {}, layers=2, experts=None, local_spec=False)


def test_names_it_cannot_place_are_refused() -> None:
    check_names(list(dense(1)))
    with pytest.raises(ReshardError, match=r"Megatron-Core's names.*not language_model.encoder.final_norm.weight"):
        check_names(["embedding.word_embeddings.weight", "language_model.encoder.final_norm.weight"])
    with pytest.raises(ReshardError, match="grouped-GEMM experts") as err:
        check_names(["decoder.layers.0.mlp.experts.linear_fc1.weight3"])
    assert err.value.tensor == "decoder.layers.0.mlp.experts.linear_fc1.weight3"
