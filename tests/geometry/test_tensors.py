"""``reshard.geometry.tensors``: split then gather is the identity, for every partition kind, dtype, dim and
dividing tp."""

from __future__ import annotations

import pytest
import torch
from fixtures.tp import arange
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.errors import DivergentReplicaError
from reshard.geometry import Grouped, Heads, Packed, Replicate, Shard, Vocab, rank_shapes
from reshard.geometry.tensors import bitwise_equal, gather, pad, split, unpad

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool]
TPS = [1, 2, 4, 8]


@settings(deadline=None, max_examples=60)
@given(
    tp=st.sampled_from(TPS),
    dim=st.sampled_from([0, 1, 2, -1]),
    blocks=st.lists(st.integers(1, 5), min_size=3, max_size=3),
    dtype=st.sampled_from(DTYPES),
)
def test_shard_split_then_gather_is_identity(tp, dim, blocks, dtype):
    shape = list(blocks)
    shape[dim] *= tp
    full = arange(tuple(shape), dtype)
    pieces = split(full, Shard(dim), tp)
    assert [tuple(p.shape) for p in pieces] == rank_shapes(Shard(dim), full.shape, tp)
    assert bitwise_equal(gather(pieces, Shard(dim)), full)


@settings(deadline=None, max_examples=60)
@given(tp=st.sampled_from(TPS), rows=st.integers(1, 40), dim=st.sampled_from([0, 1]), dtype=st.sampled_from(DTYPES))
def test_vocab_pads_then_gather_unpads(tp, rows, dim, dtype):
    shape = (rows, 3) if dim == 0 else (3, rows)
    full = arange(shape, dtype)
    padded = -(-rows // tp) * tp
    pieces = split(full, Vocab(dim), tp, padded=padded)
    assert sum(p.shape[dim] for p in pieces) == padded
    assert len({p.shape for p in pieces}) == 1
    tail = torch.cat(pieces, dim=dim).narrow(dim, rows, padded - rows)
    assert not tail.to(torch.float32).any(), "pad rows are zeros"
    assert bitwise_equal(gather(pieces, Vocab(dim), vocab_size=rows), full)


@settings(deadline=None, max_examples=60)
@given(
    tp=st.sampled_from(TPS),
    part_blocks=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    dtype=st.sampled_from(DTYPES),
)
def test_packed_split_then_gather_is_identity(tp, part_blocks, dtype):
    parts = tuple(b * tp for b in part_blocks)
    full = arange((sum(parts), 2), dtype)
    pieces = split(full, Packed(0, parts), tp)
    assert bitwise_equal(gather(pieces, Packed(0, parts)), full)


@settings(deadline=None, max_examples=40)
@given(tp=st.sampled_from([2, 3, 4, 8]), rows=st.integers(1, 30))
def test_uneven_follows_torch_chunk(tp, rows):
    full = arange((rows, 2), torch.float32)
    pieces = split(full, Shard(0), tp, uneven=True)
    expected = list(torch.chunk(full, tp, dim=0))
    assert [p.shape[0] for p in pieces[: len(expected)]] == [e.shape[0] for e in expected]
    assert all(p.shape[0] == 0 for p in pieces[len(expected) :])
    assert bitwise_equal(gather(pieces, Shard(0), uneven=True), full)


def test_packed_rank_holds_its_piece_of_every_part():
    q, k, v = torch.arange(0, 8), torch.arange(100, 104), torch.arange(200, 204)
    pieces = split(torch.cat([q, k, v]), Packed(0, (8, 4, 4)), 2)
    assert pieces[0].tolist() == [0, 1, 2, 3, 100, 101, 200, 201]
    assert pieces[1].tolist() == [4, 5, 6, 7, 102, 103, 202, 203]


def test_replicate_checks_copies():
    a = torch.arange(6.0)
    assert torch.equal(gather([a, a.clone()], Replicate()), a)
    with pytest.raises(DivergentReplicaError, match="differs between rank 0 and rank 1 .max abs diff 1"):
        gather([a, a + torch.tensor([0, 0, 1.0, 0, 0, 0])], Replicate())
    assert torch.equal(gather([a, a + 1], Replicate(), allow_divergent=True), a)


def test_nan_copies_with_equal_bits_are_equal():
    a = torch.tensor([float("nan"), 1.0])
    assert bitwise_equal(a, a.clone())
    assert not torch.equal(a, a.clone())


def test_pad_and_unpad():
    t = torch.arange(6.0).reshape(3, 2)
    padded = pad(t, 0, 5)
    assert padded.shape == (5, 2) and torch.equal(padded[3:], torch.zeros(2, 2))
    assert torch.equal(unpad(padded, 0, 3), t)
    assert pad(t, 1, 2) is t


def test_grouped_splits_whole_groups_or_spreads_each_group() -> None:
    # 2 groups of 6 rows (4 query heads + k + v, head dim 1): rows 0-5 group 0, rows 6-11 group 1
    full = torch.arange(12)
    assert [t.tolist() for t in split(full, Grouped(0, 2), 2)] == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    # tp 4 > 2 groups: each group spread over 2 ranks, as Megatron core stores it
    assert [t.tolist() for t in split(full, Grouped(0, 2), 4)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert torch.equal(gather(split(full, Grouped(0, 2), 4), Grouped(0, 2)), full)


def test_heads_split_whole_heads_and_gather_back() -> None:
    full = torch.arange(168).reshape(2, 84)  # 14 heads of 6 columns: rank 0 holds heads 0-6
    ranks = split(full, Heads(-1, 14), 2)
    assert torch.equal(ranks[0], full[:, :42]) and torch.equal(gather(ranks, Heads(-1, 14)), full)
    uneven = split(full.T, Heads(0, 14), 4, uneven=True)  # 3.5 heads a rank: torch.chunk's rows
    assert all(torch.equal(a, b) for a, b in zip(uneven, full.T.chunk(4), strict=True))
    assert torch.equal(gather(uneven, Heads(0, 14), uneven=True), full.T)


def test_swiglu_fc1_re_pairs_gate_and_up() -> None:
    gate, up = torch.arange(8), torch.arange(100, 108)
    tp8 = [torch.cat([gate[r : r + 1], up[r : r + 1]]) for r in range(8)]  # Megatron: [gate_r; up_r]
    full = gather(tp8, Packed(0, (8, 8)))
    assert torch.equal(full, torch.cat([gate, up]))
    assert not torch.equal(torch.cat(tp8), full)  # plain concatenation would interleave gate and up
    tp4 = split(full, Packed(0, (8, 8)), 4)
    assert [t.tolist() for t in tp4] == [[2 * r, 2 * r + 1, 100 + 2 * r, 101 + 2 * r] for r in range(4)]
