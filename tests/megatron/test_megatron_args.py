"""The closed table of Megatron arguments, and Megatron sources whose parts do not add up: refused by name, with
both numbers, before an output exists."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures.megatron import TINY, full_model, megatron_args, write_megatron

from reshard.errors import MappingError, ReshardError
from reshard.layouts.dcp.torch_dist import _stack_problems
from reshard.layouts.megatron.stages import stage_of, stage_of_layers
from reshard.megatron.args import args_problems, check_args, classify
from reshard.megatron.model import count_problems

Full = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def full() -> Full:
    return full_model(TINY)


def write(root: Path, full: Full, **extra: object) -> Path:
    return write_megatron(root, full, 1, args=megatron_args(TINY, 1, record_vocab=True, **extra))


REFUSED = {
    "moe_router_topk_scaling_factor": {"moe_router_topk_scaling_factor": 2.5},
    "moe_router_num_groups": {"moe_router_num_groups": 2, "moe_router_group_topk": 1},
    "moe_router_enable_expert_bias": {"moe_router_enable_expert_bias": True},
    "apply_layernorm_1p": {"apply_layernorm_1p": True},
    "mrope_section": {"mrope_section": [2, 2]},
    "frobnicate": {"frobnicate": 3},  # unknown to the table and set: refused too
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_an_argument_transformers_cannot_compute_is_refused_by_name(
    cli, full: Full, tmp_path: Path, name: str
) -> None:
    ckpt = write(tmp_path / "m", full, **REFUSED[name])
    out = tmp_path / "hf"
    result = cli("convert", ckpt, "--tp", 1, "--layout", "hf", "-o", out)
    assert result.exit_code == 2 and not out.exists(), result.output
    value = REFUSED[name][name]
    assert f"{name}={value!r}" in result.output and len(result.output.strip().splitlines()) == 1


def test_irrelevant_and_default_arguments_pass(cli, full: Full, tmp_path: Path) -> None:
    extra = dict(lr=3e-4, hidden_dropout=0.1, seed=1234, micro_batch_size=4, save_interval=100, use_flash_attn=True)
    extra |= dict(moe_router_topk_scaling_factor=None, moe_router_num_groups=None, some_new_flag=None)
    extra |= dict(pad_vocab_size=True, fim_rate=0.5, high_priority_stream_groups=[])  # unknown, at their defaults
    ckpt = write(tmp_path / "m", full, **extra)
    result = cli("convert", ckpt, "--tp", 1, "--layout", "hf", "-o", tmp_path / "hf")
    assert result.exit_code == 0, result.output


def test_the_table_classifies() -> None:
    assert classify("rotary_seq_len_interpolation_factor") == "carried"
    assert classify("moe_router_group_topk") == "carried"  # into DeepSeek-V3 only: refused by value elsewhere
    assert classify("mrope_section") == "refused"
    assert classify("softmax_type") == classify("window_size") == classify("no_rope_freq") == "carried"
    assert args_problems({"moe_router_group_topk": 1, "multi_latent_attention": True}) == []
    assert args_problems({"moe_router_group_topk": 1}) == [
        "moe_router_group_topk=1 (group-limited routing (DeepSeek-V3's topk_group, with multi-latent attention))"
    ]
    assert classify("attention_dropout") == classify("tensor_model_parallel_size") == "irrelevant"
    assert classify("lr_decay_style") == classify("tokenizer_model") == "irrelevant"
    assert classify("frobnicate") == "unknown"
    assert args_problems({"moe_router_load_balancing_type": ["aux_loss", "seq_aux_loss"]}) == []
    assert args_problems({"pad_vocab_size": True, "mup_width_mult": 1, "frobnicate": None}) == []
    assert args_problems({"moe_router_load_balancing_type": "sinkhorn"})
    with pytest.raises(MappingError, match=r"moe_router_topk_scaling_factor=2\.5"):
        check_args({"moe_router_topk_scaling_factor": 2.5})


def test_interpolated_rope_is_carried_and_a_disagreeing_config_refused(cli, full: Full, tmp_path: Path) -> None:
    ckpt = write(tmp_path / "m", full, rotary_seq_len_interpolation_factor=4, rotary_base=500000)
    out = tmp_path / "hf"
    result = cli("convert", ckpt, "--tp", 1, "--layout", "hf", "-o", out)
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"] == {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0}

    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    given = tmp_path / "config.json"
    given.write_text(json.dumps(config))
    refused = tmp_path / "refused"
    result = cli("convert", ckpt, "--tp", 1, "--layout", "hf", "--config", given, "-o", refused)
    assert result.exit_code == 2 and not refused.exists(), result.output
    assert "RoPE default" in result.output and "linear factor 4.0" in result.output


def test_layer_patterns_are_carried_into_smollm3(cli, full: Full, tmp_path: Path) -> None:
    """Megatron's window (left 3, right 0) on every 2nd layer (1-based: the 2nd is full) and no RoPE in the 1st."""
    ckpt = write(tmp_path / "m", full, window_size=(3, 0), window_attn_skip_freq=2, no_rope_freq=[1, 0])
    out = tmp_path / "hf"
    result = cli("convert", ckpt, "--tp", 1, "--layout", "hf", "-o", out)
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["sliding_window"], config["use_sliding_window"]) == ("smollm3", 4, True)
    assert config["layer_types"] == ["sliding_attention", "full_attention"] and config["no_rope_layers"] == [0, 1]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"window_size": (4, 2)}, "window_size=(4, 2): reshard carries a causal sliding window (left >= 0, right 0)"),
        ({"window_size": (-1, 0)}, "window_size=(-1, 0): reshard carries a causal sliding window"),
        ({"window_size": (4, 0), "window_attn_skip_freq": [1, 0, 1]}, "window_attn_skip_freq=[1, 0, 1]: neither"),
        ({"no_rope_freq": 0}, "no_rope_freq=0: neither a positive int nor a list of 2"),
        ({"no_rope_freq": 2, "rotary_percent": 0.5}, "no_rope_freq: layers without RoPE (glm4_moe has none"),
        ({"window_size": (4, 0), "qk_layernorm": True}, "qk_layernorm=True with sliding-window attention"),
        ({"rotary_percent": 1.5}, "rotary_percent=1.5: not a number in (0, 1]"),
        ({"softmax_type": "learnable", "qk_layernorm": True}, "qk_layernorm=True with an attention sink"),
        ({"softmax_type": "sigmoid"}, "softmax_type='sigmoid': Megatron-Core computes vanilla, off-by-one, learnable"),
        (
            {"softmax_scale": 0.5, "rotary_percent": 0.5},
            "softmax_scale=0.5: another softmax scale (glm4_moe has none)",
        ),
        ({"rotary_interleaved": True, "qk_layernorm": True}, "qk_layernorm=True with rotary_interleaved (glm has no"),
        ({"rotary_interleaved": True, "window_size": (3, 0)}, "window_size: sliding-window attention (glm has none"),
    ],
    ids=[
        "right",
        "unbounded",
        "skip-list",
        "no-rope-0",
        "no-rope-partial",
        "window-qk-norm",
        "percent",
        "sinks-qk-norm",
        "softmax-type",
        "scale-partial",
        "interleaved-qk-norm",
        "interleaved-window",
    ],
)
def test_layer_patterns_no_family_computes_are_refused(
    cli, full: Full, tmp_path: Path, extra: dict, message: str
) -> None:
    ckpt = write(tmp_path / "m", full, **extra)
    out = tmp_path / "hf"
    result = cli("convert", ckpt, "--tp", 1, "--layout", "hf", "-o", out)
    assert result.exit_code == 2 and not out.exists(), result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1, result.output


