"""FSDP2 to DeepSpeed, the way back: ``reshard convert DCP --tp 1 --layout deepspeed --with-optimizer``.

The FSDP2 run of ``fixtures/fsdp_resume.py`` (world 2, fp32, torch's AdamW over two groups; ``conftest.py``) is
converted to a DeepSpeed universal checkpoint and resumed by DeepSpeed ZeRO-2 (``load_universal``, torch's AdamW
configured with other hyper-parameters, no gradient clipping as the FSDP2 loop has none:
``fixtures/deepspeed_to_dcp.py resume``) at worlds 1 and 3, for the same batches. Right after loading every fp32
master, moment and step equals, bit for bit, what FSDP2 saved, and the groups' hyper-parameters are the saved ones;
the losses that follow equal FSDP2's own within fp32's order of sums. The same checkpoint with its moments reset
fails the comparison.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixtures.deepspeed import deepspeed_python, extensions_folder
from fixtures.deepspeed_runs import moments_reset
from fixtures.fsdp_resume import OTHER, STEPS
from fixtures.resumed import TOLERANCE, assert_loaded_as_saved, deviation, losses, reshard, torchrun

pytestmark = pytest.mark.oracle

WORLDS = (1, 3)


@pytest.fixture(scope="module")
def resumed(pytestconfig: pytest.Config, fsdp_trained: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """reshard's universal checkpoint of the FSDP2 run (``out/``), its moments-reset copy (``reset/``), and
    DeepSpeed's resumes of them (``<name>.pt``, ``.json``), beside the run's ``saved.pt`` and ``reference.json``."""
    root = tmp_path_factory.mktemp("fsdp-deepspeed")
    for name in ("saved.pt", "reference.json"):
        (root / name).symlink_to(fsdp_trained / name)
    reshard(
        "convert", fsdp_trained / "src", "--tp", 1, "--layout", "deepspeed", "--with-optimizer", "-o", root / "out",
        "-q",
    )  # fmt: skip
    moments_reset(root / "out", root / "reset")
    environment = {"TORCH_EXTENSIONS_DIR": str(extensions_folder(pytestconfig)), "DS_BUILD_OPS": "0"}
    environment["DS_ACCELERATOR"] = "cpu"
    python = deepspeed_python(pytestconfig)
    runs = [(world, "out") for world in WORLDS] + [(1, "reset")]
    for world, name in runs:
        resume = ["resume", str(root / name), str(root / f"{name}{world}")]
        torchrun("fixtures.deepspeed_to_dcp", ranks=world, args=resume, python=python, env=environment)
    return root


@pytest.mark.parametrize("world", WORLDS)
def test_right_after_loading_deepspeed_holds_what_fsdp2_saved(resumed: Path, world: int) -> None:
    saved = torch.load(resumed / "saved.pt", weights_only=False)
    loaded = torch.load(resumed / f"out{world}.pt", weights_only=False)
    assert_loaded_as_saved(saved, loaded)  # the step a float32 tensor(STEPS) per parameter, as torch keeps it
    assert all(slots["step"] == STEPS for slots in loaded["optimizer"]["state"].values())
    assert loaded["optimizer"]["param_groups"][0]["lr"] != OTHER["lr"]


@pytest.mark.parametrize("world", WORLDS)
def test_resumed_losses_equal_fsdp2s(resumed: Path, world: int) -> None:
    assert deviation(losses(resumed, f"out{world}"), losses(resumed, "reference")) <= TOLERANCE


def test_a_resume_with_the_moments_reset_fails_the_comparison(resumed: Path) -> None:
    saved = torch.load(resumed / "saved.pt", weights_only=False)
    with pytest.raises(AssertionError):
        assert_loaded_as_saved(saved, torch.load(resumed / "reset1.pt", weights_only=False))
    reference = losses(resumed, "reference")
    reset = deviation(losses(resumed, "reset1"), reference)
    carried = max(deviation(losses(resumed, f"out{world}"), reference) for world in WORLDS)
    assert reset > TOLERANCE and reset > 100 * max(carried, 1e-7)
