"""Where one stored chunk's raw bytes are: inside a ``torch.save`` archive, or a safetensors blob, at any
offset of a data file. Only headers are read here (the zip directory, ``data.pkl``, a safetensors header).

A DCP ``.distcp`` file is a run of whole ``torch.save`` zip archives, one per chunk (or, written with
``SerializationFormat.SAFETENSORS``, one safetensors blob after any pickled values). Rather than
``torch.load`` a copy of each archive, the archive's ``data.pkl`` is read with a restricted unpickler
(for dtype, shape, stride and storage offset) and its ``data/<key>`` record (stored, not compressed)
is located, so the caller can read the bytes it needs straight into its own buffer.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.dtypes import code_from_name, itemsize_of
from reshard.errors import CorruptFileError, UnsafePickleError
from reshard.formats.boxes import Shape
from reshard.formats.safe_pickle import DTYPE_NAMES, Dtype, PickleInput, load_restricted
from reshard.formats.safetensors.header import read_header

ZIP_MAGIC = b"PK\x03\x04"
MAX_PICKLE = 1 << 20  # a tensor's data.pkl is a few hundred bytes
# Legacy typed storages a torch.save archive names (newer dtypes use UntypedStorage + the dtype).
_STORAGES = {
    "DoubleStorage": "F64",
    "FloatStorage": "F32",
    "HalfStorage": "F16",
    "BFloat16Storage": "BF16",
    "LongStorage": "I64",
    "IntStorage": "I32",
    "ShortStorage": "I16",
    "CharStorage": "I8",
    "ByteStorage": "U8",
    "BoolStorage": "BOOL",
    "ComplexFloatStorage": "C64",
}


@dataclass(frozen=True)
class SafetensorsEntry:
    code: str
    shape: Shape
    data: int  # absolute file position of the tensor's bytes
    nbytes: int


@dataclass(frozen=True)
class ChunkLayout:
    """A chunk's bytes in its file: element ``i`` of the storage is at ``data + i * itemsize``, and element
    ``index`` of the chunk at storage element ``storage_offset + sum(index * strides)``."""

    data: int
    storage_offset: int
    strides: Shape


def starts_as_zip(path: Path, position: int) -> bool:
    """True when the bytes at ``position`` open a zip archive (a ``torch.save`` chunk), False for anything
    else (a safetensors blob starts with its header length)."""
    with path.open("rb") as handle:
        return os.pread(handle.fileno(), 4, position) == ZIP_MAGIC


def safetensors_entries(path: Path, position: int, end: int) -> tuple[dict[str, SafetensorsEntry], dict[str, str]]:
    """The tensors and ``__metadata__`` of a safetensors blob at ``[position, end)`` of ``path``, checked the way
    the safetensors library checks them (:mod:`reshard.formats.safetensors.header`).

    Raises:
        CorruptFileError: anything that safetensors itself would refuse.
    """
    entries, metadata = read_header(path, position=position, end=end)
    return {name: SafetensorsEntry(e.code, e.shape, e.start, e.nbytes) for name, e in entries.items()}, metadata


class _Range(io.RawIOBase):
    """``[start, start + length)`` of an open file, as a seekable read-only file (``pread``, thread-safe)."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        super().__init__()
        self._fd, self._start, self._length, self._pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        count = max(0, min(len(buffer), self._length - self._pos))
        data = os.pread(self._fd, count, self._start + self._pos) if count else b""
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


