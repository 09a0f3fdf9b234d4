"""NeMo-RL steps, as NeMo-RL's DTensor workers save them (``fixtures/nemo_rl_writer.py``): the output equals the
trained model's full state dict bit for bit, whichever folder of the run reshard is pointed at."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from fixtures.checks import assert_refused
from safetensors.torch import load_file

pytestmark = pytest.mark.oracle

STEP = "step_3"


def _assert_converted(out: Path, root: Path) -> None:
    oracle = torch.load(root / "oracle.pt", weights_only=True)
    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(oracle)
    for name, tensor in oracle.items():
        assert got[name].dtype == tensor.dtype == torch.float32 and torch.equal(got[name], tensor), name
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("where", ["", STEP, f"{STEP}/policy", f"{STEP}/policy/weights"])
def test_each_folder_of_a_run_converts_to_the_models_state_dict(nemo_rl, cli, tmp_path, version, where):
    out = tmp_path / "hf"
    config = nemo_rl / "source" / "config.json"
    result = cli("convert", nemo_rl / version / where, "--tp", 1, "--layout", "hf", "-o", out, "--config", config)
    assert result.exit_code == 0, result.output
    _assert_converted(out, nemo_rl)


def test_version_2s_model_folder_reads_as_its_step(nemo_rl, cli, tmp_path):
    out = tmp_path / "hf"
    config = nemo_rl / "source" / "config.json"
    model = nemo_rl / "v2" / STEP / "policy/weights/model"
    result = cli("convert", model, "--tp", 1, "--layout", "hf", "-o", out, "--config", config, "-q")
    assert result.exit_code == 0, result.output
    _assert_converted(out, nemo_rl)


def test_without_config_json_the_model_named_in_config_yaml_is_said_and_config_asked_for(nemo_rl, cli, tmp_path):
    out = tmp_path / "out"
    line = assert_refused(cli("convert", nemo_rl / "v1", "--tp", 1, "--layout", "hf", "-o", out, "-q"), out)
    assert "NeMo-RL saves no config.json" in line
    assert "config.yaml names the model: policy.model_name '" in line and "/source'" in line  # the writer's path
    assert "--config" in line


def test_inspect_says_what_every_file_was_taken_for(nemo_rl, cli):
    for version, form in (("v1", "version 1: {'model': ...}"), ("v2", "version 2: a flat state dict")):
        result = cli("inspect", nemo_rl / version / STEP, "--json")
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        assert report["layout"] == "nemo-rl"
        notes = "\n".join(report["notes"])
        assert f"policy/weights/: model weights, DCP ({form}" in notes
        assert "policy/optimizer/: training state (the optimizer and the LR scheduler, DCP), skipped" in notes
        assert (
            "policy/tokenizer/: the tokenizer, copied beside the output (tokenizer.json, tokenizer_config.json)"
            in notes
        )
        assert "config.yaml: the run's config" in notes
        assert "train_dataloader.pt: training state" in notes and "training_info.json: training state" in notes


def test_a_run_of_several_steps_names_them_and_an_unknown_file_is_refused(nemo_rl, copied, cli):
    run = copied(nemo_rl / "v1", "run")
    (run / "tmp_step_4").mkdir()  # a save NeMo-RL had not finished (renamed step_4 once complete)
    notes = json.loads(cli("inspect", run, "--json").stdout)["notes"]
    assert "run/ holds one NeMo-RL step: reading step_3/ (also in it, not read: tmp_step_4/)" in notes
    shutil.copytree(run / STEP, run / "step_10")
    line = assert_refused(cli("inspect", run), None)
    assert "holds 2 NeMo-RL steps (step_3, step_10)" in line and f"{run / 'step_10'}" in line
    (run / STEP / "notes.txt").write_text("mine")
    line = assert_refused(cli("inspect", run / STEP), None)
    assert "notes.txt" in line and "a file NeMo-RL does not write in a step" in line


def test_with_optimizer_is_refused_in_one_line_the_optimizer_being_skipped(nemo_rl, cli, tmp_path):
    config = nemo_rl / "source" / "config.json"
    out = tmp_path / "dcp"
    result = cli(
        "convert", nemo_rl / "v1", "--tp", 1, "--layout", "dcp", "-o", out, "--config", config, "--with-optimizer"
    )
    assert_refused(result, out, "holds no training state reshard reads")
