"""``reshard.layouts.hf.loose``: loose rank files, grouped by the rank number in file and folder names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fixtures.hf import llama_state_dict, load_folder, write_config
from fixtures.shapes import one_layer_llama
from fixtures.trainer import rank_states, write_rank_files
from huggingface_hub import save_torch_state_dict

from reshard.errors import MissingRankError, ReshardError
from reshard.layouts import discover
from reshard.layouts.hf.loose import rank_template

# one layer of hidden 8, 2 heads of 4, vocab 1001: a state dict filled from arange, so a misplaced row cannot pass
CONFIG = one_layer_llama()


def tiny_state() -> dict[str, torch.Tensor]:
    return llama_state_dict(CONFIG)


def write_folder(folder: Path, tp: int = 2, *, name: str = "pytorch_model_rank{r}.bin", ranks=None) -> Path:
    return write_rank_files(folder, tiny_state(), CONFIG, tp, name=name, ranks=ranks, pad_multiple=1)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("pytorch_model_rank0.bin", (0, "pytorch_model_rank{rank}.bin")),
        ("model-rank-1.safetensors", (1, "model-rank-{rank}.safetensors")),
        ("mp_rank_01_model_states.pt", (1, "mp_rank_{rank:02d}_model_states.pt")),
        ("model_tp3.safetensors", (3, "model_tp{rank}.safetensors")),
        ("tp_rank_12", (12, "tp_rank_{rank}")),
        ("model_rank0-00001-of-00002.safetensors", (0, "model_rank{rank}-00001-of-00002.safetensors")),
        ("model-00001-of-00002.safetensors", None),
        ("model.safetensors", None),
        ("tp_size_2.bin", None),
        ("rank0_tp1.bin", None),
        ("ckpt_rank1_tp1.bin", (1, "ckpt_rank{rank}_tp{rank}.bin")),
        ("{odd}_rank_3.pt", (3, "{{odd}}_rank_{rank}.pt")),
    ],
)
def test_rank_template(name, expected):
    assert rank_template(name) == expected


def test_hf_shards_are_not_ranks(tmp_path):
    save_torch_state_dict(tiny_state(), tmp_path, max_shard_size=40_000)
    assert (tmp_path / "model-00001-of-00002.safetensors").is_file()
    source = discover(tmp_path)
    assert (source.layout, source.tp) == ("hf", 1)


def save_rank_shards(ckpt: Path) -> None:
    """Each rank's state dict saved by huggingface_hub as two shards with the rank in the file name."""
    ckpt.mkdir()
    for r, state in enumerate(rank_states(tiny_state(), 2, pad_multiple=1)):
        save_torch_state_dict(
            state, ckpt, filename_pattern=f"model_rank{r}{{suffix}}.safetensors", max_shard_size=20_000
        )
    write_config(ckpt, CONFIG)


def test_several_shard_files_per_rank_group_by_rank(tmp_path, cli):
    ckpt = tmp_path / "ckpt"
    save_rank_shards(ckpt)
    assert len(list(ckpt.glob("model_rank1-0000?-of-00002.safetensors"))) == 2
    source = discover(ckpt)
    assert (source.layout, source.tp, len(source.files)) == ("loose", 2, 4)
    result = cli("inspect", ckpt)
    assert result.exit_code == 0, result.output
    assert (
        "note: loose rank files: grouped 4 file(s)/folder(s) into tp=2 by the rank number in their names "
        "(rank 0: model_rank0-00001-of-00002.safetensors, model_rank0-00002-of-00002.safetensors; "
        "rank 1: model_rank1-00001-of-00002.safetensors, model_rank1-00002-of-00002.safetensors)"
    ) in result.stdout
    result = cli("fix", ckpt, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    written = load_folder(tmp_path / "out")
    assert written.keys() == tiny_state().keys()
    assert all(torch.equal(written[k], v) for k, v in tiny_state().items())
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors", "reshard.json"]


def test_a_missing_shard_of_a_rank_is_named(tmp_path):
    ckpt = tmp_path / "ckpt"
    save_rank_shards(ckpt)
    (ckpt / "model_rank1-00002-of-00002.safetensors").unlink()
    (ckpt / "model_rank1.safetensors.index.json").unlink()  # with it, the index names the file
    with pytest.raises(MissingRankError, match=r"shard files model_rank1-00002-of-00002\.safetensors of rank 1"):
        discover(ckpt)


def test_a_rank_index_is_authoritative(tmp_path):
    """Shards with their own names: the per-rank index says which exist, and a missing one is named."""
    ckpt = write_folder(tmp_path / "ckpt", 2, name="model_rank{r}_all.bin")
    for r in range(2):
        state = torch.load(ckpt / f"model_rank{r}_all.bin")
        names = sorted(state)
        torch.save({k: state[k] for k in names[:5]}, ckpt / f"model_rank{r}_a.bin")
        torch.save({k: state[k] for k in names[5:]}, ckpt / f"model_rank{r}_b.bin")
        weight_map = {k: f"model_rank{r}_{'a' if i < 5 else 'b'}.bin" for i, k in enumerate(names)}
        (ckpt / f"model_rank{r}.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    source = discover(ckpt)
    assert [sorted(f.name for f in source.files if f"rank{r}" in f.name) for r in range(2)] == [
        ["model_rank0_a.bin", "model_rank0_b.bin"],
        ["model_rank1_a.bin", "model_rank1_b.bin"],
    ]
    (ckpt / "model_rank1_b.bin").unlink()
    with pytest.raises(MissingRankError, match=r"model_rank1\.bin\.index\.json: .*index names 'model_rank1_b\.bin'"):
        discover(ckpt)


def test_a_gap_in_ranks_names_the_missing_files(tmp_path, cli):
    ckpt = write_folder(tmp_path / "ckpt", 4, ranks=[0, 1, 3])
    result = cli("inspect", ckpt)
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: {ckpt}: rank files pytorch_model_rank2.bin are missing (found rank(s) 0, 1, 3 of 4) "
        "(every rank must be present to gather; a single full file can be named directly)\n"
    )


def test_rank_sub_folders(tmp_path, cli):
    ckpt = write_folder(tmp_path / "ckpt", 2, name="tp_rank_{r}/pytorch_model.bin")
    result = cli("inspect", ckpt)
    assert result.exit_code == 0, result.output
    assert "layout      loose, tp=2, 2 file(s)" in result.stdout
    assert "(rank 0: tp_rank_0/; rank 1: tp_rank_1/)" in result.stdout


@pytest.mark.parametrize(
    ("name", "optimizer"),
    [
        ("model_rank{r}.pt", "optimizer_rank0.pt"),
        ("mp_rank_{r:02d}_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"),  # a DeepSpeed-saved HF model
    ],
    ids=["optimizer", "deepspeed"],
)
def test_optimizer_files_are_skipped_with_a_note(tmp_path, cli, name, optimizer):
    ckpt = write_folder(tmp_path / "ckpt", 2, name=name)
    torch.save({"state": {}}, ckpt / optimizer)
    result = cli("inspect", ckpt)
    assert result.exit_code == 0, result.output
    assert "layout      loose, tp=2" in result.stdout
    assert f"note: skipped optimizer state: {optimizer}" in result.stdout


def test_pipeline_ranks_are_refused(tmp_path):
    ckpt = write_folder(tmp_path / "ckpt", 2)
    torch.save({}, ckpt / "model_pp_rank_1.bin")
    with pytest.raises(ReshardError, match=r"model_pp_rank_1\.bin: the name carries a 'pp_rank_1' number"):
        discover(ckpt)
