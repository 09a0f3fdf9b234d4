"""What Megatron-LM's ``args`` say about the model: its shape as a :class:`~reshard.config.ModelConfig` and its true
vocab size. Pure reading of the namespace (or the dict ``--trust-pickle`` may give); reading and writing the pickled
``args`` themselves is :mod:`reshard.layouts.megatron.args`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from reshard.config import HF_TOKENIZER, ModelConfig, NamedTokenizer
from reshard.megatron.vocab import DEFAULT_MEGATRON_MULTIPLE
from reshard.schema import check_ints

__all__ = [
    "ARGS_SIZES",
    "GPT2_BPE",
    "MODEL_TYPE",
    "SENTENCEPIECE_TYPES",
    "arg",
    "config_from_args",
    "count_problems",
    "named_tokenizer",
    "true_vocab_size",
    "vocab_from_tokenizer_files",
]

# The model_type of the config the args give (:func:`config_from_args`): what plans and checks know it by.
MODEL_TYPE = "megatron"
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
# Megatron-LM's tokenizer types carried into a transformers tokenizer (reshard.mappings.megatron.tokenizer).
GPT2_BPE = "GPT2BPETokenizer"
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


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


def named_tokenizer(args: Any) -> NamedTokenizer | None:
    """The tokenizer the args name (``--tokenizer-type``), with its folder or files when they are on this machine.

    ``HuggingFaceTokenizer``: the folder ``--tokenizer-model`` names (else it is a Hub id or a path elsewhere).
    ``GPT2BPETokenizer``: ``--vocab-file`` and ``--merge-file``. The SentencePiece types: ``--tokenizer-model``.
    Whether Megatron-Core's tokenizer system made the ids (Megatron-LM without ``--legacy-tokenizer`` since 2025) is
    recorded. Any other type, or options that change the ids in ways no transformers tokenizer is made for here, is
    named with the reason it is not carried.
    """
    kind = arg(args, "tokenizer_type")
    if not isinstance(kind, str) or not kind:
        return None
    kind = kind[:100]
    if kind == HF_TOKENIZER:
        return _hf_tokenizer(arg(args, "tokenizer_model"))
    names: tuple[Any, ...]
    if kind == GPT2_BPE:
        names, origin = (arg(args, "vocab_file"), arg(args, "merge_file")), "the args' vocab_file and merge_file"
    elif kind in SENTENCEPIECE_TYPES:
        names, origin = (arg(args, "tokenizer_model"),), "the args' tokenizer_model"
    else:
        return NamedTokenizer(kind, "the args' tokenizer_type", kind=kind, refused=f"Megatron-LM's {kind}")
    given = [str(n)[:4096] for n in names if isinstance(n, str) and n]
    name = " and ".join(given)  # "": the args name none
    files = tuple(_file(n) for n in names)
    found = tuple(f for f in files if f is not None) if all(files) else ()
    extra = arg(args, "vocab_extra_ids", 0)
    extra = extra if isinstance(extra, int) and not isinstance(extra, bool) and 0 <= extra <= 1 << 16 else 0
    refused, core = _refusal(args, kind), _core_tokenizers(args)
    return NamedTokenizer(name, origin, kind=kind, files=found, refused=refused, extra_ids=extra, core=core)


def _hf_tokenizer(model: Any) -> NamedTokenizer | None:
    if not isinstance(model, str) or not model:
        return None
    model = model[:4096]
    try:
        folder = Path(model) if Path(model).is_dir() else None
    except (OSError, ValueError):  # a name no file system holds (NUL, too long)
        folder = None
    return NamedTokenizer(model, "the args' tokenizer_model", folder)


def _file(name: Any) -> Path | None:
    if not isinstance(name, str) or not name:
        return None
    try:
        return Path(name) if Path(name).is_file() else None
    except (OSError, ValueError):
        return None


def _core_tokenizers(args: Any) -> bool:
    """Whether Megatron-Core's tokenizer system made the ids: ``legacy_tokenizer`` False, or (after Megatron-LM
    removed the legacy system and its flag) args of the new system only."""
    legacy = arg(args, "legacy_tokenizer")
    if legacy is not None:
        return not legacy
    return arg(args, "tokenizer_sentencepiece_legacy") is not None


def _refusal(args: Any, kind: str) -> str | None:
    """Why Megatron-Core's tokenizer system gives other ids than the transformers tokenizer made for ``kind``."""
    if not _core_tokenizers(args):
        return None
    for key in ("special_tokens", "tokenizer_special_tokens"):
        if arg(args, key):
            return f"Megatron-Core's {kind} with the args' {key}"
    if kind in SENTENCEPIECE_TYPES:
        if arg(args, "tokenizer_sentencepiece_legacy"):
            return f"Megatron-Core's {kind} with tokenizer_sentencepiece_legacy"
        if arg(args, "tokenizer_sentencepiece_ignore_extra_whitespaces", True) is False:
            return f"Megatron-Core's {kind} keeping extra spaces (tokenizer_sentencepiece_ignore_extra_whitespaces)"
    return None


