"""The training state of a DCP checkpoint: the optimizer's state beside the model, as
``torch.distributed.checkpoint.state_dict.get_state_dict`` gives it and ``dcp.save`` flattens it (torch 2.13):

* per parameter, by the model's fqn: ``<optimizer>.state.<fqn>.exp_avg`` and ``.exp_avg_sq``, global tensors stored
  as chunk boxes like the weights, and ``.step``, a float32 scalar;
* the param groups, pickled values: nested (the default), ``<optimizer>.param_groups.<i>.<key>`` with the group's
  fqns in ``<optimizer>.param_groups.<i>.params``; flat (``flatten_optimizer_state_dict=True``, torchtitan),
  ``<optimizer>.param_groups.<fqn>.<key>`` per parameter and no list, so a group is the parameters whose
  hyper-parameters are all equal, in the order they come (``set_state_dict`` matches groups by fqn either way).

``<optimizer>`` is the key path :mod:`reshard.layouts.dcp.containers` skipped as an optimizer (``optimizer``,
torchtitan's and FSDP2's; ``app.optim``, the DCP tutorial's). The step is the parameters' one step (else
torchtitan's ``train_state.step``). What else the checkpoint holds of its training (``lr_scheduler``,
``dataloader``, ``train_state``, RNG states) is listed as not carried, by kind. A parameter in a group without its
moments simply has no state tensors: the planner refuses it by name.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reshard.errors import CorruptFileError, shown
from reshard.formats.chunks import archive_value, torch_archive_layout
from reshard.formats.dcp_metadata.read import DcpIndex, StoredTensor
from reshard.layouts.base import TensorRef
from reshard.layouts.dcp.containers import ModelEntries, key_path
from reshard.layouts.training import SLOTS, Leftover, ParamGroup, TrainingState, stored_value

OPTIMIZERS = frozenset("optimizer optimizers optim optim_state optimizer_state".split())
# The kind (``--drop``) of each other training-state key :mod:`reshard.layouts.dcp.containers` skips.
KINDS = {
    **dict.fromkeys("lr_scheduler lr_schedulers scheduler schedulers".split(), "scheduler"),
    **dict.fromkeys("dataloader dataloaders data_loader".split(), "dataloader"),
    **dict.fromkeys("train_state trainer_state training_state".split(), "trainer"),
    **dict.fromkeys("rng rng_state rng_states rng_tracker_states".split(), "rng"),
    **dict.fromkeys("grad_scaler scaler".split(), "loss_scaler"),
}
STEP = "step"
TRAIN_STEP = ("train_state", "step")  # torchtitan's trainer counter, when the optimizer records none
# Scalar dtypes a step is stored in, by safetensors code: struct format.
_SCALARS = {"F32": "<f", "F64": "<d", "I64": "<q", "I32": "<i", "F16": "<e"}
MAX_STEP = 1 << 53  # beyond it a float step is not an integer any more


@dataclass
class StateEntries:
    """The optimizer's entries of a DCP index, by what they hold (names only: nothing read yet).

    Attributes:
        container: the optimizer's key path, dotted (``optimizer``, ``app.optim``); None without one.
        tensors: the fqn of each state tensor, by (parameter, slot); the step scalars apart, in ``steps``.
        steps: each parameter's step tensor's fqn.
        groups: the param groups' values' fqns, by group (its index, nested; a parameter's fqn, flat), then key.
        nested: whether the groups are nested (``param_groups.<i>.params`` lists each group's parameters).
        other: the optimizer's entries of another kind (torch's optimizers have none).
        leftovers: the other training state the checkpoint holds, with its kind.
    """

    container: str | None = None
    tensors: dict[tuple[str, str], str] = field(default_factory=dict)
    steps: dict[str, str] = field(default_factory=dict)
    groups: dict[str, dict[str, str]] = field(default_factory=dict)
    nested: bool = False
    other: list[str] = field(default_factory=list)
    leftovers: list[Leftover] = field(default_factory=list)


def state_entries(index: DcpIndex, entries: ModelEntries) -> StateEntries:
    """Sort the entries :func:`~reshard.layouts.dcp.containers.model_entries` skipped: the optimizer's by what they
    hold, the rest as leftovers of their kind. Several optimizers (an unusual trainer) are all left over."""
    by_group: dict[str, list[str]] = {}
    for fqn, group in entries.skipped.items():
        by_group.setdefault(group, []).append(fqn)
    optimizers = [g for g in by_group if g.rsplit(".", 1)[-1] in OPTIMIZERS]
    found = StateEntries(container=optimizers[0] if len(optimizers) == 1 else None)
    for group, fqns in by_group.items():
        if group == found.container:
            continue
        kind = KINDS.get(group.rsplit(".", 1)[-1], "other")
        what = group if group not in optimizers else f"optimizer state {group}"
        found.leftovers.append(Leftover(kind, what, _entries(fqns)))
    if found.container is None:
        return found
    prefix = found.container + "."
    fqns = by_group[found.container]
    found.nested = any(f[len(prefix) :].startswith("param_groups.") and f.endswith(".params") for f in fqns)
    params = set(entries.names.values())
    for fqn in fqns:
        rest = fqn[len(prefix) :]
        kind, _, inner = rest.partition(".")
        owner, key = _owner(inner, params) if kind == "state" else inner.rpartition(".")[::2]
        if kind == "state" and owner and fqn in index.tensors:
            if key == STEP:
                found.steps[owner] = fqn
            else:
                found.tensors[(owner, key)] = fqn
        elif kind == "param_groups" and owner and fqn in index.values:
            found.groups.setdefault(owner, {})[key] = fqn
        else:
            found.other.append(fqn)
    if found.other:
        found.leftovers.append(
            Leftover("other", f"{found.container} entries {', '.join(found.other[:4])}", ".metadata")
        )
    return found


def _owner(inner: str, params: set[str]) -> tuple[str, str]:
    """``(parameter, key)`` of a state entry: the longest leading part that is a parameter of the model, so that
    a nested state keeps its whole key (bitsandbytes' ``__bnb_optimizer_quant_state__.state1``) and is named by
    it; else the last part is the key."""
    parts = inner.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:cut]) in params:
            return ".".join(parts[:cut]), ".".join(parts[cut:])
    owner, _, key = inner.rpartition(".")
    return owner, key


def _entries(fqns: list[str]) -> str:
    return f".metadata: {len(fqns)} entries" if len(fqns) > 1 else ".metadata"


def training_state(
    index: DcpIndex,
    found: StateEntries,
    stored: Mapping[str, StoredTensor],
    model: list[str],
    refs: Mapping[str, TensorRef],
) -> TrainingState | None:
    """The checkpoint's training state, its values read (the steps, the param groups' hyper-parameters).

    Args:
        index: the checkpoint's index.
        found: its optimizer's entries (:func:`state_entries`).
        stored: the state tensors and steps, checked (:func:`reshard.layouts.dcp.dcp.checked`), by fqn.
        model: the model's tensors, by the names they are read by.
        refs: the state tensors' refs, by :func:`~reshard.layouts.training.state_name`.

    Raises:
        CorruptFileError: a value is not what torch writes, or the optimizer names a tensor the model lacks.
    """
    if found.container is None and not found.leftovers:
        return None
    held = set(model)
    strangers = sorted(({p for p, _ in found.tensors} | set(found.steps)) - held)
    if strangers:
        raise CorruptFileError(
            f"optimizer state for {len(strangers)} tensor(s) the model does not hold", path=index.folder,
            tensor=f"{found.container}.state.{strangers[0]}",
        )  # fmt: skip
    groups = _groups(index, found)
    grouped = [name for group in groups for name in group.params]
    if len(grouped) != len(set(grouped)):
        twice = next(name for name in grouped if grouped.count(name) > 1)
        raise CorruptFileError("is in two param groups", path=index.folder, tensor=twice)
    stateful = {p for p, _ in found.tensors}
    if groups and stateful - set(grouped):
        raise CorruptFileError(
            "has optimizer state but is in no param group",
            path=index.folder,
            tensor=sorted(stateful - set(grouped))[0],
        )
    if not groups and stateful:  # state without groups (not torch's): one group, its hyper-parameters unknown
        groups = (ParamGroup({}, tuple(name for name in model if name in stateful)),)
    moments = tuple(slot for slot in dict.fromkeys(slot for _, slot in found.tensors) if slot != STEP)
    unknown = [slot for slot in moments if slot not in SLOTS]
    frozen = tuple(name for name in model if name not in set(grouped) | stateful)
    return TrainingState(
        optimizer=None,  # DCP records no optimizer class: its moments say what it is
        step=_step(index, found, stored),
        moments=tuple(slot for slot in SLOTS if slot in moments) + tuple(unknown),
        groups=groups,
        frozen=frozen,
        not_carried=tuple(found.leftovers),
        tensors=(refs,),
    )


def _groups(index: DcpIndex, found: StateEntries) -> tuple[ParamGroup, ...]:
    """The param groups: nested, in their index order with their ``params``; flat, parameters with equal
    hyper-parameters together, in the order the parameters come."""
    values = {owner: {key: _value(index, fqn) for key, fqn in keys.items()} for owner, keys in found.groups.items()}
    if found.nested:
        groups = []
        for owner in sorted(values, key=lambda o: int(o) if o.isdigit() else -1):
            hyper = values[owner]
            names = hyper.pop("params", None)
            if not owner.isdigit() or not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise CorruptFileError(
                    "is not a param group with a list of parameter names", path=index.folder,
                    tensor=f"{found.container}.param_groups.{owner}",
                )  # fmt: skip
            groups.append(ParamGroup({k: stored_value(v) for k, v in hyper.items()}, tuple(names)))
        return tuple(groups)
    merged: dict[str, list[str]] = {}
    hypers: dict[str, dict[str, Any]] = {}
    for owner, hyper in values.items():
        kept = {k: stored_value(v) for k, v in sorted(hyper.items())}
        key = repr(kept)
        hypers.setdefault(key, {k: kept[k] for k in hyper})
        merged.setdefault(key, []).append(owner)
    return tuple(ParamGroup(hypers[key], tuple(names)) for key, names in merged.items())


def _value(index: DcpIndex, fqn: str) -> Any:
    stored = index.stored_values.get(fqn)
    if stored is None or stored.transforms:
        raise CorruptFileError(
            "a pickled value whose bytes are not located, or compressed", path=index.folder, tensor=fqn
        )
    return archive_value(stored.file, stored.position, stored.length, entry=fqn)


def _step(index: DcpIndex, found: StateEntries, stored: Mapping[str, StoredTensor]) -> int | None:
    """The one step every parameter's state was taken at; else torchtitan's ``train_state.step``; else None."""
    steps = {param: _scalar(stored[fqn]) for param, fqn in found.steps.items()}
    if steps:
        distinct = set(steps.values())
        if len(distinct) > 1:
            (first, step), *rest = steps.items()
            other, its = next((p, s) for p, s in rest if s != step)
            same = sum(1 for _, s in rest if s == step)
            raise CorruptFileError(
                f"parameters were stepped {len(distinct)} different numbers of times: at step {its:g}, where "
                f"{first}{f' and {same} more' if same else ''} are at step {step:g} (one step for all is resumed)",
                path=index.folder,
                tensor=f"{found.container}.state.{other}.step",
            )
        return _whole(distinct.pop(), index.folder, f"{found.container}.state.{next(iter(steps))}.step")
    counter = next((fqn for fqn in index.values if key_path(index, fqn)[-2:] == TRAIN_STEP), None)
    if counter is None:
        return None
    return _whole(_value(index, counter), index.folder, counter)


def _whole(value: Any, folder: Path, entry: str) -> int:
    if type(value) is float and value.is_integer() and 0 <= value < MAX_STEP:
        return int(value)
    if type(value) is int and 0 <= value < MAX_STEP:
        return value
    raise CorruptFileError(f"step {shown(value)} is not a count of steps", path=folder, tensor=entry)


def _scalar(tensor: StoredTensor) -> float | int:
    """The value of a one-element tensor (a step), read from its one chunk's bytes."""
    form = _SCALARS.get(tensor.code or "")
    if form is None or tensor.shape not in ((), (1,)) or len(tensor.chunks) != 1:
        raise CorruptFileError(f"a step stored as {tensor.dtype} {list(tensor.shape)}", path=tensor.declared_in,
                               tensor=tensor.name)  # fmt: skip
    chunk = tensor.chunks[0]
    if chunk.data is not None:
        start = chunk.data
    else:
        layout = torch_archive_layout(chunk.file, chunk.position, chunk.length, code=tensor.code or "",
                                      shape=chunk.box.sizes, tensor=tensor.name)  # fmt: skip
        start = layout.data + layout.storage_offset * struct.calcsize(form)
    with chunk.file.open("rb") as handle:
        data = os.pread(handle.fileno(), struct.calcsize(form), start)
    (value,) = struct.unpack(form, data)
    return value
