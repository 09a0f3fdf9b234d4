"""A streaming safetensors writer: the header is computed up front, tensors are written one at a time.

The files are byte-for-byte what ``safetensors.torch.save_file`` writes for the same tensors and
metadata (same tensor order, header JSON and padding), so ``safe_open`` and every loader read them,
but the writer never holds more than the tensor being written.
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from huggingface_hub import split_state_dict_into_shards_factory
from huggingface_hub.constants import SAFETENSORS_INDEX_FILE, SAFETENSORS_WEIGHTS_FILE_PATTERN

from reshard.dtypes import code_of, safetensors_order
from reshard.io.direct import Batch, DirectFile
from reshard.io.joined import Joined
from reshard.io.scratch import scratch
from reshard.io.vectored import row_views

if TYPE_CHECKING:
    import torch

    from reshard.dtypes import TensorHeader

FORMAT_METADATA = {"format": "pt"}
# A non-contiguous tensor (a column block of a row-parallel weight) is written through contiguous
# copies of at most this many bytes, so writing it never needs a second full-size buffer.
CHUNK_BYTES = 16 << 20


def ordered(headers: Mapping[str, TensorHeader]) -> list[str]:
    """Names in the order ``save_file`` lays them out (dtype, largest first; then name)."""
    return sorted(headers, key=lambda name: safetensors_order(name, headers[name].code))


def header_bytes(headers: Mapping[str, TensorHeader], metadata: Mapping[str, str] | None) -> bytes:
    """The 8-byte length plus the JSON header, padded with spaces to a multiple of 8, as safetensors does."""
    entries: dict[str, object] = {}
    if metadata:
        entries["__metadata__"] = dict(metadata)
    offset = 0
    for name in ordered(headers):
        header = headers[name]
        entries[name] = {
            "dtype": header.code,
            "shape": list(header.shape),
            "data_offsets": [offset, offset + header.nbytes],
        }
        offset += header.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in C order, without a copy when it is already contiguous."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")


def byte_chunks(tensor: torch.Tensor | Joined, limit: int = CHUNK_BYTES, *, position: int = 0) -> Iterator[memoryview]:
    """The tensor's bytes in C order as a sequence of buffers: the tensor's own memory when it is
    contiguous, else blocks along dim 0 of at most ``limit`` bytes (or one row) copied into this thread's
    :func:`~reshard.io.scratch.scratch` buffer, each valid only until the next one is asked for. A copy
    is put on the 4 KB phase of the file offset it is written to, the tensor's bytes starting at
    ``position``, so that it is written in place (:class:`~reshard.io.direct.DirectFile`)."""
    if isinstance(tensor, Joined):
        for part in tensor.parts:
            yield from byte_chunks(part, limit, position=position)
            position += part.numel() * part.element_size()
        return
    if tensor.numel() == 0:
        return
    if tensor.is_contiguous() or tensor.dim() <= 1:
        yield tensor_bytes(tensor)
        return
    row = tensor[0].numel() * tensor.element_size()
    if row > limit:
        for index in range(tensor.shape[0]):
            yield from byte_chunks(tensor[index], limit, position=position + index * row)
        return
    step = max(1, limit // row)
    for start in range(0, tensor.shape[0], step):
        block = tensor.narrow(0, start, min(step, tensor.shape[0] - start))
        with scratch(block, phase=position + start * row) as copy:
            copy.copy_(block)
            yield tensor_bytes(copy)


# For a data file: whether a resumed run keeps it as it is, and what to call once it is complete (if anything).
FileHooks = Callable[[Path], tuple[bool, Callable[[], None] | None]]


@dataclass
class SafetensorsFileWriter:
    """Writes one safetensors file whose tensors are known in advance, one tensor at a time.

    Every tensor's place in the file follows from the headers, so each is written at its own offset.
    :meth:`write` takes tensors in :func:`ordered` order; :meth:`write_unordered` takes them in any
    order and from several threads at once. The file is complete when the last one is written
    (:attr:`done`). Bytes go to the disk with ``O_DIRECT`` where the file system allows
    (:class:`~reshard.io.direct.DirectFile`), unless ``direct`` is False (a file read back soon).
    """

    path: Path
    headers: Mapping[str, TensorHeader]
    metadata: Mapping[str, str] | None = field(default_factory=lambda: dict(FORMAT_METADATA))
    direct: bool = True
    keep: bool = False  # the file is complete already (a resumed run): it is left as it is, writes are dropped
    on_done: Callable[[], None] | None = None  # called once the file is complete and closed
    _order: list[str] = field(init=False)
    _offsets: dict[str, int] = field(init=False)
    _size: int = field(init=False)
    _written: set[str] = field(init=False, default_factory=set)
    _finished: int = field(init=False, default=0)
    _file: DirectFile | None = field(init=False, default=None, repr=False)
    _started: bool = field(init=False, default=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self._order = ordered(self.headers)
        self._header = header_bytes(self.headers, self.metadata)
        self._offsets, offset = {}, len(self._header)
        for name in self._order:
            self._offsets[name] = offset
            offset += self.headers[name].nbytes
        self._size = offset

    @property
    def done(self) -> bool:
        return self.keep or self._finished == len(self._order)

    def position(self, name: str) -> int | None:
        """Where ``name``'s bytes start in the file (None for a tensor the file does not hold)."""
        return self._offsets.get(name)

    def write(self, name: str, tensor: torch.Tensor | Joined) -> None:
        """Write the next tensor in :func:`ordered` order."""
        with self._lock:
            expected = self._order[len(self._written)] if len(self._written) < len(self._order) else None
        if name != expected:
            raise ValueError(f"{self.path.name}: expected tensor {expected!r} next, got {name!r}")
        self.write_unordered(name, tensor)

    def write_unordered(self, name: str, tensor: torch.Tensor | Joined) -> None:
        """Write one announced tensor at its offset; safe to call from several threads at once."""
        file = self._claim(name, tuple(tensor.shape), code_of(tensor.dtype))
        if file is None:
            return
        position = self._offsets[name]
        rows = row_views(tensor)
        if rows is not None:
            file.write(rows, position)
        else:
            for chunk in byte_chunks(tensor, position=position):  # contiguous copies of blocks with short rows
                with Batch():  # written before the next block is copied into the same buffer
                    file.write([chunk], position)
                position += len(chunk)
        self._finish()

    def begin_parts(self, name: str, shape: tuple[int, ...], code: str) -> None:
        """Announce that tensor ``name``'s bytes (of dtype ``code``) come in parts, by :meth:`write_part` (any order,
        one thread per tensor), until :meth:`end_parts`; other tensors may be written meanwhile, from other threads."""
        self._claim(name, shape, code)

    def write_part(self, name: str, views: Sequence[memoryview], start: int) -> None:
        """Write bytes ``[start, start + len)`` of tensor ``name`` (begun by :meth:`begin_parts`), synchronously:
        the views may be reused once this returns."""
        if self.keep:
            return
        file = self._file
        assert file is not None  # opened by begin_parts
        with Batch():
            file.write(views, self._offsets[name] + start)

    def end_parts(self, name: str) -> None:
        """Tensor ``name``'s parts are all written."""
        if not self.keep:
            self._finish()

    def _claim(self, name: str, shape: tuple[int, ...], code: str) -> DirectFile | None:
        """Check tensor ``name`` against its announced header and mark it written; the open file to write it
        into (None when the file is kept as it is)."""
        header = self.headers.get(name)
        if header is None:
            raise ValueError(f"{self.path.name}: tensor {name!r} was not announced")
        if shape != header.shape or code != header.code:
            raise ValueError(f"{self.path.name}: {name}: announced {header.shape} {header.code}, got {shape} {code}")
        with self._lock:
            if name in self._written:
                raise ValueError(f"{self.path.name}: tensor {name!r} written twice")
            self._written.add(name)
            if self.keep:
                return None
            if not self._started:
                self._start()
            return self._file

    def _finish(self) -> None:
        """One tensor more is complete; the file is closed after its last."""
        with self._lock:
            self._finished += 1
            if self.done:
                self._close()

    def _start(self) -> None:
        self._file = DirectFile(self.path, self._size, direct=self.direct)
        self._started = True  # only once the file exists: a failed open is raised again by the next writer
        self._file.write([memoryview(self._header)], 0)

    def close(self) -> None:
        """Close the file; a file announced with no tensors is written (header only) here."""
        with self._lock:
            if self.keep:
                return
            if not self._started:
                self._start()
            self._close()

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            if self.on_done is not None:
                self.on_done()


