"""The optimizers whose per-parameter state reshard carries, and those it knows in order to refuse them by name: one
table. Pure: no torch.

A carried optimizer's state is, per parameter, tensors at the weight's shape (its *slots*, named as torch's
``state_dict()`` names them) and maybe a step: such a state cuts, fuses and pads exactly as the weight does, so it
takes the weight's path through a conversion. An optimizer is known by the name its checkpoint records where it
records one (DeepSpeed's ``ds_config.optimizer.type``), else by its state's keys and its param groups' keys (DCP
records no class). Anything else is refused by name, and so is a state key no entry knows: never dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Keys torch's optimizers keep in every group and that choose an implementation, not the arithmetic.
_IMPLEMENTATION = {"foreach": None, "fused": None, "capturable": False, "differentiable": False, "maximize": False}


@dataclass(frozen=True)
class Optimizer:
    """One optimizer reshard carries.

    Attributes:
        name: its name in messages and in :class:`~reshard.layouts.training.CarriedState`.
        slots: the per-parameter tensors at the weight's shape it may keep, in the order they are written.
        stepped: whether it keeps a per-parameter ``step`` (bias correction): the source must record one.
        keys: the keys of each of its param groups as torch's optimizer keeps them (``dcp.load`` is strict: a
            target that loads into torch's optimizer needs every one).
        implied: keys filled where a source does not record them, each with the one value that changes nothing.
        nonnegative: slots that are never below zero (sums of squares).
        marks: group keys only this optimizer has, which tell it apart where the state's keys do not (Muon's
            ``momentum_buffer`` is SGD's).
    """

    name: str
    slots: tuple[str, ...]
    stepped: bool
    keys: tuple[str, ...]
    implied: Mapping[str, Any] = field(default_factory=dict)
    nonnegative: tuple[str, ...] = ()
    marks: frozenset[str] = frozenset()

    def required(self, hyper: Mapping[str, Any]) -> tuple[str, ...]:
        """The slots every parameter of a group with these hyper-parameters has once stepped: SGD keeps no
        ``momentum_buffer`` without momentum, Adam a ``max_exp_avg_sq`` only with ``amsgrad``."""
        if "momentum_buffer" in self.slots:
            return () if hyper.get("momentum", 1) == 0 else ("momentum_buffer",)
        return tuple(slot for slot in self.slots if slot != "max_exp_avg_sq" or hyper.get("amsgrad") is True)


ADAM = Optimizer(
    "Adam",
    slots=("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    stepped=True,
    keys=(
        "lr",
        "betas",
        "eps",
        "weight_decay",
        "amsgrad",
        "maximize",
        "foreach",
        "capturable",
        "differentiable",
        "fused",
        "decoupled_weight_decay",
    ),  # fmt: skip
    implied={"amsgrad": False, **_IMPLEMENTATION},
    nonnegative=("exp_avg_sq", "max_exp_avg_sq"),
)
SGD = Optimizer(
    "SGD",
    slots=("momentum_buffer",),
    stepped=False,
    keys=(
        "lr",
        "momentum",
        "dampening",
        "weight_decay",
        "nesterov",
        "maximize",
        "foreach",
        "differentiable",
        "fused",
    ),  # fmt: skip
    implied={k: _IMPLEMENTATION[k] for k in ("maximize", "foreach", "differentiable", "fused")},
)
MUON = Optimizer(  # torch.optim.Muon: SGD's momentum, orthogonalized at each update, never in the state
    "Muon",
    slots=("momentum_buffer",),
    stepped=False,
    keys=("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn"),
    marks=frozenset({"ns_steps", "ns_coefficients"}),
)
ADAGRAD = Optimizer(
    "Adagrad",
    slots=("sum",),
    stepped=True,
    keys=(
        "lr",
        "lr_decay",
        "eps",
        "weight_decay",
        "initial_accumulator_value",
        "foreach",
        "maximize",
        "differentiable",
        "fused",
    ),  # fmt: skip
    implied={k: _IMPLEMENTATION[k] for k in ("maximize", "foreach", "differentiable", "fused")},
    nonnegative=("sum",),
)
CARRIED = {o.name: o for o in (ADAM, SGD, MUON, ADAGRAD)}
# Every slot a carried optimizer keeps, in the order they are written.
STATE_SLOTS = tuple(dict.fromkeys(slot for o in CARRIED.values() for slot in o.slots))
NONNEGATIVE = frozenset(slot for o in CARRIED.values() for slot in o.nonnegative)

# The names checkpoints record, lower case without ``_``: DeepSpeed's ``optimizer.type`` (its own and any
# ``torch.optim`` class it builds by name), Megatron's ``--optimizer`` (``adam``, ``sgd``, ``muon``, ...), torch's
# classes.
NAMES = {
    **dict.fromkeys(("adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam", "torchadam"), ADAM),
    "sgd": SGD,
    "muon": MUON,
    "adagrad": ADAGRAD,
}

# Optimizers reshard knows in order to refuse them: (what it is, why it is not carried), by a name a checkpoint
# records, or by a state key only it keeps.
_FACTORED = "its second moment is factored (a row mean and a column mean, not at the weight's shape): a cut of the "
_FACTORED += "weight does not cut it"
_QUANTIZED = "its moments are 8-bit codes (state1, state2) decoded through qmap1/qmap2 and one absmax per block: a "
_QUANTIZED += "cut of the weight cuts its blocks, and decoding changes the values"
_NOT_TAUGHT = "reshard carries Adam/AdamW, SGD, Muon and Adagrad only"
REFUSED_NAMES = {
    "adafactor": ("Adafactor", _FACTORED),
    "lion": ("Lion", _NOT_TAUGHT),
    "fusedlion": ("Lion", _NOT_TAUGHT),
    "cpulion": ("Lion", _NOT_TAUGHT),
    "lamb": ("LAMB", _NOT_TAUGHT),
    "fusedlamb": ("LAMB", _NOT_TAUGHT),
    "onebitadam": ("1-bit Adam", "its error-feedback buffers are per data-parallel rank"),
    "zerooneadam": ("0/1 Adam", "its error-feedback buffers are per data-parallel rank"),
    "onebitlamb": ("1-bit LAMB", "its error-feedback buffers are per data-parallel rank"),
    "muonwithauxadam": ("Muon with an auxiliary Adam", "one flat partition mixes Muon's and Adam's state"),
    "distmuon": ("Megatron's distributed Muon", _NOT_TAUGHT),
    "adaptivemuon": ("Megatron's adaptive Muon", _NOT_TAUGHT),
    "soap": ("SOAP", "its preconditioners are per-dimension matrices, not at the weight's shape"),
    "adam8bit": ("8-bit Adam (bitsandbytes)", _QUANTIZED),
    "adamw8bit": ("8-bit AdamW (bitsandbytes)", _QUANTIZED),
    "pagedadamw8bit": ("paged 8-bit AdamW (bitsandbytes)", _QUANTIZED),
}
REFUSED_KEYS = (  # first match; the keys say which optimizer wrote the state
    (frozenset({"state1", "state2", "qmap1", "qmap2", "absmax1", "absmax2"}), "8-bit Adam (bitsandbytes)", _QUANTIZED),
    (frozenset({"row_var", "col_var", "variance"}), "Adafactor (torch.optim.Adafactor)", _FACTORED),
    (frozenset({"exp_avg_sq_row", "exp_avg_sq_col", "RMS"}), "Adafactor (transformers)", _FACTORED),
    (frozenset({"mu_product"}), "NAdam", _NOT_TAUGHT),
    (frozenset({"exp_inf"}), "Adamax", _NOT_TAUGHT),
    (frozenset({"acc_delta"}), "Adadelta", _NOT_TAUGHT),
    (frozenset({"square_avg", "grad_avg"}), "RMSprop", _NOT_TAUGHT),
    (frozenset({"prev", "step_size"}), "Rprop", _NOT_TAUGHT),
    (frozenset({"ax", "eta", "mu"}), "ASGD", _NOT_TAUGHT),
    (frozenset({"moment1", "moment2"}), "Muon with AdamW (Moonlight)", _NOT_TAUGHT),
)


class UnknownOptimizer(ValueError):
    """The optimizer is not one reshard carries; the message names it and says why (one line)."""


def recognise(recorded: str | None, keys: Iterable[str], group_keys: Iterable[str]) -> Optimizer:
    """The carried optimizer a checkpoint's state belongs to.

    Args:
        recorded: the optimizer's name as the checkpoint records it, else None.
        keys: the per-parameter state's keys found (``step`` left out).
        group_keys: the keys of its param groups.

    Raises:
        UnknownOptimizer: a refused or unknown optimizer, or state keys its optimizer does not keep, by name.
    """
    found, groups = set(keys), set(group_keys)
    last = {key.rsplit(".", 1)[-1] for key in found}  # a nested state's own names (bitsandbytes')
    named = (recorded or "").lower().replace("_", "").replace("-", "")
    if named in REFUSED_NAMES:
        what, why = REFUSED_NAMES[named]
        raise UnknownOptimizer(f"optimizer {recorded!r} is {what}: {why}")
    for marks, what, why in REFUSED_KEYS:
        if last & marks:
            raise UnknownOptimizer(f"its state ({', '.join(sorted(last))}) is that of {what}: {why}")
    if recorded is not None and named not in NAMES:
        raise UnknownOptimizer(f"optimizer {recorded!r} is not one reshard knows: {_NOT_TAUGHT}")
    optimizer = NAMES.get(named) or _by_keys(found, groups)
    strangers = sorted(found - set(optimizer.slots))
    if strangers:
        raise UnknownOptimizer(
            f"the optimizer ({recorded or optimizer.name}) keeps {', '.join(strangers)} per parameter, which "
            f"{optimizer.name} does not ({', '.join(optimizer.slots)}): state reshard does not know is never dropped"
        )
    return optimizer


def _by_keys(found: set[str], groups: set[str]) -> Optimizer:
    """The carried optimizer whose slots hold every key found (else most of them; without any state: whose group
    keys the groups have), told apart by its marks among the group keys."""
    if found == {"exp_avg"}:
        raise UnknownOptimizer(
            f"its state (exp_avg alone) is Lion's (lion-pytorch, DeepSpeed's FusedLion): {_NOT_TAUGHT}"
        )
    if found:
        fits = [o for o in CARRIED.values() if found <= set(o.slots)]
        if not fits:  # the optimizer that keeps most of them, so that the keys it does not keep are named
            most = max(len(found & set(o.slots)) for o in CARRIED.values())
            fits = [o for o in CARRIED.values() if most and len(found & set(o.slots)) == most]
    else:
        fits = [o for o in CARRIED.values() if set(o.keys) - set(o.implied) <= groups]
    chosen = [o for o in fits if o.marks & groups] or [o for o in fits if not o.marks]
    if len(chosen) == 1:
        return chosen[0]
    held = (
        f"state keys ({', '.join(sorted(found))})"
        if found
        else f"param groups' keys ({', '.join(sorted(groups)) or 'none'}), without per-parameter state,"
    )
    raise UnknownOptimizer(f"its {held} match no optimizer reshard knows: {_NOT_TAUGHT}")
