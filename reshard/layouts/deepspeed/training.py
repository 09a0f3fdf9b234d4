"""The training state of a ZeRO checkpoint (:class:`~reshard.layouts.base.TrainingState`), native or universal, read
from the pickled structure of rank 0's files only (no tensor byte is read):

* the step: ``global_steps`` of the model states (the engine's count, what ``load_checkpoint`` restores);
* the optimizer: ``ds_config["optimizer"]["type"]`` when DeepSpeed built it (a client optimizer is not named);
* the groups: torch's ``state_dict()`` of the optimizer over the flat fp32 partitions, ``base_optimizer_state``
  (ZeRO-1/2) or ``optimizer_state_dict`` (ZeRO-3). Its ``param_groups`` hold the hyper-parameters, and in
  ``params`` the indices of the flat partitions; flat partition ``i`` holds the parameters of ``param_shapes[i]``
  (one per group under ZeRO-1/2, per fp32 sub-group under ZeRO-3: ``runtime/engine.py``
  ``_get_zero_param_shapes``), so each group's parameters come by name. Under ZeRO-1/2 rank 0's
  ``param_slice_mappings`` must name parameters of the same group;
* the moments: the keys of the per-partition ``state`` (``exp_avg``, ``exp_avg_sq``), ``step`` left out; in a
  universal checkpoint the per-parameter files beside ``fp32.pt``, whose ``zero/optimizer_state.pt`` holds the
  param groups as they were;
* the frozen parameters: ``frozen_param_shapes`` (ZeRO-2/3); ZeRO-1 records none, so the module's parameters in no
  group, no buffer and no tied alias;
* what is not carried: the optimizer files' other keys (loss scaler, ``clip_grad``, ...), the model states'
  scheduler, sampler, counters and client state, and the HF Trainer's files beside the DeepSpeed folder (RNG,
  scheduler).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from reshard.errors import SHOWN_LENGTH, CorruptFileError, shown
from reshard.layouts.deepspeed.pickles import Pickled
from reshard.layouts.training import Leftover, ParamGroup, TrainingState, stored_value

MAX_KEYS = 256  # keys of a param group, a state entry or an optimizer file: a few dozen in practice
MAX_STEP = 1 << 63
# Keys of a ZeRO optimizer file that reshard reads (weights, layout) or reads here.
READ = frozenset({
    "single_partition_of_fp32_groups", "fp32_flat_groups", "base_optimizer_state", "optimizer_state_dict",
    "param_slice_mappings", "partition_count", "zero_stage", "group_paddings", "param_alignment_paddings",
    "ds_version", "ds_zero_partition_groups",
})  # fmt: skip
# Keys of the model states (``runtime/engine.py`` ``_common_checkpoint_state``) DeepSpeed restores and reshard does
# not carry, when they hold something; any key not in ENGINE_KEYS is the user's ``client_state``.
MODEL_STATES_KEPT = ("lr_scheduler", "data_sampler", "random_ltd", "global_samples", "skipped_steps")
ENGINE_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps", "global_steps",
    "global_samples", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions", "ds_config", "ds_version",
})  # fmt: skip
TRAINER_FILES = re.compile(r"^(rng_state(?:_\d+)?\.pth|scheduler\.pt|optimizer\.pt|trainer_state\.json)$")
SHOWN_FILES = 8
# The kind of each key or file reshard does not carry, for ``--drop`` (first match; anything else is "other").
KINDS = (
    (re.compile(r"^rng_state"), "rng"),
    (re.compile(r"^(lr_scheduler|scheduler\.pt)$"), "scheduler"),
    (re.compile(r"^(loss_scaler|dynamic_loss_scale|overflow|skipped_steps)$"), "loss_scaler"),
    (re.compile(r"^(data_sampler|global_samples)$"), "dataloader"),
    (re.compile(r"^trainer_state\.json$"), "trainer"),
)


def native_state(
    states: Pickled, optim: Pickled, shapes: Sequence[Mapping[str, Any]], *, beside: Path | None
) -> TrainingState:
    """The training state of a native ZeRO-1/2/3 checkpoint.

    Args:
        states: rank 0's model states (its ``module``, ``buffer_names``, ``shared_params`` and ``frozen_param_shapes``
            already checked by the reader).
        optim: rank 0's optimizer file.
        shapes: ``param_shapes`` as read, one mapping per flat partition.
        beside: the folder holding the tag folder when the user named it (the HF Trainer's ``checkpoint-N``).

    Raises:
        CorruptFileError: a value is not what DeepSpeed writes, naming the file and the key.
    """
    osd = optim.obj["optimizer_state_dict"]
    key = "base_optimizer_state" if "base_optimizer_state" in osd else "optimizer_state_dict"
    inner = osd.get(key)
    state: Any
    if isinstance(inner, list):  # elastic ZeRO-1/2: one state per group, the hyper-parameters not saved
        groups = tuple(ParamGroup({}, tuple(group)) for group in shapes)
        state = dict(enumerate(inner))
    elif isinstance(inner, Mapping):
        groups = _groups(inner.get("param_groups"), shapes, optim.file, f"{key}.param_groups")
        state = inner.get("state")
    else:
        raise CorruptFileError("is not an optimizer state dict", path=optim.file, tensor=key)
    if key == "base_optimizer_state":
        _check_slices(osd.get("param_slice_mappings"), shapes, optim.file)
    trainable = {name for group in groups for name in group.params}
    return TrainingState(
        optimizer=_optimizer(states),
        step=_step(states),
        moments=_moments(state, len(shapes), optim.file, f"{key}.state"),
        groups=groups,
        frozen=_frozen(states.obj, trainable),
        not_carried=_not_carried(states, osd, optim.file, beside),
    )


def universal_state(
    states: Pickled,
    common: Pickled,
    shapes: Sequence[Mapping[str, Any]],
    moments: Sequence[str],
    *,
    beside: Path | None,
) -> TrainingState:
    """The training state of a universal checkpoint (``ds_to_universal``): its ``zero/optimizer_state.pt`` holds rank
    0's optimizer state dict without the partitions, and the param groups as ``param_groups`` (their ``params`` the
    same indices into ``param_shapes``); the moments are the per-parameter files (``zero/<name>/exp_avg.pt``).

    Args:
        states: the model states ``ds_to_universal`` copied (checked by the reader, as for :func:`native_state`).
        common: ``zero/optimizer_state.pt``.
        shapes: ``param_shapes`` as read, one mapping per flat partition.
        moments: the names of the per-parameter files beside ``fp32.pt``.
        beside: the folder holding the universal folder when the user named it.

    Raises:
        CorruptFileError: a value is not what DeepSpeed writes, naming the file and the key.
    """
    if not isinstance(common.obj, Mapping):
        raise CorruptFileError("is not a dict of the optimizer's common state", path=common.file)
    groups = _groups(common.obj.get("param_groups"), shapes, common.file, "param_groups")
    trainable = {name for group in groups for name in group.params}
    return TrainingState(
        optimizer=_optimizer(states),
        step=_step(states),
        moments=tuple(sorted(set(moments) - {"step"})),
        groups=groups,
        frozen=_frozen(states.obj, trainable),
        not_carried=_not_carried(states, common.obj, common.file, beside, read=READ | {"param_groups"}),
    )


def _groups(value: Any, shapes: Sequence[Mapping[str, Any]], file: Path, key: str) -> tuple[ParamGroup, ...]:
    """Each group's hyper-parameters and, through the indices in ``params``, its parameters' names; every flat
    partition in exactly one group."""
    if not isinstance(value, list) or not value or len(value) > len(shapes):
        raise CorruptFileError(f"is not a list of at most {len(shapes)} parameter groups", path=file, tensor=key)
    groups: list[ParamGroup] = []
    seen: set[int] = set()
    for g, group in enumerate(value):
        where = f"{key}[{g}]"
        if not isinstance(group, Mapping) or len(group) > MAX_KEYS:
            raise CorruptFileError(f"is not a parameter group of at most {MAX_KEYS} keys", path=file, tensor=where)
        indices = group.get("params")
        if not isinstance(indices, list) or not all(type(i) is int and 0 <= i < len(shapes) for i in indices):
            why = f"is not a list of flat partition indices below {len(shapes)} (param_shapes has {len(shapes)})"
            raise CorruptFileError(why, path=file, tensor=f"{where}.params")
        if seen & set(indices) or len(set(indices)) != len(indices):
            raise CorruptFileError("names a flat partition another group names", path=file, tensor=f"{where}.params")
        seen |= set(indices)
        hyper: dict[str, Any] = {}
        for name, stored in group.items():
            if not isinstance(name, str) or len(name) > SHOWN_LENGTH:
                raise CorruptFileError("has a key that is not a short name", path=file, tensor=where)
            if name != "params":
                hyper[name] = stored_value(stored)
        groups.append(ParamGroup(hyper, tuple(n for i in indices for n in shapes[i])))
    if len(seen) != len(shapes):
        missing = min(set(range(len(shapes))) - seen)
        why = f"leave flat partition {missing} of param_shapes in no group"
        raise CorruptFileError(why, path=file, tensor=key)
    return tuple(groups)


def _check_slices(value: Any, shapes: Sequence[Mapping[str, Any]], file: Path) -> None:
    """Rank 0's ``param_slice_mappings`` (ZeRO-1/2): per group, the parameters its partition holds a slice of,
    each of that group in ``param_shapes``."""
    if value is None:
        return
    if not isinstance(value, list) or len(value) != len(shapes):
        raise CorruptFileError(f"is not a list of {len(shapes)} groups", path=file, tensor="param_slice_mappings")
    for g, (held, group) in enumerate(zip(value, shapes, strict=True)):
        if not isinstance(held, Mapping):
            raise CorruptFileError("is not a mapping of names", path=file, tensor=f"param_slice_mappings[{g}]")
        stray = next((n for n in held if n not in group), None)
        if stray is not None:
            raise CorruptFileError(
                f"names {stray!r}, which is not in parameter group {g} of param_shapes" if isinstance(stray, str)
                else "has a key that is not a parameter name",
                path=file,
                tensor=f"param_slice_mappings[{g}]",
            )  # fmt: skip


def _moments(value: Any, count: int, file: Path, key: str) -> tuple[str, ...]:
    """The names of the per-partition optimizer state, ``step`` left out."""
    if value is None:
        return ()
    if not isinstance(value, Mapping) or len(value) > count:
        raise CorruptFileError(f"is not the state of at most {count} flat partitions", path=file, tensor=key)
    names: set[str] = set()
    for index, entry in value.items():
        if not isinstance(entry, Mapping) or len(entry) > MAX_KEYS:
            raise CorruptFileError("is not a mapping of state names", path=file, tensor=f"{key}[{index!r}]")
        for name in entry:
            if not isinstance(name, str) or len(name) > SHOWN_LENGTH:
                raise CorruptFileError("has a key that is not a short name", path=file, tensor=f"{key}[{index!r}]")
            names.add(name)
    return tuple(sorted(names - {"step"}))


def _step(states: Pickled) -> int | None:
    step = states.obj.get("global_steps")
    if step is None:
        return None
    if type(step) is not int or not 0 <= step < MAX_STEP:
        raise CorruptFileError("is not a step count", path=states.file, tensor="global_steps")
    return step


def _optimizer(states: Pickled) -> str | None:
    config = states.obj.get("ds_config")
    optimizer = config.get("optimizer") if isinstance(config, Mapping) else None
    kind = optimizer.get("type") if isinstance(optimizer, Mapping) else None
    if kind is None:
        return None
    if not isinstance(kind, str) or not 0 < len(kind) <= SHOWN_LENGTH:
        raise CorruptFileError("is not an optimizer's name", path=states.file, tensor="ds_config.optimizer.type")
    return kind


def _frozen(states: Mapping[str, Any], trainable: set[str]) -> tuple[str, ...]:
    """``frozen_param_shapes`` (ZeRO-2/3), else the module's parameters in no group, buffer or tie (ZeRO-1)."""
    recorded = states.get("frozen_param_shapes")
    if recorded is not None:
        return tuple(recorded)
    buffers, shared = set(states.get("buffer_names") or ()), states.get("shared_params") or {}
    return tuple(n for n in states["module"] if n not in trainable and n not in buffers and n not in shared)


