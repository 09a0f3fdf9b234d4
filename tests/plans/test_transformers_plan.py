"""``--plan transformers``: the TP plan transformers ships with a model, read as reshard partitions."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from fixtures.hf import load_folder, load_rank
from fixtures.models import tiny_qwen3_5

from reshard.commands.check import check_model
from reshard.config import ModelConfig
from reshard.errors import ReshardError
from reshard.geometry import Heads, Shard, Vocab
from reshard.plans.skeleton import ModelSkeleton, _loaded_as
from reshard.plans.transformers_plan import plan_from_skeleton, plan_from_tp_plan


def test_plan_transformers_matches_torch_chunk_of_the_loader(cli, tmp_path):
    """transformers' own plan: colwise rows chunked, linear_attn projections chunked (gathered after), conv whole."""
    tiny_qwen3_5(tmp_path / "full", vocab=1001)
    full = load_folder(tmp_path / "full")
    args = (
        "convert",
        tmp_path / "full",
        "--tp",
        3,
        "--plan",
        "transformers",
        "--uneven",
        "-o",
        tmp_path / "tp3",
        "-q",
    )
    assert cli(*args).exit_code == 0
    ranks = [load_rank(tmp_path / "tp3", r) for r in range(3)]
    for name, dim in [
        ("lm_head.weight", 0),
        ("model.embed_tokens.weight", 0),
        ("model.layers.0.linear_attn.in_proj_qkv.weight", 0),
        ("model.layers.0.linear_attn.out_proj.weight", 0),
        ("model.layers.1.self_attn.o_proj.weight", 1),
        ("model.layers.0.mlp.down_proj.weight", 1),
    ]:
        for r, expected in enumerate(full[name].chunk(3, dim=dim)):
            assert torch.equal(ranks[r][name], expected), name
    for r in range(3):
        assert torch.equal(
            ranks[r]["model.layers.0.linear_attn.conv1d.weight"], full["model.layers.0.linear_attn.conv1d.weight"]
        )
    back_args = ("convert", tmp_path / "tp3", "--tp", 1, "--plan", "transformers", "--uneven", "-o", tmp_path / "back")
    assert cli(*back_args, "-q").exit_code == 0
    back = load_folder(tmp_path / "back")
    assert all(torch.equal(back[k], full[k]) for k in full)


def test_a_transformers_style_reshard_cannot_express_is_an_error_not_a_replica():
    """``local`` keeps a replicated tensor divided by tp at load time: no partition says that."""
    plan = plan_from_tp_plan({"model.layers.*.mlp.down_proj": "local", "model.layers.*.mlp.up_proj": "colwise"}, None)
    shapes = {"model.layers.0.mlp.down_proj.weight": (8, 16), "model.layers.0.mlp.up_proj.weight": (16, 8)}
    report = check_model(shapes, None, plan, 2)
    assert not report.ok
    assert [(p.message, p.tensors) for p in report.problems] == [
        ("transformers' TP style 'local' has no reshard partition", ["model.layers.0.mlp.down_proj.weight"])
    ]
    assert report.tensors[1].rank_shape == [8, 8]


def test_plan_transformers_never_cuts_a_head_unless_uneven(cli, tmp_path):
    """One KV head at tp 2: whole heads do not divide, refused as `check` refuses it (before: the rows were halved,
    exit 0); ``--uneven`` asks for transformers' loader's ``torch.chunk`` tensors, half a head each."""
    from fixtures.models import tiny_llama

    tiny_llama(tmp_path / "full", num_key_value_heads=1)
    refused = cli("convert", tmp_path / "full", "--tp", 2, "--plan", "transformers", "-o", tmp_path / "o")
    assert refused.exit_code == 2, refused.output
    assert "self_attn.k_proj.weight" in refused.output and "cannot be split 2 ways" in refused.output
    assert "num_key_value_heads=1" in refused.output
    assert not (tmp_path / "o").exists()
    args = ("convert", tmp_path / "full", "--tp", 2, "--plan", "transformers", "--uneven", "-o", tmp_path / "u", "-q")
    assert cli(*args).exit_code == 0
    full = load_folder(tmp_path / "full")
    for r, expected in enumerate(full["model.layers.0.self_attn.k_proj.weight"].chunk(2, dim=0)):
        assert torch.equal(load_rank(tmp_path / "u", r)["model.layers.0.self_attn.k_proj.weight"], expected)


def _attention(style_q: str, style_o: str, heads: int | None, q_rows: int = 112) -> tuple:
    plan = plan_from_tp_plan(
        {"model.layers.*.self_attn.q_proj": style_q, "model.layers.*.self_attn.o_proj": style_o}, None
    )
    shapes = {
        "model.layers.0.self_attn.q_proj.weight": (q_rows, 64),
        "model.layers.0.self_attn.o_proj.weight": (64, q_rows),
    }
    config = ModelConfig({"model_type": "qwen2"} | ({"num_attention_heads": heads} if heads else {}))
    return shapes, config, plan


def test_query_and_output_projections_split_in_whole_heads_of_any_width():
    """14 heads of 8: tp 2 holds 7 each; tp 4 would cut one (refused, naming the heads); --uneven is torch.chunk."""
    shapes, config, plan = _attention("colwise", "rowwise", 14)
    assert check_model(shapes, config, plan, 2).ok
    assert [t.rank_shape for t in check_model(shapes, config, plan, 2).tensors] == [[56, 64], [64, 56]]
    refused = check_model(shapes, config, plan, 4)
    assert [p.message for p in refused.problems] == [
        "num_attention_heads=14 heads do not divide by tp=4: a head would be cut"
    ]
    assert [t.rank_shape for t in check_model(shapes, config, plan, 4, uneven=True).tensors] == [[28, 64], [64, 28]]


