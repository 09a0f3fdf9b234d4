"""Where one stored chunk's raw bytes are: inside a ``torch.save`` archive, or a safetensors blob, at any
offset of a data file. Only headers are read here (the zip directory, ``data.pkl``, a safetensors header).

A DCP ``.distcp`` file is a run of whole ``torch.save`` zip archives, one per chunk (or, written with
``SerializationFormat.SAFETENSORS``, one safetensors blob after any pickled values). Rather than
``torch.load`` a copy of each archive, the archive's ``data.pkl`` is read with the structure-only unpickler
of :mod:`reshard.formats.torch_zip.structure` (for dtype, shape, stride and storage offset) and its
``data/<key>`` record (stored, not compressed) is located, so the caller can read the bytes it needs straight
into its own buffer.
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
from reshard.formats.safetensors.header import read_header
from reshard.formats.torch_zip.structure import ZIP_MAGIC, TensorRecord, data_start, read_structure

MAX_PICKLE = 1 << 20  # a tensor's data.pkl is a few hundred bytes
MAX_VALUE = 64 << 20  # a pickled value of a checkpoint (an optimizer's param-group names) takes kilobytes to megabytes
_ARCHIVE_ERRORS = (
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
)


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
            record, stored_code = _load_record(archive.read(pickled), path, tensor)
            data = archive.getinfo(f"{prefix}data/{record.storage.key}")
            start = data_start(handle.fileno(), data, base=position)
    except _ARCHIVE_ERRORS as err:
        raise corrupt(f"not a readable torch.save archive ({str(err) or type(err).__name__})") from err
    if stored_code != code or record.sizes != shape:
        raise corrupt(f"holds {stored_code} {list(record.sizes)}, the metadata says {code} {list(shape)}")
    if start is None or data.compress_type != zipfile.ZIP_STORED:
        raise corrupt("the tensor's data record is not stored uncompressed")
    itemsize = itemsize_of(code)
    extent = record.offset + 1 + sum((s - 1) * st for s, st in zip(shape, record.strides, strict=True))
    if 0 in shape:
        extent = 0
    if min(record.strides, default=0) < 0 or record.offset < 0 or len(record.strides) != len(shape):
        raise corrupt(f"strides {list(record.strides)} / storage offset {record.offset} are not valid")
    if extent * itemsize > min(record.storage.nbytes, data.file_size) or start + data.file_size > length:
        raise corrupt("the tensor's bytes run past its storage or the archive: truncated?")
    return ChunkLayout(position + start, record.offset, record.strides)


def archive_value(path: Path, position: int, length: int, *, entry: str) -> Any:
    """What the ``torch.save`` archive at ``[position, position + length)`` of ``path`` pickles (a DCP BYTE_IO value:
    a hyper-parameter, a list of names), read without running it (:func:`read_structure`): numbers, strings and
    containers as they are, a tensor as a :class:`TensorRecord`, any other object :class:`Inert`.

    Raises:
        CorruptFileError: not a readable archive, or its pickle larger than :data:`MAX_VALUE`.
    """
    try:
        with path.open("rb") as handle, zipfile.ZipFile(_Range(handle.fileno(), position, length)) as archive:
            pickled = next((i for i in archive.infolist() if i.filename.endswith("data.pkl")), None)
            if pickled is None or pickled.file_size > MAX_VALUE:
                raise CorruptFileError(f"value at byte {position}: no data.pkl of a value", path=path, tensor=entry)
            return read_structure(archive.read(pickled))
    except _ARCHIVE_ERRORS as err:
        why = str(err) or type(err).__name__
        raise CorruptFileError(
            f"value at byte {position}: not a readable torch.save archive ({why})", path=path, tensor=entry
        ) from err


def _load_record(data: bytes, path: Path, tensor: str) -> tuple[TensorRecord, str]:
    """The one tensor a chunk's ``data.pkl`` rebuilds, and its safetensors dtype code."""

    def refuse(module: str, name: str) -> UnsafePickleError:
        return UnsafePickleError(
            f"a chunk's data.pkl pickles {module}.{name}, not a tensor: refused without running it",
            path=path,
            tensor=tensor,
        )

    record = read_structure(data, refuse=refuse)
    if not isinstance(record, TensorRecord):
        raise pickle.UnpicklingError(f"data.pkl holds a {type(record).__name__}, not one tensor")
    code = code_from_name(record.dtype)
    if code is None:
        raise pickle.UnpicklingError(f"tensor of dtype {record.dtype!r}")
    return record, code
