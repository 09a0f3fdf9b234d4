"""``--with-optimizer``: each parameter's training state planned as its weight is. Pure: no torch, no file opened.

A parameter's state tensors (its fp32 master where the source keeps one apart, its optimizer's slots: Adam's
``exp_avg`` and ``exp_avg_sq``, SGD's ``momentum_buffer``, ...; :mod:`reshard.layouts.optimizers`) have its weight's
shape, so they take the weight's unit of work with their own bytes: the same
partition and cut, the same mapping (a fused q/k/v, a RoPE permutation, a renamed tensor), the same vocab padding
(padded rows are zero in the moments as in the weight), under the target names of :func:`state_name`. Nothing
here decides a cut: the weight's :class:`~reshard.engine.plan.planner.TensorPlan` already did.

What the target cannot carry exactly is refused by name before any output exists: a layout that holds no optimizer
state, a transform that computes values instead of moving them, a unit fusing parameters of different groups, a
trainable parameter without its state, an optimizer reshard does not carry (named), and whatever else the source
keeps of its training (scheduler, RNG, loss scaler, ...) unless ``--drop`` leaves it behind. Param groups are
carried by their parameters' names, groups and the parameters in each in the source's order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from reshard.engine.plan.planner import ConversionPlan, SourceTensor, TensorPlan
from reshard.errors import PlanError, ReshardError, ShapeMismatchError
from reshard.layouts.base import SourceCheckpoint, TensorRef
from reshard.layouts.optimizers import Optimizer, UnknownOptimizer, recognise
from reshard.layouts.training import CarriedState, ParamGroup, TrainingState, state_name


def plan_training(
    conversion: ConversionPlan, dropped: Sequence[str], *, drop: frozenset[str], carries: frozenset[str] = frozenset()
) -> tuple[ConversionPlan, CarriedState]:
    """The conversion with every trainable parameter's state tensors beside its weight, and what its writer needs.

    Args:
        conversion: the planned weights.
        dropped: source tensors the mapping drops on purpose (a trainable one cannot be).
        drop: the kinds of leftover training state the user leaves behind.
        carries: the keys of the leftovers the target takes over as they are (its writer's ``carries``).

    Raises:
        PlanError: every problem at once, each naming the tensor.
        ReshardError: the source holds no training state, or more than ``drop`` leaves behind.
    """
    source = conversion.source
    state, optimizer = _readable(source, drop, carries)
    _check_padding_rows(conversion)
    trainable = state.trainable
    slots = state.slots
    problems: list[ReshardError] = [
        ReshardError("is a trainable parameter the conversion drops", path=source.path, tensor=name)
        for name in dropped
        if name in trainable
    ]
    states: list[TensorPlan] = []
    groups: list[list[tuple[int, str]]] = [[] for _ in state.groups]  # (source position, target name)
    position = {name: i for group in state.groups for i, name in enumerate(group.params)}
    frozen: list[str] = []
    aliases = _aliases(conversion.tensors, trainable)
    tied: list[tuple[str, str]] = []
    for plan in conversion.tensors:
        members = {trainable.get(s.name) for s in plan.sources}
        if members == {None} and plan.name in aliases:
            tied.append((plan.name, aliases[plan.name]))
            continue
        if members == {None}:
            frozen += [t.name for t in plan.targets]
            continue
        if len(members) > 1:
            held = ", ".join(f"{s.name} ({_group(trainable.get(s.name))})" for s in plan.sources)
            problems.append(ReshardError(f"makes one tensor of parameters of different groups: {held}",
                                         path=source.path, tensor=plan.name))  # fmt: skip
            continue
        if plan.transform is not None and not plan.transform.moves_values:
            problems.append(ReshardError(f"{plan.transform.describe()}: computes its values, and an optimizer's "
                                         "state cannot follow", path=source.path, tensor=plan.name))  # fmt: skip
            continue
        (index,) = members
        assert index is not None
        first = min(position[s.name] for s in plan.sources)
        groups[index] += [(first, t.name) for t in plan.targets]
        for slot in slots:
            made = _state_plan(plan, slot, state.tensors, problems)
            if made is not None:
                states.append(made)
    if problems:
        raise PlanError(problems)
    carried = CarriedState(
        optimizer=state.optimizer,
        step=state.step if state.step is not None else 0,
        groups=tuple(ParamGroup(g.hyper, _in_order(names)) for g, names in zip(state.groups, groups, strict=True)),
        slots=slots,
        kind=optimizer.name,
        frozen=tuple(frozen),
        tied=tuple(tied),
    )
    return replace(conversion, tensors=(*conversion.tensors, *states)), carried


def _aliases(plans: Sequence[TensorPlan], trainable: Mapping[str, int]) -> dict[str, str]:
    """``alias -> owner`` target names of the tied weights: a target tensor made of one source tensor in no group
    whose every slice is read from the bytes of one trainable parameter (DeepSpeed's ``shared_params``, read as the
    owner's slices), each of the two written as one target tensor. The source says the tie by the slices it gives,
    whatever its layout."""
    owners: dict[tuple[int, int, str], str] = {}
    for plan in plans:
        for source in plan.sources:
            if source.name in trainable and len(plan.targets) == 1:
                for ref in source.refs:
                    owners.setdefault((id(ref.reader), ref.rank, ref.key), plan.name)
    found: dict[str, str] = {}
    for plan in plans:
        if len(plan.sources) != 1 or len(plan.targets) != 1 or plan.sources[0].name in trainable:
            continue
        held = {owners.get((id(ref.reader), ref.rank, ref.key), "") for ref in plan.sources[0].refs}
        if len(held) == 1 and "" not in held and held != {plan.name}:
            found[plan.name] = held.pop()
    return found


def _readable(
    source: SourceCheckpoint, drop: frozenset[str], carries: frozenset[str]
) -> tuple[TrainingState, Optimizer]:
    """The source's training state and its optimizer, when it can be carried whole but for what ``drop`` leaves
    behind (what the target ``carries`` as it is needs no leave)."""
    state = source.training
    if state is not None and state.unread:
        raise ReshardError(f"its training state is not read: {state.unread}", path=source.path)
    if state is None or not state.tensors:
        raise ReshardError(
            f"holds no training state reshard reads (the {source.layout} layout's optimizer state, if any, is not "
            "read)",
            path=source.path,
            hint="convert without --with-optimizer to carry the weights alone",
        )
    try:
        optimizer = recognise(state.optimizer, state.moments, {key for group in state.groups for key in group.hyper})
    except UnknownOptimizer as error:
        raise ReshardError(str(error), path=source.path) from None
    if optimizer.stepped and state.step is None:
        raise ReshardError(f"records no training step: {optimizer.name}'s bias correction needs it", path=source.path)
    kept = {index: optimizer.required(group.hyper) for index, group in enumerate(state.groups) if group.params}
    if len(set(kept.values())) > 1:
        shown = "; ".join(f"group {index}: {', '.join(slots) or 'none'}" for index, slots in kept.items())
        raise ReshardError(
            f"{optimizer.name}'s param groups keep different state per parameter ({shown}): reshard carries one set "
            "of state tensors for every trainable parameter",
            path=source.path,
        )
    for index, group in enumerate(state.groups):
        lacking = [slot for slot in optimizer.required(group.hyper) if slot not in state.moments]
        if lacking and group.params:
            raise ReshardError(
                f"param group {index} keeps no {', '.join(lacking)} for any parameter, which {optimizer.name} with "
                "its hyper-parameters keeps once stepped: a resume would restart it from zero",
                path=source.path,
            )
    left = [item for item in state.not_carried if item.kind not in drop and item.key not in carries]
    if left:
        kinds = sorted({item.kind for item in left})
        raise ReshardError(
            f"holds training state no target carries: {', '.join(map(str, left))}",
            path=source.path,
            hint=f"leave it behind with --drop {','.join(kinds)}",
        )
    return state, optimizer


def _check_padding_rows(conversion: ConversionPlan) -> None:
    """A source whose vocab tensors hold rows past the true vocab (Megatron's padding) trained them: they are in the
    softmax of every step, with their moments. A conversion cuts them to the true size and pads again with zeros,
    which changes the training a resume continues (measured against Megatron-Core: 1.8e-3 on the first step's loss),
    so they are refused unless carried as rows, by saying the vocab is that large."""
    vocab = conversion.vocab
    if vocab.original is not None and vocab.source_padded is not None and vocab.source_padded > vocab.original:
        raise ReshardError(
            f"the vocab tensors hold {vocab.source_padded} rows for a vocab of {vocab.original} "
            f"({vocab.origin}): the {vocab.source_padded - vocab.original} padding rows were trained with the rest, "
            "and cutting them would change the training a resume continues",
            path=conversion.source.path,
            hint=f"carry them as rows with --vocab {vocab.source_padded}",
        )


def _in_order(names: list[tuple[int, str]]) -> tuple[str, ...]:
    """A group's target names in the order of their first source parameter in the source's group."""
    return tuple(name for _, name in sorted(names))


def _group(index: int | None) -> str:
    return "frozen" if index is None else f"group {index}"


def _state_plan(
    plan: TensorPlan, slot: str, tensors: Sequence[Mapping[str, TensorRef]], problems: list[ReshardError]
) -> TensorPlan | None:
    """``plan`` for the ``slot`` state of its parameters: their state's slices in place of the weights', the targets
    named by :func:`state_name` in the state's dtype; None (and a problem) when a slice is missing or misshapen."""
    sources: list[SourceTensor] = []
    for weight in plan.sources:
        name = state_name(weight.name, slot)
        refs = [tensors[ref.rank].get(name) if ref.rank < len(tensors) else None for ref in weight.refs]
        missing = [weight.refs[i].rank for i, ref in enumerate(refs) if ref is None]
        if missing:
            problems.append(ReshardError(f"is a trainable parameter without its {slot} (rank(s) {missing})",
                                         path=weight.refs[0].file, tensor=weight.name))  # fmt: skip
            return None
        found = [ref for ref in refs if ref is not None]
        wrong = [(w, s) for w, s in zip(weight.refs, found, strict=True) if tuple(w.shape) != tuple(s.shape)]
        if wrong:
            w, s = wrong[0]
            problems.append(ShapeMismatchError(f"its {slot} is {list(s.shape)} but its weight {list(w.shape)}",
                                               path=s.file, tensor=weight.name))  # fmt: skip
            return None
        sources.append(replace(weight, name=name, refs=tuple(found)))
    codes = {s.code for s in sources}
    if len(codes) > 1:
        problems.append(ShapeMismatchError(f"its parameters' {slot} have different dtypes: {sorted(codes)}",
                                           tensor=plan.name))  # fmt: skip
        return None
    (code,) = codes
    targets = tuple(replace(t, name=state_name(t.name, slot), code=code) for t in plan.targets)
    return replace(plan, sources=tuple(sources), targets=targets)