def test_a_projection_that_is_not_whole_heads_is_refused_not_cut_in_rows():
    """113 rows are not 14 equal heads: the rows are not what the config says, so no cut is guessed, --uneven or not"""
    shapes, config, plan = _attention("colwise", "rowwise", 14, q_rows=113)
    for uneven in (False, True):
        report = check_model(shapes, config, plan, 2, uneven=uneven)
        messages = [m for t in report.tensors for m in t.problems]
        assert messages == [
            "heads(dim=-2, heads=14) cannot be split 2 ways: dim 0 size 113 is not 14 equal heads",
            "heads(dim=-1, heads=14) cannot be split 2 ways: dim 1 size 113 is not 14 equal heads",
        ]


def test_without_a_head_count_the_heads_are_refused_by_name():
    shapes, config, plan = _attention("colwise", "rowwise", None)
    report = check_model(shapes, config, plan, 2)
    assert [m for t in report.tensors for m in t.problems] == [
        "num_attention_heads is None: its heads cannot be told apart"
    ] * 2


def test_gathered_projections_keep_their_rows():
    """``colwise_gather_output`` / ``rowwise_split_input`` (OLMo 2, Phi-3's fused qkv) compute whole after a gather:
    any even cut of rows runs, as check says (it asks heads only of split outputs)."""
    shapes, config, plan = _attention("colwise_gather_output", "rowwise_split_input", 14)
    report = check_model(shapes, config, plan, 4)
    assert report.ok, report.problems
    assert [t.partition for t in report.tensors] == [{"kind": "shard", "dim": -2}, {"kind": "shard", "dim": -1}]
    kv = plan_from_tp_plan({"model.layers.*.self_attn.k_proj": "colwise_gather_output"}, None)
    assert kv.match("model.layers.0.self_attn.k_proj.weight").resolve(config) == Shard(-2)


def test_renamed_checkpoint_names_and_per_head_vectors_get_the_partition_of_the_name_they_load_as():
    """The plan is keyed by the model's names: a checkpoint name transformers renames on load takes the partition
    of the name it loads as (kept in the output under its own name); a 1-d parameter the plan names (sinks, a gate's
    bias: one value a head) is split on its only dim in whole heads, so a tp that cuts a head is refused."""
    skeleton = ModelSkeleton(
        {
            "lm_head": "colwise_gather_output",
            "model.layers.*.self_attn.q_gate_proj": "colwise",
            "model.layers.*.self_attn.sinks": "colwise",
            "model.layers.*.self_attn.gate_bias": "colwise",
        },
        {
            "lm_head.weight": (256, 64),
            "model.layers.0.self_attn.q_gate_proj.weight": (192, 32),
            "model.layers.0.self_attn.sinks": (8,),
            "model.layers.0.self_attn.gate_bias": (8,),
        },
        "AnyForCausalLM",
        loaded_as={
            "embed_out.weight": "lm_head.weight",
            **{
                f"model.layers.{i}.self_attn.q_b_proj.weight": f"model.layers.{i}.self_attn.q_gate_proj.weight"
                for i in (0, 2)
            },
        },
        heads={"model.layers.2.self_attn": 4},  # a layer built with its own heads (dots3's sliding-window layers)
    )
    config = ModelConfig({"num_attention_heads": 8})
    plan = plan_from_skeleton(skeleton, config)
    for name, partition in [
        ("embed_out.weight", Vocab(0)),
        ("model.layers.7.self_attn.q_b_proj.weight", Heads(-2, 8)),
        ("model.layers.7.self_attn.q_gate_proj.weight", Heads(-2, 8)),
        ("model.layers.3.self_attn.sinks", Heads(-1, 8)),
        ("model.layers.3.self_attn.gate_bias", Heads(-1, 8)),
        ("model.layers.2.self_attn.gate_bias", Heads(-1, 4)),
        ("model.layers.2.self_attn.q_b_proj.weight", Heads(-2, 4)),
        ("model.layers.12.self_attn.q_b_proj.weight", Heads(-2, 8)),
    ]:
        assert plan.match(name).resolve(config) == partition, name
    shapes = {"model.layers.0.self_attn.sinks": (8,), "model.layers.0.self_attn.q_b_proj.weight": (192, 32)}
    refused = check_model(shapes, config, plan, 3)
    cut = "cannot be split 3 ways: dim 0 holds 8 heads, which tp=3 does not divide: a head would be cut"
    assert not refused.ok
    problems = [m for t in refused.tensors for m in t.problems]
    assert problems == [f"heads(dim=-1, heads=8) {cut}", f"heads(dim=-2, heads=8) {cut}"]


def test_renamings_transformers_has_but_reshard_cannot_read_are_an_error_not_none(monkeypatch):
    """A transformers that renames names on load (it has ``conversion_mapping``) whose loading module lacks what
    reshard reads them with is refused by name; one without ``conversion_mapping`` (before 5) renames nothing."""
    monkeypatch.setitem(sys.modules, "transformers.core_model_loading", types.ModuleType("core_model_loading"))
    with pytest.raises(ReshardError, match="cannot read its renamings") as refused:
        _loaded_as(None, ["embed_out.weight"])
    assert "upgrade transformers" in refused.value.one_line()
    monkeypatch.setitem(sys.modules, "transformers.conversion_mapping", None)  # import fails: before transformers 5
    assert _loaded_as(None, ["embed_out.weight"]) == {}
