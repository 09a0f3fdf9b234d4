"""``reshard convert SRC --layout dcp --with-optimizer``, proven by plain FSDP2 resuming it at another world size.

A tiny transformers Llama is trained with FSDP2 at world 2 and torch's AdamW (two groups: decay, no decay), saved
with ``dcp.save(get_state_dict(...))``, and continued: the reference losses (``fixtures/fsdp_resume.py``). The
converted checkpoint is resumed at worlds 1 and 3 by an AdamW configured with other hyper-parameters: right after
``set_state_dict`` the parameters, moments and steps equal, bit for bit, what the run held when it saved, and the
groups' hyper-parameters are the saved ones; the losses that follow equal the reference within fp32's order of
sums, and equal bit for bit those of DCP resuming the source itself at the same world size. A resume of the
weights alone (the moments start afresh) fails the same comparison.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from fixtures.fsdp_resume import DECAY, HYPER, OTHER, STEPS
from fixtures.resumed import TOLERANCE, assert_loaded_as_saved, deviation, losses, reshard, torchrun

from reshard.layouts import discover
from reshard.layouts.training import state_name

MODULE = "fixtures.fsdp_resume"
WORLDS = (1, 3)


@pytest.fixture(scope="module")
def trained(fsdp_trained: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's FSDP2 run (``src/``, ``saved.pt``, ``reference.json``; ``conftest.py``) beside this module's
    conversions and resumes."""
    root = tmp_path_factory.mktemp("fsdp-dcp")
    for name in ("src", "saved.pt", "reference.json"):
        (root / name).symlink_to(fsdp_trained / name)
    return root


@pytest.fixture(scope="module")
def resumed(trained: Path) -> Path:
    """The source converted with and without its optimizer, and every resume of them (``<name>.pt``, ``.json``)."""
    reshard("convert", trained / "src", "--tp", 1, "--layout", "dcp", "--with-optimizer", "-o", trained / "out", "-q")
    reshard("convert", trained / "src", "--tp", 1, "--layout", "dcp", "-o", trained / "weights", "-q")
    for world in WORLDS:
        torchrun(
            MODULE, ranks=world, args=["resume", str(trained / "out"), str(trained / f"out{world}"), "--other-hyper"]
        )
    torchrun(MODULE, ranks=3, args=["resume", str(trained / "src"), str(trained / "src3"), "--other-hyper"])
    torchrun(MODULE, ranks=1, args=["resume", str(trained / "weights"), str(trained / "weights1"), "--weights-only"])
    return trained


def test_inspect_reads_the_training_state_as_torch_saved_it(trained: Path) -> None:
    state = discover(trained / "src").training
    saved = torch.load(trained / "saved.pt", weights_only=False)
    assert state is not None and state.step == STEPS and state.moments == ("exp_avg", "exp_avg_sq")
    assert [g.params for g in state.groups] == [tuple(g["params"]) for g in saved["optimizer"]["param_groups"]]
    for group, decay in zip(state.groups, DECAY, strict=True):
        assert group.hyper["lr"] == HYPER["lr"] and group.hyper["betas"] == list(HYPER["betas"])
        assert group.hyper["weight_decay"] == decay
    assert state.frozen == () and state.not_carried == ()
    (refs,) = state.tensors
    for name, slots in saved["optimizer"]["state"].items():  # read lazily from the boxes of both ranks
        for slot in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(refs[state_name(name, slot)].read(), slots[slot]), (name, slot)


def test_output_is_laid_out_as_dcp_save_lays_it_out(resumed: Path) -> None:
    import torch.distributed.checkpoint  # noqa: F401  (the pickled classes)

    src = pickle.loads((resumed / "src" / ".metadata").read_bytes())
    out = pickle.loads((resumed / "out" / ".metadata").read_bytes())
    kinds = {key: type(entry).__name__ for key, entry in src.state_dict_metadata.items()}
    assert {key: type(entry).__name__ for key, entry in out.state_dict_metadata.items()} == kinds
    assert out.planner_data == src.planner_data
    weights = pickle.loads((resumed / "weights" / ".metadata").read_bytes())
    assert set(weights.state_dict_metadata) == {key for key in kinds if key.startswith("model.")}


@pytest.mark.parametrize("world", WORLDS)
def test_right_after_loading_the_state_is_the_saved_one(resumed: Path, world: int) -> None:
    saved = torch.load(resumed / "saved.pt", weights_only=False)
    loaded = torch.load(resumed / f"out{world}.pt", weights_only=False)
    assert_loaded_as_saved(saved, loaded)
    assert loaded["optimizer"]["param_groups"][0]["lr"] != OTHER["lr"]


@pytest.mark.parametrize("world", WORLDS)
def test_resumed_losses_equal_the_reference(resumed: Path, world: int) -> None:
    reference = losses(resumed, "reference")
    assert deviation(losses(resumed, f"out{world}"), reference) <= TOLERANCE


def test_resumed_losses_equal_dcp_resuming_the_source_itself(resumed: Path) -> None:
    assert losses(resumed, "out3") == losses(resumed, "src3")


def test_a_resume_with_the_moments_reset_fails_the_comparison(resumed: Path) -> None:
    reference = losses(resumed, "reference")
    reset = deviation(losses(resumed, "weights1"), reference)
    carried = max(deviation(losses(resumed, f"out{world}"), reference) for world in WORLDS)
    assert reset > TOLERANCE and reset > 100 * max(carried, 1e-7)