@pytest.mark.parametrize("layout", ["hf", "megatron"])
def test_args_counting_other_layers_than_the_tensors_are_refused(cli, full: Full, tmp_path: Path, layout: str) -> None:
    args = megatron_args(TINY, 1, record_vocab=True)
    args.num_layers = 3
    ckpt = write_megatron(tmp_path / "m", full, 1, args=args)
    out = tmp_path / "out"
    result = cli("convert", ckpt, "--tp", 1, "--layout", layout, "-o", out)
    assert result.exit_code == 2 and not out.exists(), result.output
    assert "num_layers=3" in result.output and "hold 2 layers" in result.output
    assert "Traceback" not in result.output


def test_counts_of_layers_and_experts() -> None:
    expert = "decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc{}.weight"
    names = [expert.format(0, e, 1) for e in range(4)] + [expert.format(0, e, 2) for e in range(3)]
    (problem,) = count_problems(names, {"num_layers": 1, "num_experts": 4})
    assert "linear_fc1.weight 4" in problem and "linear_fc2.weight 3" in problem
    names = [expert.format(0, e, k) for e in range(3) for k in (1, 2)]
    assert count_problems(names, {"num_layers": 1, "num_experts": 4}) == [
        "the args say num_experts=4, but layer 0 holds 3 experts"
    ]
    assert count_problems(names, {"num_layers": 1, "num_experts": 3}) == []


def test_stacked_tensors_holding_different_layer_counts() -> None:
    shapes = {
        "decoder.layers.self_attention.linear_qkv.weight": (2, 48, 32),
        "decoder.layers.mlp.linear_fc1.weight": (3, 96, 32),
        "decoder.layers.mlp.experts.experts.linear_fc1.weight": (2, 4, 64, 32),
        "decoder.layers.mlp.experts.experts.linear_fc2.weight": (2, 3, 32, 32),
        "embedding.word_embeddings.weight": (64, 32),
    }
    layers, experts = _stack_problems(shapes)
    assert "different numbers of layers" in layers and "linear_fc1.weight 3" in layers and "weight 2" in layers
    assert "different numbers of experts" in experts and " 4" in experts and " 3" in experts


