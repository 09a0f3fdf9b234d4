"""Writing a DCP ``.metadata`` file as ``torch.distributed.checkpoint`` writes it, without importing it.

A DCP save ends with ``pickle.dump(metadata, file)`` of ``torch.distributed.checkpoint.metadata.Metadata``
(reference notes ``dcp-torchdist-deepspeed.md`` 1.2), and every reader (torch's ``FileSystemReader``,
Megatron-Core's loader) unpickles it into the real classes. Here the same object graph is built from
stand-ins: dataclasses with the real classes' fields, and placeholders for the globals (``torch.Size``,
dtypes, ``_get_layout``, the memory-format enum) that :class:`_Pickler` writes as the real import paths, the
way :data:`reshard.layouts.megatron.args.PICKLE_MODULE` writes Megatron's enums. So reshard needs neither
``torch.distributed`` nor Megatron to write it, and the bytes are those ``pickle.dumps(real, protocol=4)``
gives for the real objects (``tests/formats/test_dcp_metadata_write.py`` compares them): the C pickler's
batching of long lists and dicts included, which differs from the pure-Python pickler used here.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, SupportsIndex

from reshard.formats.safe_pickle import PurePickler

PROTOCOL = 4  # what pickle.dump uses on Python 3.8-3.13 (torch writes with the default)
VERSION = "1.0.0"  # torch.distributed.checkpoint.metadata's DEFAULT version
_BATCH = 1000  # pickle's BATCHSIZE
_METADATA = "torch.distributed.checkpoint.metadata"
_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
# torch's dtype globals are found by pickle.whichmodule under sys.modules' key "torch"; torch.Size's
# __module__ is a fresh string each time. The memo follows string identity, so the two must differ.
_TORCH_DTYPES = "torch"
_TORCH_SIZE = "".join(["tor", "ch"])


def _pickled_as(module: str, name: str) -> Any:
    """Class decorator: instances pickle as instances of ``module.name`` (see :class:`_Pickler`)."""

    def mark(cls: type[Any]) -> type[Any]:
        cls._reshard_global = (module, name)
        return cls

    return mark


def _global(module: str, name: str) -> type:
    """A placeholder that pickles as the global ``module.name``."""
    return type(name, (), {"_reshard_global": (module, name)})


_SIZE = _global(_TORCH_SIZE, "Size")
_GET_LAYOUT = _global("torch.serialization", "_get_layout")
_MEM_FORMAT = _global(_METADATA, "_MEM_FORMAT_ENCODING")
_DTYPES: dict[str, type] = {}


def dtype(name: str) -> type:
    """The global ``torch.<name>`` (``"bfloat16"``), one placeholder per name (pickle memoizes it)."""
    if name not in _DTYPES:
        _DTYPES[name] = _global(_TORCH_DTYPES, name)
    return _DTYPES[name]


class Size(tuple):
    """``torch.Size``: pickles as ``torch.Size((...))``."""

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        return (_SIZE, (tuple(self),))


class _Reduced:
    """A constant pickled as ``func(*args)`` (one instance each, as torch's singletons are)."""

    def __init__(self, func: type, args: tuple[Any, ...]) -> None:
        self._reduced = (func, args)

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        return self._reduced


STRIDED = _Reduced(_GET_LAYOUT, ("torch.strided",))  # torch.strided
CONTIGUOUS = _Reduced(_MEM_FORMAT, (0,))  # _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT


@_pickled_as(_METADATA, "ChunkStorageMetadata")
@dataclass
class ChunkStorageMetadata:
    offsets: Size
    sizes: Size


@_pickled_as(_METADATA, "TensorProperties")
@dataclass
class TensorProperties:
    """Pickled through ``__getstate__`` as torch's: a 5-tuple with the memory format as its enum."""

    dtype: type
    layout: Any = STRIDED
    requires_grad: bool = False
    memory_format: Any = CONTIGUOUS
    pin_memory: bool = False

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory)


@_pickled_as(_METADATA, "TensorStorageMetadata")
@dataclass
class TensorStorageMetadata:
    properties: TensorProperties
    size: Size
    chunks: list[ChunkStorageMetadata]


@_pickled_as(_METADATA, "BytesStorageMetadata")
@dataclass
class BytesStorageMetadata:
    pass


