"""Where a DCP checkpoint keeps its model: the training state to skip and the container the weights live in.

``torch.distributed.checkpoint`` flattens a nested state dict, and every trainer nests differently: torchtitan puts
the model at the top level beside ``optimizer``, ``lr_scheduler``, ``dataloader`` and ``train_state``; the DCP
tutorial saves ``{"app": AppState(model, optimizer)}``, so the weights are ``app.model.<name>`` beside
``app.optim.*``; accelerate saves ``{"model": ...}`` and ``{"optimizer": ...}`` into two folders. Names are
therefore decided from the key paths the planner recorded, not from a fixed list of containers:

* an entry is training state when a key on its path, or the first dotted part of its last key (a flat
  ``optimizer.state.<param>.exp_avg``), names training state (:data:`NOT_MODEL`), at any depth;
* the model's container is the longest key path that every remaining tensor of more than one element sits under
  (scalars outside it, a step counter, are not weights); its keys are dropped from the names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from reshard.formats.dcp_metadata.read import DcpIndex, StoredTensor

# Keys that hold training state, not the model.
NOT_MODEL = frozenset(
    "optimizer optimizers optim optim_state optimizer_state lr_scheduler lr_schedulers scheduler schedulers "
    "dataloader dataloaders data_loader train_state trainer_state training_state rng rng_state rng_states "
    "rng_tracker_states grad_scaler scaler".split()
)

__all__ = ["NOT_MODEL", "ModelEntries", "model_entries"]


@dataclass(frozen=True)
class ModelEntries:
    """The model's part of a DCP index.

    Attributes:
        tensors: the model's tensors by fqn.
        names: the name each model fqn (tensor or value) is read by: its key path inside the container.
        container: the keys the model sits under (``("app", "model")``); empty for the top level.
        skipped: every other entry's fqn, with the key path it was skipped for (``app.optim``, ``optimizer``).
    """

    tensors: dict[str, StoredTensor]
    names: dict[str, str]
    container: tuple[Any, ...]
    skipped: dict[str, str]


def key_path(index: DcpIndex, fqn: str) -> tuple[Any, ...]:
    """The planner's key path of ``fqn``; the fqn as one key where none was recorded (hf-sharded DCP)."""
    return index.paths.get(fqn) or (fqn,)


def _training_state(path: tuple[Any, ...]) -> str | None:
    """The key path that makes an entry training state (``app.optim``), or None for a model entry."""
    for depth, key in enumerate(path[:-1]):
        if isinstance(key, str) and key in NOT_MODEL:
            return ".".join(str(k) for k in path[: depth + 1])
    leaf = path[-1] if path else None
    if isinstance(leaf, str) and "." in leaf and leaf.split(".", 1)[0] in NOT_MODEL:
        return ".".join([*(str(k) for k in path[:-1]), leaf.split(".", 1)[0]])
    return None


def _common(paths: list[tuple[Any, ...]]) -> tuple[Any, ...]:
    """The longest key path every one of ``paths`` continues (never a whole path: the last key names the entry)."""
    if not paths:
        return ()
    common = paths[0][:-1]
    for path in paths[1:]:
        size = 0
        while size < min(len(common), len(path) - 1) and common[size] == path[size]:
            size += 1
        common = common[:size]
    return common


def model_entries(index: DcpIndex) -> ModelEntries:
    """Split ``index`` into the model (under its container) and the training state (see the module docstring)."""
    skipped = {
        fqn: state for fqn in [*index.tensors, *index.values] if (state := _training_state(key_path(index, fqn)))
    }
    tensors = {fqn: t for fqn, t in index.tensors.items() if fqn not in skipped}
    weights = [key_path(index, fqn) for fqn, t in tensors.items() if math.prod(t.shape) > 1]
    container = _common(weights or [key_path(index, fqn) for fqn in tensors])
    outside = [fqn for fqn in tensors if key_path(index, fqn)[: len(container)] != container]
    for fqn in outside:  # scalars beside the model's container: counters, not weights
        skipped[fqn] = ".".join(str(k) for k in key_path(index, fqn))
        del tensors[fqn]
    names = {}
    for fqn in [*tensors, *(v for v in index.values if v not in skipped)]:
        path = key_path(index, fqn)
        if path[: len(container)] == container:
            names[fqn] = ".".join(str(k) for k in path[len(container) :])
    return ModelEntries(tensors, names, container, skipped)
