"""Megatron-Core checkpoints converted to transformers compute what Megatron-Core computed.

Megatron-Core 0.16.1 (the oracle, run in subprocesses) writes each model at its parallel layout, in both its
formats (legacy ``torch`` and ``torch_dist``), and its logits on a fixed batch; reshard converts them to
``--layout hf``; transformers' ``from_pretrained`` loads the output and must give the same logits (fp32, atol
1e-5). Nothing here imports Megatron.

DeepSeek-V3-like models (``dsv3``, ``dsv3-te``) go back too: the transformers folder to ``torch_dist``, which
Megatron-Core loads (under Transformer Engine's names, as reshard writes them for GPU runs) with the writer's logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from oracles.variants import Spec

pytestmark = pytest.mark.oracle

CASES = {
    "llama-tp2": (Spec("llama", tp=2), "llama"),
    "llama-tied-tp2": (Spec("llama-tied", tp=2), "llama"),
    "llama-pp2": (Spec("llama", pp=2), "llama"),
    "llama-pp2-vpp2": (Spec("llama", pp=2, vpp=2), "llama"),
    "moe-tp2": (Spec("moe", tp=2), "mixtral"),
    "moe-shared-gate-tp2": (Spec("moe-shared-gate", tp=2), "qwen2_moe"),
    "qk-norm-tp2": (Spec("qk-norm", tp=2), "qwen3"),
    "rope-linear-tp2": (Spec("rope-linear", tp=2), "llama"),  # rope_parameters linear, factor 4
    "moe-dense-first-tp2": (Spec("moe-dense-first", tp=2), "qwen3_moe"),  # mlp_only_layers [0]
    "dsv3-tp2": (Spec("dsv3", tp=2), "deepseek_v3"),  # MLA, YaRN, grouped sigmoid router, scaled top-k
    "dsv3-te": (Spec("dsv3-te"), "deepseek_v3"),  # no q_lora_rank, Transformer Engine's names
    # mlp_only_layers [0] with Qwen2-MoE's gated shared expert (shared_expert_gate)
    "moe-shared-gate-dense-first-tp2": (Spec("moe-shared-gate-dense-first", tp=2), "qwen2_moe"),
    # Transformer Engine's names at tp 2: the legacy files hold MLA's down projections whole on every rank
    "dsv3-te-names-tp2": (Spec("dsv3", tp=2, overrides=(("te_names", "true"),)), "deepseek_v3"),
    # the sigmoid router without an expert bias: DeepseekV3's with a zero e_score_correction_bias
    "dsv3-no-expert-bias-tp2": (Spec("dsv3", tp=2, overrides=(("expert_bias", "false"),)), "deepseek_v3"),
}


def transformers_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.inference_mode():
        return model.eval()(ids).logits


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_megatron_to_transformers_gives_megatron_s_logits(
    cli, mcore_oracle, tmp_path: Path, case: str, fmt: str
) -> None:
    spec, family = CASES[case]
    (ckpt,) = mcore_oracle.checkpoints(spec)
    out = tmp_path / "hf"
    result = cli("convert", getattr(ckpt, fmt), "--tp", 1, "--layout", "hf", "-o", out, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["mapping"]["to"] == family
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == ckpt.variant.vocab and config["tie_word_embeddings"] == ckpt.variant.tied
    logits = transformers_logits(out, ckpt.input_ids)
    torch.testing.assert_close(logits, ckpt.logits, rtol=0, atol=1e-5)


def test_a_shared_expert_without_gate_has_no_transformers_family(cli, mcore_oracle, tmp_path: Path) -> None:
    """Qwen2-MoE gates its shared expert; a Megatron model without the gate computes something no transformers
    family computes: refused, not written as a model that loads and answers differently."""
    (ckpt,) = mcore_oracle.checkpoints(Spec("moe-shared", tp=2))
    out = tmp_path / "hf"
    result = cli("convert", ckpt.torch, "--tp", 1, "--layout", "hf", "-o", out)
    assert result.exit_code == 2 and not out.exists()
    assert "no transformers family: shared experts without a gate" in result.output


def test_qwen2_moe_with_a_dense_layer_back_to_megatron_core(cli, mcore_oracle, tmp_path: Path) -> None:
    """Megatron -> transformers Qwen2-MoE (``mlp_only_layers`` [0], the gated shared expert) -> ``torch_dist`` and the
    ``torch`` format at tp 2, under Transformer Engine's names: Megatron-Core loads both with the writer's logits."""
    (ckpt,) = mcore_oracle.checkpoints(Spec("moe-shared-gate-dense-first", tp=2))
    hf, dist, legacy = tmp_path / "hf", tmp_path / "torch_dist", tmp_path / "legacy"
    for source, out, layout, tp in (
        (ckpt.torch_dist, hf, "hf", 1),
        (hf, dist, "torch_dist", 1),
        (hf, legacy, "megatron", 2),
    ):
        result = cli("convert", source, "--tp", tp, "--layout", layout, "-o", out)
        assert result.exit_code == 0, result.output
    te = Spec(ckpt.spec.variant, tp=2, overrides=(("te_names", "true"),))
    requests = [(dist, "torch_dist", te, "assume_ok_unexpected"), (legacy, "torch", te, "assume_ok_unexpected")]
    for loaded in mcore_oracle.load_many(requests):
        torch.testing.assert_close(loaded["logits"][..., : ckpt.variant.vocab], ckpt.logits, rtol=0, atol=1e-5)


def test_deepseek_v3_without_a_shared_expert_is_refused_by_name(cli, mcore_oracle, tmp_path: Path) -> None:
    """transformers' DeepseekV3 always builds a shared expert (``n_shared_experts`` 0 gives empty weights): a Megatron
    MLA MoE without one is refused, naming the argument."""
    (ckpt,) = mcore_oracle.checkpoints(Spec("dsv3-te", overrides=(("shared_ffn", "0"),)))
    out = tmp_path / "hf"
    result = cli("convert", ckpt.torch_dist, "--tp", 1, "--layout", "hf", "-o", out)
    assert result.exit_code == 2 and not out.exists()
    assert "moe_shared_expert_intermediate_size=None: no shared expert" in result.output


def test_torch_dist_to_the_legacy_format_at_other_tps_loads_in_megatron_core(
    cli, mcore_oracle, tmp_path: Path
) -> None:
    """The modern format back to Megatron-LM's ``torch`` format at tp 4 and tp 1 (pp 2): Megatron-Core loads the
    files strictly at that layout and computes the writer's logits."""
    (ckpt,) = mcore_oracle.checkpoints(Spec("llama", tp=2))
    layouts = {"tp4": ("--tp", 4), "pp2": ("--tp", 1, "--pp", 2)}
    for name, args in layouts.items():
        result = cli("convert", ckpt.torch_dist, *args, "--layout", "megatron", "-o", tmp_path / name)
        assert result.exit_code == 0, result.output
    loads = mcore_oracle.load_many(
        [
            (tmp_path / "tp4", "torch", Spec("llama", tp=4), "assume_ok_unexpected"),
            (tmp_path / "pp2", "torch", Spec("llama", pp=2), "assume_ok_unexpected"),
        ]
    )
    for loaded in loads:
        torch.testing.assert_close(loaded["logits"][..., : ckpt.variant.vocab], ckpt.logits, rtol=0, atol=1e-5)