@_pickled_as(_METADATA, "StorageMeta")
@dataclass
class StorageMeta:
    checkpoint_id: Any = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = field(default_factory=list)


@_pickled_as(_METADATA, "Metadata")
@dataclass
class Metadata:
    state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: StorageMeta | None = None
    version: str | None = None


@_pickled_as(_METADATA, "MetadataIndex")
class MetadataIndex:
    """Torch's frozen dataclass sets ``fqn`` and ``index``, and ``offset`` only when given (its ``__dict__``)."""

    def __init__(self, fqn: str, offset: Size | None = None, index: int | None = None) -> None:
        self.fqn = fqn
        self.index = index
        if offset is not None:
            self.offset = Size(offset)


@_pickled_as(_FILESYSTEM, "_StorageInfo")
@dataclass
class StorageInfo:
    """``_StorageInfo``: where one item's bytes are; its ``__getstate__`` drops the fields that are None."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: list[str] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


class _Pickler(PurePickler):  # the pure-Python pickler: its save_global and batching can be overridden
    def save_global(self, obj: Any, name: str | None = None) -> None:
        ref = getattr(obj, "_reshard_global", None) if isinstance(obj, type) else None
        if ref is None:
            super().save_global(obj, name)
            return
        module, qualname = ref
        self.save(module)
        self.save(qualname)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)

    def _batch_appends(self, items: Any, *_: Any) -> None:
        """As the C pickler's ``batch_list_exact``: one item with APPEND, else batches of MARK ... APPENDS."""
        items = list(items)
        if len(items) == 1:
            self.save(items[0])
            self.write(pickle.APPEND)
            return
        for start in range(0, len(items), _BATCH):
            self.write(pickle.MARK)
            for item in items[start : start + _BATCH]:
                self.save(item)
            self.write(pickle.APPENDS)

    def _batch_setitems(self, items: Any, *_: Any) -> None:
        """As the C pickler's ``batch_dict_exact``: one pair with SETITEM, else batches of MARK ... SETITEMS,
        and one empty batch more after a full last one."""
        pairs = list(items)
        if len(pairs) == 1:
            self.save(pairs[0][0])
            self.save(pairs[0][1])
            self.write(pickle.SETITEM)
            return
        start = 0
        while True:
            batch = pairs[start : start + _BATCH]
            self.write(pickle.MARK)
            for key, value in batch:
                self.save(key)
                self.save(value)
            self.write(pickle.SETITEMS)
            start += _BATCH
            if len(batch) < _BATCH:
                return


def dumps(metadata: Metadata) -> bytes:
    """The bytes of ``pickle.dump(metadata, file)`` for the real classes (protocol 4)."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=PROTOCOL).dump(metadata)
    return buffer.getvalue()


@dataclass(frozen=True)
class StoredChunk:
    """One chunk of a tensor as written: its box and the byte range of its ``torch.save`` archive."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    position: int
    length: int


def build_metadata(
    tensors: list[tuple[str, str, tuple[int, ...], list[StoredChunk]]],
    objects: list[tuple[str, str, int, int]],
    *,
    planner_data: Mapping[str, tuple[str | int, ...]] | None = None,
) -> Metadata:
    """The ``Metadata`` of a checkpoint of global tensors ``(key, torch dtype name, shape, chunks)`` and
    non-tensor objects ``(key, file, position, length)``: entries in the order given, ``planner_data`` (the key
    path of each flattened key, as ``DefaultSavePlanner`` records it; None as Megatron-Core's planner leaves it),
    and a ``StorageMeta`` without ids (the output stays the same from run to run)."""
    entries: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    storage: dict[MetadataIndex, StorageInfo] = {}
    for key, name, shape, chunks in tensors:
        properties = TensorProperties(dtype(name))
        boxes = [ChunkStorageMetadata(Size(c.offsets), Size(c.sizes)) for c in chunks]
        entries[key] = TensorStorageMetadata(properties, Size(shape), boxes)
        for chunk in chunks:
            storage[MetadataIndex(key, Size(chunk.offsets))] = StorageInfo(chunk.file, chunk.position, chunk.length)
    for key, file, position, length in objects:
        entries[key] = BytesStorageMetadata()
        storage[MetadataIndex(key)] = StorageInfo(file, position, length)
    paths = None if planner_data is None else dict(planner_data)
    return Metadata(entries, paths, storage, StorageMeta(), VERSION)