def test_a_layer_past_the_stages_is_an_error_not_a_traceback() -> None:
    with pytest.raises(ReshardError, match="layer 2 is past the 2 layers"):
        stage_of("decoder.layers.2.mlp.linear_fc1.weight", stage_of_layers(2, 2))


@pytest.mark.oracle
def test_every_field_of_megatron_core_s_transformer_config_is_in_the_table() -> None:
    """Megatron-Core 0.16.1's ``TransformerConfig`` (with ``ModelParallelConfig``), read in a subprocess: every
    field is carried, refused or irrelevant, except the three Megatron-LM calls otherwise (``swiglu``,
    ``num_experts``), which are refused when set."""
    code = "import dataclasses, json; from megatron.core.transformer import TransformerConfig as T; "
    code += "print(json.dumps([f.name for f in dataclasses.fields(T)]))"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    fields = json.loads(found.stdout.strip().splitlines()[-1])
    assert len(fields) > 200
    unknown = {f for f in fields if classify(f) == "unknown"}
    assert unknown == {"gated_linear_unit", "activation_func", "num_moe_experts"}


DSV3 = dict(
    num_layers=3,
    hidden_size=64,
    ffn_hidden_size=96,
    num_attention_heads=4,
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    norm_epsilon=1e-6,
    add_bias_linear=False,
    qk_layernorm=True,
    multi_latent_attention=True,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_shared_expert_intermediate_size=32,
    moe_layer_freq=[0, 1, 1],
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_num_groups=2,
    moe_router_group_topk=1,
)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"moe_router_topk": 4, "moe_router_num_groups": 2, "moe_router_group_topk": 1}, "moe_router_group_topk=1"),
        ({"moe_router_score_function": "softmax"}, "moe_router_score_function='softmax'"),
        ({"moe_shared_expert_intermediate_size": None}, "moe_shared_expert_intermediate_size=None: no shared expert"),
        ({"moe_shared_expert_gate": True}, "moe_shared_expert_gate=True"),
        ({"moe_layer_freq": [1, 0, 1]}, "moe_layer_freq"),
        ({"norm_epsilon": 1e-5}, "norm_epsilon=1e-05"),
        ({"mscale": 0.5, "mscale_all_dim": 0.0}, "mscale=0.5"),
        ({"rope_type": "rope", "rotary_scaling_factor": 40.0, "mscale_all_dim": 1.0}, "rope_type='rope'"),
    ],
)
def test_deepseek_v3_settings_transformers_does_not_compute_are_refused_by_name(change: dict, named: str) -> None:
    from reshard.megatron.config import gpt_shape_from_args, hf_family

    assert hf_family(gpt_shape_from_args(DSV3)) == "deepseek_v3"
    with pytest.raises(MappingError, match=re.escape(named)):
        hf_family(gpt_shape_from_args(DSV3 | change))


def test_a_sigmoid_router_without_expert_bias_is_deepseek_v3_with_a_zero_bias() -> None:
    """Megatron's sigmoid router without ``expert_bias`` chooses experts by the scores alone: DeepseekV3's router with
    ``e_score_correction_bias`` zero, which the mapping writes (proven by logits in ``test_megatron_oracle.py``)."""
    from reshard.mappings.megatron.gpt import megatron_to_hf
    from reshard.megatron.config import gpt_shape_from_args, hf_family

    assert hf_family(gpt_shape_from_args(DSV3 | {"moe_router_enable_expert_bias": False})) == "deepseek_v3"
    names = {"decoder.layers.1.mlp.router.weight": (4, 64)}
    (group,), _ = megatron_to_hf("deepseek_v3", expert_bias=False).plan(names, None)
    assert group.targets == ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias")
    assert group.shapes == ((4, 64), (4,))


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("pad_vocab_size", False),  # a flag Megatron-LM defaults to True, found False
        ("mup_width_mult", 2.0),  # a number away from its recorded default
        ("gated_linear_unit", True),
        ("frobnicate", False),  # no recorded default: only None passes
    ],
)
def test_an_unknown_argument_away_from_its_default_is_refused(name: str, value: object) -> None:
    assert classify(name) == "unknown"
    assert args_problems({name: value}) == [
        f"{name}={value!r} (an argument reshard does not know: it may change the model)"
    ]


def test_the_defaults_are_megatron_lms() -> None:
    """Spot checks of the generated table against Megatron-LM's source (scripts/megatron_defaults.py)."""
    from reshard.megatron.defaults import DEFAULTS, RELEASES

    assert RELEASES == ("core_v0.16.1", "core_v0.19.0")
    assert DEFAULTS["bias_gelu_fusion"] == DEFAULTS["add_bias_linear"] == DEFAULTS["masked_softmax_fusion"] == (True,)
    assert DEFAULTS["normalization"] == ("LayerNorm",) and DEFAULTS["rotary_percent"] == (1.0,)
    assert DEFAULTS["hidden_dropout"] == (0.1,) and DEFAULTS["num_moe_experts"] == (None,)
