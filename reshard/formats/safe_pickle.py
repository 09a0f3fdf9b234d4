"""Unpickling a DCP ``.metadata`` file safely, without importing ``torch.distributed``.

``.metadata`` is a raw ``pickle.dump`` of ``torch.distributed.checkpoint.metadata.Metadata`` (protocol 4,
not ``torch.save``), and torch reads it with a bare ``pickle.load``: a hostile file runs any code it
likes. torch's ``weights_only`` unpickler cannot be reused (it rejects the FRAME opcode). So this
module maps exactly the classes a DCP (or Megatron-Core ``torch_dist``) writer pickles to local
stand-ins, and refuses every other global before it is looked up: nothing of a hostile pickle runs.
The stand-ins keep the pickled state as plain attributes; :mod:`reshard.formats.dcp_metadata.read` checks
their types and turns them into reshard's own index.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from reshard.errors import CorruptFileError, UnsafePickleError

TRUST_HINT = "pass --trust-pickle to unpickle it fully, only if you trust the file"


class StandIn:
    """A pickled object's state, as attributes; fields the pickle leaves out take the class defaults."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):  # (dict state, slots)
            state = {**(state[0] or {}), **state[1]}
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"unexpected state for {type(self).__name__}: {type(state).__name__}")
        for key, value in state.items():
            if isinstance(key, str) and not key.startswith("__"):
                object.__setattr__(self, key, value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({vars(self)!r})"


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


class Dtype(str):
    """A pickled ``torch.<name>`` dtype, kept as its name (``"bfloat16"``)."""


def _value(value: Any = None) -> Any:
    """Stand-in for enums pickled as ``Enum(value)`` (``_MEM_FORMAT_ENCODING``, ``WriteItemType``)."""
    return value


def _size(values: Any = ()) -> tuple[Any, ...]:
    """``torch.Size(values)`` as a tuple."""
    return tuple(values)


def _path(*parts: Any) -> str:
    """``pathlib.PosixPath(*parts)`` as a string (only ever reported, never opened)."""
    return "/".join(str(part) for part in parts)


# Every torch dtype name a DCP writer may pickle (those safetensors cannot hold are refused later, per tensor).
DTYPE_NAMES = frozenset(
    "bool uint8 int8 int16 int32 int64 uint16 uint32 uint64 float16 bfloat16 float32 float64 complex32 complex64 "
    "complex128 float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz float8_e8m0fnu float4_e2m1fn_x2 "
    "qint8 quint8 qint32 quint4x2 quint2x4 half float double long int short".split()
)
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


class PickleInput:
    """Pickle bytes for an unpickler to read: ``read`` and ``readline`` only.

    Without ``readinto`` the C unpickler reads counted bytes with ``read`` (a short read is "truncated"), not into
    a view of a ``bytearray`` it allocated first: on a damaged length that view is left exported when the read
    fails, and CPython prints ``SystemError: deallocated bytearray object has exported buffers`` on stderr.
    A count larger than what is left is refused before anything is allocated for it.
    """

    def __init__(self, data: bytes) -> None:
        self._data, self._position = data, 0

    def read(self, size: int = -1) -> bytes:
        left = len(self._data) - self._position
        if size is None or size < 0:
            size = left
        if size > left:
            raise pickle.UnpicklingError(f"pickle data was truncated ({size} bytes wanted, {left} left)")
        chunk = self._data[self._position : self._position + size]
        self._position += size
        return chunk

    def readline(self) -> bytes:
        end = self._data.find(b"\n", self._position)
        end = len(self._data) if end < 0 else end + 1
        line = self._data[self._position : end]
        self._position = end
        return line


class _PurePython(pickle._Unpickler):
    """Python's own (pure-Python) unpickler, without ``BYTEARRAY8``, which no format reshard reads pickles."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def _no_bytearray(self) -> None:
        raise pickle.UnpicklingError("a bytearray (BYTEARRAY8) is not part of this format")

    dispatch[pickle.BYTEARRAY8[0]] = _no_bytearray


def load_restricted(unpickler: pickle.Unpickler, data: bytes) -> Any:
    """``unpickler.load()`` of ``data`` (which it was made to read, as a :class:`PickleInput`), on Python's pure
    unpickler instead when ``data`` may hold a ``BYTEARRAY8`` whose size cannot be right.

    CPython's C unpickler allocates a ``BYTEARRAY8`` before reading it; when that allocation fails it prints
    ``SystemError: deallocated bytearray object has exported buffers`` on stderr (a CPython bug). The pure
    unpickler refuses the opcode (same ``find_class`` and ``persistent_load``); it is slower, and only used for
    data with a ``0x96`` byte followed by an impossible size.
    """
    if not any(
        int.from_bytes(data[at + 1 : at + 9], "little") > len(data) - at - 9
        for at in _positions(data, pickle.BYTEARRAY8)
    ):
        return unpickler.load()
    pure = _PurePython(PickleInput(data))
    pure.find_class = unpickler.find_class  # type: ignore[method-assign]
    pure.persistent_load = unpickler.persistent_load  # type: ignore[method-assign]
    return pure.load()


def _positions(data: bytes, byte: bytes) -> Iterator[int]:
    at = data.find(byte)
    while at >= 0:
        yield at
        at = data.find(byte, at + 1)


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
