"""``reshard.engine.plan.planner`` on plain data: headers in, partitions, canonical shapes and per-rank target shapes
out.

Planning must never read a tensor's bytes (``reshard check`` answers from headers alone), so every reader here
raises when asked for bytes; the one way bytes may be consulted, the ``replicas_equal`` callback, is checked
apart. Every expected shape is worked out by hand from a tiny Llama (hidden 16, 4 query heads and 2 KV heads of
4, MLP 32, vocab 13) saved at tp 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from reshard.config import ModelConfig
from reshard.dtypes import TensorHeader
from reshard.engine.plan.planner import (
    ConversionPlan,
    TargetTensor,
    TensorPlan,
    identity_plan,
    plan_conversion,
    plan_sources,
)
from reshard.errors import AmbiguousPartitionError, PlanError, ReshardError, ShapeMismatchError
from reshard.formats.readers import FileReader
from reshard.geometry import Replicate, ReplicatedHeads, Shard, Vocab
from reshard.layouts.base import SourceCheckpoint, TensorRef
from reshard.plans.llama import LLAMA_PLAN
from reshard.vocab import VocabPlan

Shape = tuple[int, ...]
CONFIG = ModelConfig(
    {
        "model_type": "llama",
        "hidden_size": 16,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 32,
        "vocab_size": 13,
    }
)
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
Q, K = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
ATTN_OUT, GATE = "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_proj.weight"
DOWN, NORM = "model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight"
# Rank slices at tp 2: the vocab (13) padded to 14 rows, 7 per rank; q in whole heads of 4 rows, k one KV head
# per rank, o and down split along dim 1.
TP2 = {
    EMBED: (7, 16),
    HEAD: (7, 16),
    Q: (8, 16),
    K: (4, 16),
    ATTN_OUT: (16, 8),
    GATE: (16, 16),
    DOWN: (16, 16),
    NORM: (16,),
}


class NoBytes(FileReader):
    """A file known from its headers only: reading any tensor's bytes fails the test."""

    def __init__(self, path: Path, headers: dict[str, TensorHeader]) -> None:
        self.path, self.headers, self.extras, self.notes = path, headers, {}, []

    def get(self, key: str) -> Any:
        raise AssertionError(f"planning read the bytes of {key} in {self.path}")

    def read_into(self, key: str, out: Any, *, start: int = 0) -> None:
        raise AssertionError(f"planning read the bytes of {key} in {self.path}")


def checkpoint(ranks: list[dict[str, Shape | TensorHeader]], config: ModelConfig | None = CONFIG) -> SourceCheckpoint:
    """A source checkpoint of one file per rank holding these headers (a bare shape is BF16)."""
    refs = []
    for rank, tensors in enumerate(ranks):
        headers = {n: h if isinstance(h, TensorHeader) else TensorHeader(h, "BF16") for n, h in tensors.items()}
        reader = NoBytes(Path(f"/nowhere/rank_{rank}.safetensors"), headers)
        refs.append({name: TensorRef(name, rank, reader, name, header) for name, header in headers.items()})
    return SourceCheckpoint(Path("/nowhere"), "hf-ranks", refs, config=config)


def planned(source: SourceCheckpoint, target_tp: int, **options: Any) -> ConversionPlan:
    tensors = plan_sources(source, LLAMA_PLAN, vocab_size=13, target_tp=target_tp)
    return plan_conversion(source, tensors, vocab=VocabPlan(13, "config.json"), target_tp=target_tp, **options)


def rank_shapes_of(conversion: ConversionPlan) -> dict[str, tuple[Shape, ...]]:
    return {t.name: t.rank_shapes for plan in conversion.tensors for t in plan.targets}


def test_plan_sources_gives_each_tensor_its_rule_partition_and_canonical_shape() -> None:
    tensors = {t.name: t for t in plan_sources(checkpoint([TP2, TP2]), LLAMA_PLAN, vocab_size=13)}
    assert {name: (t.partition, t.shape) for name, t in tensors.items()} == {
        EMBED: (Vocab(0), (13, 16)),  # 14 rows of the two ranks, the pad row cut
        HEAD: (Vocab(0), (13, 16)),
        Q: (Shard(0, unit=4), (16, 16)),  # whole heads of head_dim 16 / 4
        K: (ReplicatedHeads(0, 2), (8, 16)),
        ATTN_OUT: (Shard(1, unit=4), (16, 16)),
        GATE: (Shard(0), (32, 16)),
        DOWN: (Shard(1), (16, 32)),
        NORM: (Replicate(), (16,)),
    }
    assert all(t.problem is None for t in tensors.values())
    assert tensors[Q].reason == r"rule 'self_attn\.q_proj\.(weight|bias)$' (llama)"
    assert [ref.rank for ref in tensors[Q].refs] == [0, 1]
    assert [ref.file.name for ref in tensors[Q].refs] == ["rank_0.safetensors", "rank_1.safetensors"]
    assert tensors[Q].code == "BF16"


