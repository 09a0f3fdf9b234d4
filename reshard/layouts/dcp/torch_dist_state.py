"""Where a ``torch_dist`` output keeps the training state: Megatron-Core's distributed optimizer in its
``fully_reshardable`` form, which it loads at any tp, pp and data-parallel size (Megatron-Core 0.19,
``optimizer/distrib_optimizer.py`` ``sharded_param_state_fully_reshardable`` and
``load_parameter_state_from_fully_reshardable``):

* each trainable parameter's ``param`` (the fp32 master), ``exp_avg`` and ``exp_avg_sq`` as global tensors of its
  weight's shape under ``optimizer.state.<slot>.<the weight's key>``, stacked and chunked as the weight is
  (:func:`~reshard.layouts.dcp.torch_dist_keys.plan_global` places them); where the source keeps no master apart,
  the fp32 weight is written as its ``param`` too;
* in the common state, ``optimizer`` = ``{"optimizer": {"param_groups": [...]}, "param_state_sharding_type":
  "fully_reshardable"}`` (what ``DistributedOptimizer.state_dict`` saves: each group's hyper-parameters and the
  ``step``, no ``params``) and ``content_metadata.distrib_optim_sharding_type``, which Megatron-LM's
  ``load_checkpoint`` reads to ask for this form.

Megatron-Core builds its param groups again at load and matches the saved ones by ``param_group_identifier_keys``
(``wd_mult``, ``lr_mult``, ``max_lr``, ``min_lr``, ``is_expert_parallel``, ...): groups without them (another
framework's) are refused, as Megatron-Core would fail on them (``KeyError`` in ``load_state_dict``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from reshard.dtypes import TensorHeader
from reshard.errors import ReshardError
from reshard.layouts.dcp.torch_dist_keys import GlobalPlan, GlobalTensor, plan_global
from reshard.layouts.optimizers import ADAM
from reshard.layouts.training import CarriedState, split_state_name, state_name

KEYS = {"master": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}  # slot -> Megatron's state key
SHARDING = "fully_reshardable"
CONTENT_METADATA = {"distrib_optim_sharding_type": SHARDING, "distrib_optim_fully_reshardable_mem_efficient": False}
# Keys Megatron-Core matches saved groups by and that every group it builds has (``_get_param_groups``).
IDENTIFIERS = ("wd_mult", "lr_mult", "max_lr", "min_lr", "is_expert_parallel")


def weights_of(headers: Mapping[str, TensorHeader]) -> dict[str, TensorHeader]:
    """The weights among a target's tensors (no state tensor)."""
    return {name: header for name, header in headers.items() if split_state_name(name)[1] is None}


def state_plan(
    weights: GlobalPlan, headers: Mapping[str, TensorHeader], carried: CarriedState, **placing: Any
) -> tuple[GlobalPlan, dict[str, str]]:
    """``weights``' plan with every slot's state tensors beside them, and the copies to write: where the source has
    no master apart, each trainable weight's name -> the name of its ``param`` chunk.

    Args:
        weights: the weights' global plan.
        headers: every target tensor (weights and :func:`state_name` tensors).
        carried: the training state carried.
        placing: :func:`plan_global`'s keywords for the weights (``homogeneous`` is the weights' plan's).

    Raises:
        ReshardError: an optimizer other than Adam, groups Megatron-Core cannot match, a non-fp32 weight standing for
            a missing master, or state tensors that stack otherwise than their weights.
    """
    if carried.kind != ADAM.name:
        raise ReshardError(
            f"the state is {carried.kind}'s: the torch_dist layout writes Megatron-Core's distributed optimizer, "
            "whose fully_reshardable form holds Adam's state only (param, exp_avg, exp_avg_sq)",
            hint="--layout dcp or --layout deepspeed carry it",
        )
    _check_groups(carried)
    by_slot: dict[str, dict[str, TensorHeader]] = {}
    for name, header in headers.items():
        base, slot = split_state_name(name)
        if slot is not None:
            by_slot.setdefault(slot, {})[base] = header
    copies: dict[str, str] = {}
    if "master" not in carried.slots:
        trainable = [name for group in carried.groups for name in group.params if name in headers]
        wide = [name for name in trainable if headers[name].code != "F32"]
        if wide:
            raise ReshardError(
                f"the source keeps no fp32 master apart and the weight is {headers[wide[0]].code}: Megatron-Core's "
                "distributed optimizer needs one (optimizer.state.param)",
                tensor=wide[0],
                hint="convert a source that holds fp32 masters (DeepSpeed, the distributed optimizer's torch_dist)",
            )
        by_slot["master"] = {name: headers[name] for name in trainable}
        copies = {name: state_name(name, "master") for name in trainable}
    tensors = list(weights.tensors)
    for slot, slot_headers in by_slot.items():
        placed = plan_global(slot_headers, {}, **placing, homogeneous=weights.homogeneous)
        if placed.homogeneous != weights.homogeneous:
            raise ReshardError(f"the {slot} of the trainable parameters cannot be stacked as their weights are")
        tensors += [_renamed(tensor, slot) for tensor in placed.tensors]
    return replace(weights, tensors=tensors), copies


def optimizer_common(carried: CarriedState) -> dict[Any, Any]:
    """The ``optimizer`` entry of the common state: the groups' hyper-parameters with the step, as the distributed
    optimizer's ``state_dict()`` saves them (a list stored is torch's tuple again: ``betas``). With expert groups,
    the two parts of Megatron-Core's chained optimizer by index, the dense groups' then the experts'
    (``get_megatron_optimizer``), as ``ChainedOptimizer.sharded_state_dict`` saves them."""
    groups = [
        {key: tuple(value) if isinstance(value, list) else value for key, value in group.hyper.items()}
        | {"step": group.hyper.get("step", carried.step)}
        for group in carried.groups
    ]
    parts = [[g for g in groups if not g["is_expert_parallel"]], [g for g in groups if g["is_expert_parallel"]]]
    made = [{"optimizer": {"param_groups": part}, "param_state_sharding_type": SHARDING} for part in parts if part]
    return made[0] if len(made) == 1 else dict(enumerate(made))


def _renamed(tensor: GlobalTensor, slot: str) -> GlobalTensor:
    chunks = [replace(chunk, name=state_name(chunk.name, slot)) for chunk in tensor.chunks]
    return replace(tensor, key=f"optimizer.state.{KEYS[slot]}.{tensor.key}", chunks=chunks)


def _check_groups(carried: CarriedState) -> None:
    """Every group has Megatron-Core's identifiers, and one step for all."""
    for index, group in enumerate(carried.groups):
        missing = [key for key in IDENTIFIERS if key not in group.hyper]
        if missing:
            raise ReshardError(
                f"param group {index} has no {', '.join(missing)}: Megatron-Core matches the saved groups to the ones "
                "it builds by these (param_group_identifier_keys), and would not find it",
                tensor=group.params[0] if group.params else None,
                hint="carry the training state between Megatron checkpoints, or convert the weights alone",
            )
        step = group.hyper.get("step")
        if step is not None and step != carried.step:
            raise ReshardError(f"param group {index} records step {step}, the others {carried.step}")
