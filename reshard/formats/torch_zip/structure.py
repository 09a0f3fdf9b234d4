"""What a ``torch.save`` archive's ``data.pkl`` says, read without running it, and where a record's bytes start.

Two readers need the same facts from an archive before any tensor byte is trusted: the check of a torch file
before ``torch.load`` (:mod:`reshard.formats.torch_zip.checks`) and the location of a DCP chunk's bytes
(:mod:`reshard.formats.chunks`). Both read ``data.pkl`` with :func:`read_structure`, an unpickler that calls
nothing it names: a tensor becomes a :class:`TensorRecord` (its storage's record key, element type and size,
its offset, sizes and strides), and both find where a record's data starts with :func:`data_start`.
"""

from __future__ import annotations

import os
import pickle
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from reshard.dtypes import code_from_name, itemsize_of
from reshard.formats.safe_pickle import (
    DTENSOR_CLASSES,
    DTYPE_NAMES,
    DTensorSpec,
    DTensorType,
    Dtype,
    PickleInput,
    load_restricted,
    wrapper_subclass,
)

ZIP_MAGIC = b"PK\x03\x04"
_LOCAL_HEADER = 30  # a zip local header's fixed part; its name and extra field lengths are its last 4 bytes
# Legacy typed storage classes, by the torch dtype of their elements (newer dtypes use UntypedStorage + a dtype).
_STORAGE_DTYPES = {
    "BoolStorage": "bool",
    "ByteStorage": "uint8",
    "CharStorage": "int8",
    "ShortStorage": "int16",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "IntStorage": "int32",
    "FloatStorage": "float32",
    "LongStorage": "int64",
    "DoubleStorage": "float64",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
    "QUInt8Storage": "quint8",
    "QInt8Storage": "qint8",
    "QInt32Storage": "qint32",
    "QUInt4x2Storage": "quint4x2",
    "QUInt2x4Storage": "quint2x4",
}
# Element sizes of the torch dtypes that safetensors cannot hold (:mod:`reshard.dtypes` has the others).
_OTHER_ITEMSIZES = {
    "complex32": 4,
    "complex128": 16,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float4_e2m1fn_x2": 1,
    "qint8": 1,
    "quint8": 1,
    "qint32": 4,
    "quint4x2": 1,
    "quint2x4": 1,
    "half": 2,
    "float": 4,
    "double": 8,
    "long": 8,
    "int": 4,
    "short": 2,
}


def _itemsize_of_name(name: str) -> int:
    """Bytes per element of the torch dtype called ``name`` (one of :data:`DTYPE_NAMES`)."""
    code = code_from_name(name)
    return itemsize_of(code) if code is not None else _OTHER_ITEMSIZES[name]


