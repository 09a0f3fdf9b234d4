"""The param groups a ``dcp`` output holds: every key of torch's AdamW (``dcp.load`` is strict), filled from the
source's group, or only where nothing is guessed; the rest refused by name before any output exists."""

from __future__ import annotations

import pytest
import torch

from reshard.errors import PlanError
from reshard.layouts.dcp.param_groups import ADAMW_KEYS, torch_groups
from reshard.layouts.training import ParamGroup

TORCH = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}


def test_every_key_torchs_adamw_keeps_is_written_and_betas_is_a_tuple() -> None:
    model = torch.nn.Linear(2, 2)
    keys = set(torch.optim.AdamW(model.parameters()).state_dict()["param_groups"][0])
    assert keys == {*ADAMW_KEYS, "params"}
    (group,) = torch_groups([ParamGroup(TORCH, ("w", "b"))], "AdamW", None)
    assert set(group) == keys and group["betas"] == (0.9, 0.95) and group["params"] == ["w", "b"]
    assert group["decoupled_weight_decay"] is True and group["amsgrad"] is False and group["foreach"] is None


def test_the_sources_own_keys_are_kept() -> None:
    hyper = TORCH | {"decoupled_weight_decay": False, "initial_lr": 5e-4, "foreach": True}
    (group,) = torch_groups([ParamGroup(hyper, ("w",))], None, None)
    assert group["decoupled_weight_decay"] is False and group["initial_lr"] == 5e-4 and group["foreach"] is True


def test_decoupled_weight_decay_is_filled_only_where_it_is_known() -> None:
    no_decay = TORCH | {"weight_decay": 0.0}
    (group,) = torch_groups([ParamGroup(no_decay, ("w",))], "Adam", None)
    assert group["decoupled_weight_decay"] is True  # no weight decay: it changes nothing
    with pytest.raises(PlanError, match="param group 0: decoupled_weight_decay is not recorded by the source"):
        torch_groups([ParamGroup(TORCH, ("w",))], "Adam", None)  # DeepSpeed's "Adam" is AdamW by default


def test_missing_and_strange_values_are_refused_together() -> None:
    groups = [ParamGroup({"betas": [0.9], "eps": 1e-8, "weight_decay": 0.0}, ("w",)), ParamGroup(TORCH, ("b",))]
    groups.append(ParamGroup(TORCH | {"lr": "<a Tensor>"}, ("c",)))
    with pytest.raises(PlanError) as caught:
        torch_groups(groups, "AdamW", None)
    text = str(caught.value)
    assert "param group 0: lr is not recorded by the source" in text
    assert "param group 0: betas is [0.9], not what torch's AdamW keeps" in text
    assert "param group 2: lr is '<a Tensor>'" in text and "param group 1" not in text
