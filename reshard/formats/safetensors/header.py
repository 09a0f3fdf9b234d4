"""A safetensors header, checked the way the ``safetensors`` library checks it before reshard trusts any of it.

The rules are those of ``safetensors/src/tensor.rs`` (``SafeTensors::read_metadata``, ``Metadata::validate``):

* the 8-byte little-endian header length is at most 100,000,000 and the header lies inside the file;
* the header is UTF-8 JSON: an object whose ``__metadata__`` (optional, may be null) maps strings to strings
  and whose every other entry is a tensor: ``dtype`` (a known code), ``shape`` (non-negative integers) and
  ``data_offsets`` (two non-negative integers);
* sorted by their offsets, the tensors' byte ranges start at 0 and follow each other with no gap and no
  overlap, each holds exactly ``numel x itemsize`` bytes (no overflow of 64 bits), and together they
  cover the data section exactly (no byte before, between or after them).

reshard adds two checks the Rust parser gets from its types: JSON nesting is bounded before the JSON is
parsed (a valid header nests 3 deep; Python's recursive parser would end a deep one in a ``RecursionError``),
and a name given twice is refused (JSON leaves it undefined; Python would keep the last silently). Every
refusal is a :class:`~reshard.errors.CorruptFileError` naming the file and, where there is one, the tensor.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.dtypes import is_code, itemsize_of
from reshard.errors import CorruptFileError

MAX_HEADER = 100_000_000  # safetensors' MAX_HEADER_SIZE
MAX_DEPTH = 8  # a valid header nests 3 deep (object -> tensor -> shape); serde_json stops at 128
METADATA_KEY = "__metadata__"
_U64 = 1 << 64
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
Shape = tuple[int, ...]


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a header: its dtype code, shape, and where its bytes are (absolute file positions)."""

    code: str
    shape: Shape
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


def read_header(
    path: Path, *, position: int = 0, end: int | None = None
) -> tuple[dict[str, HeaderEntry], dict[str, str]]:
    """The tensors and ``__metadata__`` of the safetensors data at ``[position, end)`` of ``path`` (the whole
    file by default), after every check of the module docstring.

    Raises:
        CorruptFileError: anything the safetensors library would refuse, or a file that cannot be read.
    """
    try:
        with path.open("rb") as handle:
            if end is None:
                end = os.fstat(handle.fileno()).st_size
            prefix = os.pread(handle.fileno(), 8, position)
            if len(prefix) < 8:
                raise CorruptFileError("truncated safetensors file (no header length)", path=path)
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER:
                raise CorruptFileError(
                    f"safetensors header too large ({length} bytes announced, at most {MAX_HEADER})", path=path
                )
            if length > end - position - 8:
                raise CorruptFileError(
                    f"truncated or corrupt safetensors header ({length} bytes announced, "
                    f"{max(0, end - position - 8)} in the file)",
                    path=path,
                )
            raw = os.pread(handle.fileno(), length, position + 8)
    except OSError as err:
        raise CorruptFileError(f"cannot read the safetensors header: {err.strerror or err}", path=path) from err
    if len(raw) != length:
        raise CorruptFileError("the file changed while its header was read", path=path)
    data = position + 8 + length
    entries, metadata = parse_header(raw, data_size=end - data, path=path)
    return {name: HeaderEntry(e.code, e.shape, data + e.start, data + e.stop) for name, e in entries.items()}, metadata


