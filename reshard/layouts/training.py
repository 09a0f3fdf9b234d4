"""The training state a checkpoint holds beside its weights, as every layout reports it: the optimizer's param groups
and step, each parameter's state tensors (its fp32 master where that is not the weight itself, Adam's moments),
and what else of the training it holds that reshard does not carry.

A parameter's state tensor is named after its weight: ``state_name("w", "exp_avg")`` is ``"w::exp_avg"``. The
planner gives it its weight's plan (:mod:`reshard.engine.plan.training`), so it takes the weight's path through a
conversion: the same cut, the same fused or split mapping, the same padding and permutation; a target layout that
holds a training state (:attr:`~reshard.layouts.base.CheckpointWriter.holds_training_state`) receives it under that
name and puts it where its framework keeps it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from reshard.errors import SHOWN_LENGTH, shown
from reshard.layouts.optimizers import CARRIED, STATE_SLOTS, UnknownOptimizer, recognise
from reshard.layouts.refs import TensorRef

# The state tensors a parameter may have, in the order they are written: ``master`` only where the checkpoint keeps
# an fp32 copy apart from the weight it trains (Megatron's distributed optimizer; elsewhere the weight is the master),
# then the slots of the optimizers carried (:mod:`reshard.layouts.optimizers`: Adam's moments, SGD's momentum, ...).
SLOTS = ("master", *STATE_SLOTS)
SEPARATOR = "::"
# What a checkpoint may hold of its training that reshard does not carry, by the kind ``--drop`` names.
LEFTOVER_KINDS = ("rng", "scheduler", "loss_scaler", "dataloader", "client_state", "trainer", "other")


def state_name(name: str, slot: str) -> str:
    """The name of parameter ``name``'s state tensor ``slot`` (one of :data:`SLOTS`)."""
    return f"{name}{SEPARATOR}{slot}"


def split_state_name(name: str) -> tuple[str, str | None]:
    """``(parameter, slot)`` of a state tensor's name; ``(name, None)`` for a weight's."""
    base, sep, slot = name.rpartition(SEPARATOR)
    return (base, slot) if sep and slot in SLOTS else (name, None)


MAX_STORED_ITEMS = 16  # a hyper-parameter list or tuple longer than this is shown, not kept


def stored_value(value: Any) -> Any:
    """A hyper-parameter as its checkpoint stores it, bounded: ``None``, a bool, a finite float, an int of at most
    64 bits, a string of at most :data:`~reshard.errors.SHOWN_LENGTH` characters, or a short flat list of such
    numbers (a tuple becomes a list) is kept; anything else becomes its text through :func:`reshard.errors.shown`."""
    if value is None or isinstance(value, bool) or (type(value) is float and math.isfinite(value)):
        return value
    if type(value) is int and value.bit_length() <= 64:
        return value
    if type(value) is str and len(value) <= SHOWN_LENGTH:
        return value
    if type(value) in (list, tuple) and len(value) <= MAX_STORED_ITEMS:  # one level: never walked deeper
        if all(v is None or type(v) is bool or type(v) in (int, float) and stored_value(v) is v for v in value):
            return list(value)
    return shown(value)


@dataclass(frozen=True)
class ParamGroup:
    """One optimizer parameter group: its hyper-parameters as stored (:func:`stored_value`), its parameters by
    name."""

    hyper: dict[str, Any]
    params: tuple[str, ...]


@dataclass(frozen=True)
class Leftover:
    """Something of the training a checkpoint holds beside the optimizer's state: ``kind`` (one of
    :data:`LEFTOVER_KINDS`, what ``--drop`` names), what it is, and where. ``key`` names it for a target layout of the
    same framework that takes it over as it is (:attr:`~reshard.layouts.base.CheckpointWriter.carries`); anything
    else is left behind, which ``--drop`` must allow."""

    kind: str
    what: str
    where: str
    key: str = ""

    def __str__(self) -> str:
        return f"{self.what} ({self.where})"


