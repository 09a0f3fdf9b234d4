"""A ``torch.save`` file checked before ``torch.load`` maps it: what it is, and that its records hold the bytes
its pickle says they hold.

``torch.load(mmap=True)`` trusts the archive: a storage's bytes are cut from the mapped file at its record's
offset for as many bytes as the *pickle* claims, so a storage that claims more than its record holds reads the
bytes after it (another storage, the zip directory) without an error, and a compressed record is read as if it
held raw elements. So, before torch sees the file:

* the first bytes tell a zip archive (``PK``), a legacy pickle (``0x80``) and safetensors bytes apart (a
  ``.bin`` that holds safetensors data is refused with what to rename it to, anything else as not a torch file);
* in an archive: one ``data.pkl``, every record under the same root folder and named once, and for every
  storage the pickle names a record that exists, is stored uncompressed, lies inside the file and holds at
  least the storage's bytes; every tensor's elements (offset, sizes, strides) lie inside its storage.

The pickle is read by a structure-only unpickler that calls nothing it names: every global is a stand-in
(an inert placeholder, or a record of a tensor's storage, offset, sizes and strides), so a hostile pickle
runs no code here; ``torch.load`` with its own allow-list still decides what may be rebuilt.
"""

from __future__ import annotations

import math
import os
import pickle
import struct
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.errors import CorruptFileError
from reshard.formats.safe_pickle import PickleInput, load_restricted

ZIP_MAGIC = b"PK\x03\x04"
_DTYPE_SIZES = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
}
_LEGACY = {
    "Bool": 1,
    "Byte": 1,
    "Char": 1,
    "Short": 2,
    "Half": 2,
    "BFloat16": 2,
    "Int": 4,
    "Float": 4,
    "Long": 8,
    "Double": 8,
    "ComplexFloat": 8,
    "ComplexDouble": 16,
    "QUInt8": 1,
    "QInt8": 1,
    "QInt32": 4,
    "QUInt4x2": 1,
    "QUInt2x4": 1,
}


def check_torch_file(path: Path) -> str | None:
    """Check ``path`` as a ``torch.save`` file; return the archive's root folder name, None for a legacy pickle.

    Raises:
        CorruptFileError: not a torch file, or an archive whose records do not hold what its pickle says.
    """
    try:
        with path.open("rb") as handle:
            head = handle.read(16)
            size = os.fstat(handle.fileno()).st_size
    except OSError as err:
        raise CorruptFileError(f"cannot read: {err.strerror or err}", path=path) from err
    if head.startswith(ZIP_MAGIC):
        return _check_archive(path, size)
    if len(head) >= 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] < size:
        raise CorruptFileError(
            "holds safetensors data, not a torch.save file", path=path, hint="rename it to end in .safetensors"
        )
    if not head.startswith(b"\x80"):
        raise CorruptFileError("not a torch.save file (neither a zip archive nor a pickle)", path=path)
    return None


def _check_archive(path: Path, size: int) -> str:
    try:
        with path.open("rb") as handle, zipfile.ZipFile(handle) as archive:
            infos = archive.infolist()
            names = [info.filename for info in infos]
            pickled = [name for name in names if name == "data.pkl" or name.endswith("/data.pkl")]
            pickled = [name for name in pickled if name.count("/") <= 1]
            if len(pickled) != 1:
                raise CorruptFileError(f"a torch archive holds one data.pkl, this one holds {len(pickled)}", path=path)
            prefix = pickled[0][: -len("data.pkl")]
            duplicate = next((n for n in names if names.count(n) > 1), None)
            if duplicate is not None:
                raise CorruptFileError(f"the archive holds {duplicate!r} twice", path=path)
            stray = next((n for n in names if not n.startswith(prefix)), None)
            if stray is not None:
                raise CorruptFileError(f"record {stray!r} lies outside the archive's folder {prefix!r}", path=path)
            tensors = _tensors(archive.read(pickled[0]), path)
            records = {info.filename: info for info in infos}
            starts = {
                name: _data_start(handle, info) for name, info in records.items() if name.startswith(f"{prefix}data/")
            }
    except CorruptFileError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, struct.error) as err:
        raise CorruptFileError(f"not a readable torch zip archive (truncated?): {err}", path=path) from err
    for name, tensor in tensors:
        record = records.get(f"{prefix}data/{tensor.storage.key}")
        if record is None:
            raise CorruptFileError(f"its storage record data/{tensor.storage.key} is missing", path=path, tensor=name)
        where = f"storage record data/{tensor.storage.key}"
        if record.compress_type != zipfile.ZIP_STORED:
            raise CorruptFileError(f"{where} is compressed; torch.load would read it as raw", path=path, tensor=name)
        start = starts[record.filename]
        if start + record.file_size > size:
            raise CorruptFileError(f"{where} runs past the end of the file: truncated?", path=path, tensor=name)
        if tensor.storage.nbytes > record.file_size:
            raise CorruptFileError(
                f"the pickle gives {where} {tensor.storage.nbytes} bytes, the record holds {record.file_size}",
                path=path,
                tensor=name,
            )
        if tensor.extent > tensor.storage.numel:
            raise CorruptFileError(
                f"sizes {list(tensor.sizes)}, strides {list(tensor.strides)} at offset {tensor.offset} reach "
                f"element {tensor.extent} of a storage of {tensor.storage.numel}",
                path=path,
                tensor=name,
            )
    return prefix.rstrip("/")


