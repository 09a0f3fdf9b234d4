"""The one dtype table: safetensors code <-> torch dtype, and the order safetensors writes them in."""

from __future__ import annotations

import torch

# In safetensors' own order (its Rust ``Dtype`` enum): files list tensors by this rank, largest first.
_SAFETENSORS_DTYPES: tuple[tuple[str, torch.dtype], ...] = (
    ("BOOL", torch.bool),
    ("U8", torch.uint8),
    ("I8", torch.int8),
    ("F8_E5M2", torch.float8_e5m2),
    ("F8_E4M3", torch.float8_e4m3fn),
    ("F8_E8M0", torch.float8_e8m0fnu),
    ("I16", torch.int16),
    ("U16", torch.uint16),
    ("F16", torch.float16),
    ("BF16", torch.bfloat16),
    ("I32", torch.int32),
    ("U32", torch.uint32),
    ("F32", torch.float32),
    ("C64", torch.complex64),
    ("F64", torch.float64),
    ("I64", torch.int64),
    ("U64", torch.uint64),
)
_BY_CODE = dict(_SAFETENSORS_DTYPES)
_BY_DTYPE = {dtype: code for code, dtype in _SAFETENSORS_DTYPES}
_RANK = {dtype: rank for rank, (_, dtype) in enumerate(_SAFETENSORS_DTYPES)}


def dtype_from_code(code: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype code such as ``"BF16"``."""
    return _BY_CODE[code]


def code_of(dtype: torch.dtype) -> str:
    """The safetensors code of a torch dtype; ``KeyError`` for dtypes safetensors cannot store."""
    return _BY_DTYPE[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, the spelling used in manifests and reports."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element."""
    return dtype.itemsize


def safetensors_order(name: str, dtype: torch.dtype) -> tuple[int, str]:
    """Sort key that reproduces the tensor order of ``safetensors.torch.save_file``."""
    return (-_RANK[dtype], name)
