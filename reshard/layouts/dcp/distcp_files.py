"""The data files of a DCP checkpoint written without ``torch.distributed``, for the writers of both layouts in DCP's
storage (``torch_dist``, ``dcp``).

``dcp.save`` (``FileSystemWriter``, reference notes ``dcp-torchdist-deepspeed.md`` 1.1-1.3) writes every chunk of
a tensor and every non-tensor value as a whole ``torch.save`` archive, back to back in ``__{rank}_{n}.distcp``,
and indexes them in ``.metadata``. An archive's size follows from its tensor's shape and dtype alone (or its
value), so every archive is placed up front (:func:`place_archives`, split at ``--max-shard-size``); the values
are written when the files open, and each chunk at its place as its tensor arrives, from any thread
(:class:`ArchiveFiles`), with memory for one chunk. ``.metadata`` comes last (:func:`metadata`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from huggingface_hub import split_state_dict_into_shards_factory

from reshard.dtypes import TensorHeader, name_of
from reshard.formats.dcp_metadata import write as dcp
from reshard.formats.safetensors.writer import FileHooks
from reshard.formats.torch_zip.writer import Region, TensorSlot, TorchZipWriter
from reshard.io.direct import DirectFile
from reshard.io.joined import Joined

if TYPE_CHECKING:
    import torch

METADATA = ".metadata"
ARCHIVE = "archive"  # the folder torch.save names inside an archive written to a file object, as DCP writes

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Chunk:
    """One incoming tensor (``name``) as a box of its global tensor."""

    name: str
    offsets: Shape
    sizes: Shape


@dataclass
class GlobalTensor:
    """A tensor of the output: its key, dtype code, global shape and the chunks it is written in."""

    key: str
    code: str
    shape: Shape
    axes: Shape = ()  # the stacked axes (layers, experts) at the front of ``shape``
    chunks: list[Chunk] = field(default_factory=list)


@dataclass(frozen=True)
class Archives:
    """Where every archive of the output sits.

    Attributes:
        names: the data files, ``__0_0.distcp`` ...
        sizes: each data file's size in bytes.
        where: each archive's key -> (data file index, position, length).
        chunks: each incoming tensor name -> (its chunk's archive key, the chunk's header).
    """

    names: tuple[str, ...] = ()
    sizes: tuple[int, ...] = ()
    where: Mapping[str, tuple[int, int, int]] = field(default_factory=dict)
    chunks: Mapping[str, tuple[str, TensorHeader]] = field(default_factory=dict)

    def files(self, folder: str, *, written_by_writer: frozenset[str] = frozenset()) -> dict[str, frozenset[str]]:
        """Each data file (under ``folder``, relative to the output) -> the incoming tensors it holds; chunks the
        writer fills itself (``written_by_writer``) are not incoming."""
        held: list[set[str]] = [set() for _ in self.names]
        for name, (key, _) in self.chunks.items():
            if name not in written_by_writer:
                held[self.where[key][0]].add(name)
        prefix = f"{folder}/" if folder else ""
        return {f"{prefix}{name}": frozenset(tensors) for name, tensors in zip(self.names, held, strict=True)}


def one_slice(name: str, slices: Sequence[torch.Tensor | Joined]) -> torch.Tensor:
    """The one slice of tensor ``name`` a writer of global tensors receives (the plan is at tp 1)."""
    (tensor,) = slices
    if isinstance(tensor, Joined):  # only a slice of a tensor split over ranks is its parts
        raise TypeError(f"{name}: a tp 1 slice is one tensor, not {len(tensor.parts)} parts")
    return tensor


def chunk_key(tensor: GlobalTensor, chunk: Chunk) -> str:
    return f"{tensor.key}@{chunk.offsets}"


def place_archives(tensors: Sequence[GlobalTensor], objects: Mapping[str, Any], max_shard_size: int | str) -> Archives:
    """Place every archive (the objects', then each chunk's) in the data files, split at ``max_shard_size``.

    A chunk's archive depends on its shape and dtype alone, so its size is known from one archive per distinct
    header; the archive itself is made when its tensor arrives (nothing per chunk is held).
    """
    sizes = {key: TorchZipWriter(Path(key), value, archive=ARCHIVE).size for key, value in objects.items()}
    chunks: dict[str, tuple[str, TensorHeader]] = {}
    for tensor in tensors:
        for chunk in tensor.chunks:
            key, header = chunk_key(tensor, chunk), TensorHeader(chunk.sizes, tensor.code)
            chunks[chunk.name] = (key, header)
            sizes[key] = _archive_size(header)
    split = split_state_dict_into_shards_factory(
        sizes, get_storage_size=lambda size: size, max_shard_size=max_shard_size, filename_pattern="{suffix}"
    )
    names = tuple(f"__0_{i}.distcp" for i in range(len(split.filename_to_tensors)))
    ends = [0] * len(names)
    where: dict[str, tuple[int, int, int]] = {}
    for index, keys in enumerate(split.filename_to_tensors.values()):
        for key in keys:
            where[key], ends[index] = (index, ends[index], sizes[key]), ends[index] + sizes[key]
    return Archives(names, tuple(ends), where, chunks)


def metadata(
    tensors: Sequence[GlobalTensor],
    objects: Mapping[str, Any],
    archives: Archives,
    *,
    planner_data: Mapping[str, tuple[str | int, ...]] | None = None,
) -> dcp.Metadata:
    """The ``.metadata`` of the output: every tensor's chunks and every object where :func:`place_archives` put
    them, and the key paths ``dcp.save``'s planner records, when given."""

    def place(key: str) -> tuple[str, int, int]:
        index, position, length = archives.where[key]
        return archives.names[index], position, length

    entries = []
    for tensor in tensors:
        chunks = [dcp.StoredChunk(c.offsets, c.sizes, *place(chunk_key(tensor, c))) for c in tensor.chunks]
        entries.append((tensor.key, name_of(tensor.code), tensor.shape, chunks))
    return dcp.build_metadata(entries, [(key, *place(key)) for key in objects], planner_data=planner_data)


