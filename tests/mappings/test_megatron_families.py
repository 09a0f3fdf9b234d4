"""Megatron models off the Llama path that another transformers family computes exactly (issue 46), proven against
Megatron-Core 0.19.2 on CPU: it writes each model at tp 2 (``torch_dist`` and the legacy ``torch`` format, random
nonzero norms and biases), reshard converts it with ``--layout hf``, and transformers gives Megatron-Core's logits;
the ``hf`` output converted back (``--layout torch_dist``) loads in Megatron-Core with the same logits.

- ``rotary_percent`` < 1 (partial rotary): transformers' ``glm4_moe`` rotates the first ``head_dim x
  partial_rotary_factor`` channels of each head with rotate-half pairs, as Megatron-Core does; its dense layers are
  Llama's, with q/k/v biases and per-head query/key norms. With biases on every linear it is refused by name.
- ``window_size`` / ``window_attn_skip_freq`` (sliding windows, on some layers) and ``no_rope_freq`` (layers without
  RoPE): transformers' ``smollm3`` (Llama with ``layer_types`` and ``no_rope_layers``); Megatron's window ``(left,
  0)`` is ``sliding_window`` ``left + 1``. With query/key norms it is refused by name.
- ``softmax_type`` ``learnable`` / ``off-by-one`` (a logit per head, or zero, beside every softmax row) and
  ``softmax_scale``: transformers' ``granite_swa`` (Llama with ``sinks`` per head, ``attention_multiplier``, the same
  layer patterns); off-by-one's sinks are zeros.
- ``normalization`` ``LayerNorm`` (weights and biases) with SwiGLU: transformers' ``stablelm`` (partial rotary and
  q/k/v biases too). With biases on every linear it is refused by name.
- ``rotary_interleaved`` (GPT-J pairs): transformers' ``glm`` (GLM-4: interleaved pairs, partial rotary, q/k/v
  biases, ``gate_up_proj`` = ``linear_fc1``).
- ``quick_geglu`` (quick_gelu(gate) x up, without ``glu_linear_offset`` and clamp): Llama with ``hidden_act``
  ``quick_gelu``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from fixtures.checks import assert_refused
from fixtures.mcore19 import mcore19_python, written_by_mcore19
from oracles import run_jobs
from oracles.variants import Spec
from test_megatron_oracle import transformers_logits

from reshard.cli import main

pytestmark = pytest.mark.oracle

TOLERANCE = 1e-4  # fp32


def _spec(**overrides: object) -> Spec:
    return Spec("llama", tp=2, overrides=tuple(sorted((k, str(v)) for k, v in overrides.items())))


# name -> (the writer's model, the transformers family reshard writes)
SPECS = {
    "partial-rotary": (_spec(rotary_percent=0.5), "glm4_moe"),
    "partial-rotary-qk-norm-qkv-bias-tied": (
        _spec(rotary_percent=0.25, head_dim=16, qk_norm=True, qkv_bias=True, tied=True, layers=2),
        "glm4_moe",
    ),
    # a query sees itself and 3 keys before it (of 12), in layers 1 and 3 (every 2nd layer full)
    "sliding-window": (_spec(window=3, window_skip=2), "smollm3"),
    "no-rope-biases-tied": (_spec(no_rope=2, bias=True, tied=True), "smollm3"),  # layers 2 and 4 without RoPE
    "sinks-learnable-window-biases": (_spec(softmax="learnable", window=3, bias=True), "granite_swa"),
    "sinks-off-by-one-scale-no-rope": (
        _spec(softmax="off-by-one", softmax_scale=0.5, no_rope=2, tied=True, layers=2),
        "granite_swa",
    ),
    "layernorm-partial-rotary-qkv-bias": (_spec(norm="LayerNorm", rotary_percent=0.5, qkv_bias=True), "stablelm"),
    "interleaved-partial-rotary-qkv-bias": (_spec(interleaved=True, rotary_percent=0.5, qkv_bias=True), "glm"),
    "quick-geglu": (_spec(act="quick_geglu", layers=2), "llama"),  # hidden_act quick_gelu
}
# name -> (the writer's model, what the one-line refusal names)
REFUSED = {
    "partial-rotary-all-biases": (_spec(rotary_percent=0.5, bias=True, layers=2), "add_bias_linear=True with partial"),
    "sliding-window-qk-norm": (_spec(window=3, qk_norm=True, layers=2), "qk_layernorm=True with sliding-window"),
    "layernorm-all-biases": (_spec(norm="LayerNorm", bias=True, layers=2), "add_bias_linear=True with LayerNorm"),
}


@pytest.fixture(scope="module")
def mcore19(pytestconfig: pytest.Config) -> Path:
    return mcore19_python(pytestconfig)


@pytest.fixture(scope="module")
def written(pytestconfig: pytest.Config, mcore19: Path) -> Path:
    """Every model of ``SPECS`` and ``REFUSED``, saved by Megatron-Core 0.19.2 in one run, cached across sessions."""
    specs = {name: spec for name, (spec, _) in (SPECS | REFUSED).items()}
    return written_by_mcore19(pytestconfig, mcore19, specs, "mcore-0.19-families")


def _reference(written: Path, name: str) -> dict:
    spec = (SPECS | REFUSED)[name][0]
    ref = torch.load(written / name / "reference.pt", weights_only=True)
    return ref | {"logits": ref["logits"][..., : spec.model().vocab]}


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
@pytest.mark.parametrize("name", list(SPECS))
def test_transformers_computes_megatron_core_s_logits(cli, written: Path, tmp_path: Path, name: str, fmt: str) -> None:
    out = tmp_path / "hf"
    result = cli("convert", written / name / fmt, "--tp", 1, "--layout", "hf", "-o", out)
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == SPECS[name][1]
    ref = _reference(written, name)
    torch.testing.assert_close(transformers_logits(out, ref["input_ids"]), ref["logits"], rtol=0, atol=TOLERANCE)


@pytest.fixture(scope="module")
def loaded_back(written: Path, mcore19: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """Each model of ``SPECS`` through transformers and back to ``torch_dist``, loaded by Megatron-Core 0.19.2 at
    tp 2 (built from its own spec, other random weights first): its logits, every model in one run."""
    runner, root = CliRunner(), tmp_path_factory.mktemp("back")
    jobs = []
    for name, (spec, _) in SPECS.items():
        hf, dist = root / name / "hf", root / name / "dist"
        for source, out, layout in ((written / name / "torch_dist", hf, "hf"), (hf, dist, "torch_dist")):
            result = runner.invoke(main, ["convert", str(source), "--tp", "1", "--layout", layout, "-o", str(out)])
            assert result.exit_code == 0, result.output
        job = {"command": "load", "spec": spec.to_json(), "ckpt": str(dist), "format": "torch_dist"}
        jobs.append(job | {"strict": "assume_ok_unexpected", "out": str(root / name / "logits.pt")})
    run_jobs(jobs, nproc=2, python=mcore19)
    return {name: torch.load(job["out"], weights_only=True)["logits"] for name, job in zip(SPECS, jobs, strict=True)}


@pytest.mark.parametrize("name", list(SPECS))
def test_back_to_megatron_core_with_its_logits(written: Path, loaded_back: dict, name: str) -> None:
    """Megatron-Core -> transformers -> ``torch_dist`` -> Megatron-Core: the first writer's logits."""
    ref = _reference(written, name)
    logits = loaded_back[name][..., : ref["logits"].shape[-1]]
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_no_family_computes_is_refused_by_name(cli, written: Path, tmp_path: Path, name: str) -> None:
    out = tmp_path / "hf"
    result = cli("convert", written / name / "torch_dist", "--tp", 1, "--layout", "hf", "-o", out)
    assert_refused(result, out, REFUSED[name][1])
