"""What the manifest records of every canonical tensor: a digest of its bytes and whether it is finite.

A digest is spelled ``"<algorithm>:<hex>"``. New manifests use BLAKE3 (:data:`ALGORITHM`): a tree hash, about
3 x cheaper than sha256 per core on the bench VM (0.24-0.26 against 0.68-0.73 CPU-s a GB, sha256 with SHA-NI),
and one tensor's chunks can be hashed on several cores at once; Hugging Face's Xet storage hashes with it too.
Manifests written before it record sha256, which :func:`digest_of` still computes, so ``verify`` checks either.
"""

from __future__ import annotations

import hashlib

import blake3
import numpy as np
import torch

from reshard.formats.safetensors.writer import CHUNK_BYTES, byte_chunks
from reshard.schema import DIGESTS

ALGORITHM = "blake3"
ALGORITHMS = DIGESTS
# Below this, one thread: starting blake3's worker threads costs more than they save.
THREADED_BYTES = 16 << 20


def digest_of(tensor: torch.Tensor, algorithm: str = ALGORITHM) -> str:
    """``"<algorithm>:<hex>"`` of a tensor's bytes in C order (read in place when contiguous, else in bounded
    blocks); ``algorithm`` is one of :data:`ALGORITHMS`."""
    if algorithm == "sha256":
        digest = hashlib.sha256()
    elif algorithm == "blake3":
        large = tensor.numel() * tensor.element_size() >= THREADED_BYTES
        digest = blake3.blake3(max_threads=blake3.blake3.AUTO if large else 1)
    else:
        raise ValueError(f"unknown digest algorithm {algorithm!r}")
    for chunk in byte_chunks(tensor):
        digest.update(chunk)
    return f"{algorithm}:{digest.hexdigest()}"


def algorithm_of(digest: str) -> str:
    """The algorithm a ``"<algorithm>:<hex>"`` digest was made with."""
    return digest.partition(":")[0]


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
