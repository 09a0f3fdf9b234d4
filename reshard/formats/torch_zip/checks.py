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

The pickle is read by the structure-only unpickler of :mod:`reshard.formats.torch_zip.structure`, which calls
nothing it names (every global is a stand-in: an inert placeholder, or a record of a tensor's storage, offset,
sizes and strides), so a hostile pickle runs no code here; ``torch.load`` with its own allow-list still decides
what may be rebuilt.
"""

from __future__ import annotations

import math
import os
import pickle
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from reshard.errors import CorruptFileError
from reshard.formats.torch_zip.structure import ZIP_MAGIC, TensorRecord, data_start, read_structure


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
                name: _data_start(handle.fileno(), info)
                for name, info in records.items()
                if name.startswith(f"{prefix}data/")
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
        extent = _extent(tensor)
        if extent > tensor.storage.numel:
            raise CorruptFileError(
                f"sizes {list(tensor.sizes)}, strides {list(tensor.strides)} at offset {tensor.offset} reach "
                f"element {extent} of a storage of {tensor.storage.numel}",
                path=path,
                tensor=name,
            )
    return prefix.rstrip("/")


def _data_start(fd: int, info: zipfile.ZipInfo) -> int:
    start = data_start(fd, info)
    if start is None:
        raise zipfile.BadZipFile(f"no local header for {info.filename}")
    return start


def _extent(tensor: TensorRecord) -> int:
    """Storage elements (of the storage's own unit) up to the tensor's last element."""
    if any(size == 0 for size in tensor.sizes):
        return 0
    last = tensor.offset + sum((size - 1) * stride for size, stride in zip(tensor.sizes, tensor.strides, strict=False))
    return math.ceil((last + 1) * tensor.itemsize / tensor.storage.itemsize)


def _tensors(data: bytes, path: Path) -> list[tuple[str, TensorRecord]]:
    """Every tensor the pickle rebuilds, by its dotted key path, without running anything it names."""
    try:
        tensors = list(_walk(read_structure(data), ""))
        for _, tensor in tensors:
            _check_geometry(tensor)
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as err:
        raise CorruptFileError(f"cannot read data.pkl: {err}", path=path) from err
    except (RecursionError, MemoryError, OverflowError) as err:
        raise CorruptFileError(f"cannot read data.pkl: {type(err).__name__}", path=path) from err
    return tensors


def _check_geometry(tensor: TensorRecord) -> None:
    offset, sizes, strides = tensor.offset, tensor.sizes, tensor.strides
    if offset < 0 or len(sizes) != len(strides):
        raise pickle.UnpicklingError(f"tensor at offset {offset!r} with sizes {sizes!r}, strides {strides!r}")
    if min(sizes, default=0) < 0 or min(strides, default=0) < 0:
        raise pickle.UnpicklingError(f"negative sizes {list(sizes)} or strides {list(strides)}")


def _walk(value: Any, name: str, depth: int = 0) -> Iterator[tuple[str, TensorRecord]]:
    if isinstance(value, TensorRecord):
        yield name or "<top level>", value
    elif depth < 64 and isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, f"{name}.{key}" if name else str(key), depth + 1)
    elif depth < 64 and isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _walk(item, f"{name}.{index}" if name else str(index), depth + 1)
