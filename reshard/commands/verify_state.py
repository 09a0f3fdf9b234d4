"""``verify --train-state``: a checkpoint's training state checked on its own, or two checkpoints' against each other.

On its own (:func:`check_state`): what the records show (:mod:`reshard.commands.verify_state_plan`), then every
trainable parameter's fp32 master (its weight where the checkpoint keeps none apart) and moments read one tensor at
a time, as a conversion reads them: finite, a sum of squares (``exp_avg_sq``, ``max_exp_avg_sq``, Adagrad's ``sum``)
never negative, and the moments not all zero once the
step is past 0 (a state reset on load, as KempnerForge's resumes suffered, keeps the weights and loses the moments:
only the moments show it). Against another (:func:`compare_states`): the step, each group's parameters and
hyper-parameters by position (DeepSpeed matches groups by position), and every state tensor bit for bit by name
(:mod:`reshard.commands.verify_compare`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from reshard.commands.verify_checks import Difference, files_of
from reshard.commands.verify_compare import Compared, Tolerance, compare_tensors, gather
from reshard.commands.verify_state_plan import plan_state_check, state_tensors
from reshard.engine.plan.open import OpenedCheckpoint
from reshard.errors import ReshardError
from reshard.io.progress import progress_bar
from reshard.layouts.optimizers import NONNEGATIVE
from reshard.layouts.training import ParamGroup, TrainingState
from reshard.mappings import naming_of

if TYPE_CHECKING:
    import torch

SHOWN = 3  # parameter names one finding lists before "and N more"


def readable_state(opened: OpenedCheckpoint) -> TrainingState:
    """The training state of a checkpoint, with its tensors.

    Raises:
        ReshardError: it holds none, or its layout reads only the state's structure.
    """
    source = opened.source
    state = source.training
    if state is None:
        raise ReshardError(
            f"holds no training state reshard reads ({source.layout} layout): --train-state has nothing to check",
            path=opened.path,
            hint="verify without --train-state checks the weights",
        )
    if not state.tensors:
        raise ReshardError(
            f"the {source.layout} layout reads its optimizer's records but not its state tensors: they cannot be "
            "checked",
            path=opened.path,
        )
    return state


def check_state(opened: OpenedCheckpoint, *, progress: bool) -> Compared:
    """Check one checkpoint's training state on its own, one tensor in memory at a time.

    Raises:
        ReshardError: the checkpoint holds no training state with tensors (:func:`readable_state`).
    """
    state = readable_state(opened)
    plan = plan_state_check(state, opened.by_name())
    found = Compared(differences=plan.findings)
    zero: list[str] = []
    bar = progress_bar(progress, total=plan.count, desc="training state", unit="tensor", leave=False)
    try:
        for name, tensors in plan.params.items():
            moments = [(slot, tensor) for slot, tensor in tensors if slot in state.moments]
            all_zero = bool(moments)
            for slot, tensor in tensors:
                bar.update()
                full = gather(tensor, found.differences)
                if full is None:
                    all_zero = False  # not read: not judged
                    continue
                found.tensors += 1
                values = _values(full)
                del full
                found.differences += values.findings(tensor.name, slot, files_of(tensor))
                if slot in state.moments:
                    all_zero = all_zero and values.zero
            if all_zero and state.step:
                zero.append(name)
    finally:
        bar.close()
    found.differences += _reset(zero, len(plan.params), state)
    return found


@dataclass(frozen=True)
class _Values:
    """What one state tensor's values are: NaN/Inf counted, negatives counted with the least, all zero or not."""

    non_finite: int
    negative: int
    least: float
    zero: bool

    def findings(self, name: str, slot: str | None, file: str) -> list[Difference]:
        what = slot or "weight (its fp32 master)"
        found = []
        if self.non_finite:
            found.append(Difference("non-finite", name, f"{self.non_finite} NaN/Inf values in its {what}", file))
        if slot in NONNEGATIVE and self.negative:
            detail = f"{self.negative} negative values (least {self.least:.6g}): a sum of squares is never below 0"
            found.append(Difference("negative", name, detail, file))
        return found


