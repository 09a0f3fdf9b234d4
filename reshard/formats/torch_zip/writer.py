"""A streaming writer of ``torch.save``'s zip format: the pickle first, then tensors as they arrive.

``torch.save`` needs the whole object in memory. But its file is fixed by the object's structure and
its tensors' shapes and dtypes alone: the pickle refers to each storage by a key and a size, and every
record's offset follows from the sizes before it (:mod:`reshard.formats.torch_zip.layout`). So
:class:`TorchZipWriter` takes a *template*, the object with :class:`TensorSlot` placeholders where the
tensors go, pickles it, lays the file out, and then writes each tensor at its final offset when it
arrives: in any order, from several threads at once, with ``O_DIRECT`` where the file system allows; a tensor may
also come as byte ranges as the engine streams it (:meth:`TorchZipWriter.begin_parts`), whose CRC-32s are joined
(:mod:`reshard.formats.torch_zip.crc`), so no slice is ever whole in memory.
Nothing is spooled and no state dict is held. The file is byte for byte what
``torch.save(obj, path, pickle_module=...)`` writes for the real object whose tensors are contiguous
and have storages of their own (what a loader or a split hands over), so ``torch.load`` (with
``weights_only`` and ``mmap`` too), Megatron-LM and SwissArmyTransformer read it as they read
``torch.save`` files.
"""

from __future__ import annotations

import pickle
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

try:  # ISA-L's CRC-32, far faster than zlib's (measured: docs/performance.md): every record's CRC costs CPU time
    from isal.isal_zlib import crc32
except ImportError:  # a platform without its wheel: the same CRC, slower
    from zlib import crc32

from reshard.dtypes import code_of
from reshard.formats.safetensors.writer import byte_chunks
from reshard.formats.torch_zip import layout as zip_layout
from reshard.formats.torch_zip.crc import PartsCrc
from reshard.formats.torch_zip.layout import Record
from reshard.formats.torch_zip.template import DEFAULT_PROTOCOL, TensorSlot, pickle_template
from reshard.io.direct import Batch, DirectFile
from reshard.io.vectored import row_views

if TYPE_CHECKING:
    import torch

    from reshard.io.joined import Joined

__all__ = ["Region", "TensorSlot", "TorchZipWriter", "archive_name"]

FILE_FORMAT_VERSION = b"3\n"  # caffe2::serialize::kProducedFileFormatVersion, what torch.save's "version" says


def archive_name(path: Path) -> str:
    """The folder ``torch.save(obj, path)`` puts the records in: the file name up to its last dot, or
    ``archive`` when the path is not ASCII (torch then writes through a Python file object)."""
    text = str(path)
    if not text.isascii():
        return "archive"
    base = text.replace("\\", "/").rsplit("/", 1)[-1]
    stem = base.rsplit(".", 1)[0] if "." in base else base
    if not stem:
        raise ValueError(f"{path}: torch.save refuses this file name (nothing before its extension)")
    return stem


class Region:
    """The part of a shared :class:`~reshard.io.direct.DirectFile` from ``base`` on, where one archive goes (a DCP
    data file is ``torch.save`` archives back to back); its owner closes the file once every archive is done."""

    def __init__(self, file: DirectFile, base: int) -> None:
        self.file, self.base = file, base

    def write(self, views: list[memoryview], position: int) -> None:
        self.file.write(views, self.base + position)

    def close(self) -> None:
        """Nothing to do: the file is shared."""


def _options() -> tuple[int, bool]:
    """The storage alignment and whether CRCs are computed, as torch.save would in this process."""
    import torch  # noqa: F401 - first, as it waits for an import of torch under way on another thread
    from torch.utils.serialization import config  # which this alone would not: it would see a half-imported torch

    return int(config.save.storage_alignment), bool(config.save.compute_crc32)


def _storage_bytes(storage: torch.UntypedStorage) -> memoryview:
    """The bytes of a real tensor's storage (copied to the CPU first if it lives elsewhere)."""
    import torch

    if storage.device.type != "cpu":
        storage = storage.cpu()
    if not storage.nbytes():
        return memoryview(b"")
    return torch.empty(0, dtype=torch.uint8).set_(storage).numpy().data


