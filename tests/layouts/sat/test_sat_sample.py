"""The committed sample: TP=8 CogAgent-like SAT checkpoint, as the README converts it."""

from __future__ import annotations

from pathlib import Path

import torch
from fixtures import SAMPLES
from fixtures.sat import read_sat

SAMPLE = SAMPLES / "tiny-cogagent-sat-tp8"


def test_readme_tp8_to_tp4_and_back(tmp_path: Path, cli) -> None:
    result = cli("convert", SAMPLE, "--tp", 4, "--layout", "sat", "-o", tmp_path / "cogagent-tp4")
    assert result.exit_code == 0, result.output
    assert "102 tensors" in result.stdout
    assert cli("convert", tmp_path / "cogagent-tp4", "--tp", 8, "-o", tmp_path / "tp8", "-q").exit_code == 0
    _, original = read_sat(SAMPLE)
    _, again = read_sat(tmp_path / "tp8")
    for before, after in zip(original, again, strict=True):
        assert list(after["module"]) == list(before["module"])
        for name, tensor in before["module"].items():
            assert torch.equal(after["module"][name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_readme_merge_lora(tmp_path: Path, cli) -> None:
    out = tmp_path / "cogagent-merged-tp4"
    result = cli("convert", SAMPLE, "--tp", 4, "--merge-lora", "-o", out)
    assert result.exit_code == 0, result.output
    assert "merged 12 LoRA adapters" in result.stdout
    _, files = read_sat(out)
    assert len(files) == 4
    assert "transformer.layers.1.cross_attention.key_value.weight" in files[3]["module"]
