"""verl FSDP2 actors, as verl's ``FSDPCheckpointManager`` saves them under torchrun (``fixtures/verl_writer.py``),
read without ``--trust-pickle``: the output equals the run's own full state dict bit for bit."""

from __future__ import annotations

import json
import shutil
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.oracle

ACTOR = Path("run/global_step_1/actor")


def _oracle(root: Path, name: str = "oracle.pt") -> dict[str, torch.Tensor]:
    return torch.load(root / name, weights_only=True)


def _assert_equal(folder: Path, oracle: dict[str, torch.Tensor]) -> None:
    got = load_file(folder / "model.safetensors")
    assert sorted(got) == sorted(oracle)
    for name, tensor in oracle.items():
        assert got[name].dtype == tensor.dtype == torch.float32 and torch.equal(got[name], tensor), name


def _one_line(result, exit_code: int = 2) -> str:
    assert result.exit_code == exit_code, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def test_an_fsdp2_actor_converts_to_the_runs_full_state_dict_bit_for_bit(verl2, cli, tmp_path):
    out = tmp_path / "hf"
    result = cli("convert", verl2 / ACTOR, "--tp", 1, "--layout", "hf", "-o", out, "-q")
    assert result.exit_code == 0, result.output
    _assert_equal(out, _oracle(verl2))
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {
        p.name for p in out.iterdir()
    }
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.dtype == torch.float32


def test_the_run_root_follows_verls_tracker_and_a_step_reads_its_actor(verl2, cli, tmp_path):
    for path, said in ((verl2 / "run", "latest_checkpointed_iteration.txt names step 1"), (verl2 / ACTOR.parent, "")):
        result = cli("inspect", path, "--json")
        assert result.exit_code == 0, result.output
        notes = json.loads(result.stdout)["notes"]
        assert any(said in note for note in notes)
        said = "global_step_1/ is a verl step: reading its actor/ (also in it, not read: critic/, data.pt)"
        assert any(said in note for note in notes)
    out = tmp_path / "root"
    assert cli("convert", verl2 / "run", "--tp", 1, "--layout", "hf", "-o", out, "-q").exit_code == 0
    _assert_equal(out, _oracle(verl2))


def test_a_critic_converts_to_the_value_model_transformers_loads(verl2, cli, tmp_path):
    out = tmp_path / "critic"
    result = cli("convert", verl2 / ACTOR.parent / "critic", "--tp", 1, "--layout", "hf", "-o", out, "-q")
    assert result.exit_code == 0, result.output
    _assert_equal(out, _oracle(verl2, "critic_oracle.pt"))
    from transformers import AutoModelForTokenClassification

    _, info = AutoModelForTokenClassification.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_inspect_says_what_every_file_was_taken_for(verl2, cli):
    result = cli("inspect", verl2 / ACTOR, "--json")
    report = json.loads(result.stdout)
    assert report["layout"] == "verl" and report["tp"] == 1
    notes = "\n".join(report["notes"])
    for rank in (0, 1):
        assert f"model_world_size_2_rank_{rank}.pt" in notes
        assert f"optim_world_size_2_rank_{rank}.pt" in notes and f"extra_state_world_size_2_rank_{rank}.pt" in notes
    assert "training state, skipped" in notes
    assert "DTensors (Shard(1)) on a mesh of [2]" in notes and "DTensors (Shard(0)) on a mesh of [2]" in notes
    assert "huggingface/: config, tokenizer and generation config" in notes
    assert "fsdp_config.json: FSDP_version 2, world_size 2" in notes


def test_an_hsdp_actor_compares_its_replicas_and_converts(verl2, cli, tmp_path):
    out = tmp_path / "hsdp"
    assert cli("convert", verl2 / "hsdp/actor", "--tp", 1, "--layout", "hf", "-o", out, "-q").exit_code == 0
    _assert_equal(out, _oracle(verl2, "hsdp_oracle.pt"))


def test_an_fsdp1_actor_with_uneven_shards_converts(verl2, cli, tmp_path):
    actor = verl2 / "fsdp1/actor"
    local = torch.load(actor / "model_world_size_2_rank_1.pt", weights_only=False)["model.embed_tokens.weight"]
    assert local._local_tensor.shape == (63, 64)  # torch.chunk's last piece of 127 rows: uneven
    out = tmp_path / "fsdp1"
    assert cli("convert", actor, "--tp", 1, "--layout", "hf", "-o", out, "-q").exit_code == 0
    _assert_equal(out, _oracle(verl2, "fsdp1_oracle.pt"))


