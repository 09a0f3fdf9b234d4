"""The shared checkpoint builders (``tests/fixtures``) follow the frameworks' rules they claim, checked against the
real ``transformers`` models and against small hand-written layouts, never against reshard."""

from __future__ import annotations

from pathlib import Path

import torch
from fixtures.hf import llama_state_dict
from fixtures.megatron import PAD_FILL, TINY, full_model, megatron_qkv, rank_state, te_extra_state
from fixtures.models import tiny_llama, tiny_qwen3_5
from fixtures.shapes import llama_config, llama_shapes, one_layer_llama, qwen3_5_shapes
from fixtures.tp import gather_pieces, rank_piece
from fixtures.trainer import rank_states


def shapes_of(model) -> dict[str, tuple[int, ...]]:
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def test_llama_shapes_are_transformers_own(tmp_path: Path) -> None:
    model = tiny_llama(tmp_path / "llama", num_key_value_heads=4)  # 8 heads of 8, hidden 64, 2 layers, vocab 1001
    assert llama_shapes(llama_config()) == shapes_of(model)


def test_qwen3_5_shapes_are_transformers_own(tmp_path: Path) -> None:
    model = tiny_qwen3_5(tmp_path / "qwen3_5")
    assert qwen3_5_shapes(model.config.to_dict()) == shapes_of(model)


def test_trainer_pads_the_vocab_with_junk() -> None:
    """The pad rows of the last rank are junk (>= 3, never a trained value), so keeping one would show."""
    state = llama_state_dict(one_layer_llama(vocab_size=65535))  # hidden 8
    ranks = rank_states(state, 2)
    assert ranks[1]["lm_head.weight"].shape == (32768, 8)
    assert (ranks[1]["lm_head.weight"][-1] >= 3).all()
    assert torch.equal(torch.cat([r["lm_head.weight"] for r in ranks])[:65535], state["lm_head.weight"])


def test_tp_cuts_gather_back() -> None:
    full = torch.arange(48.0).reshape(12, 4)
    for kind in ("rep", "col", "row", ("packed", (4, 8))):
        assert torch.equal(gather_pieces([rank_piece(full, kind, 4, r) for r in range(4)], kind), full)
    assert rank_piece(full, ("packed", (4, 8)), 4, 1)[:, 0].tolist() == [4.0, 24.0, 28.0]  # row 1 of q, rows 2-3 of kv


def test_megatron_qkv_is_interleaved_per_query_group() -> None:
    """Reference notes 1.4: group g's rows are its nh/ng query heads, then its K head, then its V head."""
    q, k, v = torch.arange(8.0)[:, None], 100 + torch.arange(2.0)[:, None], 200 + torch.arange(2.0)[:, None]
    assert megatron_qkv(q, k, v, 2).flatten().tolist() == [0, 1, 2, 3, 100, 200, 4, 5, 6, 7, 101, 201]


def test_megatron_ranks_follow_megatron_s_cuts() -> None:
    full = full_model(TINY)
    q, k, v = full["0.q"], full["0.k"], full["0.v"]
    d, per_group = TINY.head_dim, TINY.heads // TINY.groups * TINY.head_dim
    at2, at4 = rank_state(full, TINY, 2, 1), rank_state(full, TINY, 4, 3, extra_state=te_extra_state)
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert torch.equal(at2[qkv], torch.cat([q[per_group:], k[d:], v[d:]]))  # tp 2 = ng: rank 1 holds group 1 whole
    # tp 4 > ng: a contiguous 1/4 of the rows, the second half of group 1 (it cuts through the group's query heads)
    group_rows = per_group + 2 * d
    assert torch.equal(at4[qkv], torch.cat([q[per_group + group_rows // 2 :], k[d:], v[d:]]))
    fc1 = "decoder.layers.1.mlp.linear_fc1.weight"
    assert torch.equal(at4[fc1], torch.cat([full["1.gate"].chunk(4)[3], full["1.up"].chunk(4)[3]]))
    table = at4["output_layer.weight"]  # 50 rows padded to 4 x 4 x 4 = 64: rank 3 holds rows 48-49, then pad
    assert table.shape == (16, TINY.hidden) and torch.equal(table[:2], full["out"][48:])
    assert (table[2:] == PAD_FILL).all()
    assert list(at4).index("decoder.layers.0.self_attention.linear_qkv._extra_state") == list(at4).index(qkv) + 2
