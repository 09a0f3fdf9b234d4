"""Box geometry (pure functions on tuples): byte ranges as contiguous boxes, runs of a box in a chunk, tiling."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.formats.boxes import Box, contiguous_pieces, runs, tiling_problem

shapes = st.lists(st.integers(1, 5), min_size=1, max_size=4).map(tuple)


def region(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    return tensor[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))]


@settings(deadline=None, max_examples=200)
@given(shape=shapes, data=st.data())
def test_contiguous_pieces_concatenate_to_the_range(shape, data):
    numel = math.prod(shape)
    first = data.draw(st.integers(0, numel - 1))
    stop = data.draw(st.integers(first + 1, numel))
    tensor = torch.arange(numel).reshape(shape)
    pieces = contiguous_pieces(shape, first, stop)
    assert len(pieces) <= 2 * len(shape) - 1
    assert all(region(tensor, p).is_contiguous() for p in pieces)
    assert torch.equal(torch.cat([region(tensor, p).reshape(-1) for p in pieces]), torch.arange(first, stop))


@settings(deadline=None, max_examples=200)
@given(shape=shapes, data=st.data())
def test_runs_cover_a_box_in_c_order(shape, data):
    offsets = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    sizes = tuple(data.draw(st.integers(1, n - o)) for n, o in zip(shape, offsets, strict=True))
    box = Box(offsets, sizes)
    flat = torch.arange(math.prod(shape))
    found = torch.cat([flat[first : first + count] for first, count in runs(shape, box)])
    assert torch.equal(found, region(flat.reshape(shape), box).reshape(-1))


def test_tiling_accepts_an_exact_cover_with_empty_boxes():
    boxes = [Box((0, 0), (2, 3)), Box((2, 0), (2, 3)), Box((0, 3), (4, 2)), Box((4, 0), (0, 5))]
    assert tiling_problem((4, 5), boxes) is None
    assert tiling_problem((), [Box((), ())]) is None
    assert tiling_problem((0, 5), [Box((0, 0), (0, 5))]) is None


def test_tiling_names_the_gap_and_the_overlap():
    assert tiling_problem((4, 5), [Box((0, 0), (4, 3))]) == "no chunk box covers [0:4, 3:5]"
    overlap = tiling_problem((4, 5), [Box((0, 0), (3, 5)), Box((2, 0), (2, 5))])
    assert overlap == "chunk boxes [0:3, 0:5] and [2:4, 0:5] overlap in [2:3, 0:5]"
    assert tiling_problem((), []) == "no chunk box covers []"
