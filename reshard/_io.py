"""Whole reads and writes of many buffers at once (``preadv`` / ``writev``), and the rows of strided tensors.

Writing a column block of a row-parallel weight, or reading a rank slice into its column block of the
gathered tensor, moves rows that are contiguous on their own but not together. Handing the kernel
the list of rows moves them without first copying the block into a contiguous temporary.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np
import torch

# Rows shorter than this are not worth one iovec each: the caller copies the block instead.
MIN_ROW_BYTES = 1024
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


def row_views(tensor: torch.Tensor, *, min_row: int = MIN_ROW_BYTES) -> list[memoryview] | None:
    """Memoryviews of the tensor's contiguous runs in C order, without a copy; None if the runs are
    shorter than ``min_row`` bytes or the last dim is strided."""
    if tensor.numel() == 0:
        return []
    if tensor.is_contiguous():
        return [_bytes_of(tensor.reshape(-1))]
    if tensor.stride(-1) != 1:
        return None
    first = tensor.dim() - 1  # the run is the trailing dims that are contiguous together
    while first > 0 and tensor.stride(first - 1) == tensor.stride(first) * tensor.shape[first]:
        first -= 1
    if math.prod(tensor.shape[first:]) * tensor.element_size() < min_row:
        return None
    rows = tensor.flatten(first).view(torch.uint8).numpy()
    return [memoryview(rows[index]) for index in np.ndindex(rows.shape[:-1])]


def _bytes_of(flat: torch.Tensor) -> memoryview:
    return memoryview(flat.view(torch.uint8).numpy())


def write_all(fd: int, views: Sequence[memoryview]) -> None:
    """Write every buffer, in order, at the file position (``writev`` in batches, resuming short writes)."""
    views = [v.cast("B") for v in views if v.nbytes]
    index = 0
    while index < len(views):
        count = os.writev(fd, views[index : index + IOV_MAX])
        if count == 0:
            raise OSError("write returned 0 bytes")
        index = _advance(views, index, count)


def read_all(fd: int, views: Sequence[memoryview], position: int) -> bool:
    """Fill every buffer, in order, from ``position`` on (``preadv``); False if the file ends first."""
    views = [v.cast("B") for v in views if v.nbytes]
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
