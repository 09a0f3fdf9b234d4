"""The folders trainers write, from the real writers (``fixtures/trainer_dirs_writer.py``): the DCP tutorial's
``{"app": AppState(model, optimizer)}``, optimizer state as flat top-level keys, and HF Trainer's ``checkpoint-2/``
under FSDP (accelerate's ``pytorch_model_fsdp_0/`` and ``optimizer_0/``). Each converts into a folder that
``from_pretrained`` loads with no missing or unexpected key and the logits of the trained model; a folder with no
model tensors is refused naming what it holds."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures.hf import load_folder
from fixtures.models import logits
from fixtures.trainer_dirs import VOCAB
from transformers import AutoModelForCausalLM

from reshard.layouts import discover

ROOT = Path(__file__).parents[3]


def loaded(folder: Path):
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


@pytest.mark.parametrize(
    ("folder", "note"),
    [
        ("tutorial", "skipped, not model weights: app.optim (63 tensors"),
        ("flat", "skipped, not model weights: optimizer (63 tensors"),
        ("checkpoint-2", "checkpoint-2/ is not a checkpoint itself: reading pytorch_model_fsdp_0/ (dcp)"),
    ],
)
def test_trainer_folders_convert_to_the_trained_model(cli, trainer_root, tmp_path, folder, note):
    config = trainer_root / "hf_source" / "config.json"
    result = cli("convert", trainer_root / folder, "--tp", 1, "-o", tmp_path / "out", "--config", config)
    assert result.exit_code == 0, result.output
    assert note in result.output
    reference = load_folder(trainer_root / "reference")
    got = load_folder(tmp_path / "out")
    assert sorted(got) == sorted(reference)
    assert all(torch.equal(got[name], tensor) for name, tensor in reference.items())
    want = logits(loaded(trainer_root / "reference"), VOCAB)
    assert torch.equal(logits(loaded(tmp_path / "out"), VOCAB), want)


def test_the_picked_folder_is_said_on_stderr(trainer_root):
    config = trainer_root / "hf_source" / "config.json"
    command = [sys.executable, "-m", "reshard", "inspect", str(trainer_root / "checkpoint-2"), "--config", str(config)]
    run = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr
    assert run.stderr.splitlines() == [
        "WARNING checkpoint-2/ is not a checkpoint itself: reading pytorch_model_fsdp_0/ (dcp) in it; also inside: "
        "optimizer_0/ (dcp: holds no model tensors, only optimizer (63 tensors, 12 values, 1.9 MB))"
    ]


def test_tutorial_names_lose_the_container(cli, trainer_root):
    result = cli("inspect", trainer_root / "tutorial", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert "model tensors are stored under 'app.model.': read by their names inside it" in report["notes"]
    assert sorted(t["name"] for t in report["tensors"]) == sorted(load_folder(trainer_root / "reference"))


def test_an_optimizer_folder_is_refused_naming_what_it_holds(cli, trainer_root):
    result = cli("convert", trainer_root / "checkpoint-2" / "optimizer_0", "--tp", 1, "-o", "unused-out")
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        f"Error: {trainer_root / 'checkpoint-2' / 'optimizer_0'}: holds no model tensors, only optimizer (63 tensors, "
        "12 values, 1.9 MB) (point reshard at the folder that holds the model: pytorch_model_fsdp_0/ beside it)"
    ]
    assert not Path("unused-out").exists()


def test_two_models_in_a_trainer_folder_are_refused_naming_both(cli, trainer_root, tmp_path):
    folder = tmp_path / "checkpoint-2"
    shutil.copytree(trainer_root / "checkpoint-2", folder)
    shutil.copytree(folder / "pytorch_model_fsdp_0", folder / "pytorch_model_fsdp_1")  # accelerate's second model
    result = cli("inspect", folder)
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        f"Error: {folder}: holds 2 checkpoints: pytorch_model_fsdp_0/ (dcp), pytorch_model_fsdp_1/ (dcp) "
        "(point reshard at the one to read)"
    )


def test_a_trainer_folder_with_no_model_names_what_is_inside(cli, trainer_root, tmp_path):
    folder = tmp_path / "checkpoint-2"
    shutil.copytree(trainer_root / "checkpoint-2", folder, ignore=shutil.ignore_patterns("pytorch_model_fsdp_0"))
    result = cli("inspect", folder)
    assert result.exit_code == 2
    line = result.stderr.strip()
    assert line.startswith(f"Error: {folder}: no checkpoint found (looked for ")
    assert line.endswith(
        "; inside: optimizer_0/ (dcp: holds no model tensors, only optimizer (63 tensors, 12 values, 1.9 MB))"
    )


def test_the_optimizer_is_read_nested_and_flattened_alike(trainer_root):
    """The DCP tutorial's ``app.optim`` (get_state_dict's nested form) and ``flatten_optimizer_state_dict=True``'s
    ``optimizer.param_groups.<fqn>.*``: the same groups, step and moments."""
    nested, flat = (discover(trainer_root / name).training for name in ("tutorial", "flat"))
    assert nested is not None and flat is not None
    assert (nested.step, nested.moments, nested.groups) == (flat.step, flat.moments, flat.groups)
    assert nested.step == 1 and len(nested.groups) == 1 and nested.groups[0].hyper["lr"] == 1e-2
    (left,), (right,) = nested.tensors, flat.tensors
    assert sorted(left) == sorted(right) and len(left) == 2 * len(nested.groups[0].params)
    assert all(torch.equal(left[name].read(), right[name].read()) for name in left)
