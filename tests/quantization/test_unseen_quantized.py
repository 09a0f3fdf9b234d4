"""Issue 30's unseen set: quantized checkpoints of shapes and schemes the other quantization tests do not use,
written by the libraries on CPU (``fixtures.quantized_unseen``), converted at tp 2, 4 and 8 with the built-in
plan and the escape hatches users try (``--uneven``, ``--plan transformers``). Each conversion either writes
ranks whose quantized tensors, dequantized by the library's own code, equal the rank's slice of the
dequantized whole (vLLM's cut: fused q/k/v and gate/up part by part, KV heads copied past their count), or
exits 2 naming the tensor and the rule. The outcome of every case is pinned in :data:`OUTCOMES`.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
from fixtures.quant_venvs import GPTQMODEL, LLMCOMPRESSOR
from fixtures.quantized import DECOMPRESS_SCRIPT, fp8_block_of, fp8_dequantize
from fixtures.quantized_unseen import (
    CT_JOBS,
    CT_SCRIPT,
    GPTQ_DEQUANTIZE_SCRIPT,
    GPTQ_JOBS,
    GPTQ_SCRIPT,
    MODELS,
    SIZES,
)
from fixtures.venvs import framework_python
from safetensors.torch import load_file, save_file

ROW = re.compile(r"\.(o|down)_proj$")
KV = re.compile(r"\.[kv]_proj$")
FLAGS = {"": (), "uneven": ("--uneven",), "transformers": ("--plan", "transformers")}
# (checkpoint, tp, flags) -> "ok" or the rule a refusal names. kv heads 1 < tp: the transformers plan is not
# tried on the GQA model (`check` refuses it: a head would be cut). The fused qkv of Phi-3 at tp 4 holds 2 KV
# heads, fewer than the ranks: refused (the plain phi3 plan does not copy heads inside a fused tensor).
# GPTQModel writes Phi-3's MLP unfused (gate_proj, up_proj), which transformers' phi3 plan does not name.
BLOCKS, GROUPS, HEADS = "128x128 weight blocks", "groups of 128", "cannot hold whole"
OUTCOMES = {
    ("phi3-W4A16", 2, ""): "ok",
    ("phi3-W4A16", 2, "transformers"): "ok",
    ("phi3-W4A16", 4, ""): HEADS,
    ("phi3-W4A16", 4, "uneven"): HEADS,
    ("phi3-W4A16", 4, "transformers"): "ok",
    ("phi3-W4A16", 8, ""): GROUPS,
    ("phi3-FP8_BLOCK", 2, ""): "ok",
    ("phi3-FP8_BLOCK", 2, "transformers"): "ok",
    ("phi3-FP8_BLOCK", 4, ""): BLOCKS,
    ("phi3-FP8_BLOCK", 4, "uneven"): BLOCKS,
    ("phi3-FP8_BLOCK", 4, "transformers"): "ok",
    ("phi3-FP8_BLOCK", 8, ""): BLOCKS,
    ("phi3-fp8", 2, ""): "ok",
    ("phi3-fp8", 4, ""): BLOCKS,
    ("phi3-fp8", 4, "transformers"): "ok",
    ("phi3-gptq", 2, ""): "ok",
    ("phi3-gptq", 4, ""): HEADS,
    ("phi3-gptq", 8, ""): GROUPS,
    ("moe-W4A16", 2, ""): "ok",
    ("moe-W4A16", 2, "transformers"): "ok",
    ("moe-W4A16", 4, ""): GROUPS,
    ("moe-W4A16", 4, "uneven"): GROUPS,
    ("moe-W4A16", 4, "transformers"): GROUPS,
    ("moe-FP8_BLOCK", 2, ""): "ok",
    ("moe-FP8_BLOCK", 2, "transformers"): "ok",
    ("moe-FP8_BLOCK", 4, ""): BLOCKS,
    ("moe-FP8_BLOCK", 4, "uneven"): BLOCKS,
    ("moe-FP8_BLOCK", 4, "transformers"): BLOCKS,
    ("gqa-W4A16-channel", 2, ""): "ok",
    ("gqa-W4A16-channel", 4, ""): "ok",
    ("gqa-W4A16-channel", 8, ""): "ok",
    ("gqa-W8A8", 2, ""): "ok",
    ("gqa-W8A8", 4, ""): "ok",
    ("gqa-W8A8", 8, "uneven"): "ok",
    ("gqa-W4A16-ignore", 2, ""): "ok",
    ("gqa-W4A16-ignore", 4, ""): GROUPS,
    ("gqa-W4A16-ignore", 4, "uneven"): GROUPS,
    ("gqa-W4A16-lm_head", 2, ""): "vocab(dim=0) of a compressed-tensors linear is not planned",
    ("gqa-FP8_BLOCK", 2, ""): "ok",
    ("gqa-FP8_BLOCK", 4, ""): BLOCKS,
    ("gqa-FP8_BLOCK", 4, "uneven"): BLOCKS,
    ("gqa-FP8_BLOCK", 8, ""): BLOCKS,
    ("gqa-gptq-channel", 2, ""): "ok",
    ("gqa-gptq-channel", 4, ""): "ok",
    ("gqa-gptq-channel", 8, "uneven"): "ok",
    ("gqa-gptq-act", 2, ""): "ok",
    ("gqa-gptq-act", 4, ""): "ok",  # 192 input rows a rank: groups straddle ranks, act-order keeps scales whole
    ("gqa-gptq-act", 8, "uneven"): "ok",
    ("gqa-gptq-g128", 2, ""): "ok",
    ("gqa-gptq-g128", 4, ""): GROUPS,
    ("gqa-gptq-g128", 4, "uneven"): GROUPS,
}


def model_of(checkpoint: str) -> str:
    return checkpoint.split("-")[0]


def _chunk(part: torch.Tensor, tp: int, rank: int, heads: int) -> torch.Tensor:
    """A column-parallel part's rows of ``rank``; ``heads`` KV heads fewer than the ranks are copied."""
    if heads and tp > heads:
        return part.chunk(heads, 0)[rank // (tp // heads)]
    return part.chunk(tp, 0)[rank]


def expected_slice(weight: torch.Tensor, module: str, model: str, tp: int, rank: int, plan: str) -> torch.Tensor:
    """Rank ``rank``'s slice of a linear's ``[out, in]`` weight: vLLM's cut for the built-in plans, contiguous
    rows of a fused tensor for transformers' (``colwise_gather_output``)."""
    sizes = SIZES[model]
    if ROW.search(module):
        return weight.chunk(tp, 1)[rank]
    if plan == "transformers" or module == "lm_head":
        return weight.chunk(tp, 0)[rank]
    kv = sizes["num_key_value_heads"]
    if module.endswith("qkv_proj"):
        head = sizes.get("head_dim") or sizes["hidden_size"] // sizes["num_attention_heads"]
        q, k, v = weight.split([sizes["num_attention_heads"] * head, kv * head, kv * head])
        return torch.cat([_chunk(q, tp, rank, 0), _chunk(k, tp, rank, kv), _chunk(v, tp, rank, kv)])
    if module.endswith("gate_up_proj"):
        return torch.cat([_chunk(half, tp, rank, 0) for half in weight.chunk(2, 0)])
    return _chunk(weight, tp, rank, kv if KV.search(module) else 0)


@pytest.fixture(scope="module")
def unseen(pytestconfig, tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """Every checkpoint of the set: one llm-compressor process, one GPTQModel process, transformers' FP8."""
    folder = tmp_path_factory.mktemp("unseen")
    ct_python = framework_python(pytestconfig, "llmcompressor", LLMCOMPRESSOR)
    run = subprocess.run(
        [ct_python, "-c", CT_SCRIPT, folder, json.dumps(MODELS), json.dumps(CT_JOBS)],
        capture_output=True,
        text=True,
        cwd=folder,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    gptq_python = framework_python(pytestconfig, "gptqmodel", GPTQMODEL)
    run = subprocess.run(
        [gptq_python, "-c", GPTQ_SCRIPT, folder, json.dumps(GPTQ_JOBS)], capture_output=True, text=True, cwd=folder
    )
    assert run.returncode == 0, run.stderr[-3000:]
    fp8_block_of(folder / "phi3", folder / "phi3-fp8")
    return folder, {"ct": ct_python, "gptq": gptq_python}


def test_every_case_is_right_or_refused_by_name(cli, unseen, tmp_path) -> None:
    folder, python = unseen
    ct_jobs, gptq_jobs, compared = [], [], []
    for (name, tp, flag), expected in OUTCOMES.items():
        source, out = folder / name, tmp_path / f"{name}-tp{tp}-{flag}"
        result = cli("convert", source, "--tp", tp, "-o", out, *FLAGS[flag])
        if expected != "ok":
            assert result.exit_code == 2 and expected in result.output, (name, tp, flag, result.output)
            assert not out.exists()
            continue
        assert result.exit_code == 0, (name, tp, flag, result.output)
        if tp == 2 and not flag:  # verify's own per-rank check agrees (once per checkpoint: it dequantizes)
            assert cli("verify", out).exit_code == 0, (name, tp)
        ranks = [out / f"rank_{r:02d}" / "model.safetensors" for r in range(tp)]
        targets = [tmp_path / f"{out.name}-r{r}.st" for r in range(tp)]
        if name.endswith("fp8"):
            for rank, target in zip(ranks, targets, strict=True):
                tensors = load_file(rank)
                save_file(_fp8_linears(tensors), target)
        elif "gptq" in name:
            group, act = next((g, a) for o, _, g, a in GPTQ_JOBS if o == name)
            gptq_jobs += [[str(r), str(t), group, act] for r, t in zip(ranks, targets, strict=True)]
        else:
            ct_jobs += [[str(r), str(source / "config.json"), str(t)] for r, t in zip(ranks, targets, strict=True)]
        compared.append((name, tp, flag, targets))
    wholes = {}
    for name in {c[0] for c in compared}:
        wholes[name] = target = tmp_path / f"{name}-whole.st"
        stored = folder / name / "model.safetensors"
        if name.endswith("fp8"):
            save_file(_fp8_linears(load_file(stored)), target)
        elif "gptq" in name:
            group, act = next((g, a) for o, _, g, a in GPTQ_JOBS if o == name)
            gptq_jobs.append([str(stored), str(target), group, act])
        else:
            ct_jobs.append([str(stored), str(folder / name / "config.json"), str(target)])
    for kind, script, jobs in (("ct", DECOMPRESS_SCRIPT, ct_jobs), ("gptq", GPTQ_DEQUANTIZE_SCRIPT, gptq_jobs)):
        run = subprocess.run(
            [python[kind], "-c", script, json.dumps(jobs)], capture_output=True, text=True, cwd=tmp_path
        )
        assert run.returncode == 0, run.stderr[-3000:]
    checked = 0
    for name, tp, flag, targets in compared:
        whole = load_file(wholes[name])
        assert whole, name
        pieces = [load_file(t) for t in targets]
        for module, weight in whole.items():
            for rank in range(tp):
                want = expected_slice(weight, module, model_of(name), tp, rank, flag)
                assert torch.equal(pieces[rank][module], want), (name, tp, flag, module, rank)
                checked += 1
    assert checked == 1088, checked  # every quantized linear of every rank of every "ok" case


def _fp8_linears(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        name.rpartition(".")[0]: fp8_dequantize(tensors[name.replace("_scale_inv", "")], tensors[name])
        for name in tensors
        if name.endswith(".weight_scale_inv")
    }


# (checkpoint, tensor, the wrong cut's dim): each hand-cut on the wrong axis on both ranks, the manifest saying
# so, so the gathered bytes stay right and only the per-rank check can see it.
WRONG_CUTS = [
    ("phi3-W4A16", "model.layers.0.self_attn.qkv_proj", ("weight_packed", "weight_scale"), 0),  # contiguous rows
    ("moe-FP8_BLOCK", "model.layers.0.mlp.experts.1.down_proj", ("weight", "weight_scale"), 0),
    ("gqa-W4A16-channel", "model.layers.0.self_attn.o_proj", ("weight_scale",), 0),  # whole on row-parallel
    ("gqa-W8A8", "model.layers.1.mlp.up_proj", ("weight_scale",), None),  # split on column-parallel
    ("gqa-gptq-act", "model.layers.0.mlp.down_proj", ("scales", "qzeros"), 1),  # whole with act-order
]


@pytest.mark.parametrize("case", WRONG_CUTS, ids=[c[0] for c in WRONG_CUTS])
def test_a_wrong_cut_of_each_new_kind_fails_verify(cli, unseen, tmp_path, case) -> None:
    name, module, suffixes, dim = case
    folder, _ = unseen
    out = tmp_path / "tp2"
    assert cli("convert", folder / name, "--tp", 2, "-o", out).exit_code == 0
    whole = load_file(folder / name / "model.safetensors")
    manifest = json.loads((out / "reshard.json").read_text())
    for rank in range(2):
        path = out / f"rank_{rank:02d}" / "model.safetensors"
        tensors = load_file(path)
        for suffix in suffixes:
            key = f"{module}.{suffix}"
            wrong = whole[key] if dim is None else whole[key].chunk(2, dim)[rank]
            tensors[key] = wrong.contiguous()
            manifest["tensors"][key]["partition"] = (
                {"kind": "replicate"} if dim is None else {"kind": "shard", "dim": dim}
            )
        save_file(tensors, path, metadata={"format": "pt"})
    (out / "reshard.json").write_text(json.dumps(manifest))
    result = cli("verify", out, "--json")
    assert result.exit_code == 1, result.output
    checks = {c["check"]: c for c in json.loads(result.output)["checks"]}
    found = {d["tensor"] for d in checks["ranks"]["differences"]}
    assert module in found or any(t.startswith(module + ".") for t in found), found
