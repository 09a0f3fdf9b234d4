"""The runtimes' rules in ``check``, from a bare config with a ``quantization_config`` (the model built on ``meta``,
its tensors as the quantizing library stores them): refusals where vLLM refuses, naming tensor, rule and tps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# Real models' sizes (one layer: check builds the model on meta); vocab kept small.
QWEN25_05B = dict(
    model_type="qwen2",
    architectures=["Qwen2ForCausalLM"],
    hidden_size=896,
    intermediate_size=4864,
    num_attention_heads=14,
    num_key_value_heads=2,
    num_hidden_layers=1,
    vocab_size=1024,
)
QWEN25_72B = dict(
    model_type="qwen2",
    architectures=["Qwen2ForCausalLM"],
    hidden_size=8192,
    intermediate_size=29568,
    num_attention_heads=64,
    num_key_value_heads=8,
    num_hidden_layers=1,
    vocab_size=1024,
)
QWEN3_30B_A3B = dict(
    model_type="qwen3_moe",
    architectures=["Qwen3MoeForCausalLM"],
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=4,
    num_experts_per_tok=2,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_hidden_layers=1,
    vocab_size=1024,
)


def _check(cli, tmp_path: Path, config: dict, tp: int, *more: str):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return cli("check", path, "--tp", tp, "--json", *more)


@pytest.mark.parametrize(
    ("model", "quant", "tp", "tensor", "rule", "works"),
    [  # vllm#25292: Qwen3-30B-A3B-FP8 at tp 4, 768 / 4 = 192 rows per rank
        (QWEN3_30B_A3B, FP8, 4, "mlp.experts.0.gate_proj.weight", "128x128 weight blocks", [1, 2]),
        # Qwen2.5-0.5B GPTQ g128 at tp 2: o_proj's 896 input columns, 448 per rank
        (QWEN25_05B, GPTQ, 2, "self_attn.o_proj.qweight", "groups of 128 input rows", [1]),
        # vllm#21695: Qwen2.5-72B-AWQ at tp 2: down_proj's 29568 input rows, 14784 per rank
        (QWEN25_72B, AWQ, 2, "mlp.down_proj.qweight", "AWQ int4", [1]),
    ],
)
def test_check_config_refuses_where_vllm_refuses(cli, tmp_path, model, quant, tp, tensor, rule, works) -> None:
    result = _check(cli, tmp_path, model | {"quantization_config": quant}, tp)
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    errors = [p for p in report["problems"] if p["severity"] == "error"]
    assert any(rule in p["message"] and any(t.endswith(tensor) for t in p["tensors"]) for p in errors), errors
    assert report["tp_sizes_that_work"][: len(works)] == works and tp not in report["tp_sizes_that_work"]
    assert _check(cli, tmp_path, model, tp).exit_code == 0  # the same model unquantized splits


def test_check_config_uneven_does_not_cut_a_block(cli, tmp_path) -> None:
    result = _check(cli, tmp_path, QWEN3_30B_A3B | {"quantization_config": FP8}, 4, "--uneven")
    assert result.exit_code == 1


def test_gptq_act_order_with_groups_is_a_warning(cli, tmp_path) -> None:
    model = QWEN25_72B | {"quantization_config": GPTQ | {"desc_act": True}}
    report = json.loads(_check(cli, tmp_path, model, 8).output)
    assert any("vLLM refuses it at tp > 1" in p["message"] for p in report["problems"] if p["severity"] == "warning")


CT_W4A16 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "g": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": False},
        }
    },
    "ignore": ["lm_head"],
}


@pytest.mark.parametrize(
    ("quant", "column", "row"),
    [  # each format's packed tensor and scales cut on the axis the layer is parallel on, in whole groups and words
        (
            GPTQ,
            {"qweight": (1, 8), "scales": (1, 8), "qzeros": (1, 1), "g_idx": None},
            {"qweight": (0, 16), "scales": (0, 1), "qzeros": (0, 1), "g_idx": (0, 128)},
        ),
        (
            AWQ,
            {"qweight": (1, 1), "scales": (1, 8), "qzeros": (1, 1)},
            {"qweight": (0, 128), "scales": (0, 1), "qzeros": (0, 1)},
        ),
        (
            CT_W4A16,
            {"weight_packed": (0, 8), "weight_scale": (0, 8), "weight_zero_point": (0, 1)},
            {"weight_packed": (1, 16), "weight_scale": (1, 1), "weight_zero_point": (1, 1)},
        ),
    ],
)
def test_int4_tensors_cut_on_their_layers_axis(cli, tmp_path, quant, column, row) -> None:
    model = QWEN25_72B | {"intermediate_size": 28672, "quantization_config": quant}
    report = json.loads(_check(cli, tmp_path, model, 8).output)
    assert report["ok"], report["problems"]
    cuts = {t["name"]: t["partition"] for t in report["tensors"]}
    for layer, expected in (("mlp.up_proj", column), ("mlp.down_proj", row)):
        for suffix, cut in expected.items():
            partition = cuts[f"model.layers.0.{layer}.{suffix}"]
            if cut is None:
                assert partition == {"kind": "replicate"}
            else:
                assert (partition["dim"], partition.get("unit", 1)) == cut, (layer, suffix, partition)


def test_whole_units_are_never_cut() -> None:
    from reshard.errors import ShapeMismatchError
    from reshard.geometry import Packed, Shard, partition_from_dict, partition_to_dict, rank_shapes

    block = Shard(0, 128, whole=True)
    assert rank_shapes(block, (256, 8), 2) == [(128, 8)] * 2
    for uneven in (False, True):
        with pytest.raises(ShapeMismatchError, match="cannot hold whole and equal"):
            rank_shapes(block, (256, 8), 4, uneven=uneven)
    assert rank_shapes(block, (192, 8), 1) == [(192, 8)]  # an fp8 grid may end on a partial block at tp 1
    fused = Packed(0, (256, 128), (128, 128), whole=True)
    with pytest.raises(ShapeMismatchError):
        rank_shapes(fused, (384, 8), 2, uneven=True)
    for partition in (block, fused):
        assert partition_from_dict(partition_to_dict(partition)) == partition


QWEN3 = dict(
    model_type="qwen3",
    architectures=["Qwen3ForCausalLM"],
    hidden_size=1024,
    intermediate_size=1024,
    num_hidden_layers=1,
    vocab_size=1024,
)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "works"),
    [  # a rank's rows of q, k, v (and o's columns) are whole 128-row blocks, whatever a head's size
        (8, 4, 64, [1, 2]),  # two KV heads of 64 a rank at tp 2: one block; one at tp 4: half a block
        (8, 2, 128, [1, 2, 4, 8]),  # KV heads copied at tp 4 and 8: each rank one head, one block
        (16, 2, 64, [1]),  # KV heads of 64: no rank ever holds a whole block of k
        (8, 4, 192, [1, 2]),  # two KV heads of 192 a rank at tp 2: three blocks; one at tp 4: a block and a half
    ],
)
def test_block_fp8_is_a_rule_on_a_ranks_rows_not_a_heads(cli, tmp_path, heads, kv_heads, head_dim, works) -> None:
    """vLLM ``validate_fp8_block_shape`` checks each partition's size (``output_partition_size % block_n``)."""
    model = QWEN3 | dict(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    report = json.loads(_check(cli, tmp_path, model | {"quantization_config": FP8}, 3).output)
    assert report["tp_sizes_that_work"] == works


def test_check_says_why_a_copied_kv_head_is_refused(cli, tmp_path) -> None:
    """At tp 8, 4 KV heads of 64 rows would each be copied onto two ranks: half a block each, not a head cut."""
    model = QWEN3 | dict(num_attention_heads=8, num_key_value_heads=4, head_dim=64, quantization_config=FP8)
    messages = [p["message"] for p in json.loads(_check(cli, tmp_path, model, 8).output)["problems"]]
    assert (
        "num_key_value_heads=4 heads, fewer than the 8 ranks: a head copied onto a rank would not be whole "
        "quantization blocks or groups" in messages
    ), messages
