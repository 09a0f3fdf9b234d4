"""``reshard inspect``: the layout, plan, vocab and every tensor's rank shapes and partition, as text or JSON."""

from __future__ import annotations

import json

from fixtures import SAMPLES

SAMPLE = SAMPLES / "tiny-llama-tp2"  # a tiny Llama (vocab 1001) split two ways by reshard, with its manifest


def test_inspect_json_reports_every_tensor(cli):
    result = cli("inspect", SAMPLE, "--json")
    assert result.exit_code == 0
    report = json.loads(result.stdout)
    assert (report["layout"], report["tp"], report["plan"]) == ("hf-ranks", 2, "llama")
    assert report["vocab"] == {"original": 1001, "origin": "reshard.json", "padded_in_source": 1002, "padding_rows": 1}
    assert len(report["tensors"]) == len(json.loads((SAMPLE / "reshard.json").read_text())["tensors"]) == 21
    embed = next(t for t in report["tensors"] if t["name"] == "model.embed_tokens.weight")
    assert embed["rank_shapes"] == [[501, 64]] * 2 and embed["partition"] == {"kind": "vocab", "dim": 0}
    assert embed["shape"] == [1001, 64] and embed["reason"].startswith("rule ")
    assert report["problems"] == []


def test_inspect_text_names_the_layout_the_vocab_and_each_tensor(cli):
    result = cli("inspect", SAMPLE)
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[1:5] == [
        "layout      hf-ranks, tp=2, 2 file(s)",
        f"config      {SAMPLE / 'config.json'} (model_type llama)",
        "plan        llama",
        "vocab       1001 (from reshard.json), 1002 rows in the source (1 padding)",
    ]
    row = next(line for line in lines if line.startswith("model.layers.0.mlp.down_proj.weight"))
    assert row.split()[1:6] == ["2", "x", "[64,", "64]", "float32"] and "shard(dim=1)" in row
