"""The index of a PyTorch Distributed Checkpoint: every entry, its global shape and its stored chunk boxes.

Three forms are read (reference notes ``dcp-torchdist-deepspeed.md`` 1.1-1.5):

* ``.metadata`` (a pickle, read by :mod:`reshard.formats.dcp_metadata.pickled`) + ``__{rank}_{n}.distcp`` data files;
* ``__{rank}.metadata``, one per rank (``dcp.save(..., use_collectives=False)``): merged here, a box
  stored by several ranks (a replicated tensor) is read from the lowest rank;
* no metadata at all: ``shard-{rank}-model-{i}-of-{n}.safetensors`` (``HuggingFaceStorageWriter`` with
  ``save_distributed=True``), each file's ``DCP_SHARDING_INFO`` giving its chunks' offsets.

The index only says what the files claim; :mod:`reshard.layouts.dcp.dcp_checks` checks it before any byte is read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from reshard.dtypes import code_from_name, name_of
from reshard.errors import CorruptFileError, MissingRankError, shown
from reshard.formats.boxes import Box, Shape
from reshard.formats.chunks import safetensors_entries
from reshard.formats.dcp_metadata import pickled as pk
from reshard.ranks import rank_count

METADATA = ".metadata"
RANK_METADATA = re.compile(r"^__(\d+)\.metadata$")
HF_SHARD = re.compile(r"^shard-(\d{5})-model-(\d{5})-of-(\d{5})\.safetensors$")
SHARDING_INFO = "DCP_SHARDING_INFO"
INT64 = 2**63  # torch sizes, offsets and byte counts are int64
MAX_DIMS = 64  # torch's own limit on a tensor's dimensions


@dataclass(frozen=True)
class StoredChunk:
    """One stored box: its record is ``length`` bytes at ``position`` of ``file`` (a whole ``torch.save``
    archive, or a safetensors blob). ``data`` is where its raw C-ordered bytes start, when a header says so."""

    box: Box
    file: Path
    position: int
    length: int
    transforms: tuple[str, ...] = ()
    data: int | None = None


@dataclass(frozen=True)
class StoredTensor:
    """A global tensor as the checkpoint declares it: shape, dtype name, chunks; ``declared_in`` is the metadata
    file (the folder, for the metadata-less form)."""

    name: str
    shape: Shape
    dtype: str
    chunks: tuple[StoredChunk, ...]
    declared_in: Path

    @property
    def code(self) -> str | None:
        """The safetensors dtype code, None for dtypes reshard cannot hold."""
        return code_from_name(self.dtype)

    @property
    def stored_bytes(self) -> int:
        return sum(chunk.length for chunk in self.chunks)


@dataclass(frozen=True)
class StoredValue:
    """A non-tensor entry (DCP's BYTE_IO: the ``torch.save`` archive of a pickled object): ``length`` bytes at
    ``position`` of ``file``, as the metadata claims them."""

    file: Path
    position: int
    length: int
    transforms: tuple[str, ...] = ()


@dataclass
class DcpIndex:
    """Every entry of one checkpoint folder.

    Attributes:
        form: which of the three forms it was read from.
        tensors: ``fqn -> StoredTensor``.
        values: non-tensor entries, ``fqn -> bytes stored``.
        stored_values: where each non-tensor entry's bytes are, when the metadata says (the lowest rank's).
        paths: the planner's key path of each flattened fqn (``('model', 'layers.0.w')``), where recorded.
        notes: facts found while reading (merged ranks, replicas).
    """

    folder: Path
    form: str
    tensors: dict[str, StoredTensor] = field(default_factory=dict)
    values: dict[str, int] = field(default_factory=dict)
    stored_values: dict[str, StoredValue] = field(default_factory=dict)
    paths: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def is_dcp_folder(folder: Path) -> bool:
    """True for a folder with ``.metadata``, ``__{r}.metadata`` or ``shard-*-model-*.safetensors`` files."""
    if not folder.is_dir():
        return False
    if (folder / METADATA).is_file():
        return True
    return any(RANK_METADATA.match(p.name) or HF_SHARD.match(p.name) for p in folder.iterdir())


def read_index(folder: Path, *, trust_pickle: bool = False) -> DcpIndex:
    """Read the index of a DCP folder in whichever form it is.

    Raises:
        UnsafePickleError: a metadata file pickles a class outside the DCP allow-list.
        CorruptFileError: a metadata file or safetensors header that cannot be made sense of.
        MissingRankError: a rank's metadata file is missing between others.
    """
    if (folder / METADATA).is_file():
        index = DcpIndex(folder, "dcp")
        _merge(index, folder / METADATA, pk.load_metadata(folder / METADATA, trust_pickle=trust_pickle))
        return index
    ranks = {int(m.group(1)): p for p in folder.iterdir() if (m := RANK_METADATA.match(p.name))}
    if ranks:
        tp, absent = rank_count(ranks, path=folder, name=lambda r: ranks[r].name)
        if absent:
            raise MissingRankError(
                f"per-rank metadata __{absent[0]}.metadata is missing (found {len(ranks)} of {tp})",
                path=folder,
            )
        index = DcpIndex(folder, f"dcp, per-rank metadata of {len(ranks)} ranks (use_collectives=False)")
        replicas = sum(
            _merge(index, ranks[r], pk.load_metadata(ranks[r], trust_pickle=trust_pickle)) for r in sorted(ranks)
        )
        if replicas:
            index.notes.append(
                f"{replicas} chunk box(es) stored by several ranks (replicated tensors): the lowest rank's is read"
            )
        return index
    return _read_hf_shards(folder)


def _merge(index: DcpIndex, path: Path, metadata: Any) -> int:
    """Add one metadata file's entries to ``index``; returns how many boxes were already there (replicas)."""
    if not isinstance(metadata, pk.Metadata):
        raise CorruptFileError(f"holds a {type(metadata).__name__}, not DCP Metadata", path=path)
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise CorruptFileError("state_dict_metadata or storage_data is not a dict", path=path)
    where = _storage_map(path, storage, index.folder)
    if isinstance(metadata.planner_data, dict):
        for fqn, key_path in metadata.planner_data.items():
            if isinstance(fqn, str) and isinstance(key_path, tuple):
                index.paths.setdefault(fqn, key_path)
    replicas = 0
    for fqn, entry in entries.items():
        if not isinstance(fqn, str):
            raise CorruptFileError(f"an entry is named by a {type(fqn).__name__}, not a string", path=path)
        if isinstance(entry, pk.BytesStorageMetadata):
            info = where.get((fqn, None))
            if fqn not in index.values:
                index.values[fqn] = info.length if info else 0
                if info is not None:
                    index.stored_values[fqn] = StoredValue(info.file, info.offset, info.length, info.transforms)
            continue
        if not isinstance(entry, pk.TensorStorageMetadata):
            raise CorruptFileError(f"unknown storage metadata {type(entry).__name__}", path=path, tensor=fqn)
        tensor = _tensor(path, fqn, entry, where)
        known = index.tensors.get(fqn)
        if known is None:
            index.tensors[fqn] = tensor
            continue
        if (known.shape, known.dtype) != (tensor.shape, tensor.dtype):
            raise CorruptFileError(
                f"declared {tensor.dtype} {list(tensor.shape)} here, {known.dtype} {list(known.shape)} in "
                f"{known.declared_in.name}",
                path=path,
                tensor=fqn,
            )
        boxes = {chunk.box for chunk in known.chunks}
        new = tuple(chunk for chunk in tensor.chunks if chunk.box not in boxes)
        replicas += len(tensor.chunks) - len(new)
        index.tensors[fqn] = StoredTensor(fqn, known.shape, known.dtype, known.chunks + new, known.declared_in)
    return replicas


