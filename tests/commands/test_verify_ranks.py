"""``verify``'s rank check: a rank whose piece of the recorded cut is its own slice is proven by the numbers, and
that proof agrees with reading the bytes; any other cut (other sizes, copies) is read or streamed and compared."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from fixtures import SAMPLES
from safetensors.torch import load_file, save_file

from reshard import ConvertOptions, convert
from reshard.commands import verify_ranks, verify_slices
from reshard.engine.move.gather import gather_canonical
from reshard.engine.plan.open import open_checkpoint
from reshard.engine.plan.planner import SourceTensor
from reshard.geometry import Packed, Replicate, Shard, Vocab
from reshard.options import ReadOptions


@pytest.mark.parametrize("tp", [2, 4])
def test_own_rows_hold_exactly_where_each_ranks_piece_is_its_slice(tmp_path: Path, tp: int) -> None:
    convert(SAMPLES / "tiny-llama-tp2", tmp_path / "out", ConvertOptions(tp=tp, progress=False))
    opened = open_checkpoint(tmp_path / "out", ReadOptions(), target_tp=1, recorded_plan=True)
    proven = []
    for tensor in opened.tensors:
        if not verify_ranks._own_rows(tensor):
            continue
        proven.append(tensor.name)
        whole = gather_canonical(tensor)
        diffs: list = []  # what the check read and compared before
        assert verify_slices.same_slices(whole, tensor, (tensor.partition, tensor.reason), diffs), tensor.name
        assert diffs == []
    assert "model.layers.0.self_attn.q_proj.weight" in proven  # column-parallel
    assert "model.layers.0.self_attn.o_proj.weight" in proven  # row-parallel
    assert "model.embed_tokens.weight" in proven  # a vocab: its data rows
    assert "model.layers.0.input_layernorm.weight" not in proven  # copies: compared
    assert verify_ranks.check_ranks(tmp_path / "out", ReadOptions()) == (len(opened.tensors), [])


def _tensor(partition: object, shape: tuple[int, ...], *shapes: tuple[int, ...]) -> SourceTensor:
    refs = tuple(SimpleNamespace(shape=s) for s in shapes)
    return SourceTensor("w", refs, partition, "test", shape)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("tensor", "own"),
    [
        (_tensor(Shard(0), (8, 4), (4, 4), (4, 4)), True),
        (_tensor(Shard(1), (4, 8), (4, 4), (4, 4)), True),
        (_tensor(Packed(0, (4, 2)), (6, 3), (3, 3), (3, 3)), True),  # two runs a rank
        (_tensor(Shard(0), (8, 4), (3, 4), (5, 4)), False),  # sizes neither split rule gives
        (_tensor(Shard(0), (10, 4), (4, 4), (4, 4), (2, 4)), True),  # torch.chunk's uneven sizes
        (_tensor(Shard(0), (8, 4), (4, 4), (4, 5)), False),  # another dim differs
        (_tensor(Replicate(), (4,), (4,), (4,)), False),
        (_tensor(Vocab(0), (6, 4), (4, 4), (4, 4)), True),  # two pad rows on the last rank
        (_tensor(Vocab(0), (6, 4), (3, 4), (5, 4)), False),  # not the sizes the padded split gives
    ],
)
def test_own_rows_by_the_numbers(tensor: SourceTensor, own: bool) -> None:
    assert verify_ranks._own_rows(tensor) is own


def test_a_copy_that_differs_is_found_block_by_block(tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert(SAMPLES / "tiny-llama-tp2", out, ConvertOptions(tp=2, progress=False))
    path, norm = out / "rank_01" / "model.safetensors", "model.layers.0.input_layernorm.weight"
    state = load_file(path)
    state[norm][-1] += 1
    save_file(state, path, metadata={"format": "pt"})
    checked, diffs = verify_ranks.check_ranks(out, ReadOptions())
    assert [(d.kind, d.tensor) for d in diffs] == [("inconsistent", norm)]
    assert "rank 0 and rank 1" in diffs[0].detail
    assert checked == len(open_checkpoint(out, ReadOptions(), target_tp=1).tensors) - 1
