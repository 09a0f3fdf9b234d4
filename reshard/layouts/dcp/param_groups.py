"""The param groups a ``dcp`` output holds, as torch's optimizer keeps them (torch 2.13).

``dcp.load`` is strict: every key the loading optimizer's ``state_dict()`` has must be in the checkpoint, so a
group carries every key of its optimizer (:attr:`~reshard.layouts.optimizers.Optimizer.keys`: AdamW's, SGD's,
Muon's, Adagrad's). Each comes from the source's group; where the source does not record one, it is filled only
when nothing is guessed: the keys that choose an implementation and not the arithmetic (``foreach``, ``fused``,
``capturable``, ``differentiable``), and those the state carried implies (Adam's ``amsgrad`` False without a
``max_exp_avg_sq``; ``maximize`` False). Adam's ``decoupled_weight_decay`` is filled only where it cannot matter
(no weight decay) or the optimizer's name says it (AdamW); ``lr``, ``betas``, ``eps``, ``weight_decay``,
``momentum`` ... are never filled. The source's other keys (``initial_lr`` of a scheduler) are kept: torch's
``load_state_dict`` keeps them too. A list is written as the tuple torch keeps (``betas``, ``ns_coefficients``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from reshard.errors import PlanError, ReshardError, shown
from reshard.layouts.optimizers import ADAM, Optimizer
from reshard.layouts.training import ParamGroup

DECOUPLED = "decoupled_weight_decay"


def torch_groups(
    groups: Sequence[ParamGroup], optimizer: Optimizer, recorded: str | None, path: Path | None, *, amsgrad: bool
) -> list[dict[str, Any]]:
    """Each group as torch's ``state_dict()`` gives it (``params`` last, the names of its parameters).

    Args:
        groups: the groups carried.
        optimizer: the optimizer the state is of.
        recorded: its name as the source records it (DeepSpeed's ``AdamW``), else None.
        path: the source, for messages.
        amsgrad: whether the state carried holds Adam's ``max_exp_avg_sq``.

    Raises:
        PlanError: every key that cannot be written, naming the group.
    """
    problems: list[ReshardError] = []
    out = []
    for index, group in enumerate(groups):
        hyper = dict(group.hyper)
        implied = dict(optimizer.implied) | ({"amsgrad": True} if amsgrad else {})
        for key, value in implied.items():
            hyper.setdefault(key, value)
        if optimizer is ADAM and DECOUPLED not in hyper:
            named = (recorded or "").lower().replace("_", "")
            if named == "adamw" or hyper.get("weight_decay") == 0:
                hyper[DECOUPLED] = True  # AdamW's; without weight decay it changes nothing
        for key in optimizer.keys:
            why = _problem(key, hyper.get(key, _MISSING), optimizer.name)
            if why:
                problems.append(ReshardError(f"param group {index}: {key} {why}", path=path, tensor=f"group {index}"))
        if optimizer is ADAM and hyper.get("amsgrad") is not amsgrad:
            held = "holds" if amsgrad else "holds no"
            why = f"param group {index}: amsgrad is {hyper.get('amsgrad')!r} but the state {held} max_exp_avg_sq"
            problems.append(ReshardError(why, path=path, tensor=f"group {index}"))
        hyper = {key: tuple(value) if isinstance(value, list) else value for key, value in hyper.items()}
        out.append({**{k: v for k, v in hyper.items() if k != "params"}, "params": list(group.params)})
    if problems:
        raise PlanError(problems)
    return out


class _Missing:
    pass


_MISSING = _Missing()


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _numbers(count: int) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, (list, tuple)) and len(value) == count and all(map(_number, value))


# What torch's optimizers keep under each group key; a key not here is a bool.
_KINDS: dict[str, Callable[[Any], bool]] = {
    **dict.fromkeys(
        ("lr", "eps", "weight_decay", "momentum", "dampening", "lr_decay", "initial_accumulator_value"), _number
    ),  # fmt: skip
    "betas": _numbers(2),
    "ns_coefficients": _numbers(3),
    "ns_steps": lambda value: type(value) is int,
    "adjust_lr_fn": lambda value: value is None or isinstance(value, str),
    **dict.fromkeys(("foreach", "fused"), lambda value: value is None or isinstance(value, bool)),
}


def _problem(key: str, value: Any, name: str) -> str | None:
    """Why ``value`` cannot be torch's optimizer ``name``'s ``key``; None when it can."""
    if value is _MISSING:
        return f"is not recorded by the source, and torch's {name} needs it (dcp.load is strict)"
    ok = _KINDS.get(key, lambda v: isinstance(v, bool))(value)
    return None if ok else f"is {shown(value)}, not what torch's {name} keeps"
