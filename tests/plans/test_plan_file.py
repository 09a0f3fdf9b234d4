"""Plan files (``--plan FILE``, TOML or JSON): their rules come before the plan they extend; a bad rule is named."""

from __future__ import annotations

import json

import pytest
from fixtures.models import tiny_qwen3_5

from reshard.errors import ReshardError
from reshard.geometry import Replicate, Vocab
from reshard.plans import load_plan_file, select_plan


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_plan_file_rules_come_first(tmp_path, suffix):
    path = tmp_path / f"plan{suffix}"
    if suffix == ".toml":
        path.write_text('extends = "llama"\n[[rules]]\npattern = "lm_head"\nkind = "replicate"\n')
    else:
        path.write_text('{"extends": "llama", "rules": [{"pattern": "lm_head", "kind": "replicate"}]}')
    plan = select_plan(None, [], plan_file=path)
    assert plan.match("lm_head.weight").resolve(None) == Replicate()
    assert plan.match("model.embed_tokens.weight").resolve(None) == Vocab(0)


def test_bad_plan_file_names_the_rule(tmp_path):
    path = tmp_path / "plan.toml"
    path.write_text('[[rules]]\npattern = "x"\nkind = "colwise"\n')
    with pytest.raises(ReshardError, match=r"plan.toml: rule 1 .* is invalid: unknown partition kind 'colwise'"):
        load_plan_file(path)


def test_plan_option_still_takes_a_file_and_rejects_a_missing_one(cli, tmp_path):
    tiny_qwen3_5(tmp_path / "full")
    plan = tmp_path / "plan.toml"
    plan.write_text(
        'extends = "qwen3_5"\n[[rules]]\npattern = "linear_attn\\\\.norm\\\\.weight$"\nkind = "replicate"\n'
    )
    report = json.loads(cli("inspect", tmp_path / "full", "--plan", plan, "--json").stdout)
    norm = next(t for t in report["tensors"] if t["name"] == "model.layers.0.linear_attn.norm.weight")
    assert report["plan"] == "plan+qwen3_5" and norm["reason"] == "rule 'linear_attn\\.norm\\.weight$' (plan+qwen3_5)"
    assert cli("convert", tmp_path / "full", "--tp", 2, "--plan", plan, "-o", tmp_path / "tp2", "-q").exit_code == 0
    result = cli("convert", tmp_path / "full", "--tp", 2, "--plan", tmp_path / "nope.toml", "-o", tmp_path / "x")
    assert result.exit_code == 2 and "nope.toml" in result.output and not (tmp_path / "x").exists()