def test_replicas_that_differ_are_refused_with_both_digests(verl2, copied, cli, tmp_path):
    actor = copied(verl2 / "hsdp/actor")
    file = actor / "model_world_size_2_rank_1.pt"
    state = torch.load(file, weights_only=False)  # the real DTensors, saved back by torch
    state["model.norm.weight"]._local_tensor[3] += 1.0
    torch.save(state, file)
    line = _one_line(cli("convert", actor, "--tp", 1, "--layout", "hf", "-o", tmp_path / "out", "-q"))
    assert "model.norm.weight: a replicated tensor differs between rank 0 (blake3 " in line
    assert "and rank 1 (blake3 " in line and file.name in line
    assert not (tmp_path / "out").exists()


def test_a_one_rank_actor_of_plain_tensors_converts_without_its_training_state(verl1, cli, tmp_path):
    out = tmp_path / "one"
    assert cli("convert", verl1 / "actor", "--tp", 1, "--layout", "hf", "-o", out, "-q").exit_code == 0
    _assert_equal(out, _oracle(verl1))  # no optimizer moment, no RNG state among the weights
    assert (out / "config.json").is_file()


def test_an_actor_converts_to_two_ranks_and_back(verl2, cli, tmp_path):
    ranks = tmp_path / "tp2"
    assert cli("convert", verl2 / ACTOR, "--tp", 2, "--layout", "hf-ranks", "-o", ranks, "-q").exit_code == 0
    oracle = _oracle(verl2)
    rank1 = load_file(ranks / "rank_01" / "model.safetensors")
    assert torch.equal(
        rank1["model.layers.0.mlp.down_proj.weight"], oracle["model.layers.0.mlp.down_proj.weight"][:, 48:]
    )
    assert torch.equal(rank1["model.norm.weight"], oracle["model.norm.weight"])
    verified = cli("verify", ranks, verl2 / ACTOR, "-q")
    assert verified.exit_code == 0, verified.output
    back = tmp_path / "back"
    assert cli("convert", ranks, "--tp", 1, "-o", back, "-q").exit_code == 0
    _assert_equal(back, oracle)


def test_a_damaged_rank_file_is_one_line(verl2, copied, cli, tmp_path):
    actor = copied(verl2 / ACTOR)
    file = actor / "model_world_size_2_rank_1.pt"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    line = _one_line(cli("convert", actor, "--tp", 1, "--layout", "hf", "-o", tmp_path / "out", "-q"))
    assert file.name in line
    assert not (tmp_path / "out").exists()


def test_a_run_of_several_steps_without_a_tracker_names_them(verl2, copied, cli, tmp_path):
    run = copied(verl2 / "run")
    shutil.copytree(run / "global_step_1", run / "global_step_10")
    (run / "latest_checkpointed_iteration.txt").unlink()
    line = _one_line(cli("inspect", run))
    assert "holds 2 verl steps (global_step_1, global_step_10)" in line


def test_fsdp_config_of_another_world_size_is_refused_and_its_absence_is_no_error(verl2, copied, cli, tmp_path):
    actor = copied(verl2 / ACTOR)
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 4}))
    line = _one_line(cli("inspect", actor))
    assert "records world_size 4, but the rank files are model_world_size_2_rank_*.pt" in line
    (actor / "fsdp_config.json").unlink()
    out = tmp_path / "out"
    assert cli("convert", actor, "--tp", 1, "--layout", "hf", "-o", out, "-q").exit_code == 0
    _assert_equal(out, _oracle(verl2))


def test_a_missing_rank_and_an_unknown_file_are_named(verl2, copied, cli):
    actor = copied(verl2 / ACTOR)
    (actor / "notes.txt").write_text("mine")
    assert "notes.txt: a file verl does not write" in _one_line(cli("inspect", actor))
    (actor / "notes.txt").unlink()
    (actor / "model_world_size_2_rank_1.pt").unlink()
    assert "missing model_world_size_2_rank_1.pt (2 ranks wrote this checkpoint)" in _one_line(cli("inspect", actor))


def test_trust_pickle_on_one_dtensor_file_is_one_line_naming_file_and_key(verl2, cli, tmp_path):
    file = verl2 / ACTOR / "model_world_size_2_rank_0.pt"
    line = _one_line(cli("convert", file, "--tp", 1, "-o", tmp_path / "out", "--trust-pickle", "-q"))
    assert f"{file}: model.embed_tokens.weight: holds a torch.distributed.tensor.DTensor (a tensor subclass)" in line
    assert "verl actor folder" in line
    line = _one_line(cli("inspect", file))  # torch refuses a DTensor, or loads it once torch.distributed.tensor is
    assert f"{file}: " in line and "DTensor" in line and "verl actor folder" in line  # imported: refused then


