"""Unpickling untrusted pickles without running them: the machinery every restricted unpickler shares.

A hostile pickle runs any code it likes under a bare ``pickle.load``, and torch's ``weights_only`` unpickler
cannot be reused (it rejects the FRAME opcode). So each format reshard unpickles (DCP ``.metadata``,
:mod:`reshard.formats.dcp_metadata.pickled`; a torch archive's ``data.pkl``,
:mod:`reshard.formats.torch_zip.structure`) maps exactly the globals it expects to local stand-ins and refuses
or neutralises every other global before it is looked up. This module holds what they share: the stand-in base
class, the pickle input that refuses impossible lengths, the unpickling entry point that avoids a CPython bug,
the torch dtype names, the hint shown when a pickle is refused, and the stand-ins of a DTensor's pickle.

A DTensor (``torch.distributed.tensor``, what FSDP2's ``model.state_dict()`` holds) pickles as
``_rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor, (DTensor, dtype, size, ...), (None, {"_local_tensor":
tensor, "_spec": DTensorSpec}))``; the spec holds the ``DeviceMesh`` (its ``_layout`` gives the mesh's shape,
``_coordinate_on_dim`` the saving rank's place in it; torch 2.5-2.8 pickled the ``mesh`` tensor of ranks instead),
the placements (``Shard``, ``Replicate``, ``_StridedShard``, ``Partial``) and ``tensor_meta`` (global shape, stride,
dtype). :data:`DTENSOR_CLASSES` maps each of those globals to an inert stand-in here: nothing of torch's runs, no
process group is looked up (torch's ``DeviceMesh.__setstate__`` would), and the layout that reads the tensors
(:mod:`reshard.layouts.verl`) refuses what it cannot place (``_StridedShard``, ``Partial``) by name.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

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


class Dtype(str):
    """A pickled ``torch.<name>`` dtype, kept as its name (``"bfloat16"``)."""


# Every torch dtype name a checkpoint may pickle (those safetensors cannot hold are refused later, per tensor).
DTYPE_NAMES = frozenset(
    "bool uint8 int8 int16 int32 int64 uint16 uint32 uint64 float16 bfloat16 float32 float64 complex32 complex64 "
    "complex128 float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz float8_e8m0fnu float4_e2m1fn_x2 "
    "qint8 quint8 qint32 quint4x2 quint2x4 half float double long int short".split()
)


class DeviceMesh(StandIn):
    """A pickled ``DeviceMesh``: its shape and the saving rank's coordinates in it; no process group."""

    _layout: Any = None  # torch >= 2.9: a _MeshLayout of one _FlatLayout per mesh dim
    mesh: Any = None  # torch 2.5-2.8: the tensor of global ranks, of the mesh's shape
    _coordinate_on_dim: Any = None
    _mesh_dim_names: Any = None
    _rank: Any = None

    def sizes(self) -> tuple[int, ...] | None:
        """The mesh's shape (None when the pickle does not tell it)."""
        axes = getattr(self._layout, "axes", None)
        if isinstance(axes, tuple) and all(isinstance(axis, FlatLayout) for axis in axes):
            sizes = [axis.numel() for axis in axes]
            return tuple(s for s in sizes if s is not None) if None not in sizes else None
        shape = getattr(self.mesh, "sizes", None)
        return shape if isinstance(shape, tuple) else None


class MeshLayout(StandIn):
    """``torch.distributed._mesh_layout._MeshLayout``: ``axes``, one :class:`FlatLayout` per mesh dim."""

    axes: Any = None


class FlatLayout(StandIn):
    """``torch.distributed._mesh_layout._FlatLayout``: one mesh dim's sizes (``()`` for a dim of 1)."""

    shape: Any = None

    def numel(self) -> int | None:
        shape = (self.shape,) if type(self.shape) is int else self.shape
        if not isinstance(shape, tuple) or not all(type(s) is int and s > 0 for s in shape):
            return None
        return math.prod(shape)


class Shard(StandIn):
    """``Shard(dim)``: the tensor cut along ``dim`` as ``torch.chunk`` cuts it, one piece per mesh coordinate."""

    dim: Any = None


