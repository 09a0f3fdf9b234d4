"""The bucket layout of Megatron-Core's distributed optimizer, computed again on plain ints
(:mod:`reshard.layouts.dcp.torch_dist_buckets`); the oracle tests hold it against what Megatron-Core writes."""

from __future__ import annotations

import argparse

import pytest

from reshard.layouts.dcp.torch_dist_buckets import (
    BUCKET_ARGS,
    boundaries,
    bucket_layout,
    bucket_size_of,
    parameter_order,
)


def test_one_bucket_lays_the_parameters_out_in_reverse_at_multiples_of_64() -> None:
    (bucket,) = bucket_layout([("a", 3), ("b", 100), ("c", 64)], bucket_size=None, dp=1, high_nccl_busbw=False)
    assert bucket.params == {"c": (0, 64), "b": (64, 164), "a": (192, 195)}
    assert (bucket.numel_unpadded, bucket.numel) == (195, 256)  # the end padded to lcm(dp, 128)


def test_a_bucket_closes_once_it_holds_bucket_size_elements() -> None:
    params = [("a", 50), ("b", 100), ("c", 30), ("d", 70)]
    first, second = bucket_layout(params, bucket_size=200, dp=3, high_nccl_busbw=False)
    assert first.params == {"d": (0, 70), "c": (128, 158), "b": (192, 292)}
    assert (first.numel_unpadded, first.numel) == (292, 384)  # lcm(3, 128)
    assert second.params == {"a": (0, 50)} and (second.numel_unpadded, second.numel) == (50, 384)


def test_high_nccl_busbw_pads_the_bucket_end_to_65536() -> None:
    (bucket,) = bucket_layout([("a", 10)], bucket_size=None, dp=2, high_nccl_busbw=True)
    assert (bucket.numel_unpadded, bucket.numel) == (10, 1 << 16)


def test_boundaries_cut_each_data_parallel_share_at_its_parameters() -> None:
    (bucket,) = bucket_layout([("a", 100), ("b", 200)], bucket_size=None, dp=2, high_nccl_busbw=False)
    assert bucket.params == {"b": (0, 200), "a": (256, 356)} and bucket.numel == 384
    assert boundaries(bucket, 2) == {0, 192, 200, 256, 356}  # b cut at the share edge 192
    assert boundaries(bucket, 4) == {0, 96, 192, 200, 256, 288, 356}


def test_parameter_order_is_megatron_cores_and_unknown_modules_are_named() -> None:
    names = [
        "output_layer.weight",
        "decoder.layers.1.mlp.linear_fc1.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.0.self_attention.linear_proj.weight",
        "decoder.layers.0.input_layernorm.weight",
        "embedding.word_embeddings.weight",
        "decoder.layers.0.mlp.router.weight",
    ]
    order, unknown = parameter_order(names)
    assert order == [
        "embedding.word_embeddings.weight",
        "decoder.layers.0.input_layernorm.weight",
        "decoder.layers.0.self_attention.linear_proj.weight",
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.1.mlp.linear_fc1.weight",
        "output_layer.weight",
    ]
    assert unknown == ["decoder.layers.0.mlp.router.weight"]


def args(**values: object) -> argparse.Namespace:
    return argparse.Namespace(**{name: None for name in BUCKET_ARGS} | values)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"overlap_grad_reduce": False, "ddp_bucket_size": 1000}, (None, False, None)),
        ({"overlap_grad_reduce": True}, (40_000_000, False, None)),
        ({"overlap_grad_reduce": True, "ddp_bucket_size": 1000}, (1000, False, None)),
        ({"overlap_grad_reduce": True, "overlap_param_gather_with_optimizer_step": True}, (None, False, None)),
        ({"overlap_grad_reduce": False, "ddp_pad_buckets_for_high_nccl_busbw": True}, (None, True, None)),
    ],
)
def test_bucket_size_is_megatron_lms(values: dict, expected: tuple) -> None:
    assert bucket_size_of(args(**values), 8) == expected


def test_the_default_bucket_grows_with_the_data_parallel_size() -> None:
    assert bucket_size_of(args(overlap_grad_reduce=True), 64)[0] == 64_000_000


def test_bucket_sizes_the_args_do_not_tell_are_refused_by_name() -> None:
    size, _, why = bucket_size_of(args(overlap_grad_reduce=True, ddp_num_buckets=4), 2)
    assert size is None and why is not None and "--ddp-num-buckets 4" in why
    lacking = argparse.Namespace(overlap_grad_reduce=False)
    assert bucket_size_of(lacking, 1)[2] == (
        "the args record no overlap_param_gather_with_optimizer_step, which decides the optimizer's buckets"
    )
