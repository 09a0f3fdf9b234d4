"""``convert --dtype`` planning on headers alone: which tensors are dequantized, cast, kept or dropped, and every
quantization or tensor it does not dequantize refused by name. ``quantization_config`` is read by the one parser,
:func:`reshard.quantization.read_scheme`."""

from __future__ import annotations

import pytest
from fixtures.fp8 import compressed_config

from reshard.dtypes import TensorHeader
from reshard.errors import ReshardError
from reshard.quantization import read_scheme
from reshard.quantization.dequant_plan import dequantized_config, fp8_storage, recast
from reshard.quantization.dequantize import Cast, Dequantize

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
H = TensorHeader


def _scheme(quant: dict | None):
    return read_scheme({"quantization_config": quant} if quant is not None else {})


def _storage(quant: dict):
    return fp8_storage(_scheme(quant))


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
    plan = recast(headers, _scheme(FP8), "bfloat16")
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
    plan = recast(headers, _scheme(compressed_config(strategy, static_input=True)), "float16")
    (unit,) = plan.units
    assert unit.transform == Dequantize(block, "F16", "BF16")
    assert plan.dropped == ("o.input_scale",) and plan.problems == ()


@pytest.mark.parametrize(
    ("quant", "said"),
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "dequantizing gptq 4-bit, group 128 is not"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, "dequantizing awq 4-bit, group 128 is not supported"),
        ({"quant_method": "mxfp4"}, "quant_method 'mxfp4' is not one reshard knows"),
        ({**FP8, "expert_dtype": "fp4"}, "expert_dtype 'fp4' is not planned"),
        ({**FP8, "new_knob": 1}, r"fp8 field\(s\) \['new_knob'\] unknown to reshard"),
        ({**FP8, "weight_block_size": [128]}, "weight_block_size"),
        ({**FP8, "fmt": "e5m2"}, "fp8 fmt 'e5m2' is not planned"),
        ({**FP8, "scale_fmt": "int8"}, "fp8 scale_fmt 'int8' is not planned"),
    ],
)
def test_quantizations_not_dequantized_are_refused_by_name(quant, said):
    with pytest.raises(ReshardError, match=said):
        _storage(quant)


def test_compressed_tensors_int4_and_nvfp4_are_refused_by_name():
    w4 = compressed_config("group")
    w4["config_groups"]["group_0"] |= {"format": "pack-quantized"}
    w4["config_groups"]["group_0"]["weights"] |= {"num_bits": 4, "type": "int", "group_size": 32}
    with pytest.raises(ReshardError, match=r"dequantizing compressed-tensors 4-bit, group 32 is not supported"):
        _storage(w4)
    nvfp4 = compressed_config("tensor")
    nvfp4["format"] = nvfp4["config_groups"]["group_0"]["format"] = "nvfp4-pack-quantized"
    with pytest.raises(ReshardError, match="format 'nvfp4-pack-quantized' .* is not planned"):
        _storage(nvfp4)
    kv = compressed_config("tensor") | {"kv_cache_scheme": {"num_bits": 8}}
    with pytest.raises(ReshardError, match="kv_cache_scheme is not planned"):
        _storage(kv)
    for group, said in (({"output_activations": {"num_bits": 8}}, "output_activations"), ({"knob": 1}, "'knob'")):
        bad = compressed_config("channel")
        bad["config_groups"]["group_0"] |= group
        with pytest.raises(ReshardError, match=said):
            _storage(bad)
    asymmetric = compressed_config("channel")
    asymmetric["config_groups"]["group_0"]["weights"]["symmetric"] = False
    with pytest.raises(ReshardError, match="fp8 weights with a zero point"):
        _storage(asymmetric)


def test_tensors_that_do_not_pair_are_each_a_problem():
    headers = _headers(
        a__weight=((256, 256), "F8_E4M3"),  # no scale
        b__weight=((256, 256), "F8_E4M3"),
        b__weight_scale_inv=((2, 3), "F32"),  # the grid of another shape
        c__weight_scale_inv=((1, 1), "F32"),  # no weight
        d__weight=((256, 256), "F8_E4M3"),
        d__weight_scale_inv=((2, 2), "I32"),
    )
    plan = recast(headers, _scheme(FP8), "bfloat16")
    said = sorted(p.one_line() for p in plan.problems)
    assert len(said) == 4
    assert "a.weight: an FP8 tensor without its weight_scale_inv" in said[0]
    assert "b.weight: weight_scale_inv [2, 3] is not a scale grid of [256, 256]" in said[1]
    assert "c.weight_scale_inv: a quantization tensor without its FP8 weight" in said[2]
    assert "d.weight: its weight_scale_inv is I32, not a float" in said[3]


def test_fp8_tensors_without_a_quantization_config_and_dtypes_not_floats():
    plan = recast(_headers(w__weight=((4, 4), "F8_E4M3")), None, "bfloat16")
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
    with pytest.raises(ReshardError, match="the config group has no weights scheme"):
        _storage(bad)
    with pytest.raises(ReshardError, match="quantization_config: is not an object"):
        _storage("fp8")
