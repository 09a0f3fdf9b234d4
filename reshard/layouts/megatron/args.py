"""Megatron's pickled ``args``: reading them safely and writing them back (what they say of the model is
:mod:`reshard.megatron.model`).

Megatron pickles an ``argparse.Namespace`` of every training argument next to the weights, and a few
of its values are Megatron enums (``args.model_type = ModelType.encoder_or_decoder``,
``args.attention_backend = AttnBackend.auto``). ``torch.load(weights_only=True)`` refuses both. Rather
than unpickle fully (which runs whatever the file names), reshard allow-lists ``Namespace`` and stands
in for the known enums with :class:`PickledEnum`, a record of the enum's import path and value that
needs no Megatron install. :data:`PICKLE_MODULE` writes such a record back as the original global, so
Megatron reads the rewritten ``args`` exactly as it wrote them.
"""

from __future__ import annotations

import argparse
import copy
import pickle
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from reshard.formats.safe_pickle import PurePickler

# Enums Megatron puts into args and its common state (import paths as Megatron pickles them, old and new module
# layouts; Megatron-Core 0.19's own safe_globals.py lists the newer ones).
ENUM_PATHS = (
    "megatron.core.enums.ModelType",
    "megatron.core.enums.Fp8Recipe",
    "megatron.core.enums.Fp4Recipe",
    "megatron.core.transformer.enums.ModelType",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.CudaGraphModule",
    "megatron.core.transformer.enums.InferenceCudaGraphScope",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.AttnType",
    "megatron.core.transformer.enums.LayerType",
    "megatron.model.enums.AttnMaskType",
    "megatron.model.enums.AttnType",
    "megatron.model.enums.LayerType",
    "megatron.model.enums.PositionEmbeddingType",
    "megatron.legacy.model.enums.AttnMaskType",
    "megatron.legacy.model.enums.AttnType",
    "megatron.legacy.model.enums.LayerType",
)


@dataclass(frozen=True)
class PickledEnum:
    """A Megatron enum member, kept as its class's import path and its value (Megatron need not be installed)."""

    path: str
    value: Any

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return (_global_ref(self.path), (self.value,))


def _enum_factory(path: str) -> Any:
    def rebuild(value: Any) -> PickledEnum:
        return PickledEnum(path, value)

    rebuild.__qualname__ = rebuild.__name__ = f"rebuild_{path.rsplit('.', 1)[-1]}"
    return rebuild


# Allow-list for torch.load(weights_only=True): Namespace itself, and stand-ins for Megatron's enums.
SAFE_GLOBALS: list[Any] = [argparse.Namespace] + [(_enum_factory(p), p) for p in ENUM_PATHS]

_REFS: dict[str, type] = {}


def _global_ref(path: str) -> type:
    """A placeholder class that :class:`_Pickler` writes as the global ``path`` (one per path, memoizable)."""
    if path not in _REFS:
        module, name = path.rsplit(".", 1)
        _REFS[path] = type(name, (), {"_reshard_global": (module, name)})
    return _REFS[path]


class _Pickler(PurePickler):  # the pure-Python pickler: its save_global can be overridden
    def save_global(self, obj: Any, name: str | None = None) -> None:
        ref = getattr(obj, "_reshard_global", None) if isinstance(obj, type) else None
        if ref is None or self.proto >= 4:
            super().save_global(obj, name)
            return
        module, qualname = ref
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)


# What torch.save(pickle_module=...) needs: a Pickler (ours) and the module's other names.
PICKLE_MODULE = ModuleType("reshard_megatron_pickle")
PICKLE_MODULE.__dict__.update({k: getattr(pickle, k) for k in dir(pickle) if not k.startswith("__")})
PICKLE_MODULE.__dict__["Pickler"] = _Pickler


def retarget_args(args: Any, tp: int, padded_vocab_size: int | None, *, pp: int = 1) -> Any:
    """A copy of ``args`` with the new tensor- and pipeline-parallel sizes and padded vocab size (experts and
    virtual chunks merged: one each)."""
    updates: dict[str, Any] = {"tensor_model_parallel_size": tp}
    merged: dict[str, int | None] = {"pipeline_model_parallel_size": pp, "expert_model_parallel_size": 1}
    merged["virtual_pipeline_model_parallel_size"] = None
    present = args.keys() if isinstance(args, dict) else vars(args).keys()
    updates |= {key: value for key, value in merged.items() if key in present or (key.startswith("pipe") and pp > 1)}
    if padded_vocab_size is not None:
        updates["padded_vocab_size"] = padded_vocab_size
    if isinstance(args, dict):
        return {**args, **updates}
    out = copy.copy(args)
    for key, value in updates.items():
        setattr(out, key, value)
    return out
