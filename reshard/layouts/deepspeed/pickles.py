"""DeepSpeed's files read without running their pickles, and without importing torch or DeepSpeed.

Each file is a ``torch.save`` archive: it is checked first (:func:`reshard.formats.torch_zip.checks.check_torch_file`:
every storage record present, stored raw, inside the file, holding what the pickle says), then its ``data.pkl`` is
read by the structure-only unpickler (:mod:`reshard.formats.torch_zip.structure`): a tensor becomes a
:class:`~reshard.formats.torch_zip.structure.TensorRecord` (storage record, offset, sizes, strides), located in
the file from its record's local header, and never loaded.

DeepSpeed's own classes are read as inert objects: nothing reshard reads depends on their contents (the loss
scale, the ZeRO stage enum, the fragment addresses that ``param_shapes`` already gives). Verified on the files of
deepspeed 0.19.8 (``shared/reference/deepspeed-zero-verified.md``). Any other class is refused by name, as
``torch.load(weights_only=True)`` refused it, unless the user trusts the file (then it is inert too).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reshard.errors import CorruptFileError, UnsafePickleError
from reshard.formats.torch_zip.archive import read_archive
from reshard.formats.torch_zip.structure import TensorRecord
from reshard.layouts.deepspeed.pieces import Piece

PICKLED = frozenset({
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
})  # fmt: skip
# Plain values ``torch.load(weights_only=True)`` accepts too, so that no file it read is refused now.
PLAIN = frozenset({
    "builtins.set", "builtins.complex", "builtins.bytearray", "_codecs.encode", "collections.Counter", "torch.device",
})  # fmt: skip


@dataclass(frozen=True)
class Pickled:
    """A DeepSpeed file's pickled object, and where each storage record's bytes start in the file."""

    file: Path
    obj: Any
    starts: Mapping[str, int] = field(repr=False)  # storage key -> byte position

    def piece(self, key: str, tensor: Any) -> Piece:
        """Where ``tensor``'s bytes are in the file (``key``: its name in errors)."""
        if not isinstance(tensor, TensorRecord):
            raise CorruptFileError(f"holds {type(tensor).__name__}, not a tensor", path=self.file, tensor=key)
        if not _contiguous(tensor):
            raise CorruptFileError("stored strided: cannot be read in place", path=self.file, tensor=key)
        start = self.starts.get(tensor.storage.key)
        if start is None:
            raise CorruptFileError(f"no storage record data/{tensor.storage.key}", path=self.file, tensor=key)
        position = start + tensor.offset * tensor.itemsize
        return Piece(self.file, position, math.prod(tensor.sizes) * tensor.itemsize)


def read(file: Path, *, trust_pickle: bool) -> Pickled:
    """``file`` checked and its ``data.pkl`` read structurally (no tensor byte is read).

    Raises:
        UnsafePickleError: it pickles a class neither DeepSpeed's nor a tensor's (and ``trust_pickle`` is off).
        CorruptFileError: not a torch zip archive (a legacy torch file too), or one whose records do not hold what
            its pickle says.
    """

    def refuse(module: str, name: str) -> UnsafePickleError | None:
        if trust_pickle or f"{module}.{name}" in PICKLED | PLAIN:
            return None
        return UnsafePickleError(
            f"pickles {module}.{name}, which is not on reshard's allow-list",
            path=file,
            hint="pass --trust-pickle to read it as an inert object (nothing in it runs), only if you trust the file",
        )

    obj, starts = read_archive(file, refuse=refuse)
    return Pickled(file, obj, starts)


def _contiguous(tensor: TensorRecord) -> bool:
    """C order, as ``torch.Tensor.is_contiguous`` says (a dimension of size 1 may have any stride)."""
    if 0 in tensor.sizes:
        return True
    expected = 1
    for size, stride in zip(reversed(tensor.sizes), reversed(tensor.strides), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True
