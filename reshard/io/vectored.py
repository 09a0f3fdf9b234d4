"""Whole reads and writes of many buffers at once (``preadv`` / ``pwritev``), the rows of strided tensors,
and dropping the pages of memory-mapped files once read.

Writing a column block of a row-parallel weight, or reading a rank slice into its column block of the
gathered tensor, moves rows that are contiguous on their own but not together. Handing the kernel
the list of rows moves them without first copying the block into a contiguous temporary.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from reshard.io.joined import Joined

if TYPE_CHECKING:
    import torch

# Rows shorter than this are not worth a buffer each: the caller copies blocks of rows with torch instead.
# Every row costs Python calls (a memoryview, a copy into or out of a staging block) and the threads
# queue for the GIL between them, and row-parallel weights have hundreds of thousands of rows of 1-3 KB.
MIN_ROW_BYTES = 256 << 10
# One pwritev moves at most this many bytes. A buffered write holds the file's inode lock for the
# whole call, so with huge calls (a 262 MB tensor at once) two threads writing one file take turns
# for long stretches, one of them spinning on the lock; smaller calls were no better.
WRITE_BYTES = 1 << 20
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


def row_views(tensor: torch.Tensor | Joined, *, min_row: int = MIN_ROW_BYTES) -> list[memoryview] | None:
    """Memoryviews of the tensor's contiguous runs in C order, without a copy; None if the runs are
    shorter than ``min_row`` bytes or the last dim is strided."""
    if isinstance(tensor, Joined):
        runs = [row_views(part, min_row=min_row) for part in tensor.parts]
        found = [views for views in runs if views is not None]
        return None if len(found) < len(runs) else [view for views in found for view in views]
    if tensor.numel() == 0:
        return []
    if tensor.is_contiguous():
        return [_bytes_of(tensor.reshape(-1))]
    if tensor.stride(-1) != 1:
        return None
    first = tensor.dim() - 1  # the run is the trailing dims that are contiguous together
    while first > 0 and tensor.stride(first - 1) == tensor.stride(first) * tensor.shape[first]:
        first -= 1
    itemsize = tensor.element_size()
    run = math.prod(tensor.shape[first:]) * itemsize
    if run < min_row:
        return None
    import numpy as np
    import torch

    offsets = np.zeros((), dtype=np.int64)
    for size, stride in zip(tensor.shape[:first], tensor.stride()[:first], strict=True):
        offsets = offsets[..., None] + np.arange(size, dtype=np.int64) * stride
    whole = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    base = whole.numpy().data
    start = tensor.storage_offset() * itemsize
    return [base[start + o : start + o + run] for o in (offsets.reshape(-1) * itemsize).tolist()]


def _bytes_of(flat: torch.Tensor) -> memoryview:
    import torch

    return flat.view(torch.uint8).numpy().data


def pwrite_all(fd: int, views: Sequence[memoryview], position: int) -> None:
    """Write every buffer (1-d byte views), in order, from ``position`` on (``pwritev`` of at most
    :data:`WRITE_BYTES` per call, resuming short writes); leaves the file position alone, so threads
    may write one file at once."""
    views = [view[o : o + WRITE_BYTES] for view in views for o in range(0, len(view), WRITE_BYTES)]
    index = 0
    while index < len(views):
        batch: list[memoryview] = []
        size = 0
        for view in views[index : index + IOV_MAX]:
            if batch and size + len(view) > WRITE_BYTES:
                break
            batch.append(view)
            size += len(view)
        count = os.pwritev(fd, batch, position)
        if count == 0:
            raise OSError("write returned 0 bytes")
        position += count
        index = _advance(views, index, count)


def read_all(fd: int, views: Sequence[memoryview], position: int) -> bool:
    """Fill every buffer (1-d byte views), in order, from ``position`` on (``preadv``); False if the file
    ends first."""
    views = [view for view in views if len(view)]
    index = 0
    while index < len(views):
        count = os.preadv(fd, views[index : index + IOV_MAX], position)
        if count == 0:
            return False
        position += count
        index = _advance(views, index, count)
    return True


def _advance(views: list[memoryview], index: int, count: int) -> int:
    """Drop ``count`` bytes from the front of ``views[index:]``; the index of the first unfinished buffer."""
    while count:
        size = len(views[index])
        if count >= size:
            count -= size
            index += 1
        else:
            views[index] = views[index][count:]
            count = 0
    return index


def file_mappings(path: Path) -> list[tuple[int, int, int]]:
    """Where this process maps ``path``: ``(first address, end address, file offset of the first)`` for each
    mapping (from ``/proc/self/maps``; empty where there is none)."""
    target = str(path.resolve())
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n") == target:
                    low, high = (int(x, 16) for x in fields[0].split("-"))
                    ranges.append((low, high, int(fields[2], 16)))
    except OSError:
        return []
    return ranges


def mapped_offset(tensor: torch.Tensor, mappings: Sequence[tuple[int, int, int]]) -> int | None:
    """The file offset of a tensor's first byte when its bytes lie inside one of ``mappings`` (None otherwise)."""
    low = tensor.data_ptr()
    high = low + tensor.numel() * tensor.element_size()
    for start, end, offset in mappings:
        if start <= low and high <= end:
            return offset + low - start
    return None


def release_mapped(tensor: torch.Tensor, mappings: Sequence[tuple[int, int, int]]) -> None:
    """Drop the pages of a tensor memory-mapped from a file out of this process (``MADV_DONTNEED``).

    Pages of a file mapping count as resident memory for as long as they stay mapped; dropping them
    after the bytes were read keeps a conversion from torch files from growing with the file sizes.
    The page cache keeps them, and a later access reads them in again. Only done when the tensor's
    storage lies inside one of ``mappings`` (so anonymous memory, whose pages would be zeroed, never is).
    """
    if _LIBC is None:
        return
    storage = tensor.untyped_storage()
    low, high = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    if not any(start <= low and high <= end for start, end, _ in mappings):
        return
    first, last = -(-low // mmap.PAGESIZE) * mmap.PAGESIZE, high // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        _LIBC.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED)


def _libc() -> ctypes.CDLL | None:
    if sys.platform != "linux":
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


MADV_DONTNEED = 4
_LIBC = _libc()


def return_large_frees_to_os(threshold: int = 1 << 20) -> None:
    """Make glibc serve allocations of ``threshold`` bytes or more with their own mappings.

    glibc raises its mmap threshold as large blocks are freed, after which blocks of up to 32 MB come
    from per-thread heaps that hold on to freed memory; with several threads converting tensors of
    many sizes the resident memory then creeps up by hundreds of MB over a long run. A fixed
    threshold hands every large block back to the OS when freed. A no-op without glibc.
    """
    mallopt = getattr(_LIBC, "mallopt", None)
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, threshold)


M_MMAP_THRESHOLD = -3
