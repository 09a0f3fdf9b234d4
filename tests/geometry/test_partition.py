"""``reshard.geometry``: rank shapes and full shapes of every partition kind, and their dict form."""

from __future__ import annotations

import pytest

from reshard.errors import ShapeMismatchError
from reshard.geometry import (
    Grouped,
    Heads,
    Packed,
    Replicate,
    Shard,
    Vocab,
    at_tp,
    canonical_shape,
    partition_from_dict,
    partition_to_dict,
    rank_shapes,
    split_sizes,
)


def test_shapes_that_do_not_add_up_are_refused():
    with pytest.raises(ShapeMismatchError, match="differ outside dim 0"):
        canonical_shape(Shard(0), [(4, 8), (4, 7)])
    with pytest.raises(ShapeMismatchError, match=r"rank sizes \[4, 3\] along dim 0 are not a shard"):
        canonical_shape(Shard(0), [(4, 8), (3, 8)])
    with pytest.raises(ShapeMismatchError, match="fewer than the vocab 65535"):
        canonical_shape(Vocab(0), [(32768, 8)], vocab_size=65535)
    with pytest.raises(ShapeMismatchError, match="2 blocks of 16, which do not divide by tp=4"):
        rank_shapes(Shard(0, unit=16), (32, 8), 4)
    with pytest.raises(ShapeMismatchError, match="does not divide by tp=3"):
        split_sizes(10, 3)


def test_vocab_canonical_shape_unpads():
    assert canonical_shape(Vocab(0), [(32768, 16), (32768, 16)], vocab_size=65535) == (65535, 16)


@pytest.mark.parametrize(
    "partition",
    [
        Replicate(),
        Shard(1),
        Shard(0, unit=64),
        Vocab(0),
        Packed(0, (8, 4, 4)),
        Packed(0, (8, 4), units=(4, 2)),
        Heads(-1, 14),
    ],
    ids=lambda p: p.describe(),
)
def test_partition_dict_round_trip(partition):
    assert partition_from_dict(partition_to_dict(partition)) == partition


def test_unknown_partition_kind_is_named():
    with pytest.raises(ValueError, match="unknown partition kind 'colwise'"):
        partition_from_dict({"kind": "colwise"})
    with pytest.raises(ValueError, match="needs the field 'dim'"):
        partition_from_dict({"kind": "shard"})


@pytest.mark.parametrize(("groups", "tp"), [(2, 3), (4, 6), (6, 4)])
def test_grouped_refuses_tp_that_mixes_groups(groups: int, tp: int) -> None:
    with pytest.raises(ShapeMismatchError, match=f"holds {groups} groups: tp={tp} neither divides"):
        rank_shapes(Grouped(0, groups), (groups * 12, 8), tp)


def test_grouped_round_trips_through_its_dict_form() -> None:
    assert partition_to_dict(Grouped(0, 2)) == {"kind": "grouped", "dim": 0, "groups": 2}
    assert partition_from_dict({"kind": "grouped", "dim": 0, "groups": 2}) == Grouped(0, 2)


def test_heads_split_whole_heads_of_the_width_the_size_gives():
    """14 heads of 6 (an MLA o_proj's columns): tp 2 holds 7 each and is recorded as shard(unit=6); tp 4 would cut
    one; --uneven is torch.chunk's rows; a size that is not 14 heads is refused, --uneven or not."""
    assert rank_shapes(Heads(-1, 14), (64, 84), 2) == [(64, 42), (64, 42)]
    assert at_tp(Heads(-1, 14), (64, 84), 2) == Shard(-1, unit=6)
    with pytest.raises(
        ShapeMismatchError, match="dim 1 holds 14 heads, which tp=4 does not divide: a head would be cut"
    ):
        rank_shapes(Heads(-1, 14), (64, 84), 4)
    assert rank_shapes(Heads(0, 14), (84, 8), 4, uneven=True) == [(21, 8), (21, 8), (21, 8), (21, 8)]
    assert rank_shapes(Heads(0, 14), (112, 8), 4, uneven=True) == [(28, 8)] * 4
    assert rank_shapes(Heads(0, 14), (70, 8), 4, uneven=True) == [(18, 8), (18, 8), (18, 8), (16, 8)]
    assert canonical_shape(Heads(0, 14), [(18, 8), (18, 8), (18, 8), (16, 8)], uneven=True) == (70, 8)
    for uneven in (False, True):
        with pytest.raises(ShapeMismatchError, match="dim 0 size 85 is not 14 equal heads"):
            rank_shapes(Heads(0, 14), (85, 8), 2, uneven=uneven)