@dataclass(frozen=True)
class _Location:
    file: Path
    offset: int
    length: int
    transforms: tuple[str, ...]


def _storage_map(path: Path, storage: dict[Any, Any], folder: Path) -> dict[tuple[str, Shape | None], _Location]:
    """``(fqn, chunk offsets or None) -> where its bytes are``; file names are untrusted (plain names only)."""
    where: dict[tuple[str, Shape | None], _Location] = {}
    for key, info in storage.items():
        fqn = getattr(key, "fqn", None)
        if not isinstance(key, pk.MetadataIndex) or not isinstance(fqn, str):
            raise CorruptFileError(f"storage_data has a key of type {type(key).__name__}", path=path)
        offsets = None if key.offset is None else _ints(key.offset, path, fqn, "storage offset")
        if not isinstance(info, pk.StorageInfo):
            raise CorruptFileError(f"storage entry of type {type(info).__name__}", path=path, tensor=fqn)
        name, offset, length = info.relative_path, info.offset, info.length
        pure = PurePosixPath(name) if isinstance(name, str) else None
        if pure is None or len(pure.parts) != 1 or pure.name in ("", ".", "..") or "\\" in name:
            raise CorruptFileError(f"storage entry names an unsafe file {shown(name)}", path=path, tensor=fqn)
        if not (_is_int(offset) and _is_int(length) and 0 <= offset < INT64 and 0 <= length < INT64):
            raise CorruptFileError(
                f"storage entry has bytes at {shown(offset)}, length {shown(length)}", path=path, tensor=fqn
            )
        transforms = info.transform_descriptors or ()
        if not isinstance(transforms, (list, tuple)) or not all(isinstance(t, str) for t in transforms):
            raise CorruptFileError("malformed transform_descriptors", path=path, tensor=fqn)
        if (fqn, offsets) in where:
            raise CorruptFileError(
                f"two storage entries for the chunk at {list(offsets or ())}", path=path, tensor=fqn
            )
        where[(fqn, offsets)] = _Location(folder / name, offset, length, tuple(transforms))
    return where