def parse_header(raw: bytes, *, data_size: int, path: Path) -> tuple[dict[str, HeaderEntry], dict[str, str]]:
    """Check header bytes against a data section of ``data_size`` bytes; offsets stay relative to the data."""
    header = _load_json(raw, path)
    metadata = header.pop(METADATA_KEY, None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptFileError(
            f"is a {_kind(metadata)}, not a map of strings to strings", path=path, tensor=METADATA_KEY
        )
    entries = {name: _entry(name, info, path) for name, info in header.items()}
    past = [(e.stop, name) for name, e in entries.items() if e.stop > data_size]
    if past:
        stop, name = min(past)
        raise CorruptFileError(
            f"tensor bytes [{entries[name].start}, {stop}) do not fit (file holds {data_size} data bytes): "
            "truncated file?",
            path=path,
            tensor=name,
        )
    expected, previous = 0, None
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].start, item[1].stop)):
        if entry.start < expected:
            raise CorruptFileError(
                f"invalid offsets: its bytes [{entry.start}, {entry.stop}) overlap those of {previous}",
                path=path,
                tensor=name,
            )
        if entry.start > expected:
            raise CorruptFileError(
                f"invalid offsets: its bytes start at {entry.start}, leaving bytes [{expected}, {entry.start}) "
                "of the data section to no tensor",
                path=path,
                tensor=name,
            )
        expected, previous = entry.stop, name
    if expected != data_size:
        raise CorruptFileError(
            f"incomplete metadata, file not fully covered: the tensors end at data byte {expected}, "
            f"the file holds {data_size}",
            path=path,
        )
    return entries, metadata


def _load_json(raw: bytes, path: Path) -> dict[str, Any]:
    if _too_deep(raw):
        raise CorruptFileError(
            f"safetensors header JSON nests deeper than {MAX_DEPTH} levels (or is unbalanced)", path=path
        )
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique, parse_constant=_no_constant)
    except UnicodeDecodeError as err:
        raise CorruptFileError(f"safetensors header is not UTF-8 ({err.reason})", path=path) from err
    except ValueError as err:  # JSONDecodeError, a duplicate name, NaN, an integer of too many digits
        raise CorruptFileError(f"cannot read the safetensors header: {err}", path=path) from err
    if not isinstance(header, dict):
        raise CorruptFileError(f"safetensors header is a JSON {_kind(header)}, not an object", path=path)
    return header


def _too_deep(raw: bytes) -> bool:
    """Whether brackets outside strings nest deeper than :data:`MAX_DEPTH` (or do not pair up), found by
    deleting innermost pairs a level at a time: bounded time, no recursion, whatever the input."""
    skeleton = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    for _ in range(MAX_DEPTH):
        shorter = skeleton.replace(b"[]", b"").replace(b"{}", b"")
        if shorter == skeleton:
            break
        skeleton = shorter
    return bool(skeleton)


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the name {key!r} appears twice in one object")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _kind(value: Any) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def _is_u64(value: Any) -> bool:
    return type(value) is int and 0 <= value < _U64


def _entry(name: str, info: Any, path: Path) -> HeaderEntry:
    """One tensor entry, checked alone: its fields, their types, and its byte count."""

    def bad(why: str) -> CorruptFileError:
        return CorruptFileError(why, path=path, tensor=name)

    if not isinstance(info, dict):
        raise bad(f"header entry is a {_kind(info)}, not a tensor (dtype, shape, data_offsets)")
    missing = [key for key in ("dtype", "shape", "data_offsets") if key not in info]
    if missing:
        raise bad(f"header entry has no {', '.join(missing)}")
    code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(code, str) or not is_code(code):
        raise bad(f"unknown dtype {code!r}")
    if not isinstance(shape, list) or not all(_is_u64(size) for size in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_u64(o) for o in offsets)):
        raise bad(f"data_offsets {offsets!r} is not two non-negative integers")
    start, stop = offsets
    if stop < start:
        raise bad(f"invalid offsets: data_offsets [{start}, {stop}) end before they start")
    numel = 1
    for size in shape:
        numel *= size
    nbytes = numel * itemsize_of(code)
    if nbytes >= _U64:
        raise bad(f"shape {shape} of {code} overflows 64 bits of bytes")
    if stop - start != nbytes:
        raise bad(
            f"data_offsets [{start}, {stop}) hold {stop - start} bytes, a {code} tensor of shape {shape} "
            f"needs {nbytes}"
        )
    return HeaderEntry(code, tuple(shape), start, stop)
