"""A verl LoRA run (``lora_rank`` > 0): PEFT-named DTensors in the rank files, the adapter's config in
``lora_adapter/`` (``fixtures/verl_writer.py``). ``--merge-lora`` gives PEFT's ``merge_and_unload()`` of the trained
model bit for bit, with the alpha verl recorded; ``--layout peft`` gives the adapter PEFT loads with the same
logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.oracle

ACTOR = Path("lora/actor")


def _trained_peft(root: Path):
    """The trained PeftModel, rebuilt from the run's full state dict on one process."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    recorded = json.loads((root / ACTOR / "lora_adapter" / "adapter_config.json").read_text())
    model = get_peft_model(
        LlamaForCausalLM(LlamaConfig.from_pretrained(root / ACTOR / "huggingface")),
        LoraConfig(task_type="CAUSAL_LM", target_modules=recorded["target_modules"], bias="none",
                   r=recorded["r"], lora_alpha=recorded["lora_alpha"]),
    )  # fmt: skip
    model.load_state_dict(torch.load(root / "lora_oracle.pt", weights_only=True), strict=True)
    return model.eval()


def test_merge_lora_equals_peft_merge_and_unload_with_the_recorded_alpha(verl2, cli, tmp_path):
    out = tmp_path / "merged"
    result = cli("convert", verl2 / ACTOR, "--tp", 1, "--merge-lora", "-o", out, "-q")
    assert result.exit_code == 0, result.output
    expected = _trained_peft(verl2).merge_and_unload().state_dict()
    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    assert not (out / "adapter_config.json").exists()


def test_the_adapter_folder_loads_in_peft_with_the_trained_models_logits(verl2, cli, tmp_path):
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    out = tmp_path / "adapter"
    result = cli("convert", verl2 / ACTOR, "--tp", 1, "--layout", "peft", "-o", out, "-q")
    assert result.exit_code == 0, result.output
    assert json.loads((out / "adapter_config.json").read_text())["lora_alpha"] == 16
    trained = _trained_peft(verl2)
    full = torch.load(verl2 / "lora_oracle.pt", weights_only=True)
    base = LlamaForCausalLM(trained.get_base_model().config)
    plain = {k.removeprefix("base_model.model.").replace(".base_layer", ""): v for k, v in full.items()}
    base.load_state_dict({k: v for k, v in plain.items() if "lora_" not in k})
    loaded = PeftModel.from_pretrained(base, out).eval()
    ids = torch.randint(0, 127, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, trained(input_ids=ids).logits)


def test_inspect_says_what_lora_adapter_holds(verl2, cli):
    result = cli("inspect", verl2 / ACTOR, "--json")
    assert result.exit_code == 0, result.output
    notes = json.loads(result.stdout)["notes"]
    assert any(n.startswith("lora_adapter/: a LoRA run's adapter (adapter_config.json, adapter_model.safetensors)")
               for n in notes)  # fmt: skip
