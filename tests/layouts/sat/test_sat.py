"""``reshard.layouts.sat.checkpoint``: SAT (CogVLM / CogAgent) checkpoints, TP=8 -> 4, 2, 1 and back with their LoRA
adapters kept, and bad inputs (LoRA merging is in ``tests/engine/test_lora_merge.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fixtures.checks import assert_refused
from fixtures.sat import full_tensors, layout, read_sat, sat_config, write_sat
from fixtures.sat import split_rank as expected_rank

from reshard import ConvertOptions, convert
from reshard.errors import MissingRankError

CFG = sat_config()  # hidden 32, 16 heads of 2 in 8 KV groups, one layer, tp 8


@pytest.fixture(params=[8, 0], ids=["gqa", "mha"])
def tp8(request, tmp_path: Path):
    """The model with KV groups or multi-head attention, at tp 8: (folder, config, full tensors, rank states)."""
    cfg = sat_config(multi_query_heads=request.param)
    full = full_tensors(cfg)
    ranks = write_sat(tmp_path / "cogagent-tp8", cfg, full, 8)
    return tmp_path / "cogagent-tp8", cfg, full, ranks


@pytest.fixture
def src(tmp_path: Path) -> Path:
    """The default model at tp 8 in ``tmp_path / "src"`` (iteration 400)."""
    write_sat(tmp_path / "src", CFG, full_tensors(CFG), 8)
    return tmp_path / "src"


@pytest.mark.parametrize("tp", [4, 2, 1])
def test_tp8_to_tp_and_back_is_exact(tp8, tmp_path: Path, cli, tp: int) -> None:
    src, cfg, full, ranks = tp8
    out = tmp_path / f"tp{tp}"
    result = cli("convert", src, "--tp", tp, "--layout", "sat", "-o", out, "-q")
    assert result.exit_code == 0, result.output
    assert (out / "latest").read_text() == "400"
    written_cfg = json.loads((out / "model_config.json").read_text())
    assert written_cfg == cfg | {"model_parallel_size": tp}
    iteration, files = read_sat(out)
    kinds = layout(cfg)
    for rank, obj in enumerate(files):
        assert obj["iteration"] == 400 and set(obj) == {"module", "iteration"}
        assert list(obj["module"]) == list(full), "names and order as the source has them"
        for name, tensor in obj["module"].items():
            assert torch.equal(tensor, expected_rank(full[name], kinds[name][1], tp, rank)), (name, rank)

    back = tmp_path / f"tp{tp}-back"
    assert cli("convert", out, "--tp", 8, "--layout", "sat", "-o", back, "-q").exit_code == 0
    _, again = read_sat(back)
    for rank, obj in enumerate(again):
        assert obj["module"].keys() == ranks[rank].keys()
        for name, tensor in obj["module"].items():
            assert tensor.dtype == ranks[rank][name].dtype
            assert torch.equal(tensor.view(torch.uint8), ranks[rank][name].view(torch.uint8)), (name, rank)


def test_qkv_rank_is_cat_of_its_q_k_v_pieces(tp8, tmp_path: Path) -> None:
    src, cfg, full, _ = tp8
    convert(src, tmp_path / "tp4", ConvertOptions(tp=4, layout="sat", progress=False))
    _, files = read_sat(tmp_path / "tp4")
    name = "transformer.layers.0.attention.query_key_value"
    qkv = full[f"{name}.original.weight"]
    heads, hd = cfg["num_attention_heads"], cfg["hidden_size"] // cfg["num_attention_heads"]
    groups = cfg["num_multi_query_heads"] or heads
    q, k, v = qkv[: heads * hd], qkv[heads * hd : (heads + groups) * hd], qkv[(heads + groups) * hd :]
    for r, obj in enumerate(files):
        sd = obj["module"]
        rq, rk = heads * hd // 4, groups * hd // 4
        want = torch.cat([q[r * rq : (r + 1) * rq], k[r * rk : (r + 1) * rk], v[r * rk : (r + 1) * rk]])
        assert torch.equal(sd[f"{name}.original.weight"], want)
        # one LoRA B per part, each a shard of its part; A replicated
        for i, part in enumerate((q, k, v)):
            rows = part.shape[0] // 4
            b_full = full[f"{name}.matrix_B.{i}"]
            assert torch.equal(sd[f"{name}.matrix_B.{i}"], b_full[r * rows : (r + 1) * rows])
            assert torch.equal(sd[f"{name}.matrix_A.{i}"], full[f"{name}.matrix_A.{i}"])


def test_bf16_tp8_to_tp4_moves_bytes_exactly(tmp_path: Path) -> None:
    full = full_tensors(CFG, torch.bfloat16)
    write_sat(tmp_path / "src", CFG, full, 8)
    convert(tmp_path / "src", tmp_path / "tp4", ConvertOptions(tp=4, layout="sat", progress=False))
    _, files = read_sat(tmp_path / "tp4")
    kinds = layout(CFG)
    for rank, obj in enumerate(files):
        for name, tensor in obj["module"].items():
            assert tensor.dtype == torch.bfloat16
            assert torch.equal(tensor, expected_rank(full[name], kinds[name][1], 4, rank)), name


def test_missing_rank_file_is_named(src: Path, tmp_path: Path, cli) -> None:
    (src / "400" / "mp_rank_05_model_states.pt").unlink()
    result = cli("convert", src, "--tp", 4, "-o", tmp_path / "out")
    assert_refused(result, tmp_path / "out", "mp_rank_05_model_states.pt", "model_parallel_size is 8")
    with pytest.raises(MissingRankError, match="mp_rank_05_model_states.pt"):
        convert(src, tmp_path / "out", ConvertOptions(tp=4, progress=False))


def test_model_parallel_size_disagreeing_with_files_is_reported(src: Path, cli) -> None:
    (src / "model_config.json").write_text(json.dumps(CFG | {"model_parallel_size": 4}))
    result = cli("inspect", src)
    assert result.exit_code == 2
    assert "model_config.json" in result.stderr
    assert "model_parallel_size is 4" in result.stderr and "mp_rank_07_model_states.pt" in result.stderr


def test_iteration_folder_and_release_tag(tmp_path: Path, cli) -> None:
    write_sat(tmp_path / "src", CFG, full_tensors(CFG), 8, iteration="release")
    result = cli("inspect", tmp_path / "src" / "release", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["layout"] == "sat" and report["tp"] == 8 and report["plan"] == "sat" and not report["problems"]
    parts = {t["name"]: t["partition"] for t in report["tensors"]}
    assert parts["transformer.layers.0.attention.query_key_value.matrix_B.1"] == {"kind": "shard", "dim": 0, "unit": 2}
    assert parts["transformer.layers.0.attention.dense.matrix_A.0"] == {"kind": "shard", "dim": 1, "unit": 2}
    assert parts["transformer.layers.0.attention.dense.matrix_B.0"] == {"kind": "replicate"}
    out = tmp_path / "out"
    assert cli("convert", tmp_path / "src", "--tp", 2, "-o", out, "-q").exit_code == 0
    assert (out / "latest").read_text() == "release" and (out / "release" / "mp_rank_01_model_states.pt").is_file()


def test_tp_that_splits_a_head_is_refused(src: Path, tmp_path: Path, cli) -> None:
    result = cli("convert", src, "--tp", 16, "-o", tmp_path / "out")
    assert result.exit_code == 2
    assert "query_key_value" in result.stderr and "tp=16" in result.stderr
    assert not (tmp_path / "out").exists()


def test_hf_ranks_from_sat_keeps_names(src: Path, tmp_path: Path) -> None:
    full = full_tensors(CFG)
    convert(src, tmp_path / "ranks", ConvertOptions(tp=2, layout="hf-ranks", progress=False))
    convert(tmp_path / "ranks", tmp_path / "back", ConvertOptions(tp=1, layout="sat", progress=False))
    _, files = read_sat(tmp_path / "back")
    for name, tensor in files[0]["module"].items():
        assert torch.equal(tensor, full[name]), name


class Trainer:
    """Stands for an arbitrary object a training script might pickle into a rank file."""


def _resave(path: Path, **extra) -> None:
    obj = torch.load(path, weights_only=True)
    torch.save(obj | extra, path)


def test_deepspeed_rank_files_with_rng_state_load_safely(src: Path, tmp_path: Path, cli) -> None:
    """DeepSpeed saves (sat/training/model_io.py) add rng and scheduler state; they load without
    --trust-pickle, are reported, and only ``iteration`` is carried over."""
    import random

    import numpy as np

    for file in (src / "400").iterdir():
        _resave(
            file,
            random_rng_state=random.getstate(),
            np_rng_state=np.random.get_state(),
            torch_rng_state=torch.get_rng_state(),
            client_lr_scheduler={"num_iters": 400},
            mp_world_size=8,
        )
    result = cli("convert", src, "--tp", 2, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "not carried over" in result.stdout and "np_rng_state" in result.stdout
    _, files = read_sat(tmp_path / "out")
    assert set(files[0]) == {"module", "iteration"}


def test_unknown_pickled_object_needs_trust_pickle(src: Path, tmp_path: Path, cli) -> None:
    _resave(src / "400" / "mp_rank_03_model_states.pt", trainer=Trainer())
    result = cli("convert", src, "--tp", 4, "-o", tmp_path / "out")
    assert_refused(result, tmp_path / "out", "mp_rank_03_model_states.pt", "Trainer", "--trust-pickle")


def test_missing_model_config_is_reported_per_tensor(src: Path, tmp_path: Path, cli) -> None:
    (src / "model_config.json").unlink()
    result = cli("convert", src, "--tp", 4, "-o", tmp_path / "out")
    assert result.exit_code == 2
    line = next(x for x in result.stderr.splitlines() if "layers.0.attention.query_key_value.original.weight" in x)
    assert "mp_rank_00_model_states.pt" in line and "needs its model_config.json" in line and "--config" in line
    assert not (tmp_path / "out").exists()
    config_file = tmp_path / "model_config.json"
    config_file.write_text(json.dumps(CFG))
    result = cli("convert", src, "--tp", 4, "--config", config_file, "-o", tmp_path / "out", "-q")
    assert result.exit_code == 0, result.output


def test_latest_naming_a_missing_iteration_is_reported(src: Path, cli) -> None:
    (src / "latest").write_text("500")
    result = cli("inspect", src)
    assert result.exit_code == 2
    assert "latest" in result.stderr and "'500'" in result.stderr


def test_several_iterations_without_latest_ask_for_one(tmp_path: Path, cli) -> None:
    full = full_tensors(CFG)
    write_sat(tmp_path / "src", CFG, full, 8, iteration="100")
    write_sat(tmp_path / "src", CFG, full, 8, iteration="200")
    (tmp_path / "src" / "latest").unlink()
    result = cli("inspect", tmp_path / "src")
    assert result.exit_code == 2
    assert "100, 200" in result.stderr and "iteration folder" in result.stderr
    assert cli("inspect", tmp_path / "src" / "200").exit_code == 0