def _tensor(path: Path, fqn: str, entry: Any, where: dict[tuple[str, Shape | None], _Location]) -> StoredTensor:
    shape = _ints(entry.size, path, fqn, "size")
    dtype = getattr(entry.properties, "dtype", None)
    if not isinstance(dtype, pk.Dtype):
        raise CorruptFileError(f"tensor properties without a torch dtype ({shown(dtype)})", path=path, tensor=fqn)
    if not isinstance(entry.chunks, list):
        raise CorruptFileError("chunks is not a list", path=path, tensor=fqn)
    chunks = []
    for chunk in entry.chunks:
        if not isinstance(chunk, pk.ChunkStorageMetadata):
            raise CorruptFileError(f"a chunk of type {type(chunk).__name__}", path=path, tensor=fqn)
        offsets, sizes = _ints(chunk.offsets, path, fqn, "chunk offsets"), _ints(chunk.sizes, path, fqn, "chunk sizes")
        if not len(offsets) == len(sizes) == len(shape):
            raise CorruptFileError(
                f"chunk offsets {list(offsets)} and sizes {list(sizes)} do not fit a {len(shape)}-d tensor",
                path=path,
                tensor=fqn,
            )
        box = Box(offsets, sizes)
        location = where.get((fqn, box.offsets))
        if location is None:
            raise CorruptFileError(f"no storage entry for the chunk at {list(box.offsets)}", path=path, tensor=fqn)
        chunks.append(StoredChunk(box, location.file, location.offset, location.length, location.transforms))
    return StoredTensor(fqn, shape, str(dtype), tuple(chunks), path)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ints(value: Any, path: Path, fqn: str, what: str) -> Shape:
    """``value`` as a tuple of int64s (torch's sizes and offsets); untrusted, so shown bounded."""
    if not isinstance(value, (tuple, list)) or len(value) > MAX_DIMS or not all(_is_int(v) for v in value):
        raise CorruptFileError(f"{what} {shown(value)} is not a list of integers", path=path, tensor=fqn)
    if not all(-INT64 <= v < INT64 for v in value):
        raise CorruptFileError(f"{what} {shown(value)} holds an integer beyond 64 bits", path=path, tensor=fqn)
    return tuple(value)


def _read_hf_shards(folder: Path) -> DcpIndex:
    """The metadata-less form: each safetensors file holds one chunk per tensor, offsets in its metadata."""
    files = sorted(p for p in folder.iterdir() if HF_SHARD.match(p.name) and p.is_file())
    if not files:
        raise CorruptFileError("no .metadata, __{rank}.metadata or shard-*-model-*.safetensors files", path=folder)
    index = DcpIndex(folder, f"dcp, HuggingFaceStorageWriter shards without metadata ({len(files)} files)")
    chunks: dict[str, list[tuple[StoredChunk, str, Path]]] = {}
    for file in files:
        entries, metadata = safetensors_entries(file, 0, file.stat().st_size)
        try:
            sharding = json.loads(metadata[SHARDING_INFO])
            if not isinstance(sharding, dict):
                raise TypeError("not an object")
        except (KeyError, TypeError, ValueError, RecursionError) as err:
            raise CorruptFileError(f"no usable {SHARDING_INFO} in __metadata__ ({err!r})", path=file) from err
        for name, entry in entries.items():
            saved = sharding.get(name, {})
            offsets = _ints(
                saved.get("saved_offsets") if isinstance(saved, dict) else None, file, name, "saved_offsets"
            )
            if len(offsets) != len(entry.shape):
                raise CorruptFileError(
                    f"saved_offsets {list(offsets)} for a {len(entry.shape)}-d chunk", path=file, tensor=name
                )
            chunk = StoredChunk(Box(offsets, entry.shape), file, entry.data, entry.nbytes, data=entry.data)
            chunks.setdefault(name, []).append((chunk, entry.code, file))
    for name, found in chunks.items():
        codes = {code for _, code, _ in found}
        if len(codes) > 1:
            raise CorruptFileError(f"chunks disagree on dtype: {sorted(codes)}", path=found[0][2], tensor=name)
        boxes = [chunk.box for chunk, _, _ in found]
        shape = tuple(max(ends) for ends in zip(*(box.ends for box in boxes), strict=True)) if boxes[0].sizes else ()
        dtype = name_of(codes.pop())
        index.tensors[name] = StoredTensor(name, shape, dtype, tuple(c for c, _, _ in found), folder)
    return index
