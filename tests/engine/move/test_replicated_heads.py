"""KV heads copied onto several ranks when the tp is a larger multiple of their count, as vLLM runs GQA.

The layout is vLLM's ``QKVParallelLinear`` (vllm/model_executor/layers/linear.py): ``num_kv_head_replicas =
tp / kv_heads`` and rank r loads KV head ``r // num_kv_head_replicas``. Checked here: the shape arithmetic,
the tensor functions, the in-place engine against them bit for bit, a real Qwen3 model (2 KV heads) taken
through tp 1 -> 2 -> 4 -> 8 -> 1, each rank computing its own attention heads, and the refusals.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from fixtures.hf import load_folder
from fixtures.models import logits, tiny_qwen3
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from reshard.engine.move import gather as engine_gather
from reshard.engine.move.work import plan_work
from reshard.engine.plan.planner import SourceTensor, TargetTensor, TensorPlan
from reshard.errors import DivergentReplicaError, ShapeMismatchError
from reshard.formats.readers import SafetensorsReader, TorchReader
from reshard.formats.safetensors.writer import tensor_bytes
from reshard.geometry import (
    ReplicatedHeads,
    Shard,
    at_tp,
    canonical_shape,
    head_replicas,
    partition_from_dict,
    partition_to_dict,
    rank_shapes,
)
from reshard.geometry.tensors import gather, split
from reshard.io.direct import ALIGN
from reshard.layouts.base import TensorRef
from reshard.plans.lora import lora_partition, parse_lora_name


def arange(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape).to(dtype)


def vllm_rank_slice(full: torch.Tensor, kv_heads: int, tp: int, rank: int) -> torch.Tensor:
    """What vLLM's QKVParallelLinear.weight_loader loads on ``rank`` for a k/v weight, written as it does."""
    if tp >= kv_heads:
        num_kv_heads, replicas = 1, tp // kv_heads
    else:
        num_kv_heads, replicas = kv_heads // tp, 1
    shard_size = num_kv_heads * (full.shape[0] // kv_heads)
    shard_rank = rank // replicas
    return full.narrow(0, shard_rank * shard_size, shard_size)


# ---------------------------------------------------------------- shape arithmetic


def test_rank_shapes_copy_heads_past_their_count_and_split_them_below():
    kv = ReplicatedHeads(0, heads=2)
    assert rank_shapes(kv, (16, 64), 1) == [(16, 64)]
    assert rank_shapes(kv, (16, 64), 2) == [(8, 64)] * 2
    assert rank_shapes(kv, (16, 64), 8) == [(8, 64)] * 8
    assert [head_replicas(kv, tp) for tp in (1, 2, 4, 8)] == [1, 1, 2, 4]
    with pytest.raises(ShapeMismatchError, match="holds 2 heads: tp=3 neither divides them nor is a multiple"):
        rank_shapes(kv, (16, 64), 3)
    with pytest.raises(ShapeMismatchError, match="size 15 is not 2 equal heads"):
        rank_shapes(kv, (15, 64), 4)
    assert canonical_shape(kv, [(8, 64)] * 8) == (16, 64)  # one copy of each of the 2 heads
    assert canonical_shape(kv, [(8, 64)] * 2) == (16, 64)
    with pytest.raises(ShapeMismatchError, match=r"rank sizes \[8, 8, 8, 4\]"):
        canonical_shape(kv, [(8, 64)] * 3 + [(4, 64)])


def test_recorded_as_replicated_heads_only_where_heads_are_copied():
    kv = ReplicatedHeads(0, heads=4)
    assert at_tp(kv, (32, 64), 2) == Shard(0, unit=8)
    assert at_tp(kv, (32, 64), 4) == Shard(0, unit=8)
    assert at_tp(kv, (32, 64), 8) == kv
    assert partition_to_dict(kv) == {"kind": "replicated_heads", "dim": 0, "heads": 4}
    assert partition_from_dict(partition_to_dict(kv)) == kv
    with pytest.raises(ValueError, match="needs the field 'heads'"):
        partition_from_dict({"kind": "replicated_heads", "dim": 0})


def test_lora_b_of_a_kv_projection_has_its_heads():
    kv = ReplicatedHeads(0, heads=2)
    a, b = parse_lora_name("k_proj.lora_A.weight"), parse_lora_name("k_proj.lora_B.weight")
    assert lora_partition(kv, b) == kv
    assert lora_partition(kv, a).describe() == "replicate"


# ---------------------------------------------------------------- tensor functions


@settings(deadline=None, max_examples=60)
@given(
    heads=st.sampled_from([1, 2, 4]),
    tp=st.sampled_from([1, 2, 4, 8, 16]),
    head_dim=st.integers(1, 4),
    dim=st.sampled_from([0, 1]),
)
def test_split_is_vllms_layout_and_gather_inverts_it(heads, tp, head_dim, dim):
    if heads % tp and tp % heads:
        return
    shape = (heads * head_dim, 3) if dim == 0 else (3, heads * head_dim)
    full, kv = arange(*shape), ReplicatedHeads(dim, heads)
    pieces = split(full, kv, tp)
    assert [tuple(p.shape) for p in pieces] == rank_shapes(kv, shape, tp)
    if dim == 0:
        assert all(torch.equal(p, vllm_rank_slice(full, heads, tp, r)) for r, p in enumerate(pieces))
    assert torch.equal(gather([p.clone() for p in pieces], kv), full)


def test_gather_names_the_ranks_whose_copies_differ():
    full, kv = arange(4, 3), ReplicatedHeads(0, heads=2)
    pieces = [p.clone() for p in split(full, kv, 8)]
    pieces[6][1, 2] += 0.25  # rank 6 holds head 1, first copied on rank 4
    with pytest.raises(DivergentReplicaError, match=r"replicated KV head 1 differs between rank 4 and rank 6 .*0\.25"):
        gather(pieces, kv)
    assert torch.equal(gather(pieces, kv, allow_divergent=True), full)  # the first copy of each head


# ---------------------------------------------------------------- the engine, bit for bit against slicing


def refs_of(tmp_path: Path, slices: list[torch.Tensor], fmt: str) -> tuple[TensorRef, ...]:
    refs = []
    for rank, piece in enumerate(slices):
        path = tmp_path / f"rank{rank}.{'safetensors' if fmt == 'safetensors' else 'pt'}"
        if fmt == "safetensors":
            save_file({"w": piece.contiguous()}, path)
            reader = SafetensorsReader(path)
        else:
            torch.save({"w": piece.contiguous()}, path)
            reader = TorchReader(path)
        refs.append(TensorRef("w", rank, reader, "w", reader.headers["w"]))
    return tuple(refs)


def _plan(source: SourceTensor, rank_shapes: tuple) -> TensorPlan:
    """One tensor kept under its name and partition, split into ``rank_shapes``."""
    return TensorPlan(
        (source,), (TargetTensor(source.name, source.shape, source.code, source.partition, rank_shapes),)
    )


ENGINE_CASES = {
    "tp8-to-tp2": ((16, 6), 0, 2, 8, 2),
    "tp2-to-tp8": ((16, 6), 0, 2, 2, 8),
    "tp8-to-tp16": ((32, 5), 0, 4, 8, 16),
    "tp4-to-tp1": ((8, 3), 0, 1, 4, 1),  # multi-query attention: one KV head on every rank
    "dim1-tp8-to-tp4": ((3, 16), 1, 2, 8, 4),  # a head dim off dim 0 goes through the short-row path
    "3d-tp4-to-tp8": ((2, 8, 1024), 1, 2, 4, 8),
}


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
@pytest.mark.parametrize("case", list(ENGINE_CASES), ids=list(ENGINE_CASES))
def test_engine_gathers_and_splits_as_slicing_does(tmp_path, case, fmt):
    shape, dim, heads, source_tp, target_tp = ENGINE_CASES[case]
    kv = ReplicatedHeads(dim, heads)
    full = arange(*shape, dtype=torch.bfloat16 if fmt == "torch" else torch.float32)
    slices = split(full, kv, source_tp)
    targets = tuple(rank_shapes(kv, shape, target_tp))
    plan = _plan(SourceTensor("w", refs_of(tmp_path, slices, fmt), kv, "test", shape), targets)
    work = plan_work(plan, target_tp=target_tp)
    assert work.buffer_shapes == (shape,)  # one copy of each head, never tp / heads of them
    slice_bytes = max(ref.header.nbytes for ref in plan.sources[0].refs)
    # near one tensor: the buffer (with its phase slack) and one slice-sized temporary
    assert work.cost <= full.nbytes + ALIGN + slice_bytes
    ((_, canonical, pieces),) = engine_gather.gather_and_split(work, allow_divergent=False)
    assert torch.equal(canonical, full) and torch.equal(gather([s.clone() for s in slices], kv), full)
    expected = split(full, kv, target_tp)
    assert [bytes(tensor_bytes(p)) for p in pieces] == [bytes(tensor_bytes(e)) for e in expected]


def test_engine_names_the_file_and_ranks_of_a_differing_copy(tmp_path):
    full, kv = arange(16, 6), ReplicatedHeads(0, heads=2)
    slices = [s.clone() for s in split(full, kv, 8)]
    slices[3][0, 0] = -1.0  # rank 3 holds head 0, first copied on rank 0
    refs = refs_of(tmp_path, slices, "safetensors")
    plan = _plan(SourceTensor("w", refs, kv, "test", (16, 6)), ((16, 6),))
    work = plan_work(plan, target_tp=1)
    with pytest.raises(
        DivergentReplicaError, match=r"rank0\.safetensors: w: replicated KV head 0 differs between rank 0 and rank 3"
    ):
        engine_gather.gather_and_split(work, allow_divergent=False)
    divergent: set[str] = set()
    ((_, canonical, _),) = engine_gather.gather_and_split(work, allow_divergent=True, divergent=divergent)
    assert torch.equal(canonical, full) and divergent == {"w"}


# ---------------------------------------------------------------- a real model


@pytest.fixture(scope="module")
def qwen3_kv2(tmp_path_factory):
    """Qwen3 with 16 query heads and 2 KV heads of 8: tp 4 and 8 copy each KV head onto 2 and 4 ranks."""
    path = tmp_path_factory.mktemp("kv2")
    model = tiny_qwen3(path / "full", vocab=1024, num_key_value_heads=2)
    return path, model


def rank_file(folder: Path, rank: int) -> dict[str, torch.Tensor]:
    return load_file(folder / f"rank_{rank:02d}" / "model.safetensors")


def test_round_trip_through_copied_heads_is_bit_exact(qwen3_kv2, cli):
    path, model = qwen3_kv2
    original = load_folder(path / "full")
    previous = path / "full"
    for tp in (2, 4, 8, 1):
        out = path / f"chain-tp{tp}"
        assert cli("convert", previous, "--tp", tp, "-o", out, "-q").exit_code == 0
        manifest = json.loads((out / "reshard.json").read_text())["tensors"]
        k_proj = manifest["model.layers.0.self_attn.k_proj.weight"]["partition"]
        if tp in (4, 8):
            assert k_proj == {"kind": "replicated_heads", "dim": 0, "heads": 2}
            for rank in range(tp):
                ranked = rank_file(out, rank)
                for name in ("k_proj.weight", "v_proj.weight"):
                    full = original[f"model.layers.1.self_attn.{name}"]
                    assert torch.equal(ranked[f"model.layers.1.self_attn.{name}"], vllm_rank_slice(full, 2, tp, rank))
        else:
            assert k_proj == {"kind": "shard", "dim": 0, "unit": 8}
        previous = out
    back = load_folder(previous)
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in original)
    reloaded = type(model).from_pretrained(previous).eval()
    assert torch.equal(logits(reloaded, 1024), logits(model, 1024))
    assert cli("verify", path / "chain-tp8").exit_code == 0  # read back by its manifest


