"""``convert --dtype`` planning on headers alone: which tensors are dequantized, cast, kept or dropped, and every
quantization or tensor it does not dequantize refused by name."""

from __future__ import annotations

import pytest
from fixtures.fp8 import compressed_config

from reshard.dtypes import TensorHeader
from reshard.errors import ReshardError
from reshard.quantization.dequant_plan import dequantized_config, fp8_format, recast
from reshard.quantization.dequantize import Cast, Dequantize

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
H = TensorHeader


def _headers(**tensors: tuple[tuple[int, ...], str]) -> dict[str, TensorHeader]:
    return {name.replace("__", "."): H(shape, code) for name, (shape, code) in tensors.items()}


def test_deepseek_block_fp8_dequantizes_weights_casts_floats_keeps_the_rest():
    headers = _headers(
        q__weight=((576, 300), "F8_E4M3"),
        q__weight_scale_inv=((5, 3), "F32"),
        norm__weight=((300,), "BF16"),
        embed__weight=((10, 300), "F32"),
        step=((1,), "I64"),
    )
    plan = recast(headers, {"quantization_config": FP8}, "bfloat16")
    units = {u.target: u for u in plan.units}
    assert units["q.weight"].sources == ("q.weight", "q.weight_scale_inv")
    assert units["q.weight"].transform == Dequantize((128, 128), "BF16", None)
    assert units["norm.weight"].transform is None and units["norm.weight"].code == "BF16"
    assert units["embed.weight"].transform == Cast("BF16")
    assert units["step"].transform is None and units["step"].code == "I64"
    assert "q.weight_scale_inv" not in units and plan.problems == () and plan.dequantized == 1


@pytest.mark.parametrize(
    ("strategy", "scale", "block"),
    [("tensor", (1,), (256, 300)), ("channel", (256, 1), (1, 300))],
)
def test_compressed_tensors_fp8_scales_and_the_dropped_input_scale(strategy, scale, block):
    headers = _headers(
        o__weight=((256, 300), "F8_E4M3"), o__weight_scale=(scale, "BF16"), o__input_scale=((1,), "BF16")
    )
    plan = recast(headers, {"quantization_config": compressed_config(strategy, static_input=True)}, "float16")
    (unit,) = plan.units
    assert unit.transform == Dequantize(block, "F16", "BF16")
    assert plan.dropped == ("o.input_scale",) and plan.problems == ()


@pytest.mark.parametrize(
    ("quant", "said"),
    [
        ({"quant_method": "gptq", "bits": 4}, "dequantizing gptq is not supported"),
        ({"quant_method": "awq"}, "dequantizing awq is not supported"),
        ({"quant_method": "mxfp4"}, "dequantizing mxfp4 is not supported"),
        ({**FP8, "expert_dtype": "fp4"}, "dequantizing fp8 with expert_dtype fp4 is not supported"),
        ({**FP8, "new_knob": 1}, r"keys the dequantizer does not know: \['new_knob'\]"),
        ({**FP8, "weight_block_size": [128]}, "weight_block_size"),
    ],
)
def test_quantizations_not_dequantized_are_refused_by_name(quant, said):
    with pytest.raises(ReshardError, match=said):
        fp8_format({"quantization_config": quant})


def test_compressed_tensors_int4_and_nvfp4_are_refused_by_name():
    w4 = compressed_config("group")
    w4["config_groups"]["group_0"] |= {"format": "pack-quantized"}
    w4["config_groups"]["group_0"]["weights"] |= {"num_bits": 4, "type": "int"}
    with pytest.raises(ReshardError, match=r"dequantizing compressed-tensors pack-quantized \(int, 4 bits\)"):
        fp8_format({"quantization_config": w4})
    nvfp4 = compressed_config("tensor")
    nvfp4["format"] = nvfp4["config_groups"]["group_0"]["format"] = "nvfp4-pack-quantized"
    with pytest.raises(ReshardError, match="dequantizing compressed-tensors nvfp4-pack-quantized"):
        fp8_format({"quantization_config": nvfp4})
    kv = compressed_config("tensor") | {"kv_cache_scheme": {"num_bits": 8}}
    with pytest.raises(ReshardError, match="compressed-tensors with a kv_cache_scheme is not supported"):
        fp8_format({"quantization_config": kv})


def test_tensors_that_do_not_pair_are_each_a_problem():
    headers = _headers(
        a__weight=((256, 256), "F8_E4M3"),  # no scale
        b__weight=((256, 256), "F8_E4M3"),
        b__weight_scale_inv=((2, 3), "F32"),  # the grid of another shape
        c__weight_scale_inv=((1, 1), "F32"),  # no weight
        d__weight=((256, 256), "F8_E4M3"),
        d__weight_scale_inv=((2, 2), "I32"),
    )
    plan = recast(headers, {"quantization_config": FP8}, "bfloat16")
    said = sorted(p.one_line() for p in plan.problems)
    assert len(said) == 4
    assert "a.weight: an FP8 tensor without its weight_scale_inv" in said[0]
    assert "b.weight: weight_scale_inv [2, 3] is not a scale grid of [256, 256]" in said[1]
    assert "c.weight_scale_inv: a quantization tensor without its FP8 weight" in said[2]
    assert "d.weight: its weight_scale_inv is I32, not a float" in said[3]


def test_fp8_tensors_without_a_quantization_config_and_dtypes_not_floats():
    plan = recast(_headers(w__weight=((4, 4), "F8_E4M3")), {}, "bfloat16")
    assert "config.json has no quantization_config" in plan.problems[0].one_line()
    with pytest.raises(ReshardError, match="--dtype 'int8' is not one of bfloat16, float16, float32"):
        recast({}, None, "int8")


def test_the_config_loses_quantization_config_and_states_the_dtype():
    source = {"model_type": "llama", "dtype": "bfloat16", "quantization_config": FP8}
    assert dequantized_config(source, "float16") == {"model_type": "llama", "dtype": "float16"}
    assert dequantized_config({"torch_dtype": "float32"}, "bfloat16") == {"torch_dtype": "bfloat16"}
    assert dequantized_config({}, "bfloat16") == {"dtype": "bfloat16"}
    assert "quantization_config" in source  # the source's mapping is left alone


def test_a_malformed_compressed_tensors_config_is_one_line():
    bad = compressed_config("channel")
    bad["config_groups"]["group_0"]["weights"] = [8, "float"]
    with pytest.raises(ReshardError, match=r"config_groups.'group_0'.weights is \[8, 'float'\], not a mapping"):
        fp8_format({"quantization_config": bad})
    with pytest.raises(ReshardError, match="quantization_config is 'fp8', not a mapping"):
        fp8_format({"quantization_config": "fp8"})
