"""Optimizers other than AdamW through ``convert --with-optimizer``: torch's own optimizers trained a few steps, their
``get_state_dict`` saved by ``dcp.save`` (real bytes). SGD (with and without momentum), Muon, Adagrad and Adam with
``amsgrad`` are carried: loaded into a fresh optimizer configured otherwise, the state is the saved one bit for bit
and the next step moves the parameters exactly as the original optimizer does. The others are refused by name, in
one line, before any output exists: torch's Adafactor, NAdam, RMSprop, Adamax, Adadelta, Rprop and ASGD,
transformers' Adafactor, bitsandbytes' 8-bit Adam (bitsandbytes installed from PyPI, run on CPU), Lion (lion-pytorch
is not installed: its state, ``exp_avg`` alone, is written as its source names it), and a state key no optimizer
keeps."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from fixtures.venvs import pip_target
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from reshard.layouts import discover

STEPS = 3
Make = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


class Tiny(torch.nn.Module):
    def __init__(self, *, bias: bool = True) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 5, bias=bias)
        self.b = torch.nn.Linear(5, 4, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, index: int) -> None:
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(index))
    (model(x) ** 2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def trained(folder: Path, make: Make, *, bias: bool = True) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Tiny(bias=bias)
    optimizer = make(list(model.parameters()))
    for index in range(STEPS):
        step(model, optimizer, index)
    weights, state = get_state_dict(model, optimizer)
    dcp.save({"model": weights, "optimizer": state}, checkpoint_id=folder, no_dist=True)
    return model, optimizer


CARRIED: dict[str, tuple[Make, Make, bool]] = {  # the run's optimizer, another configured otherwise, biases
    "sgd-momentum": (
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
        lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.1),
        True,
    ),
    "sgd": (lambda p: torch.optim.SGD(p, lr=0.05), lambda p: torch.optim.SGD(p, lr=0.5), True),
    "muon": (lambda p: torch.optim.Muon(p, lr=0.02), lambda p: torch.optim.Muon(p, lr=0.5, momentum=0.5), False),
    "adagrad": (lambda p: torch.optim.Adagrad(p, lr=0.05), lambda p: torch.optim.Adagrad(p, lr=0.5), True),
    "adam-amsgrad": (
        lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
        lambda p: torch.optim.Adam(p, lr=0.5, amsgrad=True),
        True,
    ),
}


def assert_same_state(ours: dict, theirs: dict) -> None:
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys()
    for index, slots in ours["state"].items():
        assert slots.keys() == theirs["state"][index].keys(), index
        for key, value in slots.items():
            other = theirs["state"][index][key]
            assert value.dtype == other.dtype and torch.equal(value, other), (index, key)


@pytest.mark.parametrize("kind", list(CARRIED))
def test_a_carried_optimizer_resumes_as_it_saved(tmp_path: Path, cli, kind: str) -> None:
    make, other, bias = CARRIED[kind]
    model, optimizer = trained(tmp_path / "src", make, bias=bias)
    training = discover(tmp_path / "src").training
    assert training is not None and training.carried_as() == type(optimizer).__name__
    result = cli("convert", tmp_path / "src", "--tp", 1, "--layout", "dcp", "--with-optimizer", "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    checked = cli("verify", tmp_path / "src", tmp_path / "out", "--train-state")
    assert checked.exit_code == 0, checked.output
    torch.manual_seed(1)
    resumed = Tiny(bias=bias)
    reloaded = other(list(resumed.parameters()))
    weights, state = get_state_dict(resumed, reloaded)
    loaded = {"model": weights, "optimizer": state}
    dcp.load(loaded, checkpoint_id=tmp_path / "out", no_dist=True)
    set_state_dict(resumed, reloaded, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
    assert_same_state(reloaded.state_dict(), optimizer.state_dict())
    step(model, optimizer, STEPS)
    step(resumed, reloaded, STEPS)
    for (name, ours), theirs in zip(resumed.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(ours, theirs), name


def test_sgd_without_momentum_carries_groups_and_weights_alone(tmp_path: Path, cli) -> None:
    trained(tmp_path / "src", CARRIED["sgd"][0])
    training = discover(tmp_path / "src").training
    assert training is not None and training.moments == () and training.step is None
    result = cli("convert", tmp_path / "src", "--tp", 1, "--layout", "dcp", "--with-optimizer", "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output

    keys = pickle.loads((tmp_path / "out" / ".metadata").read_bytes()).state_dict_metadata
    assert not [key for key in keys if key.startswith("optimizer.state.")]
    assert {key.rsplit(".", 1)[1] for key in keys if key.startswith("optimizer.param_groups.0.")} == {
        *torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]).state_dict()["param_groups"][0]
    }


def test_sgd_to_a_deepspeed_universal_checkpoint_writes_its_momentum_and_no_step(tmp_path: Path, cli) -> None:
    """DeepSpeed's ``load_hp_checkpoint_state`` reads every ``<key>.pt`` of a parameter's folder into the
    optimizer's state by its name; SGD keeps no step, so none is written. Converted back to DCP, the state is the
    source's, bit for bit."""
    _, optimizer = trained(tmp_path / "src", CARRIED["sgd-momentum"][0])
    args = ("--tp", 1, "--layout", "deepspeed", "--with-optimizer", "-o", tmp_path / "out")
    result = cli("convert", tmp_path / "src", *args)
    assert result.exit_code == 0, result.output
    folder = tmp_path / "out" / "global_step0" / "zero" / "a.weight"
    assert sorted(p.name for p in folder.iterdir()) == ["fp32.pt", "momentum_buffer.pt"]
    saved = torch.load(folder / "momentum_buffer.pt", weights_only=True)["param"]
    assert torch.equal(saved, optimizer.state_dict()["state"][0]["momentum_buffer"])
    groups = torch.load(tmp_path / "out" / "global_step0" / "zero" / "optimizer_state.pt", weights_only=False)
    assert groups["param_groups"][0]["momentum"] == 0.9 and groups["param_groups"][0]["nesterov"] is True
    back = ("--tp", 1, "--layout", "dcp", "--with-optimizer", "-o", tmp_path / "back")
    assert cli("convert", tmp_path / "out", *back).exit_code == 0  # read back as SGD's state: its keys say it
    checked = cli("verify", tmp_path / "src", tmp_path / "back", "--train-state")
    assert checked.exit_code == 0, checked.output


