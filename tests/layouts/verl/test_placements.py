"""Where a DTensor's local piece lies, against torch's own cut (``torch.chunk`` and ``distribute_tensor``)."""

from __future__ import annotations

import pytest
import torch

from reshard.formats.boxes import Box
from reshard.formats.safe_pickle import Partial, Replicate, StridedShard
from reshard.layouts.verl.placements import PlacementError, chunk, local_box, shard


@pytest.mark.parametrize("pieces", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("length", [0, 1, 2, 5, 7, 9, 127])
def test_a_shard_is_the_piece_torch_chunk_gives(length: int, pieces: int) -> None:
    rows = torch.arange(length)
    chunks = list(torch.chunk(rows, pieces)) if length else []
    for index in range(pieces):
        start, size = chunk(length, pieces, index)
        want = chunks[index] if index < len(chunks) else rows[length:]
        assert torch.equal(rows[start : start + size], want), (length, pieces, index)


def test_two_mesh_dims_cut_in_mesh_order() -> None:
    """(Shard(0), Shard(1)) on a 2 x 3 mesh: rows by the first coordinate, then columns by the second."""
    full = torch.arange(5 * 7).reshape(5, 7)
    for a in range(2):
        for b in range(3):
            box = local_box((5, 7), (2, 3), (a, b), (shard(0), shard(1)))
            want = torch.chunk(torch.chunk(full, 2, dim=0)[a], 3, dim=1)[b]
            got = full[box.offsets[0] : box.ends[0], box.offsets[1] : box.ends[1]]
            assert torch.equal(got, want)


def test_hsdp_replicates_across_the_first_dim_and_shards_on_the_second() -> None:
    boxes = [local_box((9, 4), (2, 2), (a, b), (Replicate(), shard(0))) for a in range(2) for b in range(2)]
    assert boxes == [Box((0, 0), (5, 4)), Box((5, 0), (4, 4))] * 2


@pytest.mark.parametrize(
    ("placement", "said"),
    [(StridedShard(), "placement _StridedShard"), (Partial(), "placement Partial"), ("x", r"is not Shard\(dim\)")],
)
def test_placements_that_cannot_be_placed_are_refused_by_name(placement, said: str) -> None:
    with pytest.raises(PlacementError, match=said):
        local_box((4,), (2,), (0,), (placement,))


def test_a_coordinate_outside_its_mesh_is_refused() -> None:
    with pytest.raises(PlacementError, match=r"mesh coordinate \(2,\) outside a mesh of \(2,\)"):
        local_box((4,), (2,), (2,), (shard(0),))