def _data_start(handle: Any, info: zipfile.ZipInfo) -> int:
    local = os.pread(handle.fileno(), 30, info.header_offset)
    if len(local) < 30 or local[:4] != ZIP_MAGIC:
        raise zipfile.BadZipFile(f"no local header for {info.filename}")
    name_length, extra_length = struct.unpack("<HH", local[26:30])
    return info.header_offset + 30 + name_length + extra_length


@dataclass(frozen=True)
class _Storage:
    key: str
    itemsize: int
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class _Tensor:
    storage: _Storage
    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int

    @property
    def extent(self) -> int:
        """Storage elements (of the storage's own unit) up to the tensor's last element."""
        if any(size == 0 for size in self.sizes):
            return 0
        last = self.offset + sum((size - 1) * stride for size, stride in zip(self.sizes, self.strides, strict=False))
        return math.ceil((last + 1) * self.itemsize / self.storage.itemsize)


class _Inert:
    """What every unknown global becomes: takes any arguments and state, and does nothing."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Inert:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _Dict(dict):
    """``collections.OrderedDict``, whose pickled state (``_metadata`` of a module's state dict) is dropped."""

    def __setstate__(self, state: Any) -> None:
        pass


class _StorageKind(int):
    """A pickled storage class, as the bytes of one of its elements."""


class _Dtype(int):
    """A pickled ``torch.<dtype>``, as its element size."""


def _ints(values: Any) -> tuple[int, ...]:
    if not isinstance(values, tuple) or not all(type(v) is int for v in values):
        raise pickle.UnpicklingError(f"{values!r} is not a tuple of integers")
    return values


def _rebuild(storage: Any, offset: Any, sizes: Any, strides: Any, *rest: Any) -> Any:
    if not isinstance(storage, _Storage):
        return _Inert()
    dtype = next((r for r in rest if isinstance(r, _Dtype)), None)  # _rebuild_tensor_v3 names the dtype
    if type(offset) is not int or offset < 0 or len(_ints(sizes)) != len(_ints(strides)):
        raise pickle.UnpicklingError(f"tensor at offset {offset!r} with sizes {sizes!r}, strides {strides!r}")
    if min(sizes, default=0) < 0 or min(strides, default=0) < 0:
        raise pickle.UnpicklingError(f"negative sizes {list(sizes)} or strides {list(strides)}")
    return _Tensor(storage, offset, sizes, strides, int(dtype) if dtype else storage.itemsize)


def _parameter(data: Any, *rest: Any) -> Any:
    return data


class _StructureUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor_v3"):
            return _rebuild
        if module == "torch._utils" and name in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
            return _parameter
        if module == "collections" and name == "OrderedDict":
            return _Dict
        if module == "torch.storage" and name == "UntypedStorage":
            return _StorageKind(1)
        if module == "torch" and name.endswith("Storage") and name[: -len("Storage")] in _LEGACY:
            return _StorageKind(_LEGACY[name[: -len("Storage")]])
        if module == "torch" and name in _DTYPE_SIZES:
            return _Dtype(_DTYPE_SIZES[name])
        if module == "torch" and name.startswith("float8"):
            return _Dtype(1)
        return _Inert

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageKind):
            numel = pid[4]
            if type(numel) is not int or numel < 0:
                raise pickle.UnpicklingError(f"storage of {numel!r} elements")
            return _Storage(str(pid[2]), int(pid[1]), numel)
        return _Inert()


def _tensors(data: bytes, path: Path) -> list[tuple[str, _Tensor]]:
    """Every tensor the pickle rebuilds, by its dotted key path, without running anything it names."""
    try:
        root = load_restricted(_StructureUnpickler(PickleInput(data)), data)
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as err:
        raise CorruptFileError(f"cannot read data.pkl: {err}", path=path) from err
    except (RecursionError, MemoryError, OverflowError) as err:
        raise CorruptFileError(f"cannot read data.pkl: {type(err).__name__}", path=path) from err
    return list(_walk(root, ""))


def _walk(value: Any, name: str, depth: int = 0) -> Iterator[tuple[str, _Tensor]]:
    if isinstance(value, _Tensor):
        yield name or "<top level>", value
    elif depth < 64 and isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, f"{name}.{key}" if name else str(key), depth + 1)
    elif depth < 64 and isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _walk(item, f"{name}.{index}" if name else str(index), depth + 1)
