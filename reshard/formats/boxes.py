"""Boxes: axis-aligned regions of a global tensor, and the geometry of assembling one from stored boxes.

DCP and Megatron-Core ``torch_dist`` store a tensor as its global shape plus chunk boxes ``(offsets, sizes)``;
one layer of a stacked ``[L, ...]`` tensor is a box too. Everything here is pure arithmetic on tuples of
ints (no torch, no files), so that planning and validation stay instant and testable on plain lists.
"""

from __future__ import annotations

import array
import bisect
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

Shape = tuple[int, ...]
# A tiling check marks every cell of the grid the boxes' edges make; beyond this many cells the boxes
# are too fragmented to be a real checkpoint's chunks (and checking them would take too long).
MAX_CELLS = 1 << 22


@dataclass(frozen=True)
class Box:
    """The region ``[offsets[d], offsets[d] + sizes[d])`` along every dim ``d`` of a tensor."""

    offsets: Shape
    sizes: Shape

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        return cls((0,) * len(shape), tuple(shape))

    @property
    def ends(self) -> Shape:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes, strict=True))

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def intersect(self, other: Box) -> Box | None:
        """The common region, or None when it holds no element."""
        lows = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True))
        highs = tuple(min(a, b) for a, b in zip(self.ends, other.ends, strict=True))
        if any(high <= low for low, high in zip(lows, highs, strict=True)):
            return None
        return Box(lows, tuple(high - low for low, high in zip(lows, highs, strict=True)))

    def within(self, outer: Box) -> Box:
        """This box in the coordinates of ``outer`` (which contains it)."""
        return Box(tuple(a - b for a, b in zip(self.offsets, outer.offsets, strict=True)), self.sizes)

    def fits(self, shape: Sequence[int]) -> bool:
        """True when the box lies inside a tensor of ``shape``."""
        return len(self.offsets) == len(self.sizes) == len(shape) and all(
            o >= 0 and s >= 0 and o + s <= n for o, s, n in zip(self.offsets, self.sizes, shape, strict=True)
        )

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes, strict=True)) + "]"


def contiguous_pieces(sizes: Shape, first: int, stop: int) -> list[Box]:
    """Elements ``[first, stop)`` (C order) of an array of ``sizes``, as boxes each contiguous in C order.

    The boxes follow each other in C order, so the byte range ``[first, stop)`` of a buffer is their
    concatenation; there are at most ``2 * len(sizes) - 1`` of them.
    """
    if first >= stop:
        return []
    if not sizes:
        return [Box((), ())]
    inner = math.prod(sizes[1:])
    row, offset = divmod(first, inner)
    last_row, last_offset = divmod(stop, inner)
    if row == last_row:
        return [_in_row(row, box) for box in contiguous_pieces(sizes[1:], offset, last_offset)]
    pieces = []
    if offset:
        pieces += [_in_row(row, box) for box in contiguous_pieces(sizes[1:], offset, inner)]
        row += 1
    if last_row > row:
        pieces.append(Box((row,) + (0,) * (len(sizes) - 1), (last_row - row, *sizes[1:])))
    if last_offset:
        pieces += [_in_row(last_row, box) for box in contiguous_pieces(sizes[1:], 0, last_offset)]
    return pieces


def _in_row(row: int, box: Box) -> Box:
    return Box((row, *box.offsets), (1, *box.sizes))


def runs(sizes: Shape, region: Box) -> Iterator[tuple[int, int]]:
    """``(first element, count)`` of each contiguous run of ``region`` in a C-ordered array of ``sizes``,
    in C order."""
    if region.numel == 0:
        return
    if not sizes:
        yield 0, 1
        return
    strides = c_strides(sizes)
    dim = len(sizes) - 1  # the run spans dims dim.. (every dim after dim is whole)
    while dim > 0 and region.sizes[dim] == sizes[dim]:
        dim -= 1
    count = region.sizes[dim] * strides[dim]
    base = sum(o * s for o, s in zip(region.offsets, strides, strict=True))
    for index in itertools.product(*(range(n) for n in region.sizes[:dim])):
        yield base + sum(i * s for i, s in zip(index, strides, strict=False)), count


def c_strides(sizes: Sequence[int]) -> Shape:
    """Element strides of a C-ordered array."""
    strides, step = [], 1
    for size in reversed(sizes):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def tiling_problem(shape: Shape, boxes: Sequence[Box]) -> str | None:
    """None when ``boxes`` (each inside ``shape``) cover every element of ``shape`` exactly once; else what
    is wrong: the first region no box covers, or two boxes that overlap and where."""
    breaks = [
        sorted({0, size, *(b.offsets[d] for b in boxes), *(b.ends[d] for b in boxes)}) for d, size in enumerate(shape)
    ]
    cells = [len(edges) - 1 for edges in breaks]
    total = math.prod(cells)
    if total > MAX_CELLS:
        return f"{len(boxes)} chunk boxes cut it into {total} cells, too fragmented to check"
    owner = array.array("i", [-1]) * total  # the box covering each cell
    steps = c_strides(cells)
    for number, box in enumerate(boxes):
        if box.numel == 0:
            continue
        spans = [
            range(bisect.bisect_left(edges, o), bisect.bisect_left(edges, e))
            for edges, o, e in zip(breaks, box.offsets, box.ends, strict=True)
        ]
        for index in itertools.product(*spans):
            cell = sum(i * s for i, s in zip(index, steps, strict=True))
            if owner[cell] >= 0:
                other = boxes[owner[cell]]
                return f"chunk boxes {other} and {box} overlap in {other.intersect(box)}"
            owner[cell] = number
    if -1 in owner:
        index = _unravel(owner.index(-1), cells)
        low = tuple(edges[i] for edges, i in zip(breaks, index, strict=True))
        high = tuple(edges[i + 1] for edges, i in zip(breaks, index, strict=True))
        return f"no chunk box covers {Box(low, tuple(h - lo for lo, h in zip(low, high, strict=True)))}"
    return None


def _unravel(flat: int, sizes: Sequence[int]) -> Shape:
    index = []
    for size in reversed(sizes):
        flat, rest = divmod(flat, size)
        index.append(rest)
    return tuple(reversed(index))
