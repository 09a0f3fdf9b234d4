"""``verify --train-state``, the part that reads no byte: what a checkpoint's training state must hold, judged from
its records and headers, and the state tensors left to read, each as its weight is read.

A trainable parameter (one in a param group) has every moment the state records, on every rank its weight has a
slice on, at that slice's shape; no parameter is in two groups; every tensor of the model is in a group, frozen, or
a tied alias of one that is. The tensors are then read one at a time by :mod:`reshard.commands.verify_state`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from reshard.commands.verify_checks import Difference, files_of
from reshard.engine.plan.planner import SourceTensor
from reshard.layouts.optimizers import UnknownOptimizer, recognise
from reshard.layouts.training import TrainingState, split_state_name, state_name

MASTER = "master"


@dataclass
class StatePlan:
    """What the records say, and what is left to read.

    Attributes:
        findings: what the records and headers already show wrong, each naming its tensor.
        slots: the state tensors every trainable parameter must have (:attr:`TrainingState.slots`).
        params: each trainable parameter's tensors to read, the slot first (``None``: the weight, its own fp32 master
            where the checkpoint keeps none apart), only those found at their weight's shape.
    """

    findings: list[Difference] = field(default_factory=list)
    slots: tuple[str, ...] = ()
    params: dict[str, list[tuple[str | None, SourceTensor]]] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return sum(len(tensors) for tensors in self.params.values())


def plan_state_check(state: TrainingState, weights: Mapping[str, SourceTensor]) -> StatePlan:
    """Judge ``state`` against the checkpoint's ``weights`` (by name), and list the state tensors to read.

    Args:
        state: the checkpoint's training state, its tensors filled by the layout.
        weights: the checkpoint's tensors as :meth:`~reshard.engine.plan.open.OpenedCheckpoint.by_name` gives them.
    """
    plan = StatePlan()
    grouped = _grouped(state, weights, plan.findings)
    _coverage(state, weights, grouped, plan.findings)
    plan.slots = state.slots
    has_master = MASTER in plan.slots
    if state.step is None and _stepped(state):
        plan.findings.append(Difference("step", None, "the checkpoint records no training step"))
    for name in grouped:
        weight = weights.get(name)
        if weight is None:
            continue
        found: list[tuple[str | None, SourceTensor]] = [] if has_master else [(None, weight)]
        for slot in plan.slots:
            tensor = state_tensor(weight, slot, state, plan.findings)
            if tensor is not None:
                found.append((slot, tensor))
        plan.params[name] = found
    plan.findings += _strays(state, grouped)
    return plan


def _stepped(state: TrainingState) -> bool:
    """Whether the state's optimizer keeps a step (SGD and Muon keep none); one reshard does not know is taken to."""
    try:
        return recognise(
            state.optimizer, state.moments, {key for group in state.groups for key in group.hyper}
        ).stepped
    except UnknownOptimizer:
        return True


def state_tensor(
    weight: SourceTensor, slot: str, state: TrainingState, findings: list[Difference]
) -> SourceTensor | None:
    """``weight``'s ``slot`` state as a tensor read as the weight is (its slices in place of the weight's); None, and
    a finding naming it, when a rank's slice is missing or not at the weight's shape."""
    name = state_name(weight.name, slot)
    refs = [state.tensors[ref.rank].get(name) if ref.rank < len(state.tensors) else None for ref in weight.refs]
    missing = [weight.refs[i].rank for i, ref in enumerate(refs) if ref is None]
    if missing:
        where = f" on rank(s) {missing}" if len(weight.refs) > 1 else ""
        findings.append(Difference("missing", name, f"a trainable parameter without its {slot}{where}"))
        return None
    found = [ref for ref in refs if ref is not None]
    for mine, theirs in zip(weight.refs, found, strict=True):
        if tuple(mine.shape) != tuple(theirs.shape):
            where = f" on rank {mine.rank}" if len(weight.refs) > 1 else ""
            what = f"{list(theirs.shape)}{where}, its weight {list(mine.shape)}"
            findings.append(Difference("shape", name, what, str(theirs.file)))
            return None
    return replace(weight, name=name, refs=tuple(found))


def state_tensors(state: TrainingState, weights: Mapping[str, SourceTensor]) -> dict[str, SourceTensor]:
    """Every trainable parameter's state tensors found at their weight's shape, by :func:`state_name`: what two
    checkpoints' states are compared by (what is missing or misshapen shows as missing on one side)."""
    plan = plan_state_check(state, weights)
    return {tensor.name: tensor for found in plan.params.values() for slot, tensor in found if slot is not None}


def _grouped(state: TrainingState, weights: Mapping[str, SourceTensor], findings: list[Difference]) -> list[str]:
    """Every parameter the groups name, once, in their order; one in two groups, one the checkpoint does not hold or
    one also recorded frozen are findings."""
    seen: dict[str, int] = {}
    frozen = set(state.frozen)
    for index, group in enumerate(state.groups):
        for name in group.params:
            if name in seen:
                findings.append(Difference("group", name, f"in parameter groups {seen[name]} and {index}"))
                continue
            seen[name] = index
            if name not in weights:
                findings.append(Difference("group", name, f"in parameter group {index}, not a tensor of the model"))
            if name in frozen:
                findings.append(Difference("group", name, f"in parameter group {index} and recorded frozen"))
    return list(seen)


def _coverage(
    state: TrainingState, weights: Mapping[str, SourceTensor], grouped: list[str], findings: list[Difference]
) -> None:
    """Every tensor of the model in a group, frozen, or a tied alias of another (its slices are another's, which is
    judged in its place)."""
    known = set(grouped) | set(state.frozen)
    owners: dict[tuple[int, int, str], str] = {}
    for name, tensor in weights.items():
        for ref in tensor.refs:
            owners.setdefault((id(ref.reader), ref.rank, ref.key), name)
    for name, tensor in weights.items():
        if name in known:
            continue
        owner = {owners[(id(ref.reader), ref.rank, ref.key)] for ref in tensor.refs}
        if owner - {name}:
            continue  # a tied alias reads its owner's bytes: one parameter, judged by its owner's name
        findings.append(Difference("ungrouped", name, "a tensor of the model in no parameter group, not frozen",
                                   files_of(tensor)))  # fmt: skip


def _strays(state: TrainingState, grouped: list[str]) -> list[Difference]:
    """State tensors of parameters in no group: a frozen parameter has no moments, and a name no group holds is
    state the optimizer will not find."""
    trainable = set(grouped)
    strays: dict[str, str] = {}
    for rank in state.tensors:
        for name, ref in rank.items():
            if split_state_name(name)[0] not in trainable:
                strays.setdefault(name, str(ref.file))
    frozen = set(state.frozen)
    whose = {True: "state of a frozen parameter", False: "state of a parameter in no group"}
    return [Difference("extra", n, whose[split_state_name(n)[0] in frozen], file) for n, file in strays.items()]
