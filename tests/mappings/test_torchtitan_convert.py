"""A tiny torchtitan Llama 3 saved with ``torch.distributed.checkpoint`` under torchrun (TP 2, FSDP2 + TP, the fused
``wqkv``, tied embeddings, v0.1's names) converts to transformers' Llama and gives the logits of the model that wrote
it (fp32, atol 1e-5); a conversion that skipped the RoPE permutation would not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fixtures.checks import assert_refused
from fixtures.hf import load_folder, load_rank
from fixtures.titan_dcp import expected

from reshard.config import ModelConfig
from reshard.mappings.base import Entry, Mapping
from reshard.mappings.torchtitan_config import llama_config, titan_model
from reshard.mappings.torchtitan_llama import torchtitan_to_hf
from reshard.mappings.transforms import Rename, RopePermute

HEADS = 'n_heads = 4\nrope_theta = 500000\nrope_scaling = "llama"\n'
JOBS = {  # what each variant's user knows: the job's [model] (v0.1: the head size comes from freqs_cis)
    "v01_tp2": "rope_theta = 500000.0\n",
    "head_fsdp_tp2": HEADS,
    "fused_tp2": HEADS,
    "tied": HEADS + "enable_weight_tying = true\n",
}


def job_file(tmp_path: Path, variant: str) -> Path:
    path = tmp_path / f"{variant}.toml"
    path.write_text(f'[job]\ndump_folder = "./outputs"\n\n[model]\nname = "llama3"\n{JOBS[variant]}')
    return path


def hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' logits for the converted folder; every tensor it holds is one the model uses, none missing."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        return model.eval()(tokens).logits


@pytest.mark.parametrize("variant", list(JOBS))
def test_converted_to_transformers_it_gives_the_writer_s_logits(titan_root, cli, tmp_path, variant: str) -> None:
    want, out = expected(titan_root, variant), tmp_path / "hf"
    result = cli(
        "convert",
        titan_root / variant,
        "--tp",
        1,
        "--layout",
        "hf",
        "-o",
        out,
        "--config",
        job_file(tmp_path, variant),
    )
    assert result.exit_code == 0, result.output
    assert "names torchtitan -> llama" in result.stdout
    torch.testing.assert_close(hf_logits(out, want["tokens"]), want["logits"], atol=1e-5, rtol=0)
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 1001 and config["tie_word_embeddings"] is (variant == "tied")
    assert config["rope_parameters"]["rope_type"] == ("default" if variant == "v01_tp2" else "llama3")
    mapping = json.loads((out / "reshard.json").read_text())["mapping"]
    assert mapping["from"] == "torchtitan" and mapping["to"] == "llama"
    if variant == "fused_tp2":
        assert mapping["tensors"]["layers.1.attention.qkv_linear.wqkv.weight"] == [
            f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"
        ]


def test_split_for_two_ranks_each_rank_holds_its_slice_and_back_gives_the_logits(titan_root, cli, tmp_path) -> None:
    variant, want = "head_fsdp_tp2", expected(titan_root, "head_fsdp_tp2")
    job = job_file(tmp_path, variant)
    whole, ranks, back = tmp_path / "whole", tmp_path / "ranks", tmp_path / "back"
    assert (
        cli("convert", titan_root / variant, "--tp", 1, "--layout", "hf", "-o", whole, "--config", job).exit_code == 0
    )
    result = cli("convert", titan_root / variant, "--tp", 2, "--layout", "hf-ranks", "-o", ranks, "--config", job)
    assert result.exit_code == 0, result.output
    vocab = json.loads((ranks / "reshard.json").read_text())["vocab"]
    assert (vocab["original"], vocab["padded"]) == (1001, 1002)
    full = load_folder(whole)
    halves = [load_rank(ranks, r) for r in range(2)]
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(torch.cat([h[q] for h in halves]), full[q])  # whole heads: 2 of 4 per rank
    o = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(torch.cat([h[o] for h in halves], dim=1), full[o])
    embed = torch.cat([h["model.embed_tokens.weight"] for h in halves])
    assert torch.equal(embed[:1001], full["model.embed_tokens.weight"]) and not embed[1001:].any()
    assert cli("convert", ranks, "--tp", 1, "--layout", "hf", "-o", back).exit_code == 0
    torch.testing.assert_close(hf_logits(back, want["tokens"]), want["logits"], atol=1e-5, rtol=0)


def test_a_transformers_config_json_gives_the_heads_too(titan_root, cli, tmp_path) -> None:
    want = expected(titan_root, "fused_tp2")
    model = titan_model(
        ModelConfig({"model": {"n_heads": 4, "rope_theta": 5e5, "rope_scaling": "llama"}}), _shapes(want)
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(llama_config(model, vocab_size=1001, dtype="float32")))
    out = tmp_path / "hf"
    result = cli("convert", titan_root / "fused_tp2", "--tp", 1, "--layout", "hf", "-o", out, "--config", path)
    assert result.exit_code == 0, result.output
    torch.testing.assert_close(hf_logits(out, want["tokens"]), want["logits"], atol=1e-5, rtol=0)


def test_without_the_heads_or_with_a_flavor_that_does_not_fit_nothing_is_written(titan_root, cli, tmp_path) -> None:
    out = tmp_path / "hf"
    result = cli("convert", titan_root / "head_fsdp_tp2", "--tp", 1, "--layout", "hf", "-o", out)
    assert_refused(result, out, "dim 64, 2 layers, vocab 1001, FFN 192, wq 64 rows, wk 32 rows", "--config")
    wrong = tmp_path / "8b.toml"
    wrong.write_text('[model]\nname = "llama3"\nflavor = "8B"\n')
    result = cli("convert", titan_root / "head_fsdp_tp2", "--tp", 1, "--layout", "hf", "-o", out, "--config", wrong)
    assert_refused(result, out, "does not fit the checkpoint", "dim 4096 vs 64")


def test_inspect_shows_each_tensor_s_transformers_names(titan_root, cli, tmp_path) -> None:
    result = cli("inspect", titan_root / "fused_tp2", "--json", "--config", job_file(tmp_path, "fused_tp2"))
    report = json.loads(result.stdout)
    assert report["plan"] == "torchtitan" and report["mapping"] == "torchtitan -> llama"
    by_name = {t["name"]: t for t in report["tensors"]}
    assert by_name["tok_embeddings.weight"]["partition"] == {"kind": "vocab", "dim": 0}
    assert by_name["layers.0.feed_forward.w3.weight"]["targets"] == ["model.layers.0.mlp.up_proj.weight"]


def test_the_same_table_without_the_permutation_gives_other_logits(titan_root) -> None:
    """What torchtitan#1291 hit: the names alone load, but the model computes something else."""
    from transformers import LlamaConfig, LlamaForCausalLM

    want = expected(titan_root, "head_fsdp_tp2")
    model = titan_model(
        ModelConfig({"model": {"n_heads": 4, "rope_theta": 5e5, "rope_scaling": "llama"}}), _shapes(want)
    )
    config = LlamaConfig(**llama_config(model, vocab_size=1001, dtype="float32"))
    table = torchtitan_to_hf(model.n_heads, model.n_kv_heads, model.head_dim)
    plain = Mapping(
        table.source_family,
        table.target_family,
        tuple(
            Entry(e.sources, e.targets, Rename() if isinstance(e.transform, RopePermute) else e.transform)
            for e in table.entries
        ),
    )
    logits = []
    for mapping in (table, plain):
        groups, _ = mapping.plan(_shapes(want), None)
        state = {}
        for group in groups:
            state.update(
                zip(group.targets, group.transform.apply([want["state"][s] for s in group.sources]), strict=True)
            )
        hf = LlamaForCausalLM(config).eval()
        hf.load_state_dict(state, strict=True)
        with torch.no_grad():
            logits.append(hf(want["tokens"]).logits)
    torch.testing.assert_close(logits[0], want["logits"], atol=1e-5, rtol=0)
    assert (logits[1] - want["logits"]).abs().max() > 0.05, (logits[1] - want["logits"]).abs().max()


