"""Quantized checkpoints written by the real libraries on CPU, split at tp 2 and 4: every rank's stored tensors,
dequantized by the format's own code, equal the rank's slice of the whole dequantized weight (the slice a runtime
expects: output rows of q/k/v/gate/up, input columns of o/down, KV heads copied past their count); refusals where
vLLM refuses; a hand-cut wrong axis fails ``verify``.

Writers: transformers' ``Fp8Quantize`` (block FP8), llm-compressor ``oneshot`` (compressed-tensors W4A16, its
asymmetric form, FP8 per-channel), GPTQModel 7.6 (GPTQ, with and without act-order); oracles: transformers'
``Fp8Dequantize``, compressed-tensors' decompressors, GPTQModel's ``TorchLinear.dequantize_weight``.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
from fixtures.quant_venvs import GPTQMODEL, LLMCOMPRESSOR
from fixtures.quantized import (
    AWQ_DEQUANTIZE_SCRIPT,
    AWQ_SCRIPT,
    DECOMPRESS_SCRIPT,
    DENSE,
    GPTQ_DEQUANTIZE_SCRIPT,
    GPTQ_SCRIPT,
    LLMCOMPRESSOR_SCRIPT,
    fp8_block,
    fp8_dequantize,
)
from fixtures.venvs import framework_python
from safetensors.torch import load_file, save_file

from reshard.options import ReadOptions

ROW = re.compile(r"\.(o|down)_proj$")
KV = re.compile(r"\.[kv]_proj$")
CT_SCHEMES = ["W4A16", "W4A16_ASYM", "FP8_DYNAMIC"]


def expected_slice(weight: torch.Tensor, module: str, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s slice of a linear's ``[out, in]`` weight as vLLM cuts it."""
    if ROW.search(module):
        return weight.chunk(tp, 1)[rank]
    heads = DENSE["num_key_value_heads"]
    if KV.search(module) and tp > heads:
        return weight.chunk(heads, 0)[rank // (tp // heads)]
    return weight.chunk(tp, 0)[rank]


def assert_every_rank(whole: dict[str, torch.Tensor], ranks: list[dict[str, torch.Tensor]]) -> int:
    """Every rank's dequantized linears equal their slices of the whole; returns how many were compared."""
    compared = 0
    for module, weight in whole.items():
        for rank, pieces in enumerate(ranks):
            assert torch.equal(pieces[module], expected_slice(weight, module, len(ranks), rank)), (module, rank)
            compared += 1
    return compared


def convert(cli, source: Path, out: Path, tp: int) -> list[Path]:
    result = cli("convert", source, "--tp", tp, "-o", out)
    assert result.exit_code == 0, result.output
    assert cli("verify", out).exit_code == 0  # the manifest, and every rank against the plan's cut
    return [out / f"rank_{r:02d}" / "model.safetensors" for r in range(tp)]


# ---------------------------------------------------------------- block FP8 (transformers)


@pytest.fixture(scope="module")
def fp8(tmp_path_factory) -> Path:
    return fp8_block(tmp_path_factory.mktemp("fp8") / "dense")


def _fp8_linears(path: Path) -> dict[str, torch.Tensor]:
    tensors = load_file(path)
    return {
        name.rpartition(".")[0]: fp8_dequantize(tensors[name.replace("_scale_inv", "")], tensors[name])
        for name in tensors
        if name.endswith(".weight_scale_inv")
    }


@pytest.mark.parametrize("tp", [2, 4])
def test_fp8_block_every_rank_dequantizes_to_its_slice(cli, fp8, tmp_path, tp) -> None:
    ranks = convert(cli, fp8, tmp_path / f"tp{tp}", tp)
    whole = _fp8_linears(fp8 / "model.safetensors")
    assert assert_every_rank(whole, [_fp8_linears(r) for r in ranks]) == 14 * tp


def test_fp8_block_loose_ranks_with_copied_kv_heads_gather_back(cli, fp8, tmp_path) -> None:
    """tp 4 copies each of the 2 KV heads (one 128-row block) onto two ranks; read back as loose rank files, with no
    record of the cut, each head is told from rank 0's share of the ranks (not taken for a quarter of the tensor)."""
    out, loose = tmp_path / "tp4", tmp_path / "loose"
    convert(cli, fp8, out, 4)
    loose.mkdir()
    (loose / "config.json").write_bytes((out / "config.json").read_bytes())
    for rank in range(4):
        (loose / f"model-rank-{rank}.safetensors").write_bytes(
            (out / f"rank_{rank:02d}" / "model.safetensors").read_bytes()
        )
    result = cli("convert", loose, "--tp", 1, "--layout", "hf", "-o", tmp_path / "back")
    assert result.exit_code == 0, result.output
    source, back = load_file(fp8 / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(source)
    assert all(torch.equal(back[n].view(torch.uint8), source[n].view(torch.uint8)) for n in source)


def test_fp8_moe_refused_where_vllm_refuses(cli, tmp_path) -> None:
    """Qwen3-30B-A3B-FP8 at tp 4 in small: 256 expert rows / 4 = 64, not whole 128-row blocks; whatever the flags."""
    moe = fp8_block(tmp_path / "moe", moe=True)
    for flags in ((), ("--uneven",), ("--plan", "transformers")):
        result = cli("convert", moe, "--tp", 4, "-o", tmp_path / "out", *flags)
        assert result.exit_code == 2, (flags, result.output)
        assert "mlp.experts.0." in result.output and "128x128 weight blocks" in result.output, flags
        assert "tp sizes that work: 1, 2" in result.output, flags
        assert not (tmp_path / "out").exists()
    for source in (moe, moe / "config.json"):
        report = json.loads(cli("check", source, "--tp", 4, "--json").output)
        assert not report["ok"] and report["tp_sizes_that_work"] == [1, 2]
    assert cli("convert", moe, "--tp", 2, "-o", tmp_path / "tp2").exit_code == 0


def test_a_wrong_axis_fails_verify(cli, fp8, tmp_path) -> None:
    """q_proj's weight and scales hand-cut on the input axis on both ranks (the manifest saying so): the gathered
    bytes are the same, so only the per-rank check can see it."""
    out = tmp_path / "tp2"
    convert(cli, fp8, out, 2)
    name = "model.layers.0.self_attn.q_proj.weight"
    whole = load_file(fp8 / "model.safetensors")
    for rank in range(2):
        path = out / f"rank_{rank:02d}" / "model.safetensors"
        tensors = load_file(path)
        for key in (name, name + "_scale_inv"):
            tensors[key] = whole[key].chunk(2, 1)[rank].contiguous()
        save_file(tensors, path, metadata={"format": "pt"})
    manifest = json.loads((out / "reshard.json").read_text())
    for key in (name, name.replace(".weight", ".weight_scale_inv")):
        manifest["tensors"][key]["partition"] = {"kind": "shard", "dim": 1}
    (out / "reshard.json").write_text(json.dumps(manifest))
    result = cli("verify", out, "--json")
    assert result.exit_code == 1, result.output
    checks = {c["check"]: c for c in json.loads(result.output)["checks"]}
    assert checks["manifest"]["ok"]  # the gathered bytes are right
    found = {(d["kind"], d["tensor"]) for d in checks["ranks"]["differences"]}
    assert ("rank-slice", name) in found or ("dequantized", "model.layers.0.self_attn.q_proj") in found, found


# ---------------------------------------------------------------- compressed-tensors (llm-compressor)


@pytest.fixture(scope="module")
def compressed(pytestconfig, tmp_path_factory) -> tuple[Path, Path]:
    python = framework_python(pytestconfig, "llmcompressor", LLMCOMPRESSOR)
    folder = tmp_path_factory.mktemp("llmcompressor")
    run = subprocess.run(
        [python, "-c", LLMCOMPRESSOR_SCRIPT, folder, json.dumps(CT_SCHEMES), json.dumps(DENSE)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return python, folder


def test_compressed_tensors_every_rank_decompresses_to_its_slice(cli, compressed, tmp_path) -> None:
    python, folder = compressed
    jobs, layout = [], []
    for scheme in CT_SCHEMES:
        source = folder / scheme
        jobs.append([str(source / "model.safetensors"), str(source / "config.json"), str(tmp_path / f"{scheme}.st")])
        for tp in (2, 4):
            ranks = convert(cli, source, tmp_path / f"{scheme}-tp{tp}", tp)
            targets = [tmp_path / f"{scheme}-tp{tp}-r{r}.st" for r in range(tp)]
            jobs += [[str(r), str(source / "config.json"), str(t)] for r, t in zip(ranks, targets, strict=True)]
            layout.append((tmp_path / f"{scheme}.st", targets))
    run = subprocess.run([python, "-c", DECOMPRESS_SCRIPT, json.dumps(jobs)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    compared = sum(assert_every_rank(load_file(w), [load_file(t) for t in ts]) for w, ts in layout)
    assert compared == 3 * 14 * (2 + 4)
    # per-channel scales: split with a column-parallel layer's rows, whole on a row-parallel one, --uneven or not
    result = cli("convert", folder / "FP8_DYNAMIC", "--tp", 2, "--uneven", "-o", tmp_path / "uneven", "--json")
    assert result.exit_code == 0, result.output
    cuts = {
        k: v["partition"] for k, v in json.loads((tmp_path / "uneven" / "reshard.json").read_text())["tensors"].items()
    }
    assert cuts["model.layers.0.self_attn.o_proj.weight_scale"] == {"kind": "replicate"}
    assert cuts["model.layers.0.mlp.up_proj.weight_scale"]["dim"] == 0


# ---------------------------------------------------------------- GPTQ (GPTQModel)


@pytest.fixture(scope="module")
def gptq(pytestconfig, compressed, tmp_path_factory) -> tuple[Path, Path]:
    python = framework_python(pytestconfig, "gptqmodel", GPTQMODEL)
    folder = tmp_path_factory.mktemp("gptq")
    for act_order in ("0", "1"):
        run = subprocess.run(
            [python, "-c", GPTQ_SCRIPT, compressed[1] / "bf16", folder / f"act{act_order}", act_order],
            capture_output=True,
            text=True,
            cwd=folder,  # GPTQModel writes a logs/ folder where it runs
        )
        assert run.returncode == 0, run.stderr[-3000:]
    run = subprocess.run(
        [python, "-c", AWQ_SCRIPT, compressed[1] / "bf16", folder / "awq"], capture_output=True, text=True, cwd=folder
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return python, folder


def test_awq_every_rank_dequantizes_to_its_slice(cli, gptq, tmp_path) -> None:
    """AWQ GEMM packed by GPTQModel's ``pack_awq``; GPTQModel's ``dequantize_gemm`` is the oracle."""
    python, folder = gptq
    jobs, layout = [[str(folder / "awq" / "model.safetensors"), str(tmp_path / "whole.st")]], []
    for tp in (2, 4):
        targets = [tmp_path / f"tp{tp}-r{r}.st" for r in range(tp)]
        ranks = convert(cli, folder / "awq", tmp_path / f"tp{tp}", tp)
        jobs += [[str(r), str(t)] for r, t in zip(ranks, targets, strict=True)]
        layout.append(targets)
    run = subprocess.run(
        [python, "-c", AWQ_DEQUANTIZE_SCRIPT, json.dumps(jobs)], capture_output=True, text=True, cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr[-3000:]
    whole = load_file(tmp_path / "whole.st")
    assert sum(assert_every_rank(whole, [load_file(t) for t in ts]) for ts in layout) == 14 * (2 + 4)
    # transformers' plan names the modules; each stored tensor still follows its weight (it cut qweight on `in`)
    result = cli("convert", folder / "awq", "--tp", 2, "--plan", "transformers", "-o", tmp_path / "transformers")
    assert result.exit_code == 0, result.output
    for rank in range(2):
        ours = load_file(tmp_path / "tp2" / f"rank_{rank:02d}" / "model.safetensors")
        theirs = load_file(tmp_path / "transformers" / f"rank_{rank:02d}" / "model.safetensors")
        assert all(torch.equal(ours[n], theirs[n]) for n in ours if n.endswith((".qweight", ".qzeros", ".scales")))


@pytest.mark.parametrize("act_order", ["0", "1"])
def test_gptq_every_rank_dequantizes_to_its_slice(cli, gptq, tmp_path, act_order) -> None:
    python, folder = gptq
    source = folder / f"act{act_order}"
    jobs, layout = [[str(source / "model.safetensors"), str(tmp_path / "whole.st")]], []
    for tp in (2, 4):
        targets = [tmp_path / f"tp{tp}-r{r}.st" for r in range(tp)]
        jobs += [
            [str(r), str(t)] for r, t in zip(convert(cli, source, tmp_path / f"tp{tp}", tp), targets, strict=True)
        ]
        layout.append(targets)
    run = subprocess.run(
        [python, "-c", GPTQ_DEQUANTIZE_SCRIPT, json.dumps(jobs), act_order],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    whole = load_file(tmp_path / "whole.st")
    assert sum(assert_every_rank(whole, [load_file(t) for t in ts]) for ts in layout) == 14 * (2 + 4)
    if act_order == "1":  # a row-parallel rank keeps every group's scales, and its own rows' g_idx
        rank = load_file(tmp_path / "tp2" / "rank_01" / "model.safetensors")
        full = load_file(source / "model.safetensors")
        name = "model.layers.0.self_attn.o_proj"
        assert torch.equal(rank[f"{name}.scales"], full[f"{name}.scales"])
        assert torch.equal(rank[f"{name}.g_idx"], full[f"{name}.g_idx"].chunk(2)[1])


def test_the_rank_check_gathers_each_tensor_once(cli, fp8, tmp_path, monkeypatch) -> None:
    """A quantized linear's tensors serve both the slice check and the dequantized check from one gather; the
    others are proven by the numbers or their copies streamed, never gathered."""
    import reshard.commands.verify_ranks as verify_ranks
    import reshard.commands.verify_slices as verify_slices

    out = tmp_path / "tp2"
    convert(cli, fp8, out, 2)
    gathered: list[str] = []
    real = verify_slices.gather_canonical

    def counted(tensor, **kwargs):
        gathered.append(tensor.name)
        return real(tensor, **kwargs)

    monkeypatch.setattr(verify_slices, "gather_canonical", counted)
    checked, diffs = verify_ranks.check_ranks(out, ReadOptions())
    names = json.loads((out / "reshard.json").read_text())["tensors"]
    assert diffs == [] and checked == len(names) and len(gathered) == len(set(gathered))
    assert sum(name.endswith("weight_scale_inv") for name in gathered) == 14
    assert all(name.rsplit(".", 1)[1] in ("weight", "weight_scale_inv") for name in gathered)