def _values(tensor: torch.Tensor) -> _Values:
    """One pass (``aminmax``, which propagates NaN) for a sound tensor; masks only for one that is not."""
    import torch

    with torch.inference_mode():
        flat = tensor.reshape(-1)
        if flat.numel() == 0:
            return _Values(0, 0, 0.0, True)
        low, high = (float(v) for v in torch.aminmax(flat))
        non_finite = 0 if math.isfinite(low) and math.isfinite(high) else int((~torch.isfinite(flat)).sum())
        negative = int((flat < 0).sum()) if low < 0 or non_finite else 0
        least = float(flat[flat < 0].min()) if negative else 0.0
        return _Values(non_finite, negative, least, low == 0 and high == 0)


def _reset(zero: list[str], trainable: int, state: TrainingState) -> list[Difference]:
    """The parameters whose moments are all zero past step 0, each by name; all of them: the state was reset."""
    if not zero:
        return []
    why = (
        f"all {trainable} trainable parameters' moments are zero: the optimizer state was reset"
        if len(zero) == trainable
        else "no update reached it, or its state was reset"
    )
    detail = f"{', '.join(state.moments)} all zero at step {state.step}: {why}"
    return [Difference("zero-moments", name, detail) for name in zero]


def compare_states(a: OpenedCheckpoint, b: OpenedCheckpoint, *, progress: bool) -> Compared:
    """Two checkpoints' training states: the step, the groups by position, each state tensor by name, bit for bit
    (a resume from moments off in their last bits is not the run that saved them).

    Raises:
        ReshardError: neither holds a training state with tensors.
    """
    states = [_state_or_none(side) for side in (a, b)]
    if states == [None, None]:
        readable_state(a)  # raises: neither holds one
    paths = (str(a.path), str(b.path))
    if None in states:
        lacking = paths[states.index(None)]
        return Compared(differences=[Difference("missing", None, f"{lacking} holds no training state to compare")])
    ours, theirs = states
    assert ours is not None and theirs is not None
    namings = naming_of(a.source), naming_of(b.source)
    if namings[0] != namings[1]:
        detail = f"named as {namings[0]} and {namings[1]} name them: states are compared under the same names only"
        return Compared(differences=[Difference("not-run", None, detail)])
    records = _records(ours, theirs, paths)
    compared = compare_tensors(
        state_tensors(ours, a.by_name()),
        state_tensors(theirs, b.by_name()),
        names=paths,
        tolerance=Tolerance(),
        progress=progress,
    )
    compared.differences[:0] = records
    return compared


def _state_or_none(opened: OpenedCheckpoint) -> TrainingState | None:
    try:
        return readable_state(opened)
    except ReshardError:
        return None


def _records(ours: TrainingState, theirs: TrainingState, paths: tuple[str, str]) -> list[Difference]:
    """The step, and each group's parameters and hyper-parameters, by position."""
    diffs = []
    if ours.step != theirs.step:
        diffs.append(Difference("step", None, f"step {ours.step} vs {theirs.step}"))
    if len(ours.groups) != len(theirs.groups):
        detail = f"{len(ours.groups)} parameter groups vs {len(theirs.groups)}"
        diffs.append(Difference("group", None, detail))
    for index, (mine, other) in enumerate(zip(ours.groups, theirs.groups, strict=False)):
        diffs += _group(index, mine, other, paths)
    return diffs


def _group(index: int, ours: ParamGroup, theirs: ParamGroup, paths: tuple[str, str]) -> list[Difference]:
    diffs = []
    for only, side in ((set(ours.params) - set(theirs.params), 0), (set(theirs.params) - set(ours.params), 1)):
        if only:
            names = sorted(only)
            shown = ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
            detail = f"{len(names)} parameters only in {paths[side]}'s group {index}: {shown}"
            diffs.append(Difference("group", names[0], detail))
    for key in sorted(set(ours.hyper) | set(theirs.hyper)):
        mine, other = ours.hyper.get(key, "(none)"), theirs.hyper.get(key, "(none)")
        if mine != other:
            diffs.append(Difference("hyper", None, f"group {index} {key}: {mine!r} vs {other!r}"))
    return diffs


__all__ = ["check_state", "compare_states", "readable_state"]