# Per-rank target shapes, by hand: vocab 13 padded to a multiple of the tp (13, 14, 16); q in whole 4-row heads;
# k's 2 KV heads split at tp 2 and each copied onto 2 ranks at tp 4.
EXPECTED = {
    1: {EMBED: [(13, 16)], Q: [(16, 16)], K: [(8, 16)], ATTN_OUT: [(16, 16)], GATE: [(32, 16)], DOWN: [(16, 32)]},
    2: {EMBED: [(7, 16)] * 2, Q: [(8, 16)] * 2, K: [(4, 16)] * 2, ATTN_OUT: [(16, 8)] * 2, GATE: [(16, 16)] * 2},
    4: {EMBED: [(4, 16)] * 4, Q: [(4, 16)] * 4, K: [(4, 16)] * 4, ATTN_OUT: [(16, 4)] * 4, DOWN: [(16, 8)] * 4},
}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_plan_conversion_gives_each_target_rank_its_shape(tp: int) -> None:
    conversion = planned(checkpoint([TP2, TP2]), tp)
    shapes = rank_shapes_of(conversion)
    assert {name: list(shapes[name]) for name in EXPECTED[tp]} == EXPECTED[tp]
    assert shapes[NORM] == ((16,),) * tp
    assert shapes[HEAD] == shapes[EMBED]
    assert conversion.target_tp == tp and conversion.uneven is False
    # the canonical shape travels unchanged: only the rank shapes depend on the tp
    assert {t.name: t.shape for plan in conversion.tensors for t in plan.targets}[EMBED] == (13, 16)


@pytest.mark.parametrize(("tp", "padded"), [(1, 13), (2, 14), (4, 16)])
def test_the_vocab_plan_records_the_pad_rows_of_source_and_target(tp: int, padded: int) -> None:
    vocab = planned(checkpoint([TP2, TP2]), tp).vocab
    assert vocab == VocabPlan(13, "config.json", source_padded=14, target_padded=padded, pad_multiple=tp)


def test_a_pad_multiple_pads_further_and_uneven_pads_not_at_all() -> None:
    padded = planned(checkpoint([TP2, TP2]), 2, pad_multiple=8)
    assert padded.vocab.target_padded == 16 and padded.vocab.pad_multiple == 8
    assert rank_shapes_of(padded)[EMBED] == ((8, 16), (8, 16))

    uneven = planned(checkpoint([TP2, TP2]), 4, uneven=True)
    assert uneven.vocab.target_padded == 13 and uneven.vocab.pad_multiple is None
    assert rank_shapes_of(uneven)[EMBED] == ((4, 16), (4, 16), (4, 16), (1, 16))  # torch.chunk's 4, 4, 4, 1


def test_target_tensors_come_in_the_order_safetensors_writes_them() -> None:
    """Wider dtypes first (F32 before BF16), then by name, as ``safetensors.torch.save_file`` lays them out."""
    ranks = [{**TP2, NORM: TensorHeader((16,), "F32")} for _ in range(2)]
    names = [plan.name for plan in planned(checkpoint(ranks), 2).tensors]
    assert names == [NORM, HEAD, EMBED, DOWN, GATE, K, ATTN_OUT, Q]


def test_identity_plan_keeps_the_name_partition_and_shape() -> None:
    (source,) = (t for t in plan_sources(checkpoint([TP2, TP2]), LLAMA_PLAN, vocab_size=13) if t.name == ATTN_OUT)
    plan = identity_plan(source)
    assert plan == TensorPlan((source,), (TargetTensor(ATTN_OUT, (16, 16), "BF16", Shard(1, unit=4)),))
    assert plan.transform is None and plan.targets[0].rank_shapes == ()
    assert plan.nbytes == 16 * 16 * 2


def test_bytes_are_consulted_only_through_the_replica_callback() -> None:
    """A tensor no rule covers whose ranks have equal shapes needs its bytes: without the callback it carries a
    problem; with it, the callback is asked about its two rank slices and no reader is touched."""
    extra = "model.layers.0.extra.weight"
    source = checkpoint([{extra: (3, 5)}, {extra: (3, 5)}])
    (headers_only,) = plan_sources(source, LLAMA_PLAN, vocab_size=13, target_tp=2)
    assert headers_only.partition is None and headers_only.shape is None
    assert isinstance(headers_only.problem, AmbiguousPartitionError)
    assert headers_only.problem.detail == "no plan rule, and rank shapes [[3, 5], [3, 5]] need its bytes to tell"

    asked: list[tuple[str, ...]] = []

    def replicas_equal(refs: Any) -> bool:
        asked.append(tuple(f"{ref.name}@{ref.rank}" for ref in refs))
        return True

    (told,) = plan_sources(source, LLAMA_PLAN, vocab_size=13, target_tp=2, replicas_equal=replicas_equal)
    assert (told.partition, told.shape, told.reason) == (Replicate(), (3, 5), "inferred: identical on every rank")
    assert set(asked) == {(f"{extra}@0", f"{extra}@1")}


