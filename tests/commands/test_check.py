"""``reshard check``: the pre-flight report, from a config.json or from checkpoint headers."""

from __future__ import annotations

import json

import pytest
from fixtures.checks import check_in_a_fresh_interpreter
from fixtures.models import tiny_qwen3_5

# transformers 5.12's Qwen3.5 plan (transformers#46846): attention and MLP only, no linear_attn.
OLD_PLAN = """
extends = "none"
[[rules]]
pattern = 'self_attn\\.[qkv]_proj\\.weight$'
kind = "shard"
dim = 0
[[rules]]
pattern = 'self_attn\\.o_proj\\.weight$'
kind = "shard"
dim = 1
[[rules]]
pattern = 'mlp\\.(gate|up)_proj\\.weight$'
kind = "shard"
dim = 0
[[rules]]
pattern = 'mlp\\.down_proj\\.weight$'
kind = "shard"
dim = 1
[[rules]]
pattern = '(embed_tokens|lm_head)\\.weight$'
kind = "vocab"
dim = 0
[[rules]]
pattern = '(norm|layernorm)\\.weight$'
kind = "replicate"
"""


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen35") / "full"
    tiny_qwen3_5(path)
    return path


def run_json(cli, *args):
    result = cli("check", *args, "--json")
    return result.exit_code, json.loads(result.output)


def test_builtin_plan_splits_qwen3_5_config_four_ways(cli, qwen35):
    code, report = run_json(cli, qwen35 / "config.json", "--tp", 4)
    assert code == 0 and report["ok"] and report["input"] == "config" and report["plan"] == "qwen3_5"
    rows = {t["name"]: t for t in report["tensors"]}
    assert rows["model.layers.0.linear_attn.in_proj_qkv.weight"]["rank_shape"] == [32, 64]
    assert rows["model.layers.0.linear_attn.conv1d.weight"]["rank_shape"] == [32, 1, 4]
    assert [p["message"] for p in report["problems"]] == [
        "vocab 1001 needs padding to 1004 rows (a multiple of 4) for tp=4"
    ]


def test_plan_lacking_linear_attn_names_those_parameters(cli, qwen35, tmp_path):
    plan = tmp_path / "old.toml"
    plan.write_text(OLD_PLAN)
    code, report = run_json(cli, qwen35 / "config.json", "--tp", 4, "--plan", plan)
    assert code == 1 and not report["ok"]
    uncovered = {n for p in report["problems"] if p["message"] == "no rule covers it" for n in p["tensors"]}
    prefix = "model.layers.0.linear_attn."
    assert uncovered == {
        prefix + n
        for n in (
            "in_proj_qkv.weight",
            "in_proj_z.weight",
            "in_proj_b.weight",
            "in_proj_a.weight",
            "out_proj.weight",
            "conv1d.weight",
            "A_log",
            "dt_bias",
        )
    }  # linear_attn.norm.weight is covered by the plan's norm rule
    text = cli("check", qwen35 / "config.json", "--tp", 4, "--plan", plan)
    assert text.exit_code == 1 and "in_proj_qkv.weight" in text.output and "cannot be split 4 ways" in text.output


def test_heads_that_do_not_divide_are_named(cli, qwen35):
    code, report = run_json(cli, qwen35 / "config.json", "--tp", 8)
    messages = [p["message"] for p in report["problems"] if p["severity"] == "error"]
    assert code == 1
    assert (
        "linear_num_key_heads=4 heads do not divide by tp=8 (fewer than the 8 ranks): a head would be cut" in messages
    )
    assert (
        "num_attention_heads=4 heads do not divide by tp=8 (fewer than the 8 ranks): a head would be cut" in messages
    )
    assert not any(m.startswith("num_key_value_heads") for m in messages)  # copied onto 2 ranks each: a note


def test_kv_heads_fewer_than_ranks_from_checkpoint_headers(cli, tmp_path):
    """2 KV heads at tp 4 are copied onto 2 ranks each (as vLLM runs them): a note, not an error."""
    tiny_qwen3_5(tmp_path / "m", num_key_value_heads=2)
    code, report = run_json(cli, tmp_path / "m", "--tp", 4)
    assert code == 0 and report["input"] == "checkpoint"
    (problem,) = [p for p in report["problems"] if p["message"].startswith("num_key_value_heads")]
    assert problem["severity"] == "note"
    assert problem["message"] == (
        "num_key_value_heads=2 heads, fewer than the 4 ranks: each is copied onto 2 ranks, "
        "those whose query heads use it (as vLLM runs it)"
    )
    assert sorted(problem["tensors"]) == [f"model.layers.1.self_attn.{p}_proj.weight" for p in "kv"]


