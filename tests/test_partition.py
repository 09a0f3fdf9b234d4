"""``reshard.partition``: rank shapes and full shapes of every partition kind, and their dict form."""

from __future__ import annotations

import pytest

from reshard.errors import ShapeMismatchError
from reshard.partition import (
    Grouped,
    Packed,
    Replicate,
    Shard,
    Vocab,
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
    [Replicate(), Shard(1), Shard(0, unit=64), Vocab(0), Packed(0, (8, 4, 4)), Packed(0, (8, 4), units=(4, 2))],
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
