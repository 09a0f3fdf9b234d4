"""``reshard.testing`` and round trips over real transformers models, including a wrong plan only logits catch."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from fixtures.hf import load_folder, write_hf
from fixtures.models import tiny_llama, tiny_qwen3
from fixtures.trainer import write_rank_files

from reshard.testing import assert_roundtrip, assert_same_checkpoint, assert_same_logits

# 8 KV heads of 8 so that tp 8 splits whole heads; vocab 1001 needs padding at every tp.
MODELS = {
    "llama": lambda path: tiny_llama(path, vocab=1001),
    "qwen3": lambda path: tiny_qwen3(path, vocab=1001),
}


@pytest.mark.parametrize("family", sorted(MODELS))
def test_roundtrip_tp_2_4_8(cli, tmp_path: Path, family: str) -> None:
    MODELS[family](tmp_path / "model")
    result = cli("verify", tmp_path / "model", "--roundtrip", "2,4,8", "--json")
    assert result.exit_code == 0, result.stdout
    checks = json.loads(result.stdout)["checks"]
    tensors = len(load_folder(tmp_path / "model"))
    assert [(c["check"], c["tp"], c["ok"], c["tensors"]) for c in checks] == [
        ("roundtrip", tp, True, tensors) for tp in (2, 4, 8)
    ]
    assert_roundtrip(tmp_path / "model", tp=[2, 4, 8])


def test_assertions_raise_the_cli_report(cli, tmp_path: Path) -> None:
    tiny_llama(tmp_path / "a", vocab=1001)
    tiny_llama(tmp_path / "b", vocab=1001, seed=1)
    assert_same_checkpoint(tmp_path / "a", tmp_path / "a")
    with pytest.raises(AssertionError) as caught:
        assert_same_checkpoint(tmp_path / "a", tmp_path / "b")
    shown = cli("verify", tmp_path / "a", tmp_path / "b")
    assert shown.exit_code == 1
    assert str(caught.value).strip() == shown.stdout.strip()
    assert "model.embed_tokens.weight" in str(caught.value) and "max abs difference" in str(caught.value)
    with pytest.raises(AssertionError, match=r"round trip through tp=3: \d+ difference"):
        assert_roundtrip(tmp_path / "a", tp=[3])


def real_tp_ranks(full: Path, out: Path, tp: int) -> None:
    """Rank files as Megatron-style TP holds them (``rank_NN/model.safetensors``): column-parallel split on dim 0,
    row-parallel on dim 1, written by the fixtures (not by reshard), so the test does not trust the code it checks."""
    config = json.loads((full / "config.json").read_text())
    write_rank_files(out, load_folder(full), config, tp, name="rank_{r:02d}/model.safetensors", pad_multiple=1)


BROKEN_PLANS = {
    # Row-parallel o_proj marked column-parallel: gathers to the wrong shape.
    "o_proj-as-column": "extends = \"llama\"\n[[rules]]\npattern = 'self_attn\\.o_proj\\.weight$'\n"
    'kind = "shard"\ndim = 0\n',
    # q_proj (separate heads) taken for a fused pair of parts: same shape, rows in the wrong order.
    "q_proj-as-packed": "extends = \"llama\"\n[[rules]]\npattern = 'self_attn\\.q_proj\\.weight$'\n"
    'kind = "packed"\ndim = 0\nparts = [32, 32]\n',
}


@pytest.mark.parametrize("broken", sorted(BROKEN_PLANS))
def test_wrong_plan_roundtrips_bytes_but_not_logits(cli, tmp_path: Path, broken: str) -> None:
    tiny_llama(tmp_path / "full", vocab=1000)  # hidden 64, 8 heads of 8
    real_tp_ranks(tmp_path / "full", tmp_path / "ranks", tp=2)
    plan = tmp_path / "broken.toml"
    plan.write_text(BROKEN_PLANS[broken])

    # A wrong plan that is consistent with itself survives a byte round trip: bytes alone cannot see it.
    assert cli("verify", tmp_path / "ranks", "--roundtrip", "2,4", "--plan", plan).exit_code == 0
    assert_roundtrip(tmp_path / "ranks", tp=[4], plan=plan)

    # The right (built-in) plan gathers the same model transformers saved.
    assert_same_logits(tmp_path / "full", tmp_path / "ranks")
    expected = "o_proj.weight: shape [128, 32], the model expects [64, 64]" if "o_proj" in broken else "logits differ"
    with pytest.raises(AssertionError, match=re.escape(expected)):
        assert_same_logits(tmp_path / "full", tmp_path / "ranks", plan=plan)


def test_same_logits_sees_small_changes(tmp_path: Path) -> None:
    tiny_llama(tmp_path / "full", vocab=1000)
    state = load_folder(tmp_path / "full")
    state = {k: v.clone() for k, v in state.items()}
    state["model.norm.weight"] *= 1.01
    write_hf(tmp_path / "scaled", json.loads((tmp_path / "full" / "config.json").read_text()), state)
    with pytest.raises(AssertionError, match=r"logits differ .* max abs difference"):
        assert_same_logits(tmp_path / "full", tmp_path / "scaled")
    assert_same_logits(tmp_path / "full", tmp_path / "scaled", atol=1.0, rtol=0.1)
    assert torch.equal(load_folder(tmp_path / "full")["model.norm.weight"] * 1.01, state["model.norm.weight"])


def test_checkpoint_written_with_a_plan_verifies_without_it(cli, tmp_path: Path) -> None:
    """reshard.json records each partition, so verify reads the checkpoint as it was written."""
    tiny_llama(tmp_path / "full", vocab=1000)
    plan = tmp_path / "broken.toml"
    plan.write_text(BROKEN_PLANS["o_proj-as-column"])
    assert cli("convert", tmp_path / "full", "--tp", "2", "-o", tmp_path / "tp2", "--plan", plan, "-q").exit_code == 0
    o_proj = load_folder(tmp_path / "tp2" / "rank_00")["model.layers.0.self_attn.o_proj.weight"]
    assert list(o_proj.shape) == [32, 64]  # split on dim 0, as the plan said
    assert cli("verify", tmp_path / "tp2").exit_code == 0
    assert cli("verify", tmp_path / "tp2", tmp_path / "full").exit_code == 0
