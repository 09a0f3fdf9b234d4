"""The mapping transforms: shapes from headers, bytes from torch, and each transform undone by its inverse."""

from __future__ import annotations

import pytest
import torch

from reshard.errors import ShapeMismatchError
from reshard.mappings.transforms import (
    Chain,
    Chunk,
    Concat,
    FuseGroupedQKV,
    Parallel,
    Rename,
    RopePermute,
    RopeUnpermute,
    SplitGroupedQKV,
)


def test_grouped_qkv_split_takes_each_group_s_heads() -> None:
    """3 groups of 2 query heads (head size 2): rows of group g are [q_2g, q_2g+1, k_g, v_g]."""
    split = SplitGroupedQKV(groups=3, q_per_group=2, head_dim=2)
    qkv = torch.arange(3 * 4 * 2 * 5).reshape(24, 5)
    q, k, v = split.apply([qkv])
    assert [tuple(t.shape) for t in (q, k, v)] == split.target_shapes([(24, 5)]) == [(12, 5), (6, 5), (6, 5)]
    for g in range(3):
        block = qkv[g * 8 : (g + 1) * 8]
        assert torch.equal(q[g * 4 : (g + 1) * 4], block[:4])
        assert torch.equal(k[g * 2 : (g + 1) * 2], block[4:6])
        assert torch.equal(v[g * 2 : (g + 1) * 2], block[6:8])
    assert torch.equal(FuseGroupedQKV(3, 2, 2).apply([q, k, v])[0], qkv)
    assert split.inverse() == FuseGroupedQKV(3, 2, 2)


@pytest.mark.parametrize("shape", [(24,), (24, 3)], ids=["bias", "weight"])
def test_grouped_qkv_round_trip(shape: tuple[int, ...]) -> None:
    split = SplitGroupedQKV(groups=2, q_per_group=4, head_dim=2)
    fused = torch.arange(torch.Size(shape).numel()).reshape(shape)
    assert torch.equal(split.inverse().apply(split.apply([fused]))[0], fused)


def test_shapes_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ShapeMismatchError, match="25 rows, not 2 groups"):
        SplitGroupedQKV(groups=2, q_per_group=4, head_dim=2).target_shapes([(25, 3)])
    with pytest.raises(ShapeMismatchError, match="do not make"):
        FuseGroupedQKV(groups=2, q_per_group=4, head_dim=2).target_shapes([(16, 3), (4, 3), (5, 3)])
    with pytest.raises(ShapeMismatchError, match="equal parts"):
        Chunk(2).target_shapes([(7, 3)])
    with pytest.raises(ShapeMismatchError, match="differ"):
        Concat(2).target_shapes([(3, 3), (4, 3)])


def test_chunk_gives_views_and_concat_undoes_it() -> None:
    fc1 = torch.arange(40).reshape(8, 5)
    gate, up = Chunk(2).apply([fc1])
    assert gate.data_ptr() == fc1.data_ptr() and torch.equal(up, fc1[4:])
    assert torch.equal(Concat(2).apply([gate, up])[0], fc1)
    assert Rename().apply([fc1])[0] is fc1