class ArchiveFiles:
    """The data files of :class:`Archives` being written: opened (a file a resumed run kept is left as it is), the
    objects written at once, each chunk's archive at its place when its tensor arrives, from any thread; a file
    whose archives are all written is closed and announced to its hook."""

    def __init__(self, folder: Path, archives: Archives, objects: Mapping[str, Any], hooks: FileHooks) -> None:
        self.folder, self.archives = folder, archives
        folder.mkdir(parents=True, exist_ok=True)
        opened = [hooks(folder / name) for name in archives.names]
        self.kept = [keep for keep, _ in opened]
        self._on_done = [on_done for _, on_done in opened]
        self._files: list[DirectFile | None] = [
            None if keep else DirectFile(folder / name, end)
            for name, end, keep in zip(archives.names, archives.sizes, self.kept, strict=True)
        ]
        self._left: list[set[str]] = [set() for _ in archives.names]  # per file, the archives still to write
        for key, (index, _, _) in archives.where.items():
            self._left[index].add(key)
        self._written: set[str] = set()
        self._lock = threading.Lock()
        for key, value in objects.items():  # known already: written now
            region = self._region(key)
            if region is not None:
                TorchZipWriter(folder / key, value, archive=ARCHIVE, region=region).close()
            self._landed(key)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write incoming tensor ``name`` as its chunk's archive (unit dims it lacks in front are added as views)."""
        key, header = self.archives.chunks[name]
        with self._lock:
            if name in self._written:
                raise ValueError(f"{name}: written twice")
            self._written.add(name)
        region = self._region(key)
        if region is not None:
            while tensor.dim() < len(header.shape):  # the stacked axes: views, never copies
                tensor = tensor.unsqueeze(0)
            archive = TorchZipWriter(self.folder / key, TensorSlot(name, header), archive=ARCHIVE, region=region)
            archive.write(name, tensor)  # its only tensor: the archive is complete
        self._landed(key)

    def missing(self) -> list[str]:
        """The incoming tensors not written, but in a file a resumed run kept."""
        chunks, where = self.archives.chunks, self.archives.where
        return [
            name for name, (key, _) in chunks.items() if name not in self._written and not self.kept[where[key][0]]
        ]

    def close(self) -> None:
        """Close the files without archives (none are planned so)."""
        for file in self._files:
            if file is not None:
                file.close()

    def _region(self, key: str) -> Region | None:
        """Where archive ``key`` goes in its data file; None when that file is kept as it is (a resumed run)."""
        index, position, _ = self.archives.where[key]
        file = self._files[index]
        return None if file is None else Region(file, position)

    def _landed(self, key: str) -> None:
        """Count an archive as written; a data file whose archives are all written is closed and announced."""
        index = self.archives.where[key][0]
        with self._lock:
            left = self._left[index]
            left.discard(key)
            file = self._files[index] if not left else None
            if file is not None:
                self._files[index] = None
        if file is not None:
            file.close()
            on_done = self._on_done[index]
            if on_done is not None:
                on_done()


@functools.lru_cache(maxsize=1024)
def _archive_size(header: TensorHeader) -> int:
    """The bytes ``torch.save`` writes for one contiguous tensor of ``header`` to a file object."""
    return TorchZipWriter(Path(ARCHIVE), TensorSlot("t", header), archive=ARCHIVE).size
