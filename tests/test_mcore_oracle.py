"""The Megatron-Core oracle is right: what it writes reloads at other layouts with the writer's logits, and its
files have the layout the reference notes describe (checked against each other, so a wrong note fails too)."""

from __future__ import annotations

import json
import pickle
import types
from pathlib import Path
from typing import NamedTuple

import numpy as np
import psutil
import pytest
import torch
from oracles import COMMON, SCRIPT, McoreCheckpoint, OracleError, run_jobs
from oracles.variants import Spec

pytestmark = pytest.mark.oracle

LLAMA, TIED, MOE, SHARED = Spec("llama", tp=2), Spec("llama-tied", tp=2), Spec("moe", tp=2), Spec("moe-shared", tp=2)
LLAMA_PP, TIED_PP, VPP = Spec("llama", pp=2), Spec("llama-tied", pp=2), Spec("llama", pp=2, vpp=2)
PAD8 = Spec("llama", tp=2, overrides=(("divisible_by", "8"),))
QKV, PROJ = "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight"
FC1, FC2 = "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"
FLOPS = "num_floating_point_operations_so_far"

# (writer, format, reader layout): every torch_dist checkpoint at new layouts, every legacy one at its own.
LOADS = [
    *[(w, "torch_dist", (tp, pp, 1)) for w in (LLAMA, TIED, SHARED) for tp, pp in ((1, 1), (4, 1), (2, 2))],
    (MOE, "torch_dist", (1, 1, 1)),
    (LLAMA, "torch_dist", (1, 2, 1)),
    (LLAMA_PP, "torch_dist", (1, 1, 1)),
    (LLAMA_PP, "torch_dist", (2, 1, 1)),
    (TIED_PP, "torch_dist", (1, 1, 1)),
    (VPP, "torch_dist", (2, 1, 1)),
    (PAD8, "torch_dist", (1, 1, 1)),  # 1008 rows written, 1000 read
    *[(w, "torch", (w.tp, w.pp, w.vpp)) for w in (LLAMA, TIED, MOE, SHARED, LLAMA_PP, TIED_PP, VPP, PAD8)],
]


def _id(load: tuple) -> str:
    writer, fmt, (tp, pp, vpp) = load
    return f"{writer.slug}-{fmt}-as-tp{tp}-pp{pp}" + (f"-vpp{vpp}" if vpp > 1 else "")


@pytest.fixture(scope="module")
def saved(mcore_oracle) -> dict[Spec, McoreCheckpoint]:
    return dict(zip(COMMON, mcore_oracle.checkpoints(*COMMON), strict=True))


@pytest.fixture(scope="module")
def loaded(mcore_oracle, saved) -> dict[str, dict]:
    requests = []
    for writer, fmt, (tp, pp, vpp) in LOADS:
        root = saved[writer].torch_dist if fmt == "torch_dist" else saved[writer].torch
        requests.append((root, fmt, Spec(writer.variant, tp, pp, writer.overrides, vpp), "assume_ok_unexpected"))
    return dict(zip(map(_id, LOADS), mcore_oracle.load_many(requests), strict=True))


@pytest.mark.parametrize("load", LOADS, ids=_id)
def test_reload_gives_the_writers_logits(load, saved, loaded):
    writer, fmt, (tp, _, _) = load
    ckpt, out = saved[writer], loaded[_id(load)]
    assert torch.equal(out["input_ids"], ckpt.input_ids)
    assert out["logits"].shape == (2, 12, ckpt.variant.padded_vocab(tp))
    torch.testing.assert_close(out["logits"][..., : ckpt.variant.vocab], ckpt.logits, rtol=0, atol=1e-5)
    assert (out["iteration"], out["checkpoint_version"]) == (10, 3.0)
    assert out["args"]["ckpt_format"] == fmt and out["args"]["tensor_model_parallel_size"] == writer.tp


