"""Inputs that do not add up are refused with the numbers that disagree (issue 31): a config of another family than
the tensors, a ``--vocab`` below the true size."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fixtures.checks import assert_refused
from fixtures.models import tiny_llama, tiny_qwen3

from reshard.engine.move import execute
from reshard.plans import skeleton

VOCAB = 1001


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "orig"
    tiny_llama(path, vocab=VOCAB)
    return path


def with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text()) | changes
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    ("model_type", "architecture", "fragment"),
    [
        ("gemma2", "Gemma2ForCausalLM", "'gemma2', whose models have tensors *.pre_feedforward_layernorm.weight"),
        ("qwen3", "Qwen3ForCausalLM", "'qwen3', whose models have tensors *.self_attn.q_norm.weight"),
        ("deepseek_v3", "DeepseekV3ForCausalLM", "'deepseek_v3', whose models have tensors *.self_attn.kv_a_proj"),
    ],
)
def test_a_config_of_another_family_is_refused(cli, tmp_path, llama_dir, model_type, architecture, fragment):
    ckpt = with_config(llama_dir, tmp_path / "ckpt", model_type=model_type, architectures=[architecture])
    result = cli("convert", ckpt, "--tp", 2, "-o", tmp_path / "out")
    assert_refused(result, tmp_path / "out", fragment, "model.layers.0.self_attn.q_proj.weight")


def test_a_config_given_with_config_of_another_family_is_refused(cli, tmp_path, llama_dir):
    config = json.loads((llama_dir / "config.json").read_text()) | {"model_type": "gemma2"}
    (tmp_path / "gemma2.json").write_text(json.dumps(config))
    result = cli("convert", llama_dir, "--tp", 2, "--config", tmp_path / "gemma2.json", "-o", tmp_path / "out")
    assert_refused(result, tmp_path / "out", "gemma2.json: the config is of model_type 'gemma2'")


def test_a_llama_config_on_qwen3_tensors_is_refused(cli, tmp_path):
    tiny_qwen3(tmp_path / "qwen3", vocab=VOCAB)
    ckpt = with_config(tmp_path / "qwen3", tmp_path / "ckpt", model_type="llama", architectures=["LlamaForCausalLM"])
    result = cli("convert", ckpt, "--tp", 2, "-o", tmp_path / "out")
    assert_refused(result, tmp_path / "out", "'llama', whose models have no tensor *.self_attn.q_norm.weight")


def test_the_config_of_its_own_family_converts(cli, tmp_path, llama_dir):
    result = cli("convert", llama_dir, "--tp", 2, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        (
            {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
            "transformers builds Qwen2ForCausalLM for this config (model_type 'qwen2'), and 6 of its 27 tensors are "
            "not among the checkpoint's 21 (21 are), e.g. 'model.layers.0.self_attn.k_proj.bias'",
        ),
    ],
    ids=["qwen2-biases"],
)
def test_a_config_whose_built_model_lacks_tensors_is_refused(cli, tmp_path, llama_dir, changes, expected, monkeypatch):
    """No name signature tells a Qwen2 config (q/k/v biases) from Llama's tensors: the model transformers builds for
    the config on the meta device does; the second command hears it from the cache of meta builds, building nothing
    and moving no byte."""
    monkeypatch.setenv("RESHARD_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = with_config(llama_dir, tmp_path / "ckpt", **changes)
    for command in (["convert", ckpt, "--tp", 2], ["fix", ckpt, "--vocab", VOCAB, "--force"]):
        result = cli(*command, "-o", tmp_path / "out")
        line = assert_refused(result, tmp_path / "out", expected, "from_pretrained would initialise them at random")
        assert line.startswith(f"Error: {ckpt / 'config.json'}: ")
        monkeypatch.setattr(skeleton, "_build", lambda config: pytest.fail("built again"))
        monkeypatch.setattr(execute, "execute", lambda *a, **k: pytest.fail("bytes moved"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "ckpt"]


def test_a_config_with_a_layer_more_than_held_is_refused(cli, tmp_path, llama_dir):
    """A config saying 3 layers over tensors of 2: refused by the count, at once, before transformers is imported."""
    ckpt = with_config(llama_dir, tmp_path / "ckpt", num_hidden_layers=3)
    for command in (["convert", ckpt, "--tp", 2], ["fix", ckpt, "--vocab", VOCAB, "--force"]):
        result = cli(*command, "-o", tmp_path / "out")
        line = assert_refused(
            result,
            tmp_path / "out",
            "the config says num_hidden_layers 3, but the checkpoint holds 2 decoder layer(s) (layer 2 is missing)",
        )
        assert line.startswith(f"Error: {ckpt / 'config.json'}: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_layer_count_past_the_tensors_is_refused_without_building_the_model(cli, tmp_path, llama_dir):
    """10^12 layers would take a meta build without end: refused at once, by the counts."""
    ckpt = with_config(llama_dir, tmp_path / "ckpt", num_hidden_layers=10**12)
    result = cli("convert", ckpt, "--tp", 2, "-o", tmp_path / "out")
    assert_refused(
        result,
        tmp_path / "out",
        "the config says num_hidden_layers 1000000000000, more layers than the checkpoint has tensors (21)",
    )


def test_a_tied_head_left_out_is_not_missing(cli, tmp_path):
    tiny_llama(tmp_path / "tied", vocab=VOCAB, tie=True)
    result = cli("convert", tmp_path / "tied", "--tp", 2, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output


def test_fix_refuses_a_vocab_below_the_configs(cli, tmp_path, llama_dir):
    result = cli("fix", llama_dir, "--vocab", VOCAB - 5, "-o", tmp_path / "out")
    assert_refused(
        result,
        tmp_path / "out",
        f"--vocab {VOCAB - 5} is below the vocab size {VOCAB} that config.json gives: the 5 rows 996..1000 of every "
        "vocab tensor would be dropped",
        "--allow-vocab-shrink",
    )


def test_convert_refuses_a_vocab_below_the_manifests(cli, tmp_path, llama_dir):
    result = cli("convert", llama_dir, "--tp", 2, "-o", tmp_path / "tp2")
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "tp2" / "config.json").read_text()) | {"vocab_size": 1024}
    (tmp_path / "tp2" / "config.json").write_text(json.dumps(config))
    result = cli("convert", tmp_path / "tp2", "--tp", 1, "--vocab", 1000, "-o", tmp_path / "out")
    assert_refused(result, tmp_path / "out", "--vocab 1000 is below the vocab size 1001 that the reshard.json")


def test_allow_vocab_shrink_drops_the_rows_on_purpose(cli, tmp_path, llama_dir):
    result = cli("fix", llama_dir, "--vocab", VOCAB - 5, "--allow-vocab-shrink", "-o", tmp_path / "out", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == VOCAB - 5


def test_a_vocab_below_what_megatrons_padded_size_can_hold_is_refused(cli, tmp_path):
    """The args record padded_vocab_size 56 = 50 padded to a multiple of 4 x tp 2: a true size of 49..56. --vocab 40
    would drop rows 40..48, which cannot be padding; --vocab 50 drops only pad rows."""
    from fixtures.megatron import TINY, full_model, write_megatron

    src = write_megatron(tmp_path / "src", full_model(TINY), 2)
    result = cli("fix", src, "--vocab", 40, "-o", tmp_path / "out")
    assert_refused(
        result,
        tmp_path / "out",
        "--vocab 40 is below what the padded_vocab_size 56 recorded in model_optim_rng.pt can hold: padded to a "
        "multiple of 8 (make_vocab_size_divisible_by x tp 2), its true size is 49..56; the rows 40..48 of every "
        "vocab tensor would be dropped",
        "--allow-vocab-shrink",
    )
    assert cli("fix", src, "--vocab", 50, "-o", tmp_path / "fixed").exit_code == 0


def test_a_true_vocab_the_args_record_is_never_taken_for_padding(cli, tmp_path):
    """args.vocab_size 50 is the true size (--vocab-size): --vocab 49 drops a real row, though 50 is a multiple of
    2 that the guess for a config's lone size would have taken for 49 padded."""
    from fixtures.megatron import TINY, full_model, megatron_args, write_megatron

    args = megatron_args(TINY, 2, record_vocab=True)
    src = write_megatron(tmp_path / "src", full_model(TINY), 2, args=args)
    result = cli("fix", src, "--vocab", 49, "-o", tmp_path / "out")
    assert_refused(
        result,
        tmp_path / "out",
        "--vocab 49 is below the vocab size 50 that model_optim_rng.pt gives: the 1 rows 49..49 of every vocab "
        "tensor would be dropped",
        "--allow-vocab-shrink",
    )


