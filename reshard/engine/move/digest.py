"""What the manifest records of every canonical tensor: a digest of its bytes and whether it is finite.

A digest is spelled ``"<algorithm>:<hex>"``. New manifests use BLAKE3 (:data:`ALGORITHM`): a tree hash, several
times cheaper than sha256 per core (measured: docs/performance.md), and one tensor's chunks can be hashed on several
cores at once; Hugging Face's Xet storage hashes with it too.
Manifests written before it record sha256, which :func:`digest_of` still computes, so ``verify`` checks either.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import blake3
import numpy as np

from reshard.dtypes import code_of, dtype_from_code
from reshard.formats.safetensors.writer import CHUNK_BYTES, byte_chunks
from reshard.schema import DIGESTS

if TYPE_CHECKING:
    import torch

ALGORITHM = "blake3"
ALGORITHMS = DIGESTS
# Below this, one thread: starting blake3's worker threads costs more than they save.
THREADED_BYTES = 16 << 20


def digest_of(tensor: torch.Tensor, algorithm: str = ALGORITHM) -> str:
    """``"<algorithm>:<hex>"`` of a tensor's bytes in C order (read in place when contiguous, else in bounded
    blocks); ``algorithm`` is one of :data:`ALGORITHMS`."""
    digest = _hasher(algorithm, threaded=tensor.numel() * tensor.element_size() >= THREADED_BYTES)
    for chunk in byte_chunks(tensor):
        digest.update(chunk)
    return f"{algorithm}:{digest.hexdigest()}"


def _hasher(algorithm: str, *, threaded: bool) -> hashlib._Hash | blake3.blake3:
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "blake3":
        return blake3.blake3(max_threads=blake3.blake3.AUTO if threaded else 1)
    raise ValueError(f"unknown digest algorithm {algorithm!r}")


def checked_without_torch(code: str) -> bool:
    """Whether :class:`RunningDigest` checks values of dtype ``code`` for NaN/Inf on their bits alone (every float
    code but ``F8_E8M0``, whose only non-finite value is one bit pattern, and the complex one; every integer)."""
    return code in EXPONENT_BITS or code in NEVER_NAN


class RunningDigest:
    """:func:`digest_of` and :func:`all_finite_in_blocks` of a tensor fed its bytes in C order, block by block.

    Each block is checked for NaN/Inf right after it is hashed, while it is still in the core's cache: one pass
    over memory instead of two (the check alone costs a memory read; measured: docs/performance.md).
    Blocks hold whole values. Torch-free for the dtypes :func:`checked_without_torch` names.
    """

    def __init__(self, code: str, *, finite: bool, algorithm: str = ALGORITHM) -> None:
        self._hash = _hasher(algorithm, threaded=False)
        self._algorithm = algorithm
        self._code = code
        self._finite: bool | None = True if finite else None

    def update(self, block: memoryview) -> None:
        """Hash the next bytes and, while no NaN/Inf has been met, check them."""
        self._hash.update(block)
        if self._finite and len(block) and self._code not in NEVER_NAN:
            if self._code in EXPONENT_BITS:
                bits, mask = EXPONENT_BITS[self._code]
                self._finite = _no_exponent_all_ones(np.frombuffer(block, dtype=bits), bits, mask)
            else:
                import torch

                self._finite = all_finite_in_blocks(torch.frombuffer(block, dtype=dtype_from_code(self._code)))

    def result(self) -> tuple[str, bool | None]:
        """``("<algorithm>:<hex>", finite)``; finite is None when not asked for."""
        return f"{self._algorithm}:{self._hash.hexdigest()}", self._finite


def algorithm_of(digest: str) -> str:
    """The algorithm a ``"<algorithm>:<hex>"`` digest was made with."""
    return digest.partition(":")[0]


def all_finite(tensor: torch.Tensor) -> bool:
    """True when no value is NaN or Inf (always for integer and bool tensors)."""
    import torch

    if not (tensor.is_floating_point() or tensor.is_complex()):
        return True
    try:
        return bool(torch.isfinite(tensor).all())
    except (RuntimeError, NotImplementedError):  # float8 kinds without an isfinite kernel
        return bool(torch.isfinite(tensor.float()).all())


# A float is NaN or +-Inf exactly when the bits of this mask are all ones: by dtype code, the integer type of its
# bits and that mask. The exponent bits, except float8 e4m3fn: it has no Inf, and its exponent all ones is a
# number too, but for the mantissa all ones (NaN).
EXPONENT_BITS: dict[str, tuple[type[np.integer], int]] = {
    "BF16": (np.int16, 0x7F80),
    "F16": (np.int16, 0x7C00),
    "F32": (np.int32, 0x7F800000),
    "F64": (np.int64, 0x7FF0000000000000),
    "F8_E5M2": (np.int8, 0x7C),
    "F8_E4M3": (np.int8, 0x7F),
}
# Dtype codes with no NaN or Inf to look for.
NEVER_NAN = frozenset({"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64"})


def all_finite_in_blocks(tensor: torch.Tensor) -> bool:
    """:func:`all_finite` without a mask of the whole tensor.

    A contiguous tensor of a common float type is checked on its bits, with two maxima and no temporary: NaN and Inf
    are the values whose exponent bits are all ones (faster than ``aminmax``, which widens bf16 to float). Others take
    one ``aminmax`` pass: it propagates NaN, and a tensor is finite when its min and max are (far faster than
    ``isfinite(t).all()``, which builds a mask). Measurements: docs/performance.md.
    """
    import torch

    if tensor.numel() == 0 or not tensor.is_floating_point():
        return all_finite(tensor)
    code = _code_of(tensor.dtype)
    if code in EXPONENT_BITS and tensor.is_contiguous():
        bits, mask = EXPONENT_BITS[code]
        return _no_exponent_all_ones(tensor.reshape(-1).view(torch.uint8).numpy().view(bits), bits, mask)
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


def _code_of(dtype: torch.dtype) -> str | None:
    try:
        return code_of(dtype)
    except KeyError:  # a dtype safetensors cannot hold (float8 e4m3fnuz...)
        return None


def _no_exponent_all_ones(values: np.ndarray, bits: type[np.integer], mask: int) -> bool:
    """No value whose ``mask`` bits are all ones, i.e. none whose bits without the sign reach ``mask`` (the mask is the
    highest bits under the sign). Two maxima and no temporary: a positive value reaches it as a signed integer, a
    negative one reaches ``sign | mask`` as an unsigned integer, and neither reaches the other's bound. Masking first
    wrote every value once more, and took longer (measured: docs/performance.md)."""
    if not values.size:
        return True
    sign = 1 << (8 * values.itemsize - 1)
    unsigned = values.view(np.dtype(bits).str.replace("i", "u"))
    return int(values.max()) < mask and int(unsigned.max()) < sign | mask
