"""What the manifest records of every canonical tensor: the sha256 of its bytes and whether it is finite."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from reshard.formats.safetensors.writer import CHUNK_BYTES, byte_chunks


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


# A float is NaN or +-Inf exactly when its exponent bits are all ones: the integer type of its bits and that mask.
EXPONENT_BITS: dict[torch.dtype, tuple[type[np.integer], int]] = {
    torch.bfloat16: (np.int16, 0x7F80),
    torch.float16: (np.int16, 0x7C00),
    torch.float32: (np.int32, 0x7F800000),
    torch.float64: (np.int64, 0x7FF0000000000000),
}
# Values per block of the exponent check: its one temporary stays in a core's cache.
FINITE_BLOCK = 1 << 18


def all_finite_in_blocks(tensor: torch.Tensor) -> bool:
    """:func:`all_finite` without a mask of the whole tensor.

    A contiguous tensor of a common float type is checked on its bits, block by block: NaN and Inf are the
    values whose exponent bits are all ones (faster than ``aminmax``, which widens bf16 to float). Others take
    one ``aminmax`` pass: it propagates NaN, and a tensor is finite when its min and max are (far faster than
    ``isfinite(t).all()``, which builds a mask). Measurements: docs/performance.md.
    """
    if tensor.numel() == 0 or not tensor.is_floating_point():
        return all_finite(tensor)
    if tensor.dtype in EXPONENT_BITS and tensor.is_contiguous():
        return _no_exponent_all_ones(tensor, *EXPONENT_BITS[tensor.dtype])
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


def _no_exponent_all_ones(tensor: torch.Tensor, bits: type[np.integer], mask: int) -> bool:
    values = tensor.reshape(-1).view(torch.uint8).numpy().view(bits)
    masked = np.empty(min(FINITE_BLOCK, values.size), dtype=bits)
    for start in range(0, values.size, FINITE_BLOCK):
        block = masked[: min(FINITE_BLOCK, values.size - start)]
        np.bitwise_and(values[start : start + len(block)], bits(mask), out=block)
        if block.max() == mask:
            return False
    return True