def _shapes(want: dict) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in want["state"].items()}


def test_kept_names_split_by_torchtitan_s_plan_stay_then_map_when_described(titan_root, cli, tmp_path) -> None:
    """``--keep-names`` at tp 2 splits torchtitan's tensors as its TP plan does (the fused wqkv by KV group); that
    folder keeps its names when nothing describes the model, and maps from its rank files when ``--config`` does."""
    want, kept, again, hf = expected(titan_root, "fused_tp2"), tmp_path / "kept", tmp_path / "again", tmp_path / "hf"
    assert cli("convert", titan_root / "fused_tp2", "--tp", 2, "--keep-names", "-o", kept).exit_code == 0
    wqkv = "layers.0.attention.qkv_linear.wqkv.weight"
    halves = [load_rank(kept, r)[wqkv] for r in range(2)]
    assert all(torch.equal(h, want["state"][wqkv][r * 64 : (r + 1) * 64]) for r, h in enumerate(halves))
    assert cli("convert", kept, "--tp", 1, "-o", again).exit_code == 0
    assert wqkv in load_folder(again)
    job = job_file(tmp_path, "fused_tp2")
    result = cli("convert", kept, "--tp", 1, "--layout", "hf", "--vocab", 1001, "--config", job, "-o", hf)
    assert result.exit_code == 0, result.output
    torch.testing.assert_close(hf_logits(hf, want["tokens"]), want["logits"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_a_rope_theta_that_is_not_a_finite_number_is_refused_not_written_as_infinity(
    titan_root, cli, tmp_path, value: str
) -> None:
    toml = tmp_path / "inf.toml"
    toml.write_text(f'[model]\nname = "llama3"\nn_heads = 4\nrope_theta = {value}\nrope_scaling = "none"\n')
    out = tmp_path / "hf"
    result = cli("convert", titan_root / "head_fsdp_tp2", "--tp", 1, "--layout", "hf", "-o", out, "--config", toml)
    assert_refused(result, out, "inf.toml", f"rope_theta = {float(value)!r}", "finite numbers")