class Replicate(StandIn):
    """``Replicate()``: every coordinate of the mesh dim holds the whole (so far cut) tensor."""


class StridedShard(Shard):
    """``_StridedShard``: interleaved pieces (FSDP2 over tensor parallelism); not placed, refused by name."""


class Partial(StandIn):
    """``Partial``: pending sums across the mesh dim; not a stored value, refused by name."""


class DTensorSpec(StandIn):
    """A DTensor's ``_spec``: ``mesh``, ``placements`` (one per mesh dim), ``tensor_meta``."""

    mesh: Any = None
    placements: Any = None
    tensor_meta: Any = None


class TensorMeta(tuple):
    """``TensorMeta(shape, stride, dtype)``, a named tuple pickled by its arguments."""

    def __new__(cls, *args: Any) -> TensorMeta:
        return tuple.__new__(cls, args)


class DTensorType:
    """The class ``DTensor`` itself, as ``_rebuild_from_type_v2`` names it."""


def wrapper_subclass(*args: Any) -> tuple[Any, ...]:
    """``torch._utils._rebuild_wrapper_subclass``: its arguments (class, dtype, size, stride, ...), not called."""
    return args


def _named(value: Any) -> str:
    """``torch.device("cpu")``, ``torch.serialization._get_layout("torch.strided")``: the name."""
    return str(value)


_PLACEMENTS = "torch.distributed.tensor.placement_types"
# Every global of a DTensor's pickle, under the module names torch 2.5 and later pickle it with.
DTENSOR_CLASSES: dict[str, Any] = {
    "torch.distributed.tensor.DTensor": DTensorType,
    "torch.distributed.tensor._api.DTensor": DTensorType,
    "torch.distributed._tensor.api.DTensor": DTensorType,
    "torch._utils._rebuild_wrapper_subclass": wrapper_subclass,
    "torch.distributed.tensor._dtensor_spec.DTensorSpec": DTensorSpec,
    "torch.distributed.tensor._dtensor_spec.TensorMeta": TensorMeta,
    "torch.distributed.tensor._dtensor_spec.ShardOrderEntry": TensorMeta,
    "torch.distributed.device_mesh.DeviceMesh": DeviceMesh,
    "torch.distributed._mesh_layout._MeshLayout": MeshLayout,
    "torch.distributed._mesh_layout._FlatLayout": FlatLayout,
    f"{_PLACEMENTS}.Shard": Shard,
    f"{_PLACEMENTS}.Replicate": Replicate,
    f"{_PLACEMENTS}._StridedShard": StridedShard,
    f"{_PLACEMENTS}.Partial": Partial,
    f"{_PLACEMENTS}._MaskPartial": Partial,
    f"{_PLACEMENTS}._NormPartial": Partial,
    "torch.device": _named,
    "torch.serialization._get_layout": _named,
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


if TYPE_CHECKING:

    class PurePickler(pickle._Pickler):
        """Python's pure-Python pickler as it is: typeshed's stub of it leaves out the methods a subclass calls."""

        proto: int

        def save(self, obj: Any, save_persistent_id: bool = True) -> None: ...
        def write(self, data: bytes) -> None: ...
        def memoize(self, obj: Any) -> None: ...
        def save_global(self, obj: Any, name: str | None = None) -> None: ...

else:
    PurePickler = pickle._Pickler  # the pure-Python pickler, whose methods (save_global, batching) can be overridden


class _PurePython(pickle._Unpickler):
    """Python's own (pure-Python) unpickler, without ``BYTEARRAY8``, which no format reshard reads pickles."""

    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = dict(pickle._Unpickler.dispatch)

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
    # The restricted unpickler's own hooks, bound to it (mypy takes an instance's method for an unbound one).
    pure.find_class = unpickler.find_class  # type: ignore[method-assign,assignment]
    pure.persistent_load = unpickler.persistent_load  # type: ignore[method-assign,assignment]
    return pure.load()


def _positions(data: bytes, byte: bytes) -> Iterator[int]:
    at = data.find(byte)
    while at >= 0:
        yield at
        at = data.find(byte, at + 1)
