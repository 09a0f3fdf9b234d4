"""The training state of small DCP checkpoints written by ``dcp.save`` without a process group: what is read, what
is reported as not carried and by which kind, and what ``convert --with-optimizer`` refuses by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from reshard.errors import CorruptFileError
from reshard.layouts import discover

NAMES = ("a.weight", "b.weight")
GROUP = {
    "lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False, "maximize": False,
    "foreach": None, "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True,
}  # fmt: skip


def model() -> dict[str, torch.Tensor]:
    return {name: torch.arange(12.0).view(3, 4) + i for i, name in enumerate(NAMES)}


def state(step: float = 3.0, names: tuple[str, ...] = NAMES) -> dict[str, dict[str, torch.Tensor]]:
    return {n: {"exp_avg": torch.arange(12.0).view(3, 4) / 7, "exp_avg_sq": torch.arange(12.0).view(3, 4) / 9,
                "step": torch.tensor(step)} for n in names}  # fmt: skip


def saved(folder: Path, everything: dict) -> Path:
    dcp.save(everything, checkpoint_id=folder, no_dist=True)
    return folder


def test_torchtitans_other_state_is_reported_by_kind_and_its_step_read(tmp_path: Path) -> None:
    """No step in the optimizer (exp_avg alone, as a flattened state of a trainer's own): train_state's is read."""
    optimizer = {f"state.{name}.exp_avg": torch.ones(3, 4) for name in NAMES}
    extras = {"lr_scheduler": {"last_epoch": 4}, "dataloader": {"rank_0": b"at=7"}, "train_state": {"step": 7}}
    training = discover(saved(tmp_path / "ckpt", {**model(), "optimizer": optimizer, **extras})).training
    assert training is not None and training.step == 7 and training.moments == ("exp_avg",)
    kinds = {item.what: item.kind for item in training.not_carried}
    assert kinds == {"lr_scheduler": "scheduler", "dataloader": "dataloader", "train_state": "trainer"}


def test_a_parameter_without_moments_is_refused_by_name(tmp_path: Path, cli) -> None:
    groups = [{**GROUP, "params": list(NAMES)}]
    ckpt = saved(
        tmp_path / "ckpt", {"model": model(), "optimizer": {"state": state(names=NAMES[:1]), "param_groups": groups}}
    )
    training = discover(ckpt).training
    assert training is not None and [g.params for g in training.groups] == [NAMES]
    result = cli("convert", ckpt, "--tp", 1, "--layout", "dcp", "--with-optimizer", "-o", tmp_path / "out")
    assert result.exit_code == 2 and "b.weight" in result.stderr and "without its exp_avg" in result.stderr
    assert not (tmp_path / "out").exists()


def test_other_state_is_refused_unless_dropped(tmp_path: Path, cli) -> None:
    optimizer = {"state": state(), "param_groups": [{**GROUP, "params": list(NAMES)}]}
    ckpt = saved(tmp_path / "ckpt", {"model": model(), "optimizer": optimizer, "lr_scheduler": {"last_epoch": 3}})
    result = cli("convert", ckpt, "--tp", 1, "--layout", "dcp", "--with-optimizer", "-o", tmp_path / "out")
    assert result.exit_code == 2 and "lr_scheduler" in result.stderr and "--drop scheduler" in result.stderr
    args = ("--with-optimizer", "--drop", "scheduler", "-o", tmp_path / "out")
    result = cli("convert", ckpt, "--tp", 1, "--layout", "dcp", *args)
    assert result.exit_code == 0, result.output
    again = discover(tmp_path / "out").training
    assert again is not None and again.step == 3 and again.not_carried == ()
    assert again.groups[0].hyper == {k: list(v) if isinstance(v, tuple) else v for k, v in GROUP.items()}


@pytest.mark.parametrize(
    ("optimizer", "match"),
    [
        ({"state": {**state(), "c.weight": state()["a.weight"]}}, "optimizer state for 1 tensor.* the model does not"),
        ({"state": {**state(names=NAMES[:1]), **state(step=4.0, names=NAMES[1:])}}, "stepped 2 different numbers"),
    ],
    ids=["stranger", "steps"],
)
def test_inconsistent_optimizer_states_are_refused(tmp_path: Path, optimizer: dict, match: str) -> None:
    optimizer["param_groups"] = [{**GROUP, "params": sorted(optimizer["state"])}]
    with pytest.raises(CorruptFileError, match=match):
        discover(saved(tmp_path / "ckpt", {"model": model(), "optimizer": optimizer}))


def test_verify_names_the_first_parameter_whose_step_differs(tmp_path: Path, cli) -> None:
    """DCP keeps one step per parameter: they must all agree, and ``verify --train-state`` says which does not, in
    one line, by its entry."""
    names = (*NAMES, "c.weight")
    steps = {**state(names=names[:1]), **state(step=5.0, names=names[1:2]), **state(names=names[2:])}
    optimizer = {"state": steps, "param_groups": [{**GROUP, "params": list(names)}]}
    weights = {**model(), "c.weight": torch.ones(3, 4)}
    ckpt = saved(tmp_path / "ckpt", {"model": weights, "optimizer": optimizer})
    result = cli("verify", ckpt, "--train-state")
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert f"{ckpt}: optimizer.state.b.weight.step: parameters were stepped 2 different numbers of times" in line
    assert "at step 5, where a.weight and 1 more are at step 3" in line
