"""A block-FP8 MoE (per-expert tensors, transformers' ``Fp8Quantize``, 128x128 blocks) at the tp sizes vLLM runs it.

The rule is a rank's rows, not a head's (vLLM ``validate_fp8_block_shape`` checks each partition's size): with
``head_dim`` 64 and 4 KV heads, a tp-2 rank holds two KV heads, one whole 128-row block, and each expert 128 of its
256 rows; at tp 4 a rank would hold half a block of both. Oracle: transformers' CPU ``from_pretrained`` (which
dequantizes every expert, then fuses them) for the whole model, and its ``Fp8Dequantize`` for each rank's tensors.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from fixtures.hf import load_folder
from fixtures.quantized import fp8_block
from safetensors.torch import load_file, save_file

# Qwen3-MoE whose heads are half a block: tp 2 works only by the per-rank rule, tp 3 and 4 do not work at all
SIZES = dict(head_dim=64, num_attention_heads=8, num_key_value_heads=4, moe_intermediate_size=256)
EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj$")
TP = 2


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    return fp8_block(tmp_path_factory.mktemp("fp8-moe") / "moe", moe=True, sizes=SIZES)


@pytest.fixture(scope="module")
def whole(moe) -> dict[str, torch.Tensor]:
    """transformers' own dequantization of the whole model (bf16, experts fused per layer)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.bfloat16)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def ranks(moe, tmp_path_factory) -> Path:
    from click.testing import CliRunner

    from reshard.cli import main

    out = tmp_path_factory.mktemp("fp8-moe-tp2") / "tp2"
    result = CliRunner().invoke(main, ["convert", str(moe), "--tp", str(TP), "-o", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


def expected_slice(whole: dict[str, torch.Tensor], module: str, rank: int) -> torch.Tensor:
    """Rank ``rank``'s slice of ``module``'s weight in transformers' dequantized model, as vLLM cuts it."""
    expert = EXPERT.match(module)
    if expert is None:
        weight = whole[f"{module}.weight"]
        return weight.chunk(TP, 1 if module.endswith("o_proj") else 0)[rank]
    prefix, index, kind = expert.groups()
    if kind == "down":
        return whole[f"{prefix}.down_proj"][int(index)].chunk(TP, 1)[rank]
    gate, up = whole[f"{prefix}.gate_up_proj"][int(index)].chunk(2, 0)
    return (gate if kind == "gate" else up).chunk(TP, 0)[rank]


def test_each_rank_dequantizes_to_its_slice_of_transformers_model(cli, ranks, whole) -> None:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    dequantize = Fp8Dequantize(None)._dequantize_one
    assert cli("verify", ranks).exit_code == 0  # the manifest, and every rank dequantized against its slice
    compared = 0
    for rank in range(TP):
        tensors = load_file(ranks / f"rank_{rank:02d}" / "model.safetensors")
        for name in (n for n in tensors if n.endswith(".weight_scale_inv")):
            module = name.removesuffix(".weight_scale_inv")
            weight, grid = tensors[f"{module}.weight"], tensors[name]
            assert grid.shape == (-(-weight.shape[0] // 128), -(-weight.shape[1] // 128)), module
            mine = dequantize(weight, grid, torch.bfloat16)
            assert torch.equal(mine, expected_slice(whole, module, rank)), (module, rank)
            compared += 1
    assert compared == TP * 2 * (4 + 4 * 3)  # 2 layers: q, k, v, o and 4 experts' gate, up, down


def test_gathered_back_bit_for_bit(cli, moe, ranks, tmp_path) -> None:
    """From the ranks as written (their cuts recorded), and as loose rank files with no record: the cut of a
    head of half a block is worked out from rank 0's share of it."""
    loose = tmp_path / "loose"
    loose.mkdir()
    shutil.copy(ranks / "config.json", loose)
    for rank in range(TP):
        shutil.copy(ranks / f"rank_{rank:02d}" / "model.safetensors", loose / f"model-rank-{rank}.safetensors")
    source = load_file(moe / "model.safetensors")
    for folder in (ranks, loose):
        result = cli("convert", folder, "--tp", 1, "--layout", "hf", "-o", tmp_path / f"back-{folder.name}")
        assert result.exit_code == 0, result.output
        back = load_folder(tmp_path / f"back-{folder.name}")
        assert sorted(back) == sorted(source)
        assert all(torch.equal(back[n].view(torch.uint8), source[n].view(torch.uint8)) for n in source), folder


@pytest.mark.parametrize("tp", [3, 4])
def test_tps_vllm_refuses_are_refused_in_one_line(cli, moe, tmp_path, tp) -> None:
    result = cli("convert", moe, "--tp", tp, "-o", tmp_path / "out")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "128x128 weight blocks (vLLM validate_fp8_block_shape)" in lines[0], lines
    assert "_proj.weight" in lines[0] and f"cannot be split {tp} ways" in lines[0], lines
    assert "tp sizes that work: 1, 2" in lines[0]
    assert not (tmp_path / "out").exists()


def test_check_lists_the_tps_that_work(cli, moe) -> None:
    for source in (moe, moe / "config.json"):
        report = json.loads(cli("check", source, "--tp", 4, "--json").output)
        assert not report["ok"] and report["tp_sizes_that_work"] == [1, 2], source
        assert json.loads(cli("check", source, "--tp", 2, "--json").output)["ok"], source


def _rewrite(ranks: Path, out: Path, name: str, pieces: list[torch.Tensor]) -> None:
    """A copy of ``ranks`` whose rank files hold ``pieces`` as ``name``."""
    shutil.copytree(ranks, out)
    for rank, piece in enumerate(pieces):
        path = out / f"rank_{rank:02d}" / "model.safetensors"
        save_file(load_file(path) | {name: piece.contiguous()}, path, metadata={"format": "pt"})


def _differences(result) -> dict[str, set[tuple[str, str]]]:
    assert result.exit_code == 1, result.output
    checks = json.loads(result.output)["checks"]
    return {c["check"]: {(d["kind"], d["tensor"]) for d in c["differences"]} for c in checks}


def test_a_wrong_cut_of_an_expert_fails_verify(cli, ranks, tmp_path) -> None:
    """Two wrong cuts of an expert's scale grid: swapped between the ranks (its digest no longer matches), and cut
    on the wrong axis with the manifest saying so (the gathered bytes are right: only the per-rank check sees it)."""
    name = "model.layers.0.mlp.experts.1.up_proj.weight_scale_inv"
    grids = [load_file(ranks / f"rank_{r:02d}" / "model.safetensors")[name] for r in range(TP)]
    _rewrite(ranks, tmp_path / "swapped", name, grids[::-1])
    assert ("blake3", name) in _differences(cli("verify", tmp_path / "swapped", "--json"))["manifest"]

    name = "model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"  # [2, 2], each rank's [2, 1]
    whole = torch.cat([load_file(ranks / f"rank_{r:02d}" / "model.safetensors")[name] for r in range(TP)], 1)
    _rewrite(ranks, tmp_path / "axis", name, list(whole.chunk(TP, 0)))
    manifest = json.loads((tmp_path / "axis" / "reshard.json").read_text())
    manifest["tensors"][name]["partition"] = {"kind": "shard", "dim": 0, "whole": True}
    (tmp_path / "axis" / "reshard.json").write_text(json.dumps(manifest))
    found = _differences(cli("verify", tmp_path / "axis", "--json"))
    assert not found["manifest"]  # the gathered bytes are the source's
    assert ("dequantized", name.removesuffix(".weight_scale_inv")) in found["ranks"], found