def test_conv_split_not_matching_its_input_projection(cli, qwen35, tmp_path):
    """The field failure: in_proj_qkv split by rows while the depthwise conv stays whole."""
    plan = tmp_path / "bad.toml"
    plan.write_text(
        'extends = "qwen3_5"\n[[rules]]\npattern = "in_proj_qkv"\nkind = "shard"\ndim = 0\n'
        '[[rules]]\npattern = "conv1d"\nkind = "replicate"\n'
    )
    code, report = run_json(cli, qwen35 / "config.json", "--tp", 4, "--plan", plan)
    assert code == 1
    (problem,) = [p for p in report["problems"] if "depthwise" in p["message"]]
    assert problem["tensors"] == ["model.layers.0.linear_attn.conv1d.weight"]
    assert problem["message"].startswith("holds 128 channels per rank but in_proj_qkv hands it 32")


def test_transformers_plan_gathers_linear_attn_so_the_whole_conv_fits(cli, qwen35):
    code, report = run_json(cli, qwen35 / "config.json", "--tp", 2, "--plan", "transformers", "--uneven")
    assert code == 0 and report["plan"] == "transformers"
    warned = {
        n for p in report["problems"] if p["message"].startswith("not in the transformers plan") for n in p["tensors"]
    }
    assert warned == {"model.layers.0.linear_attn.conv1d.weight"}


def test_transformers_plan_heads_only_matter_where_the_output_stays_split(cli, qwen35):
    """linear_attn projections are gathered after the matmul (storage split only); k/v_proj are not."""
    code, report = run_json(cli, qwen35 / "config.json", "--tp", 8, "--plan", "transformers", "--uneven")
    errors = [p["message"] for p in report["problems"] if p["severity"] == "error"]
    assert code == 1
    assert [m.split("=")[0] for m in errors] == ["num_attention_heads", "num_key_value_heads"]


def test_model_with_no_plan_says_so(cli, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2, "vocab_size": 50}))
    for extra in ((), ("--plan", "transformers")):
        result = cli("check", config, "--tp", 2, *extra)
        assert result.exit_code == 1, result.output
        assert "no TP plan for gpt2" in result.output


def test_bad_input_exits_2(cli, tmp_path):
    config = tmp_path / "config.json"
    config.write_text("{not json")
    result = cli("check", config, "--tp", 2)
    assert result.exit_code == 2 and "config.json" in result.output
    unknown = tmp_path / "other.json"
    unknown.write_text(json.dumps({"model_type": "no-such-model"}))
    result = cli("check", unknown, "--tp", 2)
    assert result.exit_code == 2 and "no-such-model" in result.output


def test_checkpoint_at_tp2_is_checked_on_its_full_shapes(cli, qwen35, tmp_path):
    """Rank headers are joined by the plan: the same table as from the full checkpoint, no data read."""
    assert cli("convert", qwen35, "--tp", 2, "-o", tmp_path / "tp2", "-q").exit_code == 0
    _, from_full = run_json(cli, qwen35, "--tp", 4)
    code, from_ranks = run_json(cli, tmp_path / "tp2", "--tp", 4)
    assert code == 0 and from_ranks["input"] == "checkpoint"
    assert sorted(from_ranks["tensors"], key=lambda t: t["name"]) == sorted(
        from_full["tensors"], key=lambda t: t["name"]
    )
    conv = next(t for t in from_ranks["tensors"] if t["name"].endswith("conv1d.weight"))
    assert conv["shape"] == [128, 1, 4] and conv["rank_shape"] == [32, 1, 4]


def test_checking_safetensors_headers_never_imports_torch(cli, qwen35, tmp_path):
    """``reshard check`` on safetensors answers without importing torch (its import alone takes ~1.5 s,
    longer than the whole check of a 9B model's headers): the command runs in a fresh interpreter."""
    assert cli("convert", qwen35, "--tp", 2, "-o", tmp_path / "tp2", "-q").exit_code == 0
    report, imported_torch = check_in_a_fresh_interpreter(tmp_path / "tp2", 4)
    assert report["ok"] and not imported_torch
