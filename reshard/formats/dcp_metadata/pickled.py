"""A DCP ``.metadata`` file unpickled safely, without importing ``torch.distributed``.

``.metadata`` is a raw ``pickle.dump`` of ``torch.distributed.checkpoint.metadata.Metadata`` (protocol 4,
not ``torch.save``), and torch reads it with a bare ``pickle.load``: a hostile file runs any code it
likes. So this module maps exactly the classes a DCP (or Megatron-Core ``torch_dist``) writer pickles to local
stand-ins, and refuses every other global before it is looked up: nothing of a hostile pickle runs.
The stand-ins keep the pickled state as plain attributes; :mod:`reshard.formats.dcp_metadata.read` checks
their types and turns them into reshard's own index.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, BinaryIO

from reshard.errors import CorruptFileError, UnsafePickleError
from reshard.formats.safe_pickle import DTYPE_NAMES, TRUST_HINT, Dtype, PickleInput, StandIn, load_restricted


class Metadata(StandIn):
    state_dict_metadata: Any = None
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: Any = None
    version: Any = None


class MCoreMetadata(Metadata):
    mcore_data: Any = None


class TensorStorageMetadata(StandIn):
    properties: Any = None
    size: Any = None
    chunks: Any = None


class ChunkStorageMetadata(StandIn):
    offsets: Any = None
    sizes: Any = None


class BytesStorageMetadata(StandIn):
    pass


class TensorProperties(StandIn):
    """Pickled as the 5-tuple ``(dtype, layout, requires_grad, memory format, pin_memory)`` since torch 2.1,
    as a dict before."""

    dtype: Any = None

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 5:
            self.dtype = state[0]
            return
        super().__setstate__(state)


class MetadataIndex(StandIn):
    """Compared by identity: the index is rebuilt from ``(fqn, offset)`` after unpickling."""

    fqn: Any = None
    offset: Any = None
    index: Any = None


class StorageMeta(StandIn):
    checkpoint_id: Any = None
    save_id: Any = None
    load_id: Any = None
    modules: Any = None


class StorageInfo(StandIn):
    """``torch.distributed.checkpoint.filesystem._StorageInfo``: where one item's bytes are."""

    relative_path: Any = None
    offset: Any = None
    length: Any = None
    transform_descriptors: Any = None


class SavePlan(StandIn):
    items: Any = None
    storage_data: Any = None
    planner_data: Any = None
    usable: Any = True


class WriteItem(StandIn):
    index: Any = None
    type: Any = None
    bytes_io_data: Any = None
    tensor_data: Any = None


class TensorWriteData(StandIn):
    chunk: Any = None
    properties: Any = None
    size: Any = None


class MCoreSavePlan(SavePlan):
    mcore_data: Any = None
    shapes_validation_sharded_tensors: Any = None


def _value(value: Any = None) -> Any:
    """Stand-in for enums pickled as ``Enum(value)`` (``_MEM_FORMAT_ENCODING``, ``WriteItemType``)."""
    return value


def _size(values: Any = ()) -> tuple[Any, ...]:
    """``torch.Size(values)`` as a tuple."""
    return tuple(values)


def _path(*parts: Any) -> str:
    """``pathlib.PosixPath(*parts)`` as a string (only ever reported, never opened): strings only, as pathlib
    takes (``str`` of anything else, a reference bomb of tuples, would never end)."""
    if len(parts) > 256 or not all(isinstance(part, str) for part in parts):
        raise pickle.UnpicklingError("a pickled path is made of something other than strings")
    if sum(len(part) for part in parts) > 4096:
        raise pickle.UnpicklingError("a pickled path is longer than 4096 characters")
    return "/".join(parts)


_DCP = "torch.distributed.checkpoint"
_MCORE = "megatron.core.dist_checkpointing.strategies.torch"
ALLOWED: dict[str, Any] = {
    f"{_DCP}.metadata.Metadata": Metadata,
    f"{_DCP}.metadata.TensorStorageMetadata": TensorStorageMetadata,
    f"{_DCP}.metadata.ChunkStorageMetadata": ChunkStorageMetadata,
    f"{_DCP}.metadata.TensorProperties": TensorProperties,
    f"{_DCP}.metadata.BytesStorageMetadata": BytesStorageMetadata,
    f"{_DCP}.metadata.MetadataIndex": MetadataIndex,
    f"{_DCP}.metadata.StorageMeta": StorageMeta,
    f"{_DCP}.metadata._MEM_FORMAT_ENCODING": _value,
    f"{_DCP}.filesystem._StorageInfo": StorageInfo,
    f"{_DCP}.planner.SavePlan": SavePlan,
    f"{_DCP}.planner.WriteItem": WriteItem,
    f"{_DCP}.planner.TensorWriteData": TensorWriteData,
    f"{_DCP}.planner.WriteItemType": _value,
    f"{_MCORE}.MCoreMetadata": MCoreMetadata,
    f"{_MCORE}.MCoreSavePlan": MCoreSavePlan,
    "torch.Size": _size,
    "torch.serialization._get_layout": _value,
    "pathlib.PosixPath": _path,
    "pathlib.WindowsPath": _path,
    "pathlib.PurePosixPath": _path,
    "pathlib.PureWindowsPath": _path,
    "collections.OrderedDict": dict,
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits the :data:`ALLOWED` stand-ins and torch dtypes; anything else is refused (or, when the user
    trusts the file, imported as usual)."""

    def __init__(self, file: BinaryIO | PickleInput, *, path: Path, trust_pickle: bool) -> None:
        super().__init__(file)
        self._path = path
        self._trust = trust_pickle

    def find_class(self, module: str, name: str) -> Any:
        qualified = f"{module}.{name}"
        if qualified in ALLOWED:
            return ALLOWED[qualified]
        if module == "torch" and name in DTYPE_NAMES:
            return Dtype(name)
        if self._trust:
            return super().find_class(module, name)
        raise UnsafePickleError(
            f"pickles {qualified}, which is not a DCP metadata class: refused without running it",
            path=self._path,
            hint=TRUST_HINT,
        )

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a DCP metadata file has no persistent ids")


def load_metadata(path: Path, *, trust_pickle: bool = False) -> Any:
    """Unpickle a ``.metadata`` (or ``__{rank}.metadata``) file into stand-ins.

    Raises:
        UnsafePickleError: it pickles a class outside the allow-list (and ``trust_pickle`` is off).
        CorruptFileError: it is not a readable pickle.
    """
    try:
        data = path.read_bytes()
        return load_restricted(_MetadataUnpickler(PickleInput(data), path=path, trust_pickle=trust_pickle), data)
    except UnsafePickleError:
        raise
    except (
        OSError,
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
        KeyError,
        ImportError,
        RecursionError,
        MemoryError,
        OverflowError,
    ) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CorruptFileError(f"cannot read DCP metadata: {first}", path=path) from err
