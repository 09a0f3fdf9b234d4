"""A thread's reusable buffer for short-lived copies: blocks of rows on their way to or from the disk.

Fresh memory costs a page fault and the zeroing of every page, about as much as copying the bytes, and a
conversion copies about half its bytes as column blocks in pieces of up to 16 MB (each block of a gathered
tensor's short rows, read or written contiguously). So each thread keeps one buffer and copies into it again.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from reshard.io.direct import ALIGN

if TYPE_CHECKING:
    import torch

_local = threading.local()


@contextlib.contextmanager
def scratch(like: torch.Tensor, *, phase: int = 0) -> Iterator[torch.Tensor]:
    """An uninitialised tensor of ``like``'s shape and dtype, on this thread's buffer while the block lasts.

    It starts ``phase`` bytes into a 4 KB page when that is a multiple of the dtype's size: a block read
    from or written to a file offset on that phase goes straight between the file and this memory, not
    through the direct-I/O staging buffers (:func:`reshard.io.direct.in_phase`). A nested (or interleaved)
    user in the same thread gets a buffer of its own, never the same bytes.
    """
    import torch

    nbytes = like.numel() * like.element_size()
    buffer = getattr(_local, "free", None)
    _local.free = None
    if buffer is None or buffer.numel() < nbytes + ALIGN:
        buffer = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    start = (phase - buffer.data_ptr()) % ALIGN if phase % like.element_size() == 0 else 0
    try:
        yield buffer[start : start + nbytes].view(like.dtype).view(like.shape)
    finally:
        kept = getattr(_local, "free", None)
        if kept is None or kept.numel() < buffer.numel():
            _local.free = buffer
