"""``quantization_config`` read into a scheme: every method reshard plans, and the refusals of a closed world."""

from __future__ import annotations

import pytest

from reshard.errors import ReshardError
from reshard.quantization import read_scheme

FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128], "fmt": "e4m3"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True, "damp_percent": 0.01}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


def test_each_method_read() -> None:
    fp8 = read_scheme({"quantization_config": FP8})
    assert (fp8.method, fp8.strategy, fp8.block) == ("fp8", "block", (128, 128))
    gptq = read_scheme({"quantization_config": GPTQ})
    assert (gptq.method, gptq.group_size, gptq.act_order, gptq.packed) == ("gptq", 128, True, True)
    awq = read_scheme({"quantization_config": AWQ | {"modules_to_not_convert": ["lm_head"]}})
    assert (awq.method, awq.group_size, awq.ignore) == ("awq", 128, ("lm_head",))
    assert read_scheme({"quantization_config": GPTQ | {"group_size": -1}}).strategy == "channel"
    assert read_scheme({"model_type": "llama"}) is None


def test_compressed_tensors_ignore_patterns() -> None:
    config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": False},
            }
        },
        "ignore": ["lm_head", "re:.*mlp\\.gate$"],
    }
    scheme = read_scheme({"quantization_config": config})
    assert (scheme.group_size, scheme.symmetric) == (32, False)
    assert scheme.ignores("lm_head") and scheme.ignores("model.layers.3.mlp.gate")
    assert not scheme.ignores("model.layers.3.mlp.gate_proj")


@pytest.mark.parametrize(
    ("config", "says"),
    [
        (
            {"quant_method": "bitsandbytes", "load_in_4bit": True},
            "quant_method 'bitsandbytes' is not one reshard knows",
        ),
        (FP8 | {"weight_permutation": True}, "field(s) ['weight_permutation'] unknown to reshard"),
        (FP8 | {"weight_block_size": None}, "without weight_block_size"),
        (GPTQ | {"bits": 3}, "bits 3 is not planned"),
        (AWQ | {"version": "gemv"}, "awq format 'gemv' is not planned"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}, "exactly one group"),
    ],
)
def test_refused_by_name(config: dict, says: str) -> None:
    with pytest.raises(ReshardError, match="quantization_config: ") as err:
        read_scheme({"quantization_config": config}, path="config.json")
    assert says in err.value.detail
    assert err.value.path == "config.json"


def test_w8a8_int8_and_per_channel_int4_are_planned() -> None:
    """W8A8 int8 is stored as fp8 per-channel is (``weight`` int8, ``weight_scale [out, 1]``); with
    ``group_size: -1`` a grouped companion is one group for the whole input axis: whole on a row-parallel rank."""
    from reshard.quantization.rules import IN, WHOLE, alignment, companions

    int8 = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}
    config = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "config_groups": {"g": {"weights": int8}},
    }
    scheme = read_scheme({"quantization_config": config})
    assert (scheme.strategy, scheme.bits, scheme.packed) == ("channel", 8, False)
    with pytest.raises(ReshardError, match="asymmetric int8"):
        read_scheme(
            {"quantization_config": config | {"config_groups": {"g": {"weights": int8 | {"symmetric": False}}}}}
        )
    gptq = read_scheme({"quantization_config": GPTQ | {"group_size": -1, "desc_act": False}})
    scales = next(c for c in companions(gptq) if c.suffix == "scales")
    assert scales.dims[0].axis == IN and scales.dims[0].per == WHOLE
    assert alignment(gptq, IN, 768) == 8  # packed words only: 768 input rows split 8 ways (96 a rank)