SAMPLE = Path(__file__).resolve().parents[2] / "sample_ckpts" / "tiny-llama-tp2"


def test_a_tp_that_does_not_divide_the_heads_is_one_line_with_the_tps_that_work(cli, tmp_path):
    result = cli("convert", SAMPLE, "--tp", 3, "-o", tmp_path / "out")
    line = assert_refused(
        result,
        tmp_path / "out",
        "tp=3 cannot split 14 tensor(s) of this model (num_attention_heads=8, num_key_value_heads=4: not divisible "
        "by 3); e.g. ",
        "model.layers.0.self_attn.k_proj.weight: replicated_heads(dim=0, heads=4) of [32, 64] cannot be split 3 ways",
    )
    assert line.endswith("(tp sizes that work: 1, 2, 4, 8)")
    check = cli("check", SAMPLE, "--tp", 3)
    assert check.exit_code == 1
    assert check.stdout.splitlines()[-1] == "cannot be split 3 ways (tp sizes that work: 1, 2, 4, 8)"
    check = cli("check", SAMPLE, "--tp", 3, "--json")
    assert json.loads(check.stdout)["tp_sizes_that_work"] == [1, 2, 4, 8]
    assert "tp_sizes_that_work" not in json.loads(cli("check", SAMPLE, "--tp", 2, "--json").stdout)


def test_rank_files_of_two_runs_mixed_are_named_by_their_shapes(cli, tmp_path):
    for tp in (4, 8):
        assert cli("convert", SAMPLE, "--tp", tp, "-o", tmp_path / f"tp{tp}", "-q").exit_code == 0
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(tmp_path / "tp8" / "config.json", mixed)
    for rank in range(8):
        shutil.copytree(tmp_path / ("tp4" if rank < 4 else "tp8") / f"rank_{rank:02d}", mixed / f"rank_{rank:02d}")
    for command in (["convert", mixed, "--tp", 1], ["fix", mixed]):
        result = cli(*command, "-o", tmp_path / "out")
        assert_refused(
            result,
            tmp_path / "out",
            f"{mixed}: lm_head.weight: the rank files seem to be of 2 runs at different tps, mixed: ranks 0-3 hold "
            "[251, 64], ranks 4-7 hold [126, 64] (keep the rank files of one run together)",
        )
