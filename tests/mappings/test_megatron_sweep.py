"""A sweep of Megatron arguments: each conversion to transformers gives Megatron-Core's logits or is refused by name.

Issue 28's target: on Megatron-Core-written checkpoints reshard has not seen, no conversion exits 0 with logits
other than Megatron-Core's. Megatron-Core 0.16.1 writes every variant below (two layers, tp 1, ``torch_dist``) in
one subprocess; each is converted with ``--layout hf`` and must either exit 2 with one line naming the argument
transformers cannot compute, or load in transformers with Megatron-Core's logits (fp32, atol 1e-4).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from oracles.variants import Spec

pytestmark = pytest.mark.oracle


def _spec(variant: str = "llama", **overrides: object) -> Spec:
    fields = {"layers": "2", **{k: str(v) for k, v in overrides.items()}}
    return Spec(variant, overrides=tuple(sorted(fields.items())))


# name -> (the writer's variant, None when transformers must compute it, else what the refusal names)
SWEEP: dict[str, tuple[Spec, str | None]] = {
    "llama-untied": (_spec(), None),
    "llama-tied": (_spec(tied=True), None),
    "mha": (_spec(groups=8), None),
    "gqa-1-group": (_spec(groups=1), None),
    "add-bias-linear": (_spec(bias=True), None),
    "add-qkv-bias": (_spec(qkv_bias=True), None),
    "qk-layernorm": (_spec(qk_norm=True), None),
    "rotary-base": (_spec(rotary_base=500000), None),
    "rope-interpolation": (_spec(interpolation=2.0), None),
    "fp32-residual": (_spec(fp32_residual=True), None),
    "norm-eps": (_spec(norm_eps=1e-6), None),
    "kv-channels": (_spec(head_dim=16), None),  # heads x head_dim 128 != hidden 64
    "qk-norm-qkv-bias": (_spec(qk_norm=True, qkv_bias=True), "qk_layernorm=True with add_bias_linear / add_qkv_bias"),
    "gelu": (_spec(act="gelu"), "swiglu=False"),
    "squared-relu": (_spec(act="squared_relu"), "squared_relu=True"),
    "layernorm": (_spec(norm="LayerNorm"), None),  # stablelm
    "rotary-percent": (_spec(rotary_percent=0.5), None),  # glm4_moe's partial_rotary_factor
    "rotary-percent-bias": (_spec(rotary_percent=0.5, bias=True), "add_bias_linear=True with partial rotary"),
    "learned-absolute": (_spec(pos="learned_absolute"), "position_embedding_type='learned_absolute'"),
    "no-positions": (_spec(pos="none"), "position_embedding_type='none'"),
    "softmax-scale": (_spec(softmax_scale=0.5), "softmax_scale=0.5 with softmax_type 'vanilla'"),
    "moe": (_spec("moe"), None),
    "moe-pre-softmax": (_spec("moe", pre_softmax=True), "moe_router_pre_softmax=True"),  # Mixtral renormalizes
    "moe-qk-norm-pre-softmax": (_spec("moe", qk_norm=True, pre_softmax=True), None),
    "moe-bias": (_spec("moe", bias=True), "add_bias_linear=True"),
    "moe-shared-gate": (_spec("moe-shared-gate"), None),
    "moe-top1": (_spec("moe", topk=1, pre_softmax=True, qk_norm=True), None),  # Megatron wants pre-softmax then
    "moe-top3-wide": (_spec("moe", topk=3, moe_ffn=48, ffn=64), None),
    "moe-rotary-base-tied": (_spec("moe", rotary_base=1000, tied=True), None),
}


@pytest.fixture(scope="module")
def written(mcore_oracle) -> dict[str, object]:
    names = sorted(SWEEP)
    return dict(zip(names, mcore_oracle.checkpoints(*(SWEEP[n][0] for n in names)), strict=True))


def _transformers_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.inference_mode():
        return model.eval()(ids).logits


@pytest.mark.parametrize("name", sorted(SWEEP))
def test_a_conversion_computes_megatron_s_logits_or_is_refused_by_name(
    cli, written, tmp_path: Path, name: str
) -> None:
    ckpt, refused_for = written[name], SWEEP[name][1]
    out = tmp_path / "hf"
    result = cli("convert", ckpt.torch_dist, "--tp", 1, "--layout", "hf", "-o", out)
    if refused_for is None:
        assert result.exit_code == 0, result.output
        logits = _transformers_logits(out, ckpt.input_ids)
        torch.testing.assert_close(logits, ckpt.logits, rtol=0, atol=1e-4)
    else:
        assert result.exit_code == 2 and not out.exists(), result.output
        assert len(result.output.strip().splitlines()) == 1 and refused_for in result.output, result.output