def test_deepseek_v3_back_to_torch_dist_loads_in_megatron_core(cli, mcore_oracle, tmp_path: Path) -> None:
    """Megatron -> transformers DeepseekV3 -> ``torch_dist`` (and the legacy ``torch`` format at tp 1 and 2):
    Megatron-Core loads it (at tp 2 and 1, under Transformer Engine's names, the names reshard writes) and computes
    the first writer's logits."""
    written = mcore_oracle.checkpoints(Spec("dsv3", tp=2), Spec("dsv3-te"))
    requests = []
    for ckpt, at in zip(written, (2, 1), strict=True):
        name = ckpt.spec.variant
        hf, back = tmp_path / f"{name}-hf", tmp_path / f"{name}-back"
        for source, out, layout in ((ckpt.torch_dist, hf, "hf"), (hf, back, "torch_dist")):
            result = cli("convert", source, "--tp", 1, "--layout", layout, "-o", out)
            assert result.exit_code == 0, result.output
        te = Spec(name, tp=at, overrides=(("te_names", "true"),))
        requests.append((back, "torch_dist", te, "assume_ok_unexpected"))
    legacy = tmp_path / "dsv3-te-legacy"  # and Megatron-LM's torch format, at tp 1
    result = cli("convert", tmp_path / "dsv3-te-hf", "--tp", 1, "--layout", "megatron", "-o", legacy)
    assert result.exit_code == 0, result.output
    requests.append((legacy, "torch", requests[-1][2], "assume_ok_unexpected"))
    legacy2 = tmp_path / "dsv3-legacy-tp2"  # at tp 2: Transformer Engine's whole down projections on every rank
    result = cli("convert", tmp_path / "dsv3-hf", "--tp", 2, "--layout", "megatron", "-o", legacy2)
    assert result.exit_code == 0, result.output
    requests.append((legacy2, "torch", requests[0][2], "assume_ok_unexpected"))
    for ckpt, loaded in zip([*written, written[-1], written[0]], mcore_oracle.load_many(requests), strict=True):
        torch.testing.assert_close(loaded["logits"][..., : ckpt.variant.vocab], ckpt.logits, rtol=0, atol=1e-4)