def torch_archive_layout(
    path: Path, position: int, length: int, *, code: str, shape: Shape, tensor: str
) -> ChunkLayout:
    """Locate the tensor stored by the ``torch.save`` archive at ``[position, position + length)`` of ``path``.

    Raises:
        CorruptFileError: not an archive of one tensor of ``code`` and ``shape``, or its bytes do not fit.
        UnsafePickleError: its ``data.pkl`` pickles anything but a tensor.
    """

    def corrupt(why: str) -> CorruptFileError:
        return CorruptFileError(f"chunk at byte {position}: {why}", path=path, tensor=tensor)

    try:
        with path.open("rb") as handle, zipfile.ZipFile(_Range(handle.fileno(), position, length)) as archive:
            pickled = next((i for i in archive.infolist() if i.filename.endswith("data.pkl")), None)
            if pickled is None or pickled.file_size > MAX_PICKLE:
                raise corrupt("no data.pkl of a tensor in the torch.save archive")
            prefix = pickled.filename[: -len("data.pkl")]
            names = set(archive.namelist())
            if f"{prefix}byteorder" in names and archive.read(f"{prefix}byteorder") != b"little":
                raise corrupt("big-endian tensor bytes are not supported")
            record = _load_record(archive.read(pickled), path, tensor)
            data = archive.getinfo(f"{prefix}data/{record.key}")
            local = os.pread(handle.fileno(), 30, position + data.header_offset)
    except (
        zipfile.BadZipFile,
        KeyError,
        OSError,
        EOFError,
        ValueError,
        struct.error,
        pickle.UnpicklingError,
        TypeError,
        AttributeError,
        IndexError,
        RecursionError,
        MemoryError,
        OverflowError,
    ) as err:
        raise corrupt(f"not a readable torch.save archive ({str(err) or type(err).__name__})") from err
    if record.code != code or record.shape != shape:
        raise corrupt(f"holds {record.code} {list(record.shape)}, the metadata says {code} {list(shape)}")
    if len(local) < 30 or local[:4] != ZIP_MAGIC or data.compress_type != zipfile.ZIP_STORED:
        raise corrupt("the tensor's data record is not stored uncompressed")
    name_length, extra_length = struct.unpack("<HH", local[26:30])
    start = data.header_offset + 30 + name_length + extra_length
    itemsize = itemsize_of(code)
    extent = record.storage_offset + 1 + sum((s - 1) * st for s, st in zip(shape, record.strides, strict=True))
    if 0 in shape:
        extent = 0
    if min(record.strides, default=0) < 0 or record.storage_offset < 0 or len(record.strides) != len(shape):
        raise corrupt(f"strides {list(record.strides)} / storage offset {record.storage_offset} are not valid")
    if extent * itemsize > min(record.storage_bytes, data.file_size) or start + data.file_size > length:
        raise corrupt("the tensor's bytes run past its storage or the archive: truncated?")
    return ChunkLayout(position + start, record.storage_offset, record.strides)


@dataclass(frozen=True)
class _Storage:
    code: str
    key: str
    storage_bytes: int


@dataclass(frozen=True)
class _Record:
    code: str
    key: str
    storage_bytes: int
    storage_offset: int
    shape: Shape
    strides: Shape


def _rebuild_v2(storage: _Storage, offset: int, size: Any, stride: Any, *_: Any) -> _Record:
    return _Record(storage.code, storage.key, storage.storage_bytes, int(offset), _shape(size), _shape(stride))


def _rebuild_v3(
    storage: _Storage, offset: int, size: Any, stride: Any, grad: Any, hooks: Any, dtype: Any, *_: Any
) -> _Record:
    code = code_from_name(str(dtype)) if isinstance(dtype, Dtype) else None
    if code is None:
        raise pickle.UnpicklingError(f"tensor of dtype {dtype!r}")
    return _Record(code, storage.key, storage.storage_bytes, int(offset), _shape(size), _shape(stride))


def _parameter(data: _Record, *_: Any) -> _Record:
    """``nn.Parameter(data)``: the tensor inside."""
    return data


def _shape(values: Any) -> Shape:
    if not isinstance(values, tuple) or not all(type(v) is int for v in values):
        raise pickle.UnpicklingError(f"{values!r} is not a tuple of integers")
    return values


class _StorageType(str):
    """A pickled storage class, kept as the code of its elements."""


class _RecordUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, path: Path, tensor: str) -> None:
        super().__init__(PickleInput(data))
        self._path, self._tensor = path, tensor

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_v2
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _rebuild_v3
        if module == "torch._utils" and name == "_rebuild_parameter":
            return _parameter
        if module == "collections" and name == "OrderedDict":
            return dict
        if module == "torch" and name in _STORAGES:
            return _StorageType(_STORAGES[name])
        if module == "torch.storage" and name == "UntypedStorage":
            return _StorageType("U8")
        if module == "torch" and name in DTYPE_NAMES:
            return Dtype(name)
        raise UnsafePickleError(
            f"a chunk's data.pkl pickles {module}.{name}, not a tensor: refused without running it",
            path=self._path,
            tensor=self._tensor,
        )

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        numel = pid[4]
        if type(numel) is not int or numel < 0:
            raise pickle.UnpicklingError(f"storage of {numel!r} elements")
        return _Storage(str(pid[1]), str(pid[2]), numel * itemsize_of(str(pid[1])))


def _load_record(data: bytes, path: Path, tensor: str) -> _Record:
    record = load_restricted(_RecordUnpickler(data, path, tensor), data)
    if not isinstance(record, _Record):
        raise pickle.UnpicklingError(f"data.pkl holds a {type(record).__name__}, not one tensor")
    return record