def test_each_rank_computes_its_query_heads_with_the_kv_head_it_holds(qwen3_kv2, cli):
    """Rank attention modules (2 query heads, 1 KV head each at tp 8) fed the rank files sum to the layer."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding

    path, model = qwen3_kv2
    out = path / "tp8-compute"
    assert cli("convert", path / "full", "--tp", 8, "-o", out, "-q").exit_code == 0
    config = model.config
    x = torch.randn(2, 9, config.hidden_size, generator=torch.Generator().manual_seed(3))
    position = Qwen3RotaryEmbedding(config)(x, torch.arange(9)[None].expand(2, -1))
    local = copy.deepcopy(config)
    local.num_attention_heads, local.num_key_value_heads = config.num_attention_heads // 8, 1
    prefix = "model.layers.0.self_attn."
    with torch.no_grad():
        expected, _ = model.model.layers[0].self_attn(x, position_embeddings=position, attention_mask=None)
        total = 0
        for rank in range(8):
            attention = Qwen3Attention(local, 0).eval()
            state = {k.removeprefix(prefix): v for k, v in rank_file(out, rank).items() if k.startswith(prefix)}
            attention.load_state_dict(state)
            total = total + attention(x, position_embeddings=position, attention_mask=None)[0]
    torch.testing.assert_close(total, expected, rtol=0, atol=1e-5)


def test_check_notes_the_copies_and_inspect_shows_them(qwen3_kv2, cli):
    path, _ = qwen3_kv2
    result = cli("check", path / "full" / "config.json", "--tp", 8, "--json")
    report = json.loads(result.stdout)
    assert result.exit_code == 0 and report["ok"]
    (note,) = [p for p in report["problems"] if p["message"].startswith("num_key_value_heads")]
    assert note["severity"] == "note" and "copied onto 4 ranks" in note["message"]
    k_row = next(t for t in report["tensors"] if t["name"] == "model.layers.0.self_attn.k_proj.weight")
    assert k_row["partition"] == {"kind": "replicated_heads", "dim": 0, "heads": 2} and k_row["rank_shape"] == [8, 64]
    text = cli("check", path / "full", "--tp", 8)
    assert "note: num_key_value_heads=2 heads, fewer than the 8 ranks" in text.output
    assert cli("convert", path / "full", "--tp", 8, "-o", path / "inspected", "-q").exit_code == 0
    inspected = json.loads(cli("inspect", path / "inspected", "--json").stdout)
    row = next(t for t in inspected["tensors"] if t["name"] == "model.layers.0.self_attn.v_proj.weight")
    assert row["partition"]["kind"] == "replicated_heads" and row["shape"] == [16, 64]


def test_sat_output_refuses_copied_heads_in_one_line(qwen3_kv2, cli):
    path, _ = qwen3_kv2
    out = path / "sat"
    result = cli("convert", path / "full", "--tp", 4, "--layout", "sat", "-o", out)
    assert result.exit_code == 2 and not out.exists()
    (line,) = result.stderr.strip().splitlines()
    assert line.endswith(
        "tp=4 copies KV heads (model.layers.0.self_attn.k_proj.weight and 3 more), but SAT splits every head count "
        "exactly (mpu divide) and cannot load copies of a KV head (choose a tp that divides the KV heads, or "
        "--layout hf-ranks)"
    )
    assert cli("convert", path / "full", "--tp", 2, "--layout", "sat", "-o", out, "-q").exit_code == 0


def test_megatron_output_refuses_copied_heads_in_one_line(cli, tmp_path):
    """A plan file may declare copies on a Megatron source; the megatron layout cannot hold them."""
    plan = tmp_path / "plan.toml"
    plan.write_text(
        "extends = \"megatron\"\n[[rules]]\npattern = 'linear_qkv\\.layer_norm_weight$'\n"
        'kind = "replicated_heads"\ndim = 0\nheads = 1\n'
    )
    sample = Path(__file__).resolve().parents[3] / "sample_ckpts" / "tiny-megatron-tp8"
    out = tmp_path / "out"
    result = cli("convert", sample, "--tp", 2, "--plan", plan, "-o", out, "--vocab", 500)
    assert result.exit_code == 2 and not out.exists()
    (line,) = result.stderr.strip().splitlines()
    assert (
        "tp=2 copies KV heads (decoder.layers.0.self_attention.linear_qkv.layer_norm_weight and 1 more), but "
        "Megatron stores KV heads as query groups and cannot load copies of a KV head" in line
    )
    keep = ("--vocab", 500, "--keep-names")  # the copies stay under their Megatron names in hf-ranks
    assert (
        cli("convert", sample, "--tp", 2, "--plan", plan, "--layout", "hf-ranks", "-o", out, "-q", *keep).exit_code
        == 0
    )