@dataclass(frozen=True)
class ShardPlan:
    """How one folder's tensors are split into safetensors files: huggingface_hub's ``StateDictSplit`` as plain data.

    Attributes:
        files: each file's name and the tensors it holds (in the file, tensors sit in :func:`ordered` order).
        metadata: the index's ``metadata`` (``total_size``) when the folder is sharded; None for one unindexed file.
    """

    files: Mapping[str, tuple[str, ...]]
    metadata: Mapping[str, object] | None = None

    @property
    def index(self) -> dict[str, object] | None:
        """``model.safetensors.index.json``'s content, when the folder is sharded."""
        if self.metadata is None:
            return None
        weight_map = {name: filename for filename, names in self.files.items() for name in names}
        return {"metadata": dict(self.metadata), "weight_map": dict(sorted(weight_map.items()))}

    @property
    def filenames(self) -> list[str]:
        """Every file the folder gets: the shards, then the index when there is one."""
        return list(self.files) + ([SAFETENSORS_INDEX_FILE] if self.metadata is not None else [])


def plan_shards(
    headers: Mapping[str, TensorHeader],
    *,
    max_shard_size: int | str = "5GB",
    filename_pattern: str = SAFETENSORS_WEIGHTS_FILE_PATTERN,
) -> ShardPlan:
    """Split ``headers`` into files with ``huggingface_hub.split_state_dict_into_shards_factory`` (greedy in the
    :func:`ordered` order; a tensor larger than ``max_shard_size`` gets a file of its own). Pure: no torch, no disk.

    Example:
        >>> from reshard.dtypes import TensorHeader
        >>> plan = plan_shards({"a": TensorHeader((64,), "F32"), "b": TensorHeader((64,), "F32")}, max_shard_size=300)
        >>> dict(plan.files)
        {'model-00001-of-00002.safetensors': ('a',), 'model-00002-of-00002.safetensors': ('b',)}
    """
    in_order = {name: headers[name] for name in ordered(headers)}
    split = split_state_dict_into_shards_factory(
        in_order,
        get_storage_size=lambda header: header.nbytes,
        filename_pattern=filename_pattern,
        max_shard_size=max_shard_size,
    )
    files = {filename: tuple(names) for filename, names in split.filename_to_tensors.items()}
    if not headers:  # an empty state dict still gets its (empty) file
        files[filename_pattern.format(suffix="")] = ()
    return ShardPlan(files, dict(split.metadata) if split.is_sharded else None)


