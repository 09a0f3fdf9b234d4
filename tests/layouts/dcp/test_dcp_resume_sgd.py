"""SGD's momentum carried by ``convert --with-optimizer --layout dcp``, proven by plain FSDP2 resuming it at another
world size.

A tiny transformers Llama is trained with FSDP2 at world 2 and torch's SGD with Nesterov momentum over two groups
(weight decay on the matrices, none on the norms), saved with ``dcp.save(get_state_dict(...))`` and continued: the
reference losses (``fixtures/fsdp_resume.py --sgd``). The converted checkpoint is resumed at world 1 by an SGD
configured with other hyper-parameters: right after ``set_state_dict`` every parameter and ``momentum_buffer``
equals, bit for bit, what the run held when it saved, and the groups are the saved ones; the losses that follow
equal the reference within fp32's order of sums (4.8e-7 measured). A resume of the weights alone (the momentum
starts afresh: 1.6e-3) fails the same comparison.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from fixtures.fsdp_resume import OTHER_SGD, SGD
from fixtures.models import tiny_llama
from fixtures.resumed import TOLERANCE, assert_loaded_as_saved, deviation, losses, reshard, torchrun

from reshard.layouts import discover

MODULE = "fixtures.fsdp_resume"


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The SGD run (``src/``, ``saved.pt``, ``reference.json``), its conversions with and without the optimizer, and
    their resumes at world 1 (``<name>.pt``, ``.json``)."""
    root = tmp_path_factory.mktemp("fsdp-sgd")
    tiny_llama(root / "hf", vocab=128, num_attention_heads=4, num_key_value_heads=2)
    torchrun(MODULE, ranks=2, args=["train", str(root / "hf"), str(root), "--sgd"])
    shutil.copy(root / "hf" / "config.json", root / "src" / "config.json")
    reshard("convert", root / "src", "--tp", 1, "--layout", "dcp", "--with-optimizer", "-o", root / "out", "-q")
    reshard("convert", root / "src", "--tp", 1, "--layout", "dcp", "-o", root / "weights", "-q")
    for ckpt, result, extra in (("out", "out1", "--other-hyper"), ("weights", "weights1", "--weights-only")):
        torchrun(MODULE, ranks=1, args=["resume", str(root / ckpt), str(root / result), extra, "--sgd"])
    return root


def test_the_momentum_is_read_as_torch_saved_it(resumed: Path) -> None:
    state = discover(resumed / "src").training
    assert state is not None and state.moments == ("momentum_buffer",) and state.step is None
    assert [g.hyper["momentum"] for g in state.groups] == [SGD["momentum"]] * 2
    assert [g.hyper["weight_decay"] for g in state.groups] == [0.1, 0.0]


def test_right_after_loading_the_state_is_the_saved_one(resumed: Path) -> None:
    saved = torch.load(resumed / "saved.pt", weights_only=False)
    loaded = torch.load(resumed / "out1.pt", weights_only=False)
    assert all(set(slots) == {"momentum_buffer"} for slots in saved["optimizer"]["state"].values())
    assert_loaded_as_saved(saved, loaded)
    group = loaded["optimizer"]["param_groups"][0]
    assert group["lr"] != OTHER_SGD["lr"] and group["nesterov"] is True


def test_resumed_losses_equal_the_reference(resumed: Path) -> None:
    assert deviation(losses(resumed, "out1"), losses(resumed, "reference")) <= TOLERANCE


def test_a_resume_with_the_momentum_reset_fails_the_comparison(resumed: Path) -> None:
    reference = losses(resumed, "reference")
    reset = deviation(losses(resumed, "weights1"), reference)
    assert reset > TOLERANCE and reset > 100 * max(deviation(losses(resumed, "out1"), reference), 1e-7)
