"""Memory for gathering: buffers reused across tensors, and the byte budget that bounds what is in flight.

A tensor is only started when the bytes of every prepared-but-unwritten tensor plus its own fit in the
budget (``2 x`` the largest tensor), or when nothing else is in flight; the buffers kept for reuse count
in the same budget. So memory stays near ``2 x`` the largest tensor whatever the size of the checkpoint.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from reshard.io.direct import ALIGN
from reshard.io.memory import huge_bytes

if TYPE_CHECKING:
    import torch

    from reshard.engine.move.work import Work

MIN_BUDGET = 64 << 20
Shape = tuple[int, ...]


class BufferPool:
    """Hands out gather buffers and takes them back once written, to hand them out again.

    Fresh memory costs a page fault and the zeroing of every page, about as much as reading the
    bytes; and the same sizes come again and again (every layer has the same shapes, and the plan
    orders tensors by size). Buffers are kept by byte size; free ones are dropped when keeping them
    would take the memory held (in use or free) over ``limit``.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free: dict[int, list[torch.Tensor]] = {}
        self._held = 0
        self.peak = 0
        self._lock = threading.Lock()

    def get(self, shape: Shape, dtype: torch.dtype, *, phase: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A raw byte buffer (give it back with :meth:`put`) and a tensor of ``shape`` and ``dtype`` on it,
        starting ``phase`` bytes into a 4 KB page (:func:`reshard.engine.move.work.read_phase`): every buffer has
        :data:`~reshard.io.direct.ALIGN` bytes of slack for that."""
        nbytes = math.prod(shape) * dtype.itemsize + ALIGN
        raw = None
        with self._lock:
            if self._free.get(nbytes):
                raw = self._free[nbytes].pop()
            else:
                while self._held + nbytes > self.limit and any(self._free.values()):
                    size = max(size for size, free in self._free.items() if free)
                    self._free[size].pop()
                    self._held -= size
                self._held += nbytes
                self.peak = max(self.peak, self._held)
        if raw is None:
            import torch

            raw = torch.from_numpy(huge_bytes(nbytes))  # in 2 MB pages: a direct read into it goes out whole
        start = (phase - raw.data_ptr()) % ALIGN
        return raw, raw[start : start + nbytes - ALIGN].view(dtype).view(shape)

    def put(self, raw: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault(raw.numel(), []).append(raw)


class Budget:
    """Bytes held by tensors started but not yet written. Used from one thread only."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.peak = 0

    def take(self, cost: int) -> bool:
        """Hold ``cost`` bytes if they fit, or if nothing is held (a tensor larger than the budget runs alone)."""
        if self.held and self.held + cost > self.limit:
            return False
        self.held += cost
        self.peak = max(self.peak, self.held)
        return True

    def give(self, cost: int) -> None:
        self.held -= cost


def budget_for(works: Sequence[Work]) -> int:
    """Twice the largest tensor (and its buffer's slack): one being written while the next is read."""
    largest = max((w.tensor.nbytes for w in works), default=0)
    return max(2 * (largest + ALIGN), MIN_BUDGET)
