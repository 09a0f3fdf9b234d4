"""The values reshard reads from JSON-like files, checked where they are read: ``reshard.json`` against its schema,
and the sizes a model config (``config.json``, SAT's ``model_config.json``, Megatron's pickled args) gives.

A wrong value (``"tp": "two"``, ``"vocab_size": 999.5``, ``num_attention_heads = 0``) is refused here, in one
line naming the file and the key, rather than failing later as arithmetic on a string, a division by zero or
a loop over ``10**12`` ranks. Pure: dicts in, :class:`~reshard.errors.CorruptFileError` out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from reshard.dtypes import code_from_name
from reshard.errors import CorruptFileError, shown
from reshard.geometry import partition_from_dict
from reshard.options import MAX_RANKS

MAX_SIZE = 1 << 48  # no dimension of a real tensor comes near it; a bigger one is damage, not a model
MAX_NDIM = 64
# Sizes a config gives that reshard computes with: each must be a positive integer when present.
POSITIVE_SIZES = (
    "vocab_size",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "padded_vocab_size",
    "make_vocab_size_divisible_by",
    "tensor_model_parallel_size",
    "model_parallel_size",
    "embed_dim",
    "num_heads",
    "hidden_size_per_attention_head",
    "inner_hidden_size",
)
# Sizes that may be 0 (a dense model's expert counts, a layer kind a hybrid model does not use).
COUNTS = (
    "num_hidden_layers",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
)
# Sub-configs whose sizes are read the same way (multimodal text and vision towers, SAT's EVA).
NESTED = ("text_config", "vision_config", "eva_args")
_HEX256 = re.compile(r"^[0-9a-f]{64}$")  # a sha256 or BLAKE3 digest
# The digest fields of a tensor entry (reshard.manifest), exactly one; the algorithms reshard.engine.move.digest
# computes.
DIGESTS = ("blake3", "sha256")
# The spelling of a layout name (``hf-ranks``, ``torch_dist``); the registry knows which exist.
LAYOUT_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
SHA256 = re.compile(r"[0-9a-f]{64}")


def is_int(value: Any) -> bool:
    """An integer that is not a bool (JSON ``true`` is not a size)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _fail(path: Path | None, key: str, value: Any, what: str) -> CorruptFileError:
    return CorruptFileError(f"{_show(value)} is not {what}", path=path, tensor=key)


def _show(value: Any) -> str:
    """The value as the JSON file spells it (``true``, ``"abc"``), shortened (never walked or printed whole: a
    YAML alias bomb or a 5001-digit integer is untrusted too)."""
    return shown(value, limit=40, as_json=True)


def check_int(value: Any, *, path: Path | None, key: str, low: int = 1, high: int = MAX_SIZE) -> int:
    """``value`` when it is an integer in ``[low, high]``; else an error naming the file and the key."""
    if not is_int(value) or not low <= value <= high:
        what = {0: "a non-negative integer", 1: "a positive integer"}.get(low, f"an integer from {low}")
        raise _fail(path, key, value, what if high == MAX_SIZE else f"an integer from {low} to {high}")
    return value


def check_config_sizes(raw: Mapping[str, Any], *, path: Path | None, prefix: str = "") -> None:
    """Refuse a config whose sizes are not integers: a positive one for :data:`POSITIVE_SIZES`, a non-negative
    one for :data:`COUNTS` (``null`` means unset), here and in its :data:`NESTED` sub-configs."""
    for key in (*POSITIVE_SIZES, *COUNTS):
        value = raw.get(key)
        if value is not None:
            check_int(value, path=path, key=f"{prefix}{key}", low=1 if key in POSITIVE_SIZES else 0)
    for key in NESTED:
        nested = raw.get(key)
        if nested is not None and not isinstance(nested, Mapping):
            raise _fail(path, f"{prefix}{key}", nested, "an object")
        if nested is not None:
            check_config_sizes(nested, path=path, prefix=f"{prefix}{key}.")


