"""``--plan transformers``: the TP plan transformers ships with a model, read as reshard partitions."""

from __future__ import annotations

import torch
from fixtures.hf import load_folder, load_rank
from fixtures.models import tiny_qwen3_5

from reshard.commands.check import check_model
from reshard.plans.transformers_plan import plan_from_tp_plan


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
