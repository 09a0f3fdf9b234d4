"""The pickle ``torch.save`` writes (``data.pkl``), computed from a template whose tensors are known by header.

``torch.save`` pickles a tensor as a call of ``torch._utils._rebuild_tensor_v2`` (``_v3`` for the dtypes
typed storages lack: float8, uint16/32/64) on its storage, offset, size and stride, and its storage as a
persistent id ``("storage", storage type, key, location, numel)``, the key numbering storages in the
order the pickler meets them. None of that needs the tensor's bytes, so a :class:`TensorSlot` can stand
in the object for the tensor that will be written later, and the pickle comes out as for the real one.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from reshard.dtypes import TensorHeader

DEFAULT_PROTOCOL = 2  # torch.serialization.DEFAULT_PROTOCOL


@dataclass(frozen=True)
class TensorSlot:
    """Stands in a template for the tensor written later as ``key``: a contiguous tensor of ``header``'s
    shape and dtype with a storage of its own."""

    key: str
    header: TensorHeader


class _SlotStorage:
    """The storage of a slot while the template is pickled (what ``persistent_id`` turns into a key)."""

    def __init__(self, slot: TensorSlot, storage_type: type, numel: int) -> None:
        self.slot, self.storage_type, self.numel = slot, storage_type, numel


def pickle_template(
    template: Any, *, pickle_module: ModuleType = pickle, protocol: int = DEFAULT_PROTOCOL
) -> tuple[bytes, dict[str, TensorSlot | torch.UntypedStorage]]:
    """The ``data.pkl`` that ``torch.save`` writes for the object the template stands for, and its storages
    by key in the order they are written (a slot, or the storage of a real tensor of the template).

    This mirrors ``torch.serialization._save``'s ``persistent_id`` and ``Tensor._reduce_ex_internal``
    for CPU tensors (``_rebuild_tensor_v2`` over a typed storage, or ``_rebuild_tensor_v3`` over an
    untyped one for the dtypes typed storages lack: float8, uint16/32/64).
    """
    import torch

    storages: dict[str, TensorSlot | torch.UntypedStorage] = {}
    id_map: dict[Any, str] = {}
    dtypes: dict[int, torch.dtype] = {}
    alive: list[_SlotStorage] = []  # held so that no two stubs share an id() while pickling
    new_dtypes = torch.storage._new_dtypes()
    storage_names = torch.storage._dtype_to_storage_type_map()

    def persistent_id(obj: Any) -> tuple | None:
        if isinstance(obj, _SlotStorage):
            key = id_map.setdefault(("slot", id(obj)), str(len(id_map)))
            storages[key] = obj.slot
            return ("storage", obj.storage_type, key, "cpu", obj.numel)
        if not (isinstance(obj, torch.storage.TypedStorage) or torch.is_storage(obj)):
            return None
        if isinstance(obj, torch.storage.TypedStorage):
            storage, dtype = obj._untyped_storage, obj.dtype
            storage_type, numel = getattr(torch, obj._pickle_storage_type()), obj._size()
        else:
            storage, dtype = obj, torch.uint8
            storage_type, numel = torch.serialization.normalize_storage_type(type(obj)), obj.nbytes()
        if str(storage.device) != "meta" and storage.data_ptr() != 0:
            if dtypes.setdefault(storage.data_ptr(), dtype) != dtype:
                raise RuntimeError(
                    "Cannot save multiple tensors or storages that view the same data as different types"
                )
        key = id_map.setdefault(storage._cdata, str(len(id_map)))
        storages[key] = storage
        return ("storage", storage_type, key, torch.serialization.location_tag(storage), numel)

    def reduce_slot(slot: TensorSlot) -> tuple:
        dtype, shape = slot.header.dtype, slot.header.shape
        numel, step, strides = 1, 1, []
        for dim in reversed(shape):  # contiguous strides as torch computes them (a 0 counts as 1)
            strides.append(step)
            numel, step = numel * dim, step * max(dim, 1)
        # New tuples, as Tensor.size() and stride() give: the pickler memoizes tuples by identity.
        size, stride = tuple(int(n) for n in shape), tuple(reversed(strides))
        if dtype in new_dtypes:
            stub = _SlotStorage(slot, torch.UntypedStorage, numel * dtype.itemsize)
            alive.append(stub)
            return (torch._utils._rebuild_tensor_v3, (stub, 0, size, stride, False, OrderedDict(), dtype))
        stub = _SlotStorage(slot, getattr(torch, storage_names[dtype]), numel)
        alive.append(stub)
        return (torch._utils._rebuild_tensor_v2, (stub, 0, size, stride, False, OrderedDict()))

    # pickle_module is a module given at run time (pickle, or torch's): mypy cannot see its Pickler class.
    class Pickler(pickle_module.Pickler):  # type: ignore[name-defined]
        def persistent_id(self, obj: Any) -> tuple | None:
            return persistent_id(obj)

        def reducer_override(self, obj: Any) -> Any:
            return reduce_slot(obj) if type(obj) is TensorSlot else NotImplemented

    buffer = io.BytesIO()
    Pickler(buffer, protocol=protocol).dump(template)
    return buffer.getvalue(), storages