def _meta_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Meta's reference RoPE (llama/model.py): consecutive pairs of a head rotate as complex numbers."""
    dim = x.shape[-1]
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.polar(torch.ones(len(positions), dim // 2, dtype=torch.float64), torch.outer(positions, freqs))
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], dim // 2, 2))
    return torch.view_as_real(pairs * angles).flatten(-2)


def test_rope_permutation_makes_transformers_rope_compute_meta_s() -> None:
    """Query and key projections laid out for Meta's pairwise RoPE give, once permuted, the same attention
    scores under transformers' rotate_half RoPE (forgetting this gives garbage text: torchtitan#1291)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    heads, head_dim, hidden, seq = 4, 8, 12, 5
    torch.manual_seed(0)
    wq, wk = (torch.randn(heads * head_dim, hidden, dtype=torch.float64) for _ in range(2))
    x = torch.randn(seq, hidden, dtype=torch.float64)
    positions = torch.arange(seq, dtype=torch.float64)

    def meta_heads(w: torch.Tensor) -> torch.Tensor:
        per_head = (x @ w.T).reshape(seq, heads, head_dim).transpose(0, 1)
        return torch.stack([_meta_rope(per_head[h], positions, 10000.0) for h in range(heads)])

    meta_q, meta_k = meta_heads(wq), meta_heads(wk)
    config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, head_dim=head_dim)
    cos, sin = LlamaRotaryEmbedding(config)(x[None].float(), positions[None].long())

    def hf_heads(w: torch.Tensor) -> torch.Tensor:
        return (x @ RopePermute(heads).apply([w])[0].T).reshape(1, seq, heads, head_dim).transpose(1, 2)

    q, k = apply_rotary_pos_emb(hf_heads(wq), hf_heads(wk), cos.double(), sin.double())
    assert torch.allclose(q[0] @ k[0].transpose(-1, -2), meta_q @ meta_k.transpose(-1, -2), atol=1e-6)
    assert not torch.allclose(meta_q @ meta_k.transpose(-1, -2), _unpermuted_scores(x, wq, wk, cos, sin, heads))
    assert torch.equal(RopePermute(heads).inverse().apply(RopePermute(heads).apply([wq]))[0], wq)


def _unpermuted_scores(x, wq, wk, cos, sin, heads: int) -> torch.Tensor:
    """What transformers computes from Meta's layout without the permutation: different scores."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    seq = x.shape[0]
    q, k = ((x @ w.T).reshape(1, seq, heads, -1).transpose(1, 2) for w in (wq, wk))
    q, k = apply_rotary_pos_emb(q, k, cos.double(), sin.double())
    return q[0] @ k[0].transpose(-1, -2)


def test_chain_and_parallel_compose_and_invert() -> None:
    """torchtitan's fused ``wqkv``: split per KV group, then permute q (4 heads) and k (2 heads), v as it is."""
    split = SplitGroupedQKV(groups=2, q_per_group=2, head_dim=4)
    chain = Chain((split, Parallel((RopePermute(4), RopePermute(2), Rename()))))
    fused = torch.arange(2 * 4 * 4 * 3).reshape(32, 3)
    q, k, v = chain.apply([fused])
    plain = split.apply([fused])
    assert torch.equal(q, RopePermute(4).apply([plain[0]])[0]) and torch.equal(k, RopePermute(2).apply([plain[1]])[0])
    assert torch.equal(v, plain[2])
    assert chain.target_shapes([(32, 3)]) == [(16, 3), (8, 3), (8, 3)] and (chain.sources, chain.targets) == (1, 3)
    assert torch.equal(chain.inverse().apply([q, k, v])[0], fused)
    assert chain.inverse() == Chain(
        (Parallel((RopeUnpermute(4), RopeUnpermute(2), Rename())), FuseGroupedQKV(2, 2, 4))
    )
    assert "then" in chain.describe()
    with pytest.raises(ShapeMismatchError, match="16 rows are not 3 heads of an even size"):
        Chain((split, Parallel((RopePermute(3), RopePermute(2), Rename())))).target_shapes([(32, 3)])


@pytest.mark.parametrize(
    "transform",
    [Rename(), Chunk(2), Concat(2), RopePermute(2), Chain((Chunk(2), Parallel((Rename(), RopeUnpermute(1)))))],
    ids=["rename", "chunk", "concat", "rope", "chain"],
)
def test_a_mapping_transform_makes_its_targets_and_knows_nothing_of_their_values(transform) -> None:
    """The engine's side of the protocol (reshard.mappings.transforms.Transform): no output handed in, one False per
    target."""
    tensors = [torch.arange(8.0).reshape(4, 2) for _ in range(transform.sources)]
    finite: list[bool] = []
    made = transform.apply(tensors, finite=finite)
    assert transform.writes_into is False
    assert finite == [False] * transform.targets == [False] * len(made)
    with pytest.raises(TypeError, match="writes into no tensor it is given"):
        transform.apply(tensors, out=[torch.empty(4, 2)])