def config_from_args(args: Any, path: Path | None) -> ModelConfig | None:
    """The model shape as a :class:`ModelConfig` (HF key names, so inference and plans read it alike).

    ``vocab_size`` is set only when the args hold the true vocab size; ``padded_vocab_size`` is Megatron's.
    """
    hidden, heads = arg(args, "hidden_size"), arg(args, "num_attention_heads")
    if hidden is None or heads is None:
        return None
    check_ints(((f"args.{key}", arg(args, key)) for key in ARGS_SIZES), path=path)
    groups = arg(args, "num_query_groups") if arg(args, "group_query_attention", False) else None
    raw: dict[str, Any] = {
        "model_type": MODEL_TYPE,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": groups or heads,
        # linear_proj's input is heads x v_head_dim under multi-latent attention
        "head_dim": (arg(args, "v_head_dim", 128) if arg(args, "multi_latent_attention", False) else None)
        or arg(args, "kv_channels")
        or hidden // heads,
        "transformer_impl": arg(args, "transformer_impl"),
        "intermediate_size": arg(args, "ffn_hidden_size"),
        "num_hidden_layers": arg(args, "num_layers"),
        "swiglu": bool(arg(args, "swiglu", False) or arg(args, "quick_geglu", False)),  # fc1 is [gate; up]
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


_LAYER = re.compile(r"^(?:decoder|language_model\.encoder)\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^(?:decoder|language_model\.encoder)\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(.+)$")


def count_problems(names: Iterable[str], args: Any) -> list[str]:
    """Where the tensors and the args count layers or experts differently, one line each with both numbers.

    Pure: global tensor names (layers and experts numbered over the whole model) and the args in.
    """
    layers: set[int] = set()
    experts: dict[tuple[int, str], set[int]] = {}
    for name in names:
        if match := _LAYER.match(name):
            layers.add(int(match.group(1)))
        if match := _EXPERT.match(name):
            experts.setdefault((int(match.group(1)), match.group(3)), set()).add(int(match.group(2)))
    problems = []
    held = max(layers) + 1 if layers else 0
    num_layers = arg(args, "num_layers")
    if layers and isinstance(num_layers, int) and num_layers != held:
        problems.append(f"the args say num_layers={num_layers}, but the tensors hold {held} layers")
    missing = sorted(set(range(held)) - layers)
    if missing:
        problems.append(f"the tensors hold layers up to {held - 1} but none of layer(s) {missing}")
    by_layer: dict[int, dict[str, int]] = {}
    for (layer, part), numbers in sorted(experts.items()):
        by_layer.setdefault(layer, {})[part] = max(numbers) + 1
    num_experts = arg(args, "num_experts")
    for layer, counts in by_layer.items():
        if len(set(counts.values())) > 1:
            listed = ", ".join(f"{part} {count}" for part, count in counts.items())
            problems.append(f"layer {layer}: its experts' tensors count different experts ({listed})")
        elif isinstance(num_experts, int) and num_experts != next(iter(counts.values())):
            found = next(iter(counts.values()))
            problems.append(f"the args say num_experts={num_experts}, but layer {layer} holds {found} experts")
    return problems
