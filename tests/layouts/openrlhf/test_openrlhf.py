"""OpenRLHF checkpoints, as OpenRLHF's ``save_checkpoint`` has DeepSpeed write them (``fixtures/openrlhf_writer.py``):
the output equals DeepSpeed's own ``zero_to_fp32`` of the actor bit for bit, with the ``_hf`` folder's config and
tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from fixtures.checks import assert_refused
from safetensors.torch import load_file

pytestmark = pytest.mark.oracle


@pytest.mark.parametrize("where", ["ckpt", "ckpt/_actor"])
def test_the_checkpoint_and_its_actor_convert_to_deepspeeds_fp32_weights(openrlhf, cli, tmp_path, where):
    out = tmp_path / "hf"
    result = cli("convert", openrlhf / where, "--tp", 1, "--layout", "hf", "-o", out, "-q")
    assert result.exit_code == 0, result.output
    oracle = torch.load(openrlhf / "oracle.pt", weights_only=True)
    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(oracle)
    for name, tensor in oracle.items():
        assert got[name].dtype == tensor.dtype == torch.float32 and torch.equal(got[name], tensor), name
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {
        p.name for p in out.iterdir()
    }
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_inspect_says_what_every_file_was_taken_for(openrlhf, cli):
    result = cli("inspect", openrlhf / "ckpt", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["layout"] == "openrlhf"
    notes = "\n".join(report["notes"])
    assert "ckpt/ is an OpenRLHF checkpoint: reading its _actor/ (also in it, not read: global_step1_hf/)" in notes
    assert "global_step1/metric.json: OpenRLHF's eval metric of the checkpoint, not read" in notes
    assert "_actor/zero_to_fp32.py, zero_to_torch.py: DeepSpeed's recovery scripts, not read" in notes
    taken = "config.json, generation_config.json, tokenizer.json, tokenizer_config.json"
    assert f"global_step1_hf/: config, tokenizer and generation config taken ({taken})" in notes
    assert "global_step1_hf/ holds full weights too (model.safetensors): not read" in notes
    assert "fp32 master weights rebuilt from 2 optimizer files" in notes


def test_an_entry_openrlhf_does_not_write_is_refused_and_without_hf_folder_it_is_said(openrlhf, copied, cli):
    ckpt = copied(openrlhf / "ckpt")
    (ckpt / "notes.txt").write_text("mine")
    line = assert_refused(cli("inspect", ckpt), None)
    assert "notes.txt" in line and "an entry OpenRLHF does not write" in line
    (ckpt / "notes.txt").unlink()
    shutil.rmtree(ckpt / "global_step1_hf")
    result = cli("inspect", ckpt, "--json")
    assert result.exit_code == 0, result.output
    assert any("no <tag>_hf/ folder (--ckpt.save_hf)" in note for note in json.loads(result.stdout)["notes"])