def check_manifest_data(data: Any, path: Path) -> None:
    """Refuse a ``reshard.json`` whose fields have the wrong types or absurd values (the schema of
    docs/manifest.md); fields a manifest may lack (older versions) may be absent."""
    if not isinstance(data, dict):
        raise _fail(path, "(top level)", type(data).__name__, "a JSON object")
    for key in ("format", "reshard_version", "created"):
        if key in data and not isinstance(data[key], str):
            raise _fail(path, key, data[key], "a string")
    for side in ("source", "target"):
        part = _object(data, side, path)
        if part.get("tp") is not None:
            check_int(part["tp"], path=path, key=f"{side}.tp", high=MAX_RANKS)
        layout = part.get("layout")
        if layout is not None and not (isinstance(layout, str) and LAYOUT_NAME.fullmatch(layout)):
            raise _fail(path, f"{side}.layout", layout, "a layout name")  # which layouts exist: layouts.check_manifest
    vocab = _object(data, "vocab", path)
    for key in ("original", "padded", "pad_multiple", "source_padded", "source_config"):
        if vocab.get(key) is not None:
            check_int(vocab[key], path=path, key=f"vocab.{key}")
    if vocab.get("original") is not None and vocab.get("padded") is not None and vocab["padded"] < vocab["original"]:
        raise _fail(path, "vocab.padded", vocab["padded"], f"at least vocab.original ({vocab['original']})")
    for name, entry in _object(data, "tensors", path).items():
        _check_entry(entry, path, name)
    if data.get("mapping") is not None and not isinstance(data["mapping"], dict):
        raise _fail(path, "mapping", data["mapping"], "an object")
    if data.get("conversion") is not None:
        conversion = _object(data, "conversion", path)
        mark = conversion.get("fingerprint")
        if not (isinstance(mark, str) and SHA256.fullmatch(mark)):
            raise _fail(path, "conversion.fingerprint", mark, "a sha256 in hex")


def _object(data: Mapping[str, Any], key: str, path: Path) -> Mapping[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise _fail(path, key, value, "an object")
    return value


def _check_entry(entry: Any, path: Path, name: str) -> None:
    if not isinstance(entry, dict):
        raise _fail(path, f"tensors.{name}", entry, "an object")
    shape = entry.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(is_int(s) and 0 <= s <= MAX_SIZE for s in shape)
    ):
        raise _fail(path, f"tensors.{name}.shape", shape, "a list of non-negative integers")
    if not isinstance(entry.get("dtype"), str) or code_from_name(entry["dtype"]) is None:
        raise _fail(path, f"tensors.{name}.dtype", entry.get("dtype"), "a dtype name such as 'bfloat16'")
    digests = [key for key in DIGESTS if key in entry]
    if len(digests) != 1:
        raise _fail(path, f"tensors.{name}", sorted(entry), f"an entry with one digest field of {', '.join(DIGESTS)}")
    (key,) = digests
    if not isinstance(entry[key], str) or not _HEX256.match(entry[key]):
        raise _fail(path, f"tensors.{name}.{key}", entry[key], "64 lowercase hex digits")
    for flag in ("finite", "divergent"):
        if entry.get(flag) is not None and not isinstance(entry[flag], bool):
            raise _fail(path, f"tensors.{name}.{flag}", entry[flag], "true or false")
    check_partition(entry.get("partition"), path=path, key=f"tensors.{name}.partition")


def check_partition(data: Any, *, path: Path | None, key: str) -> None:
    """Refuse a partition record (``{"kind": "shard", "dim": 0}``) of an unknown kind, or with fields of the wrong
    type or range (a dim within 64 dims, positive unit / group / head counts, lists of part sizes)."""
    if not isinstance(data, dict):
        raise _fail(path, key, data, "a partition record (an object with a kind)")
    try:
        partition_from_dict(data)
    except (ValueError, TypeError) as err:
        raise _fail(path, key, data, f"a partition ({err})") from err
    if "dim" in data:
        check_int(data["dim"], path=path, key=f"{key}.dim", low=-MAX_NDIM, high=MAX_NDIM - 1)
    for count in ("unit", "groups", "heads"):
        if count in data:
            check_int(data[count], path=path, key=f"{key}.{count}")
    if "parts" in data:
        _int_list(data["parts"], path=path, key=f"{key}.parts", low=0)
    if data.get("units") is not None:
        _int_list(data["units"], path=path, key=f"{key}.units", low=1)
        if len(data["units"]) != len(data.get("parts") or []):
            raise _fail(path, f"{key}.units", data["units"], f"one unit per part ({len(data.get('parts') or [])})")


def _int_list(values: Any, *, path: Path | None, key: str, low: int) -> None:
    if not isinstance(values, list) or not values or not all(is_int(v) and low <= v <= MAX_SIZE for v in values):
        raise _fail(path, key, values, f"a non-empty list of integers from {low}")


def check_ints(values: Iterable[tuple[str, Any]], *, path: Path | None, low: int = 1) -> None:
    """:func:`check_int` over ``(key, value)`` pairs, skipping unset (None) values."""
    for key, value in values:
        if value is not None:
            check_int(value, path=path, key=key, low=low)