@dataclass(frozen=True)
class StorageRecord:
    """A storage the pickle names: its record is ``data/<key>``, of ``numel`` elements of ``dtype``."""

    key: str
    dtype: str
    numel: int

    @property
    def itemsize(self) -> int:
        return _itemsize_of_name(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class TensorRecord:
    """A tensor the pickle rebuilds: ``dtype`` is the one it names (``_rebuild_tensor_v3``), else its storage's.
    Offsets and strides count elements of ``dtype``; their values are not checked here."""

    storage: StorageRecord
    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str

    @property
    def itemsize(self) -> int:
        return _itemsize_of_name(self.dtype)


@dataclass(frozen=True)
class DTensorRecord:
    """A DTensor the pickle rebuilds: this rank's ``local`` tensor (a :class:`TensorRecord` when it is one), its
    ``spec`` (:class:`~reshard.formats.safe_pickle.DTensorSpec`, checked by who places it) and the global ``shape``
    and ``dtype`` the wrapper names."""

    local: Any
    spec: Any
    shape: Any
    dtype: Any


class Inert:
    """What an unknown global becomes when they are tolerated: takes any arguments and state, does nothing."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Inert:
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


class _StorageKind(str):
    """A pickled storage class, kept as the dtype name of its elements."""


def _ints(values: Any) -> tuple[int, ...]:
    if not isinstance(values, tuple) or not all(type(v) is int for v in values):
        raise pickle.UnpicklingError(f"{values!r} is not a tuple of integers")
    return values


def _rebuild(storage: Any, offset: Any, sizes: Any, strides: Any, *rest: Any) -> Any:
    """``torch._utils._rebuild_tensor_v2`` / ``_v3`` (which also names the dtype) as a record."""
    if not isinstance(storage, StorageRecord):
        return Inert()
    _ints(sizes), _ints(strides)
    if type(offset) is not int:
        raise pickle.UnpicklingError(f"tensor at offset {offset!r} with sizes {sizes!r}, strides {strides!r}")
    dtype = next((r for r in rest if isinstance(r, Dtype)), None)
    return TensorRecord(storage, offset, sizes, strides, str(dtype) if dtype is not None else storage.dtype)


def _parameter(data: Any, *rest: Any) -> Any:
    """``nn.Parameter(data)``: the tensor inside."""
    return data


class _TensorType:
    """``torch.Tensor`` itself, as the type :func:`_from_type` rebuilds a tensor as."""


def _from_type(function: Any, new_type: Any, args: Any, state: Any) -> Any:
    """``torch._tensor._rebuild_from_type_v2``: a plain tensor that carries Python attributes (DeepSpeed's ZeRO-3
    ``ds_id``) is the tensor ``function`` rebuilds, its attributes dropped; a DTensor a :class:`DTensorRecord`;
    another subclass is :class:`Inert`."""
    if function is _rebuild and new_type is _TensorType and isinstance(args, tuple):
        return _rebuild(*args)
    if function is wrapper_subclass and new_type is DTensorType and isinstance(args, tuple) and len(args) >= 4:
        slots = state[1] if isinstance(state, tuple) and len(state) == 2 else state
        if not isinstance(slots, dict):
            raise pickle.UnpicklingError(f"a DTensor with state {type(state).__name__}")
        spec = slots.get("_spec")
        return DTensorRecord(
            slots.get("_local_tensor"), spec if isinstance(spec, DTensorSpec) else None, args[2], args[1]
        )
    return Inert()


def _size(values: Any) -> tuple[int, ...]:
    """``torch.Size(values)``, as a plain tuple (shapes that DeepSpeed's ``param_shapes`` pickles)."""
    return _ints(values)


class _StructureUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, refuse: Callable[[str, str], Exception | None] | None) -> None:
        super().__init__(PickleInput(data))
        self._refuse = refuse

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor_v3"):
            return _rebuild
        if module == "torch._utils" and name in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
            return _parameter
        if module == "torch._tensor" and name == "_rebuild_from_type_v2":
            return _from_type
        if module == "torch" and name == "Tensor":
            return _TensorType
        if module == "torch" and name == "Size":
            return _size
        if module == "collections" and name == "OrderedDict":
            return _Dict
        if module == "torch.storage" and name == "UntypedStorage":
            return _StorageKind("uint8")
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageKind(_STORAGE_DTYPES[name])
        if module == "torch" and name in DTYPE_NAMES:
            return Dtype(name)
        if f"{module}.{name}" in DTENSOR_CLASSES:
            return DTENSOR_CLASSES[f"{module}.{name}"]
        error = self._refuse(module, name) if self._refuse is not None else None
        if error is not None:
            raise error
        return Inert

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageKind):
            numel = pid[4]
            if type(numel) is not int or numel < 0:
                raise pickle.UnpicklingError(f"storage of {numel!r} elements")
            return StorageRecord(str(pid[2]), str(pid[1]), numel)
        if self._refuse is not None:
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        return Inert()


def read_structure(data: bytes, *, refuse: Callable[[str, str], Exception | None] | None = None) -> Any:
    """Unpickle ``data.pkl`` into plain containers (a ``torch.Size`` a tuple), :class:`TensorRecord` for each tensor,
    :class:`DTensorRecord` for each DTensor, and :class:`Inert`.

    Args:
        data: the ``data.pkl`` record.
        refuse: builds the error raised for a global that is not part of a tensor (module, name), or returns None
            to tolerate it; without it, such a global (and an unknown persistent id) becomes :class:`Inert`, as does
            a tolerated global.

    Raises:
        pickle.UnpicklingError: not a pickle of tensors (also EOFError, ValueError, ... for damaged bytes).
    """
    return load_restricted(_StructureUnpickler(data, refuse), data)


def data_start(fd: int, info: zipfile.ZipInfo, *, base: int = 0) -> int | None:
    """Where the data of record ``info`` starts, relative to the archive at ``base`` of the open file ``fd``;
    None when no local header is there."""
    local = os.pread(fd, _LOCAL_HEADER, base + info.header_offset)
    if len(local) < _LOCAL_HEADER or local[:4] != ZIP_MAGIC:
        return None
    name_length, extra_length = struct.unpack("<HH", local[26:30])
    return info.header_offset + _LOCAL_HEADER + name_length + extra_length
