"""Megatron's pickled ``args``: reading them safely, the model shape they give, and writing them back.

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
import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from reshard.config import ModelConfig
from reshard.schema import check_ints
from reshard.vocab import DEFAULT_MEGATRON_MULTIPLE

# Enums Megatron puts into args (import paths as Megatron pickles them, old and new module layouts).
ENUM_PATHS = (
    "megatron.core.enums.ModelType",
    "megatron.core.enums.Fp8Recipe",
    "megatron.core.enums.Fp4Recipe",
    "megatron.core.transformer.enums.ModelType",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphScope",
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


# Args that size the model: positive integers when set (checked before any arithmetic on them).
ARGS_SIZES = (
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "ffn_hidden_size",
    "num_layers",
    "padded_vocab_size",
    "make_vocab_size_divisible_by",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
)

# Allow-list for torch.load(weights_only=True): Namespace itself, and stand-ins for Megatron's enums.
SAFE_GLOBALS: list[Any] = [argparse.Namespace] + [(_enum_factory(p), p) for p in ENUM_PATHS]

_REFS: dict[str, type] = {}


def _global_ref(path: str) -> type:
    """A placeholder class that :class:`_Pickler` writes as the global ``path`` (one per path, memoizable)."""
    if path not in _REFS:
        module, name = path.rsplit(".", 1)
        _REFS[path] = type(name, (), {"_reshard_global": (module, name)})
    return _REFS[path]


class _Pickler(pickle._Pickler):  # the pure-Python pickler: its save_global can be overridden
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
PICKLE_MODULE.Pickler = _Pickler


def arg(args: Any, key: str, default: Any = None) -> Any:
    """``args.key``, for a Namespace or a plain dict (``--trust-pickle`` may yield either)."""
    if isinstance(args, dict):
        return args.get(key, default)
    value = getattr(args, key, default)
    return default if value is None else value


def true_vocab_size(args: Any) -> int | None:
    """The unpadded vocab size when the args record it (``--vocab-size``, a converter's ``true_vocab_size``)."""
    for key in ("true_vocab_size", "vocab_size"):
        value = arg(args, key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def vocab_from_tokenizer_files(args: Any) -> tuple[int, Path] | None:
    """The true vocab size from the tokenizer file the args name, when it is there and tells it: a GPT-2 BPE
    ``vocab_file`` (a JSON object of tokens, whose length Megatron-LM's ``GPT2BPETokenizer`` takes)."""
    vocab_file = arg(args, "vocab_file")
    if not isinstance(vocab_file, str) or not vocab_file.endswith(".json"):
        return None
    path = Path(vocab_file)
    try:
        tokens = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return (len(tokens), path) if isinstance(tokens, dict) and tokens else None


def config_from_args(args: Any, path: Path) -> ModelConfig | None:
    """The model shape as a :class:`ModelConfig` (HF key names, so inference and plans read it alike).

    ``vocab_size`` is set only when the args hold the true vocab size; ``padded_vocab_size`` is Megatron's.
    """
    hidden, heads = arg(args, "hidden_size"), arg(args, "num_attention_heads")
    if hidden is None or heads is None:
        return None
    check_ints(((f"args.{key}", arg(args, key)) for key in ARGS_SIZES), path=path)
    groups = arg(args, "num_query_groups") if arg(args, "group_query_attention", False) else None
    raw: dict[str, Any] = {
        "model_type": "megatron",
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": groups or heads,
        "head_dim": arg(args, "kv_channels") or hidden // heads,
        "intermediate_size": arg(args, "ffn_hidden_size"),
        "num_hidden_layers": arg(args, "num_layers"),
        "swiglu": bool(arg(args, "swiglu", False)),
        "padded_vocab_size": arg(args, "padded_vocab_size"),
        "make_vocab_size_divisible_by": arg(args, "make_vocab_size_divisible_by", DEFAULT_MEGATRON_MULTIPLE),
        "tensor_model_parallel_size": arg(args, "tensor_model_parallel_size"),
        "num_experts": arg(args, "num_experts"),
        "moe_intermediate_size": (arg(args, "moe_ffn_hidden_size") or arg(args, "ffn_hidden_size"))
        if arg(args, "num_experts")
        else None,
        "shared_expert_intermediate_size": arg(args, "moe_shared_expert_intermediate_size"),
    }
    vocab = true_vocab_size(args)
    if vocab is not None:
        raw["vocab_size"] = vocab
    return ModelConfig({k: v for k, v in raw.items() if v is not None}, path)


def retarget_args(args: Any, tp: int, padded_vocab_size: int | None, *, pp: int = 1) -> Any:
    """A copy of ``args`` with the new tensor- and pipeline-parallel sizes and padded vocab size (experts and
    virtual chunks merged: one each)."""
    updates: dict[str, Any] = {"tensor_model_parallel_size": tp}
    merged = {"pipeline_model_parallel_size": pp, "expert_model_parallel_size": 1}
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
