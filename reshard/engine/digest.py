"""What the manifest records of every canonical tensor: the sha256 of its bytes and whether it is finite."""

from __future__ import annotations

import hashlib

import torch

from reshard.io.safetensors_writer import CHUNK_BYTES, byte_chunks


def sha256_of(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes in C order (read in place when contiguous, else in bounded blocks)."""
    digest = hashlib.sha256()
    for chunk in byte_chunks(tensor):
        digest.update(chunk)
    return digest.hexdigest()


def all_finite(tensor: torch.Tensor) -> bool:
    """True when no value is NaN or Inf (always for integer and bool tensors)."""
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return True
    try:
        return bool(torch.isfinite(tensor).all())
    except (RuntimeError, NotImplementedError):  # float8 kinds without an isfinite kernel
        return bool(torch.isfinite(tensor.float()).all())


def all_finite_in_blocks(tensor: torch.Tensor) -> bool:
    """:func:`all_finite` in one pass without a mask: ``aminmax`` propagates NaN, and a tensor is finite
    when its min and max are (about 80x faster than ``isfinite(t).all()``, and no mask of the whole)."""
    if tensor.numel() == 0 or not tensor.is_floating_point():
        return all_finite(tensor)
    try:
        low, high = torch.aminmax(tensor)
    except (RuntimeError, NotImplementedError):  # dtypes without an aminmax kernel (float8 kinds)
        rows = max(1, CHUNK_BYTES // max(1, tensor[0].numel() * tensor.element_size())) if tensor.dim() else 1
        if tensor.dim() == 0:
            return all_finite(tensor)
        return all(
            all_finite(tensor.narrow(0, s, min(rows, tensor.shape[0] - s))) for s in range(0, len(tensor), rows)
        )
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))
