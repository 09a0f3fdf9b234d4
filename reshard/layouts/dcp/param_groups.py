"""The param groups a ``dcp`` output holds, as torch's AdamW keeps them (torch 2.13).

``dcp.load`` is strict: every key the loading optimizer's ``state_dict()`` has must be in the checkpoint, so a
group carries all of torch's AdamW keys. Each comes from the source's group; where the source does not record
one, it is filled only when nothing is guessed: the keys that choose an implementation and not the arithmetic
(``foreach``, ``fused``, ``capturable``, ``differentiable``), and those Adam's two moments imply (``amsgrad``
False: it would keep ``max_exp_avg_sq``; ``maximize`` False). ``decoupled_weight_decay`` is filled only where it
cannot matter (no weight decay) or the optimizer's name says it (AdamW); ``lr``, ``betas``, ``eps`` and
``weight_decay`` are never filled. The source's other keys (``initial_lr`` of a scheduler) are kept: torch's
``load_state_dict`` keeps them too.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from reshard.errors import PlanError, ReshardError, shown
from reshard.layouts.training import ParamGroup

ADAMW_KEYS = (
    "lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused",
    "decoupled_weight_decay",
)  # fmt: skip
IMPLIED = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
           "fused": None}  # fmt: skip
DECOUPLED = "decoupled_weight_decay"


def torch_groups(groups: Sequence[ParamGroup], optimizer: str | None, path: Path | None) -> list[dict[str, Any]]:
    """Each group as torch's ``state_dict()`` gives it (``params`` last, the names of its parameters).

    Raises:
        PlanError: every key that cannot be written, naming the group.
    """
    problems: list[ReshardError] = []
    out = []
    for index, group in enumerate(groups):
        hyper = dict(group.hyper)
        for key, value in IMPLIED.items():
            hyper.setdefault(key, value)
        if DECOUPLED not in hyper:
            named = (optimizer or "").lower().replace("_", "")
            if named == "adamw" or hyper.get("weight_decay") == 0:
                hyper[DECOUPLED] = True  # AdamW's; without weight decay it changes nothing
        for key in ADAMW_KEYS:
            why = _problem(key, hyper.get(key, _MISSING))
            if why:
                problems.append(ReshardError(f"param group {index}: {key} {why}", path=path, tensor=f"group {index}"))
        if "betas" in hyper and isinstance(hyper["betas"], list):
            hyper["betas"] = tuple(hyper["betas"])  # torch keeps a tuple
        out.append({**{k: v for k, v in hyper.items() if k != "params"}, "params": list(group.params)})
    if problems:
        raise PlanError(problems)
    return out


class _Missing:
    pass


_MISSING = _Missing()


def _problem(key: str, value: Any) -> str | None:
    """Why ``value`` cannot be torch AdamW's ``key``; None when it can."""
    if value is _MISSING:
        return "is not recorded by the source, and torch's AdamW needs it (dcp.load is strict)"
    number = (int, float)
    if key in ("lr", "eps", "weight_decay"):
        ok = isinstance(value, number) and not isinstance(value, bool)
    elif key == "betas":
        ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(
            isinstance(v, number) and not isinstance(v, bool) for v in value
        )  # fmt: skip
    elif key in ("foreach", "fused"):
        ok = value is None or isinstance(value, bool)
    else:
        ok = isinstance(value, bool)
    return None if ok else f"is {shown(value)}, not what torch's AdamW keeps"