def broken_ranks() -> list[dict[str, Shape | TensorHeader]]:
    """Four faults at tp 2: a tensor missing on rank 1, ranks disagreeing on a dtype, a tensor no rule can
    plan from shapes, and q slices that are not a split of whole heads."""
    rank0: dict[str, Shape | TensorHeader] = {**TP2, "model.only_here.weight": (2, 2), "model.extra.weight": (3, 5)}
    rank1: dict[str, Shape | TensorHeader] = {**TP2, "model.extra.weight": (3, 5)}
    rank1[NORM] = TensorHeader((16,), "F32")
    rank1[Q] = (4, 16)
    return [rank0, rank1]


def test_every_problem_is_raised_together_in_one_plan_error() -> None:
    """Four tensors that cannot be planned, then (at tp 3) four that planned but cannot be split 3 ways: one
    error lists all eight, each naming its file and tensor; the vocab (13 padded to 15) splits 3 ways fine."""
    source = checkpoint(broken_ranks())
    tensors = plan_sources(source, LLAMA_PLAN, vocab_size=13, target_tp=3)
    with pytest.raises(PlanError, match=r"^8 problems:\n  /nowhere/rank_0.safetensors: ") as raised:
        plan_conversion(source, tensors, vocab=VocabPlan(13, "config.json"), target_tp=3)
    problems = raised.value.problems
    assert [(type(p), p.tensor, p.path) for p in problems] == [
        (ShapeMismatchError, Q, "/nowhere/rank_0.safetensors"),
        (ShapeMismatchError, NORM, "/nowhere/rank_0.safetensors"),
        (ShapeMismatchError, "model.only_here.weight", "/nowhere/rank_0.safetensors"),
        (AmbiguousPartitionError, "model.extra.weight", "/nowhere/rank_0.safetensors"),
        (ShapeMismatchError, K, "/nowhere/rank_0.safetensors"),
        (ShapeMismatchError, ATTN_OUT, "/nowhere/rank_0.safetensors"),
        (ShapeMismatchError, GATE, "/nowhere/rank_0.safetensors"),
        (ShapeMismatchError, DOWN, "/nowhere/rank_0.safetensors"),
    ]
    assert problems[0].detail.startswith("shard(dim=0, unit=4) (rule ")
    assert "rank sizes [8, 4] along dim 0 are not a shard(dim=0, unit=4) split of 12 over tp=2" in problems[0].detail
    assert problems[1].detail == "ranks disagree on dtype: ['torch.bfloat16', 'torch.float32']"
    assert (problems[2].detail, problems[2].hint) == (
        "missing on rank(s) [1] of 2",
        "every rank file must hold every tensor",
    )
    assert problems[3].hint == "add a rule for it with --plan FILE"
    assert problems[4].hint == "choose a tp that divides the 2 heads or is a multiple of them"
    assert problems[5].hint == "choose a tp that divides it"  # whole heads: --uneven would cut one
    assert problems[6].detail == "shard(dim=0) of [32, 16] cannot be split 3 ways: size 32 does not divide by tp=3"
    assert problems[7].hint == "choose a tp that divides it, or --uneven"


def test_a_pad_multiple_the_tp_does_not_divide_is_a_problem_too() -> None:
    """13 rows padded to a multiple of 3 are 15, which 2 ranks cannot share: said once for the vocab, and for
    each vocab tensor."""
    source = checkpoint([TP2, TP2])
    tensors = plan_sources(source, LLAMA_PLAN, vocab_size=13, target_tp=2)
    with pytest.raises(PlanError, match=r"^3 problems:\n  vocab padded to 15 does not divide by tp=2 \(") as raised:
        plan_conversion(source, tensors, vocab=VocabPlan(13, "config.json"), target_tp=2, pad_multiple=3)
    problems = raised.value.problems
    assert [(type(p), p.tensor) for p in problems] == [
        (ReshardError, None),
        (ShapeMismatchError, EMBED),
        (ShapeMismatchError, HEAD),
    ]
    assert problems[0].hint == "choose --pad-multiple as a multiple of the tp"
    assert problems[1].detail == "vocab(dim=0) of [13, 16] cannot be split 2 ways: size 15 does not divide by tp=2"
