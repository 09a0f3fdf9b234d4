"""The training state of ``torch_dist`` planned from names and shapes: where the writer puts each parameter's state
(``torch_dist_state``), and the param groups the reader can and cannot tell (``torch_dist_training``).

Megatron-Core 0.19.2 itself checks both ends in ``test_torch_dist_training_mcore19.py``; here each rule is pinned.
"""

from __future__ import annotations

import pytest

from reshard.dtypes import TensorHeader
from reshard.errors import ReshardError
from reshard.layouts.dcp.torch_dist_keys import GlobalPlan, plan_global
from reshard.layouts.dcp.torch_dist_state import optimizer_common, state_plan
from reshard.layouts.dcp.torch_dist_training import _members
from reshard.layouts.training import CarriedState, ParamGroup, state_name

WEIGHTS = {
    "embedding.word_embeddings.weight": (128, 8),
    "decoder.layers.0.input_layernorm.weight": (8,),
    "decoder.layers.0.self_attention.linear_qkv.weight": (16, 8),
    "decoder.layers.1.input_layernorm.weight": (8,),
    "decoder.layers.1.self_attention.linear_qkv.weight": (16, 8),
}
PLACING = {"layers": 2, "experts": None, "local_spec": True, "tied": False}
MEGATRON = {"wd_mult": 1.0, "lr_mult": 1.0, "max_lr": 1e-3, "min_lr": 1e-4, "is_expert_parallel": False}
NORMS = [name for name, shape in WEIGHTS.items() if len(shape) == 1]
MATRICES = [name for name in WEIGHTS if name not in NORMS]


def carried(slots: tuple[str, ...], hyper: dict | None = None) -> CarriedState:
    groups = (
        ParamGroup(hyper or MEGATRON, tuple(MATRICES)),
        ParamGroup(hyper or MEGATRON | {"wd_mult": 0.0}, tuple(NORMS)),
    )
    return CarriedState("adam", 3, groups, slots, "Adam")  # fmt: skip


def planned(slots: tuple[str, ...], code: str = "F32", hyper: dict | None = None):
    headers = {name: TensorHeader(shape, code) for name, shape in WEIGHTS.items()}
    states = {state_name(n, s): TensorHeader(WEIGHTS[n], "F32") for n in WEIGHTS for s in slots}
    weights = plan_global(headers, {}, **PLACING)
    return state_plan(weights, headers | states, carried(slots, hyper), **PLACING)


def test_each_slot_is_stacked_as_its_weight_under_megatrons_state_key() -> None:
    plan, copies = planned(("master", "exp_avg", "exp_avg_sq"))
    shapes = {tensor.key: tensor.shape for tensor in plan.tensors}
    weight = "decoder.layers.self_attention.linear_qkv.weight"
    for key in ("param", "exp_avg", "exp_avg_sq"):
        assert shapes[f"optimizer.state.{key}.{weight}"] == shapes[weight] == (2, 16, 8)
    assert shapes["optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.layer_norm_weight"] == (2, 8)
    chunks = {c.name for t in plan.tensors if t.key == f"optimizer.state.exp_avg.{weight}" for c in t.chunks}
    assert chunks == {state_name(f"decoder.layers.{i}.self_attention.linear_qkv.weight", "exp_avg") for i in (0, 1)}
    assert copies == {}


def test_without_a_master_apart_the_fp32_weight_is_written_as_megatrons_param() -> None:
    plan, copies = planned(("exp_avg", "exp_avg_sq"))
    assert copies == {name: state_name(name, "master") for name in [*MATRICES, *NORMS]}
    assert "optimizer.state.param.embedding.word_embeddings.weight" in {tensor.key for tensor in plan.tensors}


def test_a_16_bit_weight_does_not_stand_for_a_missing_master() -> None:
    with pytest.raises(ReshardError, match="keeps no fp32 master apart and the weight is BF16"):
        planned(("exp_avg", "exp_avg_sq"), code="BF16")


def test_groups_without_megatrons_identifiers_are_refused() -> None:
    torch_group = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    with pytest.raises(
        ReshardError, match="param group 0 has no wd_mult, lr_mult, max_lr, min_lr, is_expert_parallel"
    ):
        planned(("exp_avg", "exp_avg_sq"), hyper=torch_group)


def test_the_common_state_holds_each_group_with_the_step_and_torchs_tuples() -> None:
    common = optimizer_common(carried(("exp_avg",), MEGATRON | {"betas": [0.9, 0.95]}))
    assert common["param_state_sharding_type"] == "fully_reshardable"
    group = common["optimizer"]["param_groups"][0]
    assert group["betas"] == (0.9, 0.95) and group["step"] == 3 and "params" not in group


class _View:
    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape


def test_group_membership_follows_megatrons_standard_rule() -> None:
    views = {name: _View(shape) for name, shape in WEIGHTS.items()}
    groups = [MEGATRON, MEGATRON | {"wd_mult": 0.0}]
    members, unread = _members(list(WEIGHTS), views, groups)  # type: ignore[arg-type]
    assert unread is None and members == [MATRICES, NORMS]


def test_groups_the_standard_rule_does_not_explain_leave_the_state_unread() -> None:
    views = {name: _View(shape) for name, shape in WEIGHTS.items()}
    groups = [MEGATRON, MEGATRON | {"wd_mult": 0.0, "lr_mult": 0.5}]  # the norms' group overridden by name
    _, unread = _members(list(WEIGHTS), views, groups)  # type: ignore[arg-type]
    assert unread is not None and "does not explain for decoder.layers.0.input_layernorm.weight and 1 more" in unread


def test_another_optimizer_than_adam_is_refused_by_name() -> None:
    carried = CarriedState("SGD", 0, (ParamGroup({"lr": 0.1}, ("w",)),), ("momentum_buffer",), "SGD")
    with pytest.raises(ReshardError, match="the state is SGD's: the torch_dist layout writes Megatron-Core's"):
        state_plan(GlobalPlan([], {}), {}, carried)
