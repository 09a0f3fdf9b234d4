"""Buffers for direct I/O backed by 2 MB pages where the kernel has them.

Why: a direct request is cut into segments of physically contiguous memory, and a virtio disk takes only so many
segments a request (``max_segments``; about 1 MB of 4 KB pages on a common virtio disk). From memory of 4 KB pages
an 8 MB direct read then goes to the device as eight requests of 1 MB; from 2 MB pages as two of 4 MB (its
``max_sectors_kb``), which more than doubles a cold read and reaches the speed of the page cache's read-ahead
(measured: docs/performance.md). Transparent huge pages in the ``madvise`` mode
(the common default) back only memory that asks for them, private and anonymous, on 2 MB boundaries: so the
buffers are mapped here, not taken from ``malloc`` or a shared mapping.
"""

from __future__ import annotations

import mmap

import numpy as np

# The size of a transparent huge page on x86-64 and arm64 with 4 KB pages.
HUGE_PAGE = 2 << 20
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)
_FLAGS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)


def huge_bytes(nbytes: int) -> np.ndarray:
    """``nbytes`` bytes (a 1-d ``uint8`` array) for direct I/O: from :data:`HUGE_PAGE` on, starting on a 2 MB
    boundary in 2 MB pages where the platform gives them (else ordinary pages), unmapped when the last view of the
    array goes; below it from ``numpy`` (a request under 1 MB needs no more segments than a disk takes, and a 2 MB
    page for a small tensor would be zeroed whole)."""
    if nbytes < HUGE_PAGE:
        return np.empty(nbytes, dtype=np.uint8)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE
    mapping = mmap.mmap(-1, size, flags=_FLAGS) if _FLAGS else mmap.mmap(-1, size)
    if _ADVICE is not None:
        try:
            mapping.madvise(_ADVICE)
        except OSError:  # a kernel without transparent huge pages
            pass
    whole = np.frombuffer(mapping, dtype=np.uint8)
    start = -whole.ctypes.data % HUGE_PAGE
    return whole[start : start + nbytes]