class TorchZipWriter:
    """Writes the file ``torch.save`` would write for ``template`` with its slots filled, one tensor at a time.

    Everything but the slots' bytes (the pickle, the record headers, the storages of real tensors in the
    template) is written with the first tensor; each tensor then goes to its own offset with its CRC, from
    any thread; the last one writes the serialization id and the central directory and closes the file.
    :meth:`close` raises if a slot was never written, and removes the unfinished file.

    Args:
        path: the file to write (its name up to the last dot names the archive's folder, as in torch).
        template: the object to save, with a :class:`TensorSlot` wherever a tensor will be written.
        pickle_module: what ``torch.save`` would be given as ``pickle_module`` (its ``Pickler`` is used).
        pickle_protocol: as ``torch.save``'s.
        direct: write with ``O_DIRECT`` where the file system allows (:class:`~reshard.io.direct.DirectFile`).
        archive: the archive's folder name (default: from ``path``; ``archive`` is what ``torch.save`` names it
            when given a file object, as DCP does).
        region: write into this part of a shared file instead of creating ``path`` (which then only names the
            archive in messages); offsets inside the archive count from the region's start, as in torch's.

    Example:
        >>> from reshard.dtypes import TensorHeader
        >>> header = TensorHeader((2, 3), "F32")
        >>> writer = TorchZipWriter(Path("model.pt"), {"w": TensorSlot("w", header), "step": 7})
        >>> writer.write("w", torch.arange(6.0).view(2, 3))  # the file is complete here
        >>> torch.load("model.pt", weights_only=True)["w"].tolist()
        [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    """

    def __init__(
        self,
        path: Path,
        template: Any,
        *,
        pickle_module: ModuleType = pickle,
        pickle_protocol: int = DEFAULT_PROTOCOL,
        direct: bool = True,
        archive: str | None = None,
        region: Region | None = None,
        keep: bool = False,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        self.path = Path(path)
        self.direct = direct
        self._region = region
        self.keep = keep  # the file is complete already (a resumed run): it is left as it is, writes are dropped
        self._on_done = on_done  # called once the file is complete and closed
        pickled, storages = pickle_template(template, pickle_module=pickle_module, protocol=pickle_protocol)
        alignment, self._with_crc = _options()
        self._prefix = (archive or archive_name(self.path)).encode() + b"/"
        known: dict[str, Any] = {
            "data.pkl": pickled,
            ".format_version": b"1",
            ".storage_alignment": str(alignment).encode(),
            "byteorder": sys.byteorder.encode(),
        }
        sizes = {name: len(data) for name, data in known.items()}
        slots: dict[str, TensorSlot] = {}
        seen: set[str] = set()
        for key, storage in storages.items():
            name = f"data/{key}"
            if isinstance(storage, TensorSlot):
                if storage.key in seen:
                    raise ValueError(f"{self.path.name}: two slots of the template are written as {storage.key!r}")
                slots[name], sizes[name] = storage, storage.header.nbytes
                seen.add(storage.key)
            else:
                known[name] = _storage_bytes(storage)
                sizes[name] = len(known[name])
        known["version"], sizes["version"] = FILE_FORMAT_VERSION, len(FILE_FORMAT_VERSION)
        self._records = zip_layout.layout(self._prefix, list(sizes.items()), alignment)
        by_name = {record.name: record for record in self._records}
        self._slots = {slot.key: (slot, by_name[name]) for name, slot in slots.items()}
        self._id_record = zip_layout.local_record(
            self._prefix, zip_layout.SERIALIZATION_ID, 40, self._records[-1].end, alignment
        )
        self.size = self._id_record.end + zip_layout.directory_size(self._prefix, [*self._records, self._id_record])
        self._static = self._static_runs(known)
        self._written: set[str] = set()
        self._finished: set[str] = set()  # written in full, descriptor included
        self._parts: dict[str, PartsCrc] = {}  # slots coming as byte ranges: their CRC so far
        self._file: DirectFile | Region | None = None
        self._started = self._complete = self._aborted = False
        self._lock = threading.Lock()

    @property
    def keys(self) -> list[str]:
        """The keys of the slots, in the order their storages sit in the file."""
        return list(self._slots)

    @property
    def done(self) -> bool:
        """Whether the file is complete (and closed)."""
        return self._complete

    def _crc(self, data: Any, value: int = 0) -> int:
        return crc32(data, value) if self._with_crc else 0

    def _static_runs(self, known: dict[str, Any]) -> list[tuple[int, list[memoryview]]]:
        """Every byte known before the tensors, as runs of adjacent buffers: ``(offset, buffers)``."""
        runs: list[tuple[int, list[memoryview]]] = []
        end = -1
        for record in self._records:
            pieces = [record.header]
            if record.name in known:
                record.crc = self._crc(known[record.name])
                pieces += [known[record.name], record.descriptor()]
            if record.header_offset != end:
                runs.append((record.header_offset, []))
            runs[-1][1].extend(memoryview(piece).cast("B") for piece in pieces if len(piece))
            end = record.end if record.name in known else record.data_offset
        return runs

    def write(self, key: str, tensor: torch.Tensor | Joined) -> None:
        """Write the tensor of slot ``key`` at its offset; safe to call from several threads at once."""
        claimed = self._claim(key, tuple(tensor.shape), code_of(tensor.dtype))
        if claimed is None:
            return
        file, record = claimed
        self._end_slot(key, record, self._write_data(file, tensor, record.data_offset))

    def position(self, key: str) -> int | None:
        """Where slot ``key``'s bytes start in the file (None for a key it has no slot for)."""
        entry = self._slots.get(key)
        if entry is None:
            return None
        return entry[1].data_offset + (self._region.base if self._region is not None else 0)

    @property
    def takes_parts(self) -> bool:
        """A slot's bytes may come as byte ranges (:meth:`begin_parts`): their CRC-32s are joined at the end."""
        return True

    def begin_parts(self, key: str, shape: tuple[int, ...], code: str) -> None:
        """Announce that slot ``key``'s bytes come as ranges, by :meth:`write_part` (any order, one thread per
        slot), until :meth:`end_parts`; other slots may be written meanwhile, from other threads."""
        claimed = self._claim(key, shape, code)
        if claimed is not None:
            self._parts[key] = PartsCrc(claimed[1].size, self._crc)

    def write_part(self, key: str, views: Sequence[memoryview], start: int) -> None:
        """Write bytes ``[start, start + len)`` of slot ``key`` (begun by :meth:`begin_parts`), synchronously: the
        views may be reused once this returns."""
        if self.keep:
            return
        file = self._file
        assert file is not None  # started by begin_parts
        with Batch():
            file.write(list(views), self._slots[key][1].data_offset + start)
        self._parts[key].add(views, start)

    def end_parts(self, key: str) -> None:
        """Slot ``key``'s ranges are all written: its CRC-32 and descriptor go out."""
        if self.keep:
            return
        crc = self._parts.pop(key)
        try:
            value = crc.value()  # 0 when torch computes no CRCs: every part's is 0
        except ValueError as err:
            raise ValueError(f"{self.path.name}: {key}: {err}") from None
        self._end_slot(key, self._slots[key][1], value)

    def _claim(self, key: str, shape: tuple[int, ...], code: str) -> tuple[DirectFile | Region, Record] | None:
        """Check slot ``key`` against its announced header and mark it written; its open file and record (None
        when the file is kept as it is)."""
        entry = self._slots.get(key)
        if entry is None:
            raise ValueError(f"{self.path.name}: tensor {key!r} is not a slot of the template")
        slot, record = entry
        if shape != slot.header.shape or code != slot.header.code:
            raise ValueError(
                f"{self.path.name}: {key}: announced {slot.header.shape} {slot.header.code}, got {shape} {code}"
            )
        with self._lock:
            if key in self._written:
                raise ValueError(f"{self.path.name}: tensor {key!r} written twice")
            if self._complete or self._aborted:
                raise ValueError(f"{self.path.name}: the file is already closed")
            self._written.add(key)
            if self.keep:
                return None
            if not self._started:
                self._start()
            file = self._file
        assert file is not None  # started above, and finished only once every slot is written
        return file, record

    def _end_slot(self, key: str, record: Record, crc: int) -> None:
        """Slot ``key``'s bytes are written: its descriptor goes out with ``crc``; the file is finished after the
        last slot."""
        record.crc = crc
        file = self._file
        assert file is not None  # finished only once every slot is written
        if record.size:
            file.write([memoryview(record.descriptor())], record.data_offset + record.size)
        with self._lock:
            self._finished.add(key)
            if len(self._finished) == len(self._slots):
                self._finish()

    write_unordered = write  # any order is the only order: what RankFilesWriter calls from worker threads

    def _write_data(self, file: DirectFile | Region, tensor: torch.Tensor | Joined, position: int) -> int:
        """Write the tensor's bytes in C order from ``position``; their CRC-32 (computed while they go out)."""
        crc = 0
        rows = row_views(tensor)
        if rows is not None:
            file.write(rows, position)
            for row in rows:
                crc = self._crc(row, crc)
            return crc
        in_file = position + (file.base if isinstance(file, Region) else 0)
        for chunk in byte_chunks(tensor, position=in_file):  # contiguous copies of blocks with short rows
            with Batch():  # written before the next block is copied into the same buffer
                file.write([chunk], position)
                crc = self._crc(chunk, crc)
            position += len(chunk)
        return crc

    def _start(self) -> None:
        self._started = True
        self._file = file = self._region or DirectFile(self.path, self.size, direct=self.direct)
        for offset, views in self._static:
            file.write(views, offset)
        self._static = []

    def _finish(self) -> None:
        """Write the serialization id and the central directory, and close the file."""
        record = self._id_record
        text = zip_layout.serialization_id(self._records).encode()
        record.crc = self._crc(text)
        directory = zip_layout.directory(self._prefix, [*self._records, record])
        tail = record.header + text + record.descriptor() + directory
        file = self._file
        assert file is not None  # started by the first write, finished once
        file.write([memoryview(tail)], record.header_offset)
        file.close()
        self._file = None
        self._complete = True
        if self._on_done is not None:
            self._on_done()

    def close(self) -> None:
        """Finish the file; if a slot was never written, remove it and raise ``ValueError`` naming the missing."""
        with self._lock:
            if self._complete or self.keep:
                return
            missing = [key for key in self._slots if key not in self._finished]
            if missing:
                self._abort()
                named = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                raise ValueError(f"{self.path}: closed before every tensor was written (missing: {named})")
            if not self._started:
                self._start()
            self._finish()

    def abort(self) -> None:
        """Stop here and remove the file, if it was started."""
        with self._lock:
            self._abort()

    def _abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._started and not self._complete and self._region is None:
            self.path.unlink(missing_ok=True)
        self._aborted = True