REFUSED: dict[str, tuple[Make, str]] = {
    "adafactor": (
        lambda p: torch.optim.Adafactor(p),
        "is that of Adafactor (torch.optim.Adafactor): its second moment is factored",
    ),  # fmt: skip
    "nadam": (lambda p: torch.optim.NAdam(p), "is that of NAdam"),
    "rmsprop": (lambda p: torch.optim.RMSprop(p, momentum=0.9), "is that of RMSprop"),
    "adamax": (lambda p: torch.optim.Adamax(p), "is that of Adamax"),
    "adadelta": (lambda p: torch.optim.Adadelta(p), "is that of Adadelta"),
    "rprop": (lambda p: torch.optim.Rprop(p), "is that of Rprop"),
    "asgd": (lambda p: torch.optim.ASGD(p), "is that of ASGD"),
}


def refused(cli, source: Path, out: Path) -> str:
    result = cli("convert", source, "--tp", 1, "--layout", "dcp", "--with-optimizer", "-o", out)
    assert result.exit_code == 2 and not out.exists()
    (line,) = result.stderr.strip().splitlines()
    return line


@pytest.mark.parametrize("kind", list(REFUSED))
def test_another_torch_optimizer_is_refused_by_name(tmp_path: Path, cli, kind: str) -> None:
    make, said = REFUSED[kind]
    trained(tmp_path / "src", make)
    assert said in refused(cli, tmp_path / "src", tmp_path / "out")
    shown = cli("inspect", tmp_path / "src").output.splitlines()
    line = shown[shown.index(next(s for s in shown if s.startswith("training "))) + 1]
    assert line.startswith(" " * 12 + "--with-optimizer: not carried: ") and said in line


def test_transformers_adafactor_is_refused_by_name(tmp_path: Path, cli) -> None:
    from transformers.optimization import Adafactor

    trained(tmp_path / "src", lambda p: Adafactor(p, lr=1e-3, relative_step=False, beta1=0.9))
    assert "is that of Adafactor (transformers): its second moment is factored" in refused(
        cli, tmp_path / "src", tmp_path / "out"
    )


BNB = """
import sys, torch, bitsandbytes as bnb, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
model = torch.nn.Sequential(torch.nn.Linear(64, 64))
optimizer = bnb.optim.Adam8bit(model.parameters(), lr=1e-3, min_8bit_size=16)
for _ in range(2):
    model(torch.randn(3, 64)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
weights, state = get_state_dict(model, optimizer)
dcp.save({"model": weights, "optimizer": state}, checkpoint_id=sys.argv[1], no_dist=True)
"""


def test_bitsandbytes_8bit_adam_is_refused_by_name(tmp_path: Path, cli, pytestconfig: pytest.Config) -> None:
    target = pip_target(pytestconfig, "bitsandbytes", ["bitsandbytes==0.50.2"])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", BNB, str(tmp_path / "src")], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    line = refused(cli, tmp_path / "src", tmp_path / "out")
    assert "its state (absmax1, absmax2, qmap1, qmap2, state1, state2) is that of 8-bit Adam (bitsandbytes)" in line


def test_lion_and_unknown_state_keys_are_refused_by_name(tmp_path: Path, cli) -> None:
    """lion-pytorch keeps ``exp_avg`` alone per parameter (its ``Lion.step``); an Adam state with one more key is
    refused by that key, never carried without it."""
    model, optimizer = trained(tmp_path / "adam", lambda p: torch.optim.Adam(p))
    weights, state = get_state_dict(model, optimizer)
    lion = {"state": {n: {"exp_avg": s["exp_avg"]} for n, s in state["state"].items()}, "param_groups": []}
    lion["param_groups"] = [{"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0, "params": list(state["state"])}]
    dcp.save({"model": weights, "optimizer": lion}, checkpoint_id=tmp_path / "lion", no_dist=True)
    assert "its state (exp_avg alone) is Lion's" in refused(cli, tmp_path / "lion", tmp_path / "out")
    for slots in state["state"].values():
        slots["hessian"] = torch.ones_like(slots["exp_avg"])
    dcp.save({"model": weights, "optimizer": state}, checkpoint_id=tmp_path / "more", no_dist=True)
    line = refused(cli, tmp_path / "more", tmp_path / "out")
    assert "keeps hessian per parameter, which Adam does not" in line and "never dropped" in line


def test_sgd_groups_with_and_without_momentum_are_refused_by_name(tmp_path: Path, cli) -> None:
    def make(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD([{"params": params[:2], "momentum": 0.9}, {"params": params[2:]}], lr=0.05)

    trained(tmp_path / "src", make)
    line = refused(cli, tmp_path / "src", tmp_path / "out")
    assert "SGD's param groups keep different state per parameter (group 0: momentum_buffer; group 1: none)" in line
