"""Bad input at the command line: exit code 2, one line on stderr naming the file and the tensor, and nothing
written (not even a temporary output)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from fixtures.checks import assert_refused
from fixtures.models import tiny_llama, tiny_qwen3
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="module")
def tp4(tmp_path_factory):
    """A tiny Llama split four ways by reshard itself (hf-ranks, with its manifest)."""
    from click.testing import CliRunner

    from reshard.cli import main

    root = tmp_path_factory.mktemp("bad")
    tiny_llama(root / "orig", vocab=1001)
    result = CliRunner().invoke(main, ["convert", str(root / "orig"), "--tp", "4", "-o", str(root / "tp4"), "-q"])
    assert result.exit_code == 0, result.output
    return root


@pytest.fixture
def broken(tp4, tmp_path):
    """A private copy of the tp=4 checkpoint to damage."""
    copy = tmp_path / "ckpt"
    shutil.copytree(tp4 / "tp4", copy)
    return copy


def test_missing_rank_folder(broken, tmp_path, cli):
    shutil.rmtree(broken / "rank_02")
    out = tmp_path / "out"
    assert_refused(cli("convert", broken, "--tp", 1, "-o", out), out, str(broken), "rank_02", "missing")


def test_missing_last_rank_folder_is_caught_by_the_manifest(broken, tmp_path, cli):
    shutil.rmtree(broken / "rank_03")
    out = tmp_path / "out"
    assert_refused(cli("convert", broken, "--tp", 1, "-o", out), out, "rank_03", "missing (found 3 of 4)")


def test_rank_with_a_wrong_shape(broken, tmp_path, cli):
    rank_file = broken / "rank_01" / "model.safetensors"
    state = load_file(rank_file)
    state["model.layers.1.mlp.up_proj.weight"] = state["model.layers.1.mlp.up_proj.weight"][:-1].clone()
    save_file(state, rank_file, metadata={"format": "pt"})
    out = tmp_path / "out"
    result = cli("convert", broken, "--tp", 2, "-o", out)
    assert_refused(
        result,
        out,
        "model.layers.1.mlp.up_proj.weight",
        "rank sizes [32, 31, 32, 32] along dim 0",
        str(broken / "rank_00" / "model.safetensors"),
    )


def test_truncated_safetensors_file(broken, tmp_path, cli):
    rank_file = broken / "rank_03" / "model.safetensors"
    rank_file.write_bytes(rank_file.read_bytes()[:-100])
    out = tmp_path / "out"
    assert_refused(
        cli("convert", broken, "--tp", 1, "-o", out), out, str(rank_file), "model.norm.weight", "truncated file?"
    )


@pytest.mark.parametrize(
    ("index_text", "fragments"),
    [
        ("{not json", ["corrupt index"]),
        ('{"weight_map": {"lm_head.weight": "../../etc/passwd.safetensors"}}', ["unsafe file", "lm_head.weight"]),
        ('{"weight_map": {"lm_head.weight": "model-00009-of-00009.safetensors"}}', ["does not exist", "lm_head"]),
    ],
    ids=["not-json", "path-traversal", "missing-shard"],
)
def test_corrupt_index(tp4, tmp_path, cli, index_text, fragments):
    folder = tmp_path / "sharded"
    shutil.copytree(tp4 / "orig", folder)
    (folder / "model.safetensors.index.json").write_text(index_text)
    out = tmp_path / "out"
    assert_refused(cli("convert", folder, "--tp", 2, "-o", out), out, "model.safetensors.index.json", *fragments)


def test_unknown_tensor_with_no_rule_and_no_config_hint(broken, tmp_path, cli):
    for rank in range(4):
        rank_file = broken / f"rank_{rank:02d}" / "model.safetensors"
        state = load_file(rank_file)
        state["model.mystery.weight"] = torch.arange(15.0).reshape(3, 5) + rank
        save_file(state, rank_file, metadata={"format": "pt"})
    out = tmp_path / "out"
    assert_refused(
        cli("convert", broken, "--tp", 1, "-o", out),
        out,
        "model.mystery.weight",
        "no plan rule",
        "add a rule for it with --plan FILE",
    )
    plan = tmp_path / "plan.toml"
    plan.write_text('[[rules]]\npattern = "mystery"\nkind = "shard"\ndim = 0\n')
    assert cli("convert", broken, "--tp", 1, "-o", out, "--plan", plan, "-q").exit_code == 0
    assert torch.equal(
        load_file(out / "model.safetensors")["model.mystery.weight"],
        torch.cat([torch.arange(15.0).reshape(3, 5) + r for r in range(4)]),
    )


def test_non_empty_output_is_refused_and_left_alone(tp4, tmp_path, cli):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = cli("convert", tp4 / "tp4", "--tp", 1, "-o", out)
    assert result.exit_code == 2
    assert result.stderr.strip() == f"Error: {out}: output exists and is not empty (pass --overwrite to replace it)"
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert cli("convert", tp4 / "tp4", "--tp", 1, "-o", out, "--overwrite", "-q").exit_code == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()


def test_output_inside_the_input_is_refused(broken, cli):
    before = sorted(p.relative_to(broken) for p in broken.rglob("*"))
    result = cli("convert", broken, "--tp", 1, "-o", broken / "sub", "--overwrite")
    assert result.exit_code == 2 and "overlaps the input" in result.stderr
    assert sorted(p.relative_to(broken) for p in broken.rglob("*")) == before


def test_kv_heads_a_tp_neither_divides_nor_copies_are_reported_not_cut(tmp_path, cli):
    """2 KV heads at tp 3: no whole heads per rank, and 3 is no multiple of 2 to copy them (tp 4 copies them)."""
    tiny_qwen3(tmp_path / "orig", num_key_value_heads=2)
    out = tmp_path / "out"
    result = cli("convert", tmp_path / "orig", "--tp", 3, "-o", out)
    assert result.exit_code == 2 and not out.exists()
    assert (
        "model.layers.0.self_attn.k_proj.weight: replicated_heads(dim=0, heads=2) of [16, 64] cannot be split 3 "
        "ways: dim 0 holds 2 heads: tp=3 neither divides them nor is a multiple of them (each head copied onto "
        "tp/heads ranks) (choose a tp that divides the 2 heads or is a multiple of them)" in result.stderr
    )


def test_divergent_replicas_are_refused_or_taken_from_rank_0_and_recorded(broken, tmp_path, cli):
    name = "model.layers.0.input_layernorm.weight"
    rank_file = broken / "rank_02" / "model.safetensors"
    state = load_file(rank_file)
    rank0 = load_file(broken / "rank_00" / "model.safetensors")[name]
    state[name] = rank0 + 1
    save_file(state, rank_file, metadata={"format": "pt"})
    out = tmp_path / "out"
    assert_refused(
        cli("convert", broken, "--tp", 1, "-o", out, "-q"),
        out,
        name,
        "differs between rank 0 and rank 2 (max abs diff 1)",
        "--allow-divergent-replicas",
    )
    result = cli("convert", broken, "--tp", 1, "-o", out, "--allow-divergent-replicas", "--json")
    assert result.exit_code == 0, result.output
    assert (
        json.loads(result.stdout)["notes"][-1]
        == f"replicated but different between ranks, rank 0's copy taken: {name}"
    )
    assert torch.equal(load_file(out / "model.safetensors")[name], rank0)
    entries = json.loads((out / "reshard.json").read_text())["tensors"]
    assert entries[name]["divergent"] is True
    assert "divergent" not in entries["model.norm.weight"]