def test_views_of_one_storage_with_the_same_box_are_read_each_from_its_own_place(verl1, copied, cli, tmp_path):
    """Two tensors of one rank file that are views of one storage (an FSDP1 flat parameter's pieces) share their
    file, storage record and box: each is read at its own offset."""
    actor = copied(verl1 / "actor")
    file = actor / "model_world_size_1_rank_0.pt"
    state = torch.load(file, weights_only=True)
    both = torch.stack([state["model.layers.0.input_layernorm.weight"], state["model.norm.weight"]])
    state["model.layers.0.input_layernorm.weight"], state["model.norm.weight"] = both[0], both[1]
    torch.save(state, file)
    out = tmp_path / "out"
    assert cli("convert", actor, "--tp", 1, "--layout", "hf", "-o", out, "-q").exit_code == 0
    _assert_equal(out, _oracle(verl1))


def test_a_class_in_a_rank_file_is_refused_by_name_and_with_trust_pickle_read_as_inert(verl1, copied, cli, tmp_path):
    actor = copied(verl1 / "actor")
    file = actor / "model_world_size_1_rank_0.pt"
    state = torch.load(file, weights_only=True)
    torch.save({**state, "model.scale": Fraction(1, 3)}, file)
    line = _one_line(cli("inspect", actor))
    assert f"{file}: pickles fractions.Fraction, neither a tensor nor a DTensor's part" in line
    line = _one_line(cli("inspect", actor, "--trust-pickle"))
    assert "model.scale: holds an object of a class read as inert (--trust-pickle), not a tensor" in line


def test_a_rank_file_copied_over_another_is_named(verl2, copied, cli):
    actor = copied(verl2 / ACTOR)
    shutil.copy(actor / "model_world_size_2_rank_0.pt", actor / "model_world_size_2_rank_1.pt")
    line = _one_line(cli("inspect", actor))
    assert "model_world_size_2_rank_1.pt: model.embed_tokens.weight: holds rank 0's DTensor" in line


def test_rank_files_of_two_meshes_are_refused(verl2, copied, cli):
    actor = copied(verl2 / ACTOR)
    shutil.copy(verl2 / "hsdp/actor/model_world_size_2_rank_1.pt", actor / "model_world_size_2_rank_1.pt")
    line = _one_line(cli("inspect", actor))
    assert "model_world_size_2_rank_1.pt: model.embed_tokens.weight: saved as" in line and "on rank 0 as" in line


def test_files_of_two_world_sizes_are_refused(verl2, copied, cli):
    actor = copied(verl2 / ACTOR)
    shutil.copy(actor / "optim_world_size_2_rank_0.pt", actor / "optim_world_size_4_rank_0.pt")
    line = _one_line(cli("inspect", actor))
    assert "holds files of 2 runs (world size 2: " in line and "world size 4: optim_world_size_4_rank_0.pt" in line


def test_full_weights_in_huggingface_are_said_and_not_read(verl2, copied, cli, tmp_path):
    """``checkpoint.contents`` with ``hf_model``: verl saves a bfloat16 copy in ``huggingface/``; the rank files stay
    the source, in the dtype the run trained in."""
    from transformers import AutoConfig, AutoModelForCausalLM

    actor = copied(verl2 / ACTOR)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(actor / "huggingface"))
    model.load_state_dict(_oracle(verl2))
    model.to(torch.bfloat16).save_pretrained(actor / "huggingface")
    result = cli("inspect", actor, "--json")
    notes = "\n".join(json.loads(result.stdout)["notes"])
    assert "huggingface/ holds full weights too (model.safetensors): not read" in notes
    out = tmp_path / "out"
    assert cli("convert", actor, "--tp", 1, "--layout", "hf", "-o", out, "-q").exit_code == 0
    _assert_equal(out, _oracle(verl2))


def test_a_plain_tensor_every_rank_saved_is_compared_not_concatenated(verl2, copied, cli, tmp_path):
    """A buffer (a plain tensor beside the DTensors, on every rank): one copy is read, the others compared with it;
    verl's merger concatenates them (verl PR 7610)."""
    actor = copied(verl2 / ACTOR)
    oracle = _oracle(verl2)
    files = [actor / f"model_world_size_2_rank_{rank}.pt" for rank in (0, 1)]
    for file in files:
        state = torch.load(file, weights_only=False)
        state["model.norm.weight"] = oracle["model.norm.weight"].clone()  # saved whole by each rank, as a buffer is
        torch.save(state, file)
    out = tmp_path / "out"
    assert cli("convert", actor, "--tp", 1, "--layout", "hf", "-o", out, "-q").exit_code == 0
    _assert_equal(out, oracle)  # [64], not [128]
    state = torch.load(files[1], weights_only=False)
    state["model.norm.weight"][0] += 1.0
    torch.save(state, files[1])
    line = _one_line(cli("convert", actor, "--tp", 1, "--layout", "hf", "-o", tmp_path / "bad", "-q"))
    assert "model.norm.weight: a replicated tensor differs between rank 0 (blake3 " in line