@dataclass
class ShardedSafetensorsWriter:
    """Writes one Hugging Face folder of safetensors shards (``model-0000i-of-0000n.safetensors`` and
    ``model.safetensors.index.json``, or a single ``model.safetensors``) as :func:`plan_shards` planned it."""

    folder: Path
    headers: Mapping[str, TensorHeader]
    shards: ShardPlan
    hooks: FileHooks | None = None  # per file: whether it is kept as it is, and whom to tell once it is complete
    _files: dict[str, SafetensorsFileWriter] = field(init=False, default_factory=dict)
    _file_of: dict[str, str] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        for filename, names in self.shards.files.items():
            self._files[filename] = self._file(filename, {n: self.headers[n] for n in names})
            self._file_of.update(dict.fromkeys(names, filename))

    def _file(self, filename: str, headers: Mapping[str, TensorHeader]) -> SafetensorsFileWriter:
        path = self.folder / filename
        keep, on_done = self.hooks(path) if self.hooks is not None else (False, None)
        return SafetensorsFileWriter(path, headers, keep=keep, on_done=on_done)

    @property
    def filenames(self) -> list[str]:
        return self.shards.filenames

    def write(self, name: str, tensor: torch.Tensor | Joined) -> None:
        self._files[self._file_of[name]].write(name, tensor)

    def write_unordered(self, name: str, tensor: torch.Tensor | Joined) -> None:
        """:meth:`SafetensorsFileWriter.write_unordered` into the shard that holds ``name``."""
        self._files[self._file_of[name]].write_unordered(name, tensor)

    def position(self, name: str) -> int | None:
        """Where ``name``'s bytes start in the shard that holds it (None for a tensor no shard holds)."""
        filename = self._file_of.get(name)
        return None if filename is None else self._files[filename].position(name)

    def begin_parts(self, name: str, shape: tuple[int, ...], code: str) -> None:
        """:meth:`SafetensorsFileWriter.begin_parts` in the shard that holds ``name``."""
        self._files[self._file_of[name]].begin_parts(name, shape, code)

    def write_part(self, name: str, views: Sequence[memoryview], start: int) -> None:
        """:meth:`SafetensorsFileWriter.write_part` into the shard that holds ``name``."""
        self._files[self._file_of[name]].write_part(name, views, start)

    def end_parts(self, name: str) -> None:
        self._files[self._file_of[name]].end_parts(name)

    def close(self, *, index: bool = True) -> None:
        """Finish every file (refusing if a tensor is missing) and write the index when sharded (and ``index``)."""
        missing = [f for f, w in self._files.items() if not w.done]
        if missing:
            raise ValueError(f"{self.folder}: files not complete: {missing}")
        for writer in self._files.values():
            writer.close()
        content = self.shards.index
        if content is not None and index:
            (self.folder / SAFETENSORS_INDEX_FILE).write_text(json.dumps(content, indent=2) + "\n")
