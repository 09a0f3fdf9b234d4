"""DeepSpeed ZeRO-2 to DCP, resumed by plain FSDP2: ``reshard convert DS --layout dcp --with-optimizer``.

DeepSpeed trains the tiny Llama of ``fixtures/fsdp_resume.py`` at world 2 (fp32, torch's AdamW, the same two groups,
hyper-parameters and batches, no gradient clipping: ``fixtures/deepspeed_to_dcp.py``), saves, and continues: the
reference losses. The conversion to DCP is resumed by FSDP2 and torch's AdamW configured with other
hyper-parameters, at worlds 1 and 3: right after ``set_state_dict`` every fp32 master, moment and step equals, bit
for bit, what DeepSpeed's own ``ds_to_universal`` gathers from the checkpoint, and the groups are DeepSpeed's; the
losses that follow equal DeepSpeed's within fp32's order of sums. A resume of the weights alone fails the comparison.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixtures.deepspeed import deepspeed_python, extensions_folder
from fixtures.fsdp_resume import OTHER
from fixtures.models import tiny_llama
from fixtures.resumed import TOLERANCE, assert_loaded_as_saved, deviation, losses, reshard, torchrun

WORLDS = (1, 3)
# What DeepSpeed keeps beside the optimizer that FSDP2 does not run: its loss scaler's state (unused in fp32),
# clip_grad, its sample counter and skipped steps.
DROP = "dataloader,loss_scaler,other"


@pytest.fixture(scope="module")
def resumed(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``ds/`` (DeepSpeed's checkpoint), ``saved.pt``, ``reference.json``; the conversions with and without the
    optimizer (``out/``, ``weights/``) and their resumes (``<name>.pt``, ``.json``)."""
    root = tmp_path_factory.mktemp("deepspeed")
    tiny_llama(root / "hf", vocab=128, num_attention_heads=4, num_key_value_heads=2)
    environment = {"TORCH_EXTENSIONS_DIR": str(extensions_folder(pytestconfig)), "DS_BUILD_OPS": "0"}
    args = ["train", str(root / "hf"), str(root)]
    python = deepspeed_python(pytestconfig)
    torchrun(
        "fixtures.deepspeed_to_dcp", ranks=2, args=args, python=python, env={**environment, "DS_ACCELERATOR": "cpu"}
    )
    reshard(
        "convert", root / "ds", "--tp", 1, "--layout", "dcp", "--with-optimizer", "--drop", DROP, "-o", root / "out"
    )
    reshard("convert", root / "ds", "--tp", 1, "--layout", "dcp", "-o", root / "weights", "-q")
    for world in WORLDS:
        resume = ["resume", str(root / "out"), str(root / f"out{world}"), "--other-hyper"]
        torchrun("fixtures.fsdp_resume", ranks=world, args=resume)
    resume = ["resume", str(root / "weights"), str(root / "weights1"), "--weights-only"]
    torchrun("fixtures.fsdp_resume", ranks=1, args=resume)
    return root


@pytest.mark.parametrize("world", WORLDS)
def test_right_after_loading_the_state_is_deepspeeds(resumed: Path, world: int) -> None:
    saved = torch.load(resumed / "saved.pt", weights_only=False)
    loaded = torch.load(resumed / f"out{world}.pt", weights_only=False)
    assert_loaded_as_saved(saved, loaded)
    assert loaded["optimizer"]["param_groups"][0]["lr"] != OTHER["lr"]


@pytest.mark.parametrize("world", WORLDS)
def test_resumed_losses_equal_deepspeeds(resumed: Path, world: int) -> None:
    assert deviation(losses(resumed, f"out{world}"), losses(resumed, "reference")) <= TOLERANCE


def test_a_resume_with_the_moments_reset_fails_the_comparison(resumed: Path) -> None:
    reference = losses(resumed, "reference")
    reset = deviation(losses(resumed, "weights1"), reference)
    carried = max(deviation(losses(resumed, f"out{world}"), reference) for world in WORLDS)
    assert reset > TOLERANCE and reset > 100 * max(carried, 1e-7)
