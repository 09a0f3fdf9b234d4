"""SGD's momentum from a DeepSpeed ZeRO-2 run to a universal checkpoint DeepSpeed resumes, and to DCP.

A tiny Llama trains ``SAVED_AT`` steps at world 2 under ZeRO-2 with a client torch SGD (Nesterov momentum, the HF
Trainer's two groups; :mod:`fixtures.deepspeed_sgd`), saves and continues: the reference losses. reshard reads each
parameter's ``momentum_buffer`` from the ranks' flat partitions (the client optimizer is not named: its state's keys
say SGD), and writes it as ``zero/<param>/momentum_buffer.pt`` without ``step.pt``; DeepSpeed resumes that at world
1 with ``load_universal`` and an SGD configured otherwise: right after loading every master and momentum is the
saved one bit for bit and the groups are the saved ones, and the losses equal the reference within DeepSpeed's
nondeterminism across world sizes. The same checkpoint converted to DCP holds the same momentum, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixtures.deepspeed_runs import deepspeed_launch
from fixtures.models import tiny_llama
from fixtures.resumed import reshard, torchrun

from reshard.layouts import discover
from reshard.layouts.training import state_name

pytestmark = pytest.mark.oracle

MODULE = "fixtures.deepspeed_sgd"
TAG = "global_step3"  # fixtures.deepspeed_resume's SAVED_AT
TOLERANCE = 2e-6  # as tests/layouts/deepspeed/test_deepspeed_resume.py's fp32
DROP = "dataloader,loss_scaler,other"


@pytest.fixture(scope="module")
def runs(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ds-sgd")
    tiny_llama(root / "hf", vocab=1001)
    python, env = deepspeed_launch(pytestconfig)
    torchrun(MODULE, ranks=2, args=["train", str(root / "hf"), str(root)], python=python, env=env)
    for layout in ("deepspeed", "dcp"):
        out = root / layout
        reshard("convert", root / "ckpt", "--tp", 1, "--layout", layout, "--with-optimizer", "--drop", DROP, "-o", out)
    resume = ["resume", str(root / "hf"), str(root), str(root / "deepspeed"), "ds1"]
    torchrun(MODULE, ranks=1, args=resume, python=python, env=env)
    return root


def test_the_universal_checkpoint_holds_the_momentum_and_no_step(runs: Path) -> None:
    training = discover(runs / "ckpt").training
    assert training is not None and training.optimizer is None and training.moments == ("momentum_buffer",)
    assert training.carried_as() == "SGD"
    folder = runs / "deepspeed" / TAG / "zero" / "model.embed_tokens.weight"
    assert sorted(p.name for p in folder.iterdir()) == ["fp32.pt", "momentum_buffer.pt"]


def test_deepspeed_resumes_the_saved_state_and_losses(runs: Path) -> None:
    saved = torch.load(runs / "saved.pt", weights_only=False)
    resumed = torch.load(runs / "ds1.pt", weights_only=False)
    assert resumed["params"].keys() == saved["params"].keys()
    for name, slots in saved["params"].items():
        for slot, tensor in slots.items():
            assert torch.equal(resumed["params"][name][slot], tensor), (name, slot)
    assert resumed["groups"] == saved["groups"]
    deviation = max(abs(a - b) for a, b in zip(resumed["losses"], saved["losses"], strict=True))
    assert deviation <= TOLERANCE


def test_the_dcp_output_holds_the_same_momentum(runs: Path) -> None:
    saved = torch.load(runs / "saved.pt", weights_only=False)
    training = discover(runs / "dcp").training
    assert training is not None
    (refs,) = training.tensors
    for name, slots in saved["params"].items():
        assert torch.equal(refs[state_name(name, "momentum_buffer")].read(), slots["momentum_buffer"]), name
