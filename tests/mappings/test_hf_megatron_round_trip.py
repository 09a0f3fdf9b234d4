"""transformers -> Megatron -> transformers gives back every tensor bit for bit, and the config's model.

The fused forms (QKV interleaved per query group, fc1 ``[gate; up]``, experts, the vocab padded the Megatron
way) and their splits are exact inverses, so nothing may differ: not a row, not a bias, not the vocab size.
That Megatron-Core loads the Megatron side with transformers' logits is ``layouts/dcp/test_torch_dist_oracle.py``
and ``test_megatron_oracle.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fixtures.checks import assert_refused
from fixtures.families import build
from fixtures.models import tiny_llama, tiny_qwen3
from safetensors.torch import load_file

# The sizes of the tiny models below: GQA, 8 heads in 2 groups, an odd vocab; no token ids past it.
SIZES = dict(
    vocab_size=1001,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)


def tiny(path: Path, family: str, *, randomize: str = "", **fields: object):
    """transformers' ``{family}Config(**SIZES, **fields)`` as ``{family}ForCausalLM``, seeded and saved; parameters
    whose names hold ``randomize`` (zeros or ones at init) are drawn from a normal distribution."""
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**(SIZES | fields))
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if randomize and randomize in name:
                param.normal_()
    model.save_pretrained(path)
    return model


def tiny_qwen2(path: Path):
    """Qwen2: biases on q, k and v (they go through the fused QKV too)."""
    return tiny(path, "Qwen2", tie_word_embeddings=False)


def tiny_glm4_moe_dense(path: Path):
    """GLM-4.5's family without experts (every layer dense): partial rotary (its config's default 0.5), q/k/v
    biases, per-head query/key norms."""
    fields = dict(head_dim=16, attention_bias=True, use_qk_norm=True, first_k_dense_replace=2, num_mtp_layers=0)
    return tiny(path, "Glm4Moe", **fields)


def tiny_smollm3(path: Path):
    """SmolLM3: a sliding window on layers 0 and 2, no RoPE in layers 1 and 3, biases on every linear, untied."""
    types = ["sliding_attention", "full_attention"] * 2
    fields = dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=5, layer_types=types)
    fields |= dict(no_rope_layers=[1, 0, 1, 0], attention_bias=True, mlp_bias=True, tie_word_embeddings=False)
    return tiny(path, "SmolLM3", **fields)


def tiny_granite_swa(path: Path):
    """granite_swa: random sinks per head, a softmax scale of 0.3, a window on layer 1, no RoPE in layer 0, tied."""
    fields = dict(attention_multiplier=0.3, sliding_window=5, layer_types=["full_attention", "sliding_attention"])
    fields |= dict(layer_rope_theta=[0, 10000.0], rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return tiny(path, "GraniteSWA", randomize="sinks", **fields)


def tiny_stablelm(path: Path):
    """StableLM: LayerNorm with random weights and biases, partial rotary (its config's default 0.25), q/k/v biases."""
    return tiny(path, "StableLm", randomize="norm", use_qkv_bias=True)


def tiny_glm(path: Path):
    """GLM-4 (``glm``): interleaved RoPE pairs on half of each head (its default), q/k/v biases, fused gate_up_proj."""
    return tiny(path, "Glm", head_dim=8, attention_bias=True)


MODELS = {
    "llama-gqa": lambda path: tiny_llama(path, num_key_value_heads=2),
    "llama-tied": lambda path: tiny_llama(path, num_key_value_heads=4, tie=True),
    "qwen2-bias": tiny_qwen2,
    "qwen3-qk-norm": lambda path: tiny_qwen3(path),
    "mixtral": lambda path: build("mixtral", path),
    "qwen2-moe-shared": lambda path: build("qwen2_moe", path),
    "glm4-moe-dense-partial-rotary": tiny_glm4_moe_dense,
    "smollm3-windows-no-rope": tiny_smollm3,
    "granite-swa-sinks": tiny_granite_swa,
    "stablelm-layernorm": tiny_stablelm,
    "glm-interleaved": tiny_glm,
    "llama-quick-gelu": lambda path: tiny(path, "Llama", hidden_act="quick_gelu"),  # Megatron's --quick-geglu
}
# what each family's config says beyond MODEL_KEYS that Megatron's args carry there and back
KEPT = {
    "glm4_moe": ("attention_bias", "use_qk_norm"),
    "smollm3": ("attention_bias", "mlp_bias", "sliding_window", "layer_types", "no_rope_layers"),
    "granite_swa": ("attention_multiplier", "sliding_window", "layer_types", "layer_rope_theta"),
    "stablelm": ("use_qkv_bias", "layer_norm_eps"),
    "glm": ("attention_bias",),
    "llama": ("hidden_act",),
}
# (layout, tp, pp) of the Megatron side
ROUTES = {
    "megatron-tp2": ("megatron", 2, 1),
    "megatron-tp1-pp2": ("megatron", 1, 2),
    "torch_dist": ("torch_dist", 2, 1),
}
MODEL_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")


def weights(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors |= load_file(path)
    return tensors


# every model through the megatron layout at tp 2; pipeline stages and torch_dist on a dense and a MoE model
CASES = [(model, "megatron-tp2") for model in MODELS] + [
    (model, route)
    for model in (
        "llama-gqa",
        "qwen3-qk-norm",
        "mixtral",
        "glm4-moe-dense-partial-rotary",
        "smollm3-windows-no-rope",
        "granite-swa-sinks",
        "stablelm-layernorm",
        "glm-interleaved",
    )
    for route in ("megatron-tp1-pp2", "torch_dist")
]


@pytest.mark.parametrize(("model", "route"), CASES, ids=[f"{m}-{r}" for m, r in CASES])
def test_transformers_to_megatron_and_back_is_bit_exact(cli, tmp_path: Path, model: str, route: str) -> None:
    layout, tp, pp = ROUTES[route]
    MODELS[model](tmp_path / "hf")
    there = cli("convert", tmp_path / "hf", "--layout", layout, "--tp", tp, "--pp", pp, "-o", tmp_path / "mg", "-q")
    assert there.exit_code == 0, there.output
    back = cli("convert", tmp_path / "mg", "--layout", "hf", "--tp", 1, "-o", tmp_path / "back", "-q")
    assert back.exit_code == 0, back.output

    original, returned = weights(tmp_path / "hf"), weights(tmp_path / "back")
    assert sorted(returned) == sorted(original)
    for name, tensor in original.items():
        assert returned[name].dtype == tensor.dtype and torch.equal(returned[name], tensor), name
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    again = json.loads((tmp_path / "back" / "config.json").read_text())
    assert again["model_type"] == config["model_type"]
    assert {k: again[k] for k in MODEL_KEYS} == {k: config[k] for k in MODEL_KEYS}
    assert again.get("tie_word_embeddings", False) == config.get("tie_word_embeddings", False)
    for key in KEPT.get(config["model_type"], ()):
        assert again[key] == config[key], key
    partial = again["rope_parameters"].get("partial_rotary_factor")
    assert partial == config["rope_parameters"].get("partial_rotary_factor"), partial


def test_an_activation_megatron_does_not_gate_is_refused(cli, tmp_path: Path) -> None:
    """A gated GeLU Llama: Megatron's gated MLPs are SiLU (--swiglu) or quick GeLU (--quick-geglu) only."""
    tiny(tmp_path / "hf", "Llama", hidden_act="gelu")
    result = cli("convert", tmp_path / "hf", "--layout", "torch_dist", "--tp", 1, "-o", tmp_path / "mg")
    assert_refused(result, tmp_path / "mg", "hidden_act 'gelu'", "--quick-geglu")
