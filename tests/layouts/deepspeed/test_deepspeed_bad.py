"""Damaged and unsupported DeepSpeed checkpoints: one line naming the file, exit 2."""

from __future__ import annotations

import shutil

import pytest
import torch

TAG = "global_step2"


@pytest.mark.parametrize(("variant", "removed"), [
    ("zero2_bf16", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ("zero3_bf16", "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"),
    ("zero3_bf16", "zero_pp_rank_1_mp_rank_00_model_states.pt"),
])  # fmt: skip
def test_a_missing_rank_file_is_named(ds_copy, variant, removed, cli, tmp_path):
    folder = ds_copy(variant)
    (folder / TAG / removed).unlink()
    result = cli("convert", folder, "--tp", 1, "-o", tmp_path / "out", "-q")
    assert result.exit_code == 2, result.output
    assert "missing" in result.output and "data-parallel rank" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_a_stray_rank_file_is_refused(ds_copy, cli, tmp_path):
    folder = ds_copy("zero2_bf16")
    tag = folder / TAG
    (tag / "bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt").write_bytes(
        (tag / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt").read_bytes()
    )
    result = cli("convert", folder, "--tp", 1, "-o", tmp_path / "out", "-q")
    assert result.exit_code == 2 and "rank 3" in result.output, result.output


def test_tensor_parallel_deepspeed_is_refused_by_name(ds_copy, cli, tmp_path):
    folder = ds_copy("zero2_bf16")
    tag = folder / TAG
    (tag / "mp_rank_01_model_states.pt").write_bytes((tag / "mp_rank_00_model_states.pt").read_bytes())
    result = cli("convert", folder, "--tp", 1, "-o", tmp_path / "out", "-q")
    assert result.exit_code == 2, result.output
    assert "tensor-parallel DeepSpeed checkpoint (mp_rank_01" in result.output


def test_zero3_tag_folder_is_not_taken_for_tensor_parallel_ranks(ds_root, cli):
    result = cli("inspect", ds_root / "zero3_bf16" / TAG, "--json")
    assert result.exit_code == 0, result.output
    assert "pp_rank" not in result.output.split('"notes"')[0]


def test_a_truncated_partition_is_one_line(ds_copy, cli, tmp_path):
    folder = ds_copy("zero3_bf16")
    file = folder / TAG / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    result = cli("convert", folder, "--tp", 1, "-o", tmp_path / "out", "-q")
    assert result.exit_code == 2, result.output
    assert file.name in result.output and len(result.output.strip().splitlines()) == 1


def test_a_missing_model_states_file_is_named(ds_copy, cli, tmp_path):
    folder = ds_copy("zero2_bf16")
    (folder / TAG / "mp_rank_00_model_states.pt").unlink()
    result = cli("convert", folder, "--tp", 1, "-o", tmp_path / "out", "-q")
    assert result.exit_code == 2 and "no mp_rank_00_model_states.pt" in result.output, result.output


def rewrite_states(file, change) -> None:
    """Load a model-states file DeepSpeed wrote (plain types: it loads with weights_only), change it, save it back."""
    states = torch.load(file, weights_only=True)
    change(states)
    torch.save(states, file)


@pytest.mark.parametrize("variant", ["zero2_bf16", "zero3_bf16"])
def test_param_shapes_that_do_not_match_the_partitions_are_refused(ds_copy, variant, cli, tmp_path):
    folder = ds_copy(variant)
    zero3 = variant.startswith("zero3")
    file = folder / TAG / ("zero_pp_rank_0_mp_rank_00_model_states.pt" if zero3 else "mp_rank_00_model_states.pt")

    def grow(states) -> None:
        states["param_shapes"][0]["model.layers.0.self_attn.q_proj.weight"] = torch.Size([64, 80])

    rewrite_states(file, grow)
    result = cli("convert", folder, "--tp", 1, "-o", tmp_path / "out", "-q")
    assert result.exit_code == 2, result.output
    assert file.name in result.output and len(result.output.strip().splitlines()) == 1


def test_a_recorded_data_parallel_size_names_the_missing_ranks(ds_copy, cli, tmp_path):
    folder = ds_copy("zero2_bf16")
    rewrite_states(folder / TAG / "mp_rank_00_model_states.pt", lambda states: states.update(dp_world_size=4))
    result = cli("convert", folder, "--tp", 1, "-o", tmp_path / "out", "-q")
    assert result.exit_code == 2, result.output
    assert "missing *_optim_states.pt of data-parallel rank 3 (4 ranks wrote this checkpoint)" in result.output


@pytest.mark.parametrize("latest", [None, "global_step9"])
def test_a_root_with_several_tags_and_no_latest_names_them(ds_copy, latest, cli, tmp_path):
    root = ds_copy("zero2_bf16")
    shutil.rmtree(root / f"{TAG}_universal")
    (root / "latest_universal").unlink()
    shutil.copytree(root / TAG, root / "global_step10")
    (root / "latest").unlink()
    if latest:
        (root / "latest").write_text(latest)  # naming a folder that is not there
    result = cli("convert", root, "--tp", 1, "-o", tmp_path / "out", "-q")
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1
    assert "holds 2 DeepSpeed checkpoints (global_step2, global_step10)" in result.output
    assert str(root / "global_step10") in result.output and "zero_to_fp32" in result.output
    assert not (tmp_path / "out").exists()


def test_a_legacy_torch_file_is_refused_in_one_line(ds_copy, cli, tmp_path):
    """A model-states file in torch's legacy (non-zip) serialization has no records to read in place."""
    folder = ds_copy("zero3_bf16")
    file = folder / TAG / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    torch.save(torch.load(file, weights_only=True), file, _use_new_zipfile_serialization=False)
    result = cli("convert", folder, "--tp", 1, "-o", tmp_path / "out", "-q")
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert f"{file.name}: a legacy (non-zip) torch file" in result.output