def _not_carried(
    states: Pickled, osd: Mapping[str, Any], file: Path, beside: Path | None, *, read: frozenset[str] = READ
) -> tuple[Leftover, ...]:
    if len(osd) > MAX_KEYS:
        raise CorruptFileError(f"has more than {MAX_KEYS} keys", path=file, tensor="optimizer_state_dict")
    other = [k for k in osd if k not in read]
    if not all(isinstance(k, str) and len(k) <= SHOWN_LENGTH for k in other):
        raise CorruptFileError("has a key that is not a short name", path=file, tensor="optimizer_state_dict")
    found = [Leftover(_kind(k), k, "optimizer files") for k in other]
    kept = [k for k in MODEL_STATES_KEPT if states.obj.get(k) not in (None, {}, [], 0)]  # 0: none skipped, or seen
    found += [Leftover(_kind(k), k, "model states") for k in kept]
    client = [k for k in states.obj if k not in ENGINE_KEYS]
    found += [Leftover("client_state", _name(k), "model states: client_state") for k in client[:SHOWN_FILES]]
    if len(client) > SHOWN_FILES:
        found.append(Leftover("client_state", f"{len(client) - SHOWN_FILES} more client_state keys", "model states"))
    if beside is not None:
        names = sorted(child.name for child in beside.iterdir() if TRAINER_FILES.match(child.name))
        found += [Leftover(_kind(n), n, "beside the DeepSpeed folder") for n in names[:SHOWN_FILES]]
        if len(names) > SHOWN_FILES:
            found.append(Leftover("trainer", f"{len(names) - SHOWN_FILES} more Trainer files", "beside the folder"))
    return tuple(found)


def _kind(key: str) -> str:
    """The kind (``--drop``) of a key or file DeepSpeed or the HF Trainer keeps beside the optimizer state."""
    return next((kind for pattern, kind in KINDS if pattern.match(key)), "other")


def _name(key: Any) -> str:
    return key if isinstance(key, str) and len(key) <= SHOWN_LENGTH else shown(key)
