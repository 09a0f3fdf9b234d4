"""The param groups a ``dcp`` output holds: every key of torch's optimizer (``dcp.load`` is strict), filled from the
source's group, or only where nothing is guessed; the rest refused by name before any output exists."""

from __future__ import annotations

import pytest
import torch

from reshard.errors import PlanError
from reshard.layouts.dcp.param_groups import torch_groups
from reshard.layouts.optimizers import ADAGRAD, ADAM, MUON, SGD
from reshard.layouts.training import ParamGroup

TORCH = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}


def test_every_key_torchs_adamw_keeps_is_written_and_betas_is_a_tuple() -> None:
    model = torch.nn.Linear(2, 2)
    keys = set(torch.optim.AdamW(model.parameters()).state_dict()["param_groups"][0])
    assert keys == {*ADAM.keys, "params"}
    (group,) = torch_groups([ParamGroup(TORCH, ("w", "b"))], ADAM, "AdamW", None, amsgrad=False)
    assert set(group) == keys and group["betas"] == (0.9, 0.95) and group["params"] == ["w", "b"]
    assert group["decoupled_weight_decay"] is True and group["amsgrad"] is False and group["foreach"] is None


def test_the_sources_own_keys_are_kept() -> None:
    hyper = TORCH | {"decoupled_weight_decay": False, "initial_lr": 5e-4, "foreach": True}
    (group,) = torch_groups([ParamGroup(hyper, ("w",))], ADAM, None, None, amsgrad=False)
    assert group["decoupled_weight_decay"] is False and group["initial_lr"] == 5e-4 and group["foreach"] is True


def test_decoupled_weight_decay_is_filled_only_where_it_is_known() -> None:
    no_decay = TORCH | {"weight_decay": 0.0}
    (group,) = torch_groups([ParamGroup(no_decay, ("w",))], ADAM, "Adam", None, amsgrad=False)
    assert group["decoupled_weight_decay"] is True  # no weight decay: it changes nothing
    with pytest.raises(PlanError, match="param group 0: decoupled_weight_decay is not recorded by the source"):
        torch_groups(
            [ParamGroup(TORCH, ("w",))], ADAM, "Adam", None, amsgrad=False
        )  # DeepSpeed's "Adam" is AdamW by default


def test_missing_and_strange_values_are_refused_together() -> None:
    groups = [ParamGroup({"betas": [0.9], "eps": 1e-8, "weight_decay": 0.0}, ("w",)), ParamGroup(TORCH, ("b",))]
    groups.append(ParamGroup(TORCH | {"lr": "<a Tensor>"}, ("c",)))
    with pytest.raises(PlanError) as caught:
        torch_groups(groups, ADAM, "AdamW", None, amsgrad=False)
    text = str(caught.value)
    assert "param group 0: lr is not recorded by the source" in text
    assert "param group 0: betas is [0.9], not what torch's Adam keeps" in text
    assert "param group 2: lr is '<a Tensor>'" in text and "param group 1" not in text


@pytest.mark.parametrize(
    ("optimizer", "made"),
    [
        (SGD, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
        (MUON, lambda p: torch.optim.Muon(p)),
        (ADAGRAD, lambda p: torch.optim.Adagrad(p)),
        (ADAM, lambda p: torch.optim.Adam(p, amsgrad=True)),
    ],
    ids=lambda v: getattr(v, "name", ""),
)
def test_each_carried_optimizers_keys_are_torchs(optimizer, made) -> None:
    """The table's keys are the keys torch's own optimizer keeps, and its group goes through unchanged."""
    (saved,) = made([torch.nn.Parameter(torch.zeros(2, 2))]).state_dict()["param_groups"]
    hyper = {k: list(v) if isinstance(v, tuple) else v for k, v in saved.items() if k != "params"}
    assert set(hyper) == set(optimizer.keys)
    (group,) = torch_groups([ParamGroup(hyper, ("w",))], optimizer, None, None, amsgrad=optimizer is ADAM)
    assert group == {**saved, "params": ["w"]}


def test_sgd_hyper_parameters_are_never_guessed() -> None:
    with pytest.raises(PlanError) as caught:
        torch_groups([ParamGroup({"lr": 0.1}, ("w",))], SGD, None, None, amsgrad=False)
    text = str(caught.value)
    for key in ("momentum", "dampening", "weight_decay", "nesterov"):
        assert f"param group 0: {key} is not recorded by the source, and torch's SGD needs it" in text
    assert "maximize" not in text and "foreach" not in text
