"""The one dtype table: safetensors code, manifest name and width, and the order safetensors writes them in.

Headers carry the safetensors code (``"BF16"``), so reading a checkpoint's headers never imports torch
(``reshard check`` answers before torch would have finished importing); the torch dtype is looked up
only when a tensor is read or written.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

Shape = tuple[int, ...]

# (code, torch attribute name, bytes per element), in safetensors' own order (its Rust ``Dtype`` enum):
# files list tensors by this rank, largest first.
_SAFETENSORS_DTYPES: tuple[tuple[str, str, int], ...] = (
    ("BOOL", "bool", 1),
    ("U8", "uint8", 1),
    ("I8", "int8", 1),
    ("F8_E5M2", "float8_e5m2", 1),
    ("F8_E4M3", "float8_e4m3fn", 1),
    ("F8_E8M0", "float8_e8m0fnu", 1),
    ("I16", "int16", 2),
    ("U16", "uint16", 2),
    ("F16", "float16", 2),
    ("BF16", "bfloat16", 2),
    ("I32", "int32", 4),
    ("U32", "uint32", 4),
    ("F32", "float32", 4),
    ("C64", "complex64", 8),
    ("F64", "float64", 8),
    ("I64", "int64", 8),
    ("U64", "uint64", 8),
)
_NAME = {code: name for code, name, _ in _SAFETENSORS_DTYPES}
_ITEMSIZE = {code: size for code, _, size in _SAFETENSORS_DTYPES}
_RANK = {code: rank for rank, (code, _, _) in enumerate(_SAFETENSORS_DTYPES)}
_CODE_OF_NAME = {name: code for code, name, _ in _SAFETENSORS_DTYPES}


def is_code(code: str) -> bool:
    """Whether ``code`` is a dtype safetensors can store."""
    return code in _NAME


def itemsize_of(code: str) -> int:
    """Bytes per element of a safetensors dtype code."""
    return _ITEMSIZE[code]


def name_of(code: str) -> str:
    """``"BF16"`` -> ``"bfloat16"``, the spelling used in manifests and reports."""
    return _NAME[code]


def code_from_name(name: str) -> str | None:
    """``"bfloat16"`` -> ``"BF16"``: the code of a torch dtype's name, None for dtypes safetensors cannot hold."""
    return _CODE_OF_NAME.get(name)


def dtype_from_code(code: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype code such as ``"BF16"``."""
    return _torch_dtypes()[code]


def code_of(dtype: torch.dtype) -> str:
    """The safetensors code of a torch dtype; ``KeyError`` for dtypes safetensors cannot store."""
    return _codes_by_dtype()[dtype]


def safetensors_order(name: str, code: str) -> tuple[int, str]:
    """Sort key that reproduces the tensor order of ``safetensors.torch.save_file``."""
    return (-_RANK[code], name)


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    return {code: getattr(torch, name) for code, name, _ in _SAFETENSORS_DTYPES}


@functools.cache
def _codes_by_dtype() -> dict[torch.dtype, str]:
    return {dtype: code for code, dtype in _torch_dtypes().items()}


@dataclass(frozen=True)
class TensorHeader:
    """What a file says about one tensor before any of its bytes are read.

    The dtype is kept as its safetensors code (``"BF16"``) so that headers are read without torch.
    """

    shape: Shape
    code: str

    @classmethod
    def of(cls, shape: Sequence[int], dtype: torch.dtype) -> TensorHeader:
        """The header of a tensor of ``shape`` and torch ``dtype``."""
        return cls(tuple(shape), code_of(dtype))

    @property
    def dtype(self) -> torch.dtype:
        return dtype_from_code(self.code)

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * itemsize_of(self.code)