def test_the_comparison_tells_models_apart(saved):
    """The reader starts from other random weights: a load that did nothing could not match (atol 1e-5)."""
    logits = [saved[s].logits for s in (LLAMA, TIED, MOE, SHARED, LLAMA_PP)]
    for i, a in enumerate(logits):
        for b in logits[i + 1 :]:
            assert (a - b).abs().max() > 0.1
    assert saved[LLAMA].logits.abs().mean() > 0.1


def test_legacy_with_another_vocab_padding_fails_as_in_megatron_lm(mcore_oracle, saved):
    """Megatron-LM pads the vocab from the tokenizer and divisible-by at start-up: 1024 rows do not take 1008."""
    refused = r"size mismatch for embedding.word_embeddings.weight: .*\[504, 64\].*\[512, 64\]"
    with pytest.raises(OracleError, match=refused):
        mcore_oracle.load(saved[PAD8].torch, "llama", fmt="torch", tp=2)


def test_a_run_past_its_timeout_is_killed_with_its_workers(tmp_path):
    with pytest.raises(OracleError, match="timed out after 8 s"):
        run_jobs([{"command": "hang", "out": str(tmp_path)}], nproc=2, timeout=8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hanging-0", "hanging-1"]  # both workers were running
    left = [p for p in psutil.process_iter(["cmdline"]) if str(SCRIPT) in " ".join(p.info["cmdline"] or [])]
    assert left == []


def _local(ranks: list[dict], prefix: str) -> dict[str, list[torch.Tensor]]:
    """``name -> [rank 0's, rank 1's, ...]`` for the legacy tensors under ``prefix`` (name without the prefix)."""
    return {
        k[len(prefix) :]: [m[k] for m in ranks] for k in ranks[0] if k.startswith(prefix) and ranks[0][k] is not None
    }


def _gate_up(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The canonical SwiGLU fc1 from per-rank ``[gate_r; up_r]`` pieces: all gates, then all ups."""
    halves = [piece.chunk(2) for piece in pieces]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves])


class MegatronEnum(NamedTuple):
    """What a pickled Megatron enum member (``args.attention_backend``) reads as here: Megatron is not imported."""

    path: str
    value: object


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module.split(".")[0] == "megatron":
            return lambda value: MegatronEnum(f"{module}.{name}", value)
        return super().find_class(module, name)


MEGATRON_FREE_PICKLE = types.SimpleNamespace(**{**vars(pickle), "Unpickler": _Unpickler})


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False, pickle_module=MEGATRON_FREE_PICKLE)


def _rank(root: Path, name: str) -> dict:
    return _load(root / "iter_0000010" / name / "model_optim_rng.pt")


def _dist(root: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Every tensor of a torch_dist checkpoint at its global shape (DCP, no process group), and the metadata."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(root / "iter_0000010"))
    meta = reader.read_metadata().state_dict_metadata
    tensors = {k: m for k, m in meta.items() if isinstance(m, TensorStorageMetadata)}
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in tensors.items()}
    load(state, storage_reader=reader, no_dist=True)
    return state, meta


def test_legacy_files_are_laid_out_as_megatron_lm_writes_them(saved):
    root = saved[LLAMA].torch
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "10"
    assert sorted(p.name for p in (root / "iter_0000010").iterdir()) == ["mp_rank_00", "mp_rank_01"]
    state = _rank(root, "mp_rank_01")
    assert list(state) == ["args", "checkpoint_version", "iteration", "model", "rng_state", FLOPS]
    assert (state["checkpoint_version"], state["iteration"]) == (3.0, 10)
    args = state["args"]
    expected = dict(hidden_size=64, num_layers=4, num_attention_heads=8, group_query_attention=True)
    expected |= dict(num_query_groups=2, untie_embeddings_and_output_weights=True, position_embedding_type="rope")
    expected |= dict(kv_channels=8, ffn_hidden_size=96, swiglu=True, padded_vocab_size=1024, vocab_size=1000)
    expected |= dict(make_vocab_size_divisible_by=128, tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    expected |= dict(rotary_base=10000, norm_epsilon=1e-5, add_bias_linear=False, ckpt_format="torch")
    expected |= dict(normalization="RMSNorm", attention_backend=("megatron.core.transformer.enums.AttnBackend", 5))
    assert {k: getattr(args, k) for k in expected} == expected
    (rng,) = state["rng_state"]
    assert isinstance(rng["np_rng_state"][1], np.ndarray) and rng["np_rng_state"][1].shape == (624,)
    assert set(rng) == {"random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state", "rng_tracker_states"}
    model = state["model"]
    shapes = {k: tuple(v.shape) for k, v in model.items() if v is not None}
    assert shapes["embedding.word_embeddings.weight"] == (512, 64)  # rows 512..1023: the padding 1000.. at the tail
    assert shapes["decoder.layers.3.self_attention.linear_qkv.weight"] == (48, 64)  # one group: 4 q, k, v heads of 8
    assert shapes["decoder.layers.3.self_attention.linear_proj.weight"] == (64, 32)
    assert shapes["decoder.layers.3.mlp.linear_fc1.weight"] == (96, 64)  # [gate_r; up_r], 48 rows each
    assert shapes["decoder.layers.3.mlp.linear_fc2.weight"] == (64, 48)
    assert shapes["decoder.layers.3.input_layernorm.weight"] == shapes["decoder.final_layernorm.weight"] == (64,)
    assert shapes["output_layer.weight"] == (512, 64)
    assert len(shapes) == 2 + 6 * 4 + 1
    extra = sorted(k for k, v in model.items() if k.endswith("._extra_state"))
    assert all(model[k] is None for k in extra) and "decoder.layers.0.mlp.linear_fc1._extra_state" in extra


def test_torch_dist_files_hold_global_tensors(saved):
    root = saved[LLAMA].torch_dist
    iter_dir = root / "iter_0000010"
    names = sorted(p.name for p in iter_dir.iterdir())
    assert names == [".metadata", *(f"__{r}_{i}.distcp" for r in (0, 1) for i in (0, 1)), "common.pt", "metadata.json"]
    assert json.loads((iter_dir / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    common = _load(iter_dir / "common.pt")
    assert sorted(common) == ["args", "checkpoint_version", "content_metadata", "iteration", FLOPS]
    assert common["content_metadata"] == {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    assert common["args"].ckpt_format == "torch_dist" and common["args"].padded_vocab_size == 1024
    state, meta = _dist(root)
    shapes = {k: (tuple(v.shape), len(meta[k].chunks)) for k, v in state.items()}
    assert shapes == {
        "embedding.word_embeddings.weight": ((1024, 64), 2),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": ((4, 64), 4),  # input_layernorm, TE name
        "decoder.layers.self_attention.linear_qkv.weight": ((4, 96, 64), 8),
        "decoder.layers.self_attention.linear_proj.weight": ((4, 64, 64), 8),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": ((4, 64), 4),  # pre_mlp_layernorm, TE name
        "decoder.layers.mlp.linear_fc1.weight": ((4, 192, 64), 16),  # 4 layers x {gate, up} x 2 ranks
        "decoder.layers.mlp.linear_fc2.weight": ((4, 64, 96), 8),
        "decoder.final_layernorm.weight": ((64,), 1),
        "output_layer.weight": ((1024, 64), 2),
    }
    objects = sorted(k for k in meta if k not in state)
    assert "decoder.layers.mlp.linear_fc1._extra_state/shard_3_4" in objects
    assert "rng_state/shard_0.1_1.2" in objects and len(objects) == 4 * 4 + 2

    ranks = [_rank(saved[LLAMA].torch, f"mp_rank_0{r}")["model"] for r in range(2)]
    layer = _local(ranks, "decoder.layers.2.")
    stacked = {name[len("decoder.layers.") :]: t[2] for name, t in state.items() if name.startswith("decoder.layers.")}
    assert torch.equal(stacked[QKV], torch.cat(layer[QKV]))  # whole query groups per rank
    assert torch.equal(stacked[PROJ], torch.cat(layer[PROJ], dim=1))
    assert torch.equal(stacked[FC1], _gate_up(layer[FC1]))
    assert torch.equal(stacked["mlp.linear_fc1.layer_norm_weight"], layer["pre_mlp_layernorm.weight"][1])
    vocab = torch.cat([m["embedding.word_embeddings.weight"] for m in ranks])
    assert torch.equal(state["embedding.word_embeddings.weight"], vocab)
    assert vocab[1000:].abs().min() > 0  # padding rows are initialized like the others, not zeros


def test_moe_experts_are_stacked_per_layer_and_expert(saved):
    state, meta = _dist(saved[SHARED].torch_dist)
    experts = "decoder.layers.mlp.experts.experts."
    assert state[experts + "linear_fc1.weight"].shape == (2, 4, 64, 64)  # [layer, expert, gate 32 + up 32, hidden]
    assert state[experts + "linear_fc2.weight"].shape == (2, 4, 64, 32)
    assert len(meta[experts + "linear_fc1.weight"].chunks) == 2 * 4 * 2 * 2
    assert state["decoder.layers.mlp.router.weight"].shape == (2, 4, 64)
    assert state["decoder.layers.mlp.shared_experts.linear_fc1.weight"].shape == (2, 96, 64)
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in state  # pre_mlp_layernorm keeps the dense name
    assert f"{experts}linear_fc1._extra_state/shard_0.3_2.4" in meta
    ranks = [_rank(saved[SHARED].torch, f"mp_rank_0{r}")["model"] for r in range(2)]
    local = _local(ranks, "decoder.layers.1.mlp.experts.local_experts.3.")
    assert local["linear_fc1.weight"][0].shape == (32, 64)  # [gate_r; up_r] of expert 3, 16 rows each
    assert torch.equal(state[experts + "linear_fc1.weight"][1, 3], _gate_up(local["linear_fc1.weight"]))
    assert torch.equal(state["decoder.layers.mlp.router.weight"][1], ranks[1]["decoder.layers.1.mlp.router.weight"])
    assert "local_experts" not in " ".join(state)  # the legacy per-expert modules become one stacked tensor


def test_pipeline_stages_number_layers_locally_and_tied_output_is_a_copy(saved):
    first, last = (_rank(saved[TIED_PP].torch, f"mp_rank_00_00{p}")["model"] for p in range(2))
    assert {k.split(".")[2] for k in last if k.startswith("decoder.layers.")} == {"0", "1"}  # global layers 2, 3
    assert "output_layer.weight" not in first and "embedding.word_embeddings.weight" not in last
    assert torch.equal(last["output_layer.weight"], first["embedding.word_embeddings.weight"])
    state, _ = _dist(saved[TIED_PP].torch_dist)
    assert "output_layer.weight" not in state  # tied: only the embedding is written
    assert torch.equal(state["decoder.layers." + FC2][3], last["decoder.layers.1." + FC2])
    tied_tp = _rank(saved[TIED].torch, "mp_rank_00")["model"]
    assert "output_layer.weight" not in tied_tp and tied_tp["output_layer._extra_state"] is None

    vpp = _rank(saved[VPP].torch, "mp_rank_00_001")
    assert [k for k in vpp if k.startswith("model")] == ["model0", "model1"]
    assert vpp["args"].virtual_pipeline_model_parallel_size == 2
    state, _ = _dist(saved[VPP].torch_dist)  # chunk 1 of stage 1 holds global layer 3, numbered 0
    assert torch.equal(state["decoder.layers." + QKV][3], vpp["model1"]["decoder.layers.0." + QKV])


def test_vocab_padding_follows_divisible_by_and_tp(saved):
    state, _ = _dist(saved[PAD8].torch_dist)
    assert state["embedding.word_embeddings.weight"].shape == (1008, 64)
    args = _rank(saved[PAD8].torch, "mp_rank_00")["args"]
    assert (args.padded_vocab_size, args.vocab_size, args.make_vocab_size_divisible_by) == (1008, 1000, 8)
    assert saved[PAD8].reference["padded_vocab"] == 1008 and saved[PAD8].logits.shape == (2, 12, 1000)
