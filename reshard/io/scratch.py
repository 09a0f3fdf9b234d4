"""A thread's reusable buffer for short-lived copies: blocks of rows on their way to or from the disk.

Fresh memory costs a page fault and the zeroing of every page, about as much as copying the bytes, and a
conversion copies about half its bytes as column blocks in pieces of up to 16 MB (each block of a gathered
tensor's short rows, read or written contiguously). So each thread keeps one buffer and copies into it again.
The buffer is a numpy byte array, so that the byte stream (:mod:`reshard.engine.move.stream`) uses it without torch;
:func:`scratch` lends it to torch callers as a tensor on the same memory.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from reshard.io.direct import ALIGN
from reshard.io.memory import huge_bytes

if TYPE_CHECKING:
    import torch

_local = threading.local()


@contextlib.contextmanager
def scratch_bytes(nbytes: int, *, phase: int = 0) -> Iterator[np.ndarray]:
    """``nbytes`` uninitialised bytes (a 1-d ``uint8`` array) on this thread's buffer while the block lasts,
    starting ``phase`` bytes into a 4 KB page: a block read from or written to a file offset on that phase goes
    straight between the file and this memory, not through the direct-I/O staging buffers
    (:func:`reshard.io.direct.in_phase`). A nested (or interleaved) user in the same thread gets a buffer of its
    own, never the same bytes."""
    buffer = getattr(_local, "free", None)
    _local.free = None
    if buffer is None or buffer.size < nbytes + ALIGN:
        buffer = huge_bytes(nbytes + ALIGN)
    start = (phase - buffer.ctypes.data) % ALIGN
    try:
        yield buffer[start : start + nbytes]
    finally:
        kept = getattr(_local, "free", None)
        if kept is None or kept.size < buffer.size:
            _local.free = buffer


@contextlib.contextmanager
def scratch(like: torch.Tensor, *, phase: int = 0) -> Iterator[torch.Tensor]:
    """:func:`scratch_bytes` as an uninitialised tensor of ``like``'s shape and dtype (on ``phase`` when that is a
    multiple of the dtype's size)."""
    import torch

    itemsize = like.element_size()
    with scratch_bytes(like.numel() * itemsize, phase=phase if phase % itemsize == 0 else 0) as block:
        yield torch.from_numpy(block).view(like.dtype).view(like.shape)