@dataclass(frozen=True)
class TrainingState:
    """What a checkpoint holds of its training beside the weights, from its headers and pickled structure only.

    Attributes:
        optimizer: the optimizer's name where the checkpoint records one (a config's ``type``), else None.
        step: the training step the checkpoint records, else None.
        moments: the keys of the per-parameter state the trainable parameters have (Adam's ``exp_avg`` and
            ``exp_avg_sq``, SGD's ``momentum_buffer``, ...; any key found, known or not), the scalar ``step`` left
            out.
        groups: the parameter groups in the optimizer's order, each naming its parameters.
        frozen: parameters in no group: no moments.
        not_carried: what else the checkpoint holds of its training that reshard does not carry (loss scaler,
            scheduler, RNG, ...), each with its kind and where it is.
        tensors: per source rank (as :attr:`SourceCheckpoint.ranks`), each trainable parameter's state tensors by
            :func:`state_name`, read lazily; empty where the layout reads the state's structure only.
        unread: why the state's tensors are not read where the checkpoint holds them in a form reshard does not
            carry (Megatron's bucket-space optimizer); ``--with-optimizer`` is refused with it.
    """

    optimizer: str | None
    step: int | None
    moments: tuple[str, ...]
    groups: tuple[ParamGroup, ...]
    frozen: tuple[str, ...] = ()
    not_carried: tuple[Leftover, ...] = ()
    tensors: tuple[Mapping[str, TensorRef], ...] = ()
    unread: str | None = None

    @property
    def trainable(self) -> dict[str, int]:
        """Each trainable parameter's group index."""
        return {name: index for index, group in enumerate(self.groups) for name in group.params}

    @property
    def slots(self) -> tuple[str, ...]:
        """The state tensors every trainable parameter has, in :data:`SLOTS` order: its moments, and ``master`` where
        the checkpoint keeps an fp32 copy apart from a weight (on any rank); without it the weights are the masters."""
        trainable = self.trainable
        master = any(state_name(name, "master") in rank for rank in self.tensors for name in trainable)
        return tuple(slot for slot in SLOTS if slot in self.moments or slot == "master" and master)

    def carried_as(self) -> str:
        """The optimizer ``--with-optimizer`` carries the state as, or why it refuses it (one line)."""
        try:
            return recognise(self.optimizer, self.moments, {key for group in self.groups for key in group.hyper}).name
        except UnknownOptimizer as error:
            return f"not carried: {error}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer,
            "carried_as": self.carried_as(),
            "step": self.step,
            "moments": list(self.moments),
            "groups": [{"hyper": dict(g.hyper), "params": list(g.params)} for g in self.groups],
            "frozen": list(self.frozen),
            "not_carried": [str(item) for item in self.not_carried],
        } | ({"unread": self.unread} if self.unread else {})


@dataclass(frozen=True)
class CarriedState:
    """The training state a conversion writes beside the weights, in the target's names: what a writer that
    :attr:`~reshard.layouts.base.CheckpointWriter.holds_training_state` needs beyond the state tensors it receives.

    Attributes:
        optimizer: the source's optimizer name, where it records one.
        step: the step every parameter's state was taken at (0 where an optimizer without one records none).
        groups: the source's param groups in its order, each naming its target parameters.
        slots: the state tensors every trainable parameter has (:func:`state_name`), in :data:`SLOTS` order; without
            ``master`` the weight itself is the fp32 master.
        kind: the optimizer the state is of, a key of :data:`reshard.layouts.optimizers.CARRIED`: which group keys
            a target needs, and whether each parameter keeps a step.
        frozen: target parameters in no group (no state).
        tied: ``(alias, owner)`` target names of tensors that are another parameter (tied weights: the source reads
            the alias from its owner's bytes): no state of their own, neither grouped nor frozen.
    """

    optimizer: str | None
    step: int
    groups: tuple[ParamGroup, ...]
    slots: tuple[str, ...]
    kind: str
    frozen: tuple[str, ...] = ()
    tied: tuple[tuple[str, str], ...] = ()

    @property
    def kept(self) -> tuple[str, ...]:
        """The optimizer's own state tensors of each trainable parameter (its slots but ``master``)."""
        return tuple(slot for slot in self.slots if slot != "master")

    @property
    def stepped(self) -> bool:
        """Whether each parameter keeps a step (Adam, Adagrad; not SGD, Muon)."""
        return CARRIED[self.kind].stepped

    def master(self, name: str) -> str:
        """The target tensor that holds parameter ``name``'s fp32 master: its ``master`` state, else the weight."""
        return state_name(name, "master") if "master" in self.slots else name
