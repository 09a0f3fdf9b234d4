"""``reshard fix``: vocab-padded, TP-sliced checkpoints back to the model transformers saved."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from fixtures import SAMPLES, load_script, snapshot
from fixtures.hf import load_folder
from fixtures.models import logits, tiny_llama
from fixtures.trainer import write_rank_files
from safetensors.torch import load_file, save_file

from reshard.manifest import MANIFEST_NAME

V = 65535
HIDDEN = 16


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory):
    """A transformers Llama with a 65535 vocab (hidden 16, 8 heads, so it splits 8 ways; one layer), saved with
    save_pretrained: the model, its folder and its state dict."""
    folder = tmp_path_factory.mktemp("original") / "llama"
    sizes = dict(hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1, max_position_embeddings=32)
    model = tiny_llama(folder, vocab=V, **sizes)
    return model, folder, load_file(folder / "model.safetensors")


def write_ranks(model_dir: Path, out: Path, tp: int, *, config: dict | None = None, **options) -> Path:
    """The model saved in ``model_dir`` as a padding TP trainer writes it (see fixtures.trainer), its config.json
    or ``config``."""
    config = config or json.loads((model_dir / "config.json").read_text())
    return write_rank_files(out, load_file(model_dir / "model.safetensors"), config, tp, **options)


def from_pretrained(folder: Path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(folder).eval()


def assert_same_model(out: Path, original) -> None:
    model, _, state = original
    written = load_folder(out)
    assert written.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(written[name], tensor), name
    assert json.loads((out / "config.json").read_text())["vocab_size"] == V
    assert torch.equal(logits(from_pretrained(out), V), logits(model, V))


@pytest.mark.parametrize(
    ("tp", "name"),
    [
        (2, "pytorch_model_rank{r}.bin"),
        (4, "tp_rank_{r}/pytorch_model.bin"),
        (8, "mp_rank_{r:02d}_model_states.pt"),
        (2, "model-rank-{r}.safetensors"),
        (4, "model_tp{r}.safetensors"),
        (8, "rank_{r:02d}/model.safetensors"),
    ],
    ids=["bin-tp2", "bin-folders-tp4", "pt-tp8", "safetensors-tp2", "safetensors-tp4", "hf-ranks-tp8"],
)
def test_fix_per_rank_files_gives_the_original_logits(cli, tmp_path, original, tp, name):
    ckpt = write_ranks(original[1], tmp_path / "ckpt", tp, name=name)
    before = snapshot(ckpt)
    result = cli("fix", ckpt, "--vocab", V, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    rows = 65536 // tp
    assert f"model.embed_tokens.weight: {tp} x [{rows}, {HIDDEN}] -> [{V}, {HIDDEN}]" in result.stdout
    assert f"lm_head.weight: {tp} x [{rows}, {HIDDEN}] -> [{V}, {HIDDEN}]" in result.stdout
    assert f"manifest {tmp_path / 'out' / MANIFEST_NAME}" in result.stdout
    assert_same_model(tmp_path / "out", original)
    assert snapshot(ckpt) == before


@pytest.mark.parametrize(
    ("target", "fixed"),
    [("ckpt", "ckpt.fixed"), ("ckpt/model.safetensors", "ckpt/model.safetensors.fixed")],
    ids=["folder", "file"],
)
def test_fix_full_padded_checkpoint_unpads_into_ckpt_fixed(cli, tmp_path, original, target, fixed):
    """Case 2: one full file with 65536 vocab rows (the last one junk); output defaults to CKPT.fixed."""
    _, folder, state = original
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    padded = dict(state)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        padded[name] = torch.cat([state[name], torch.full((1, HIDDEN), 7.0)])
    save_file(padded, ckpt / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(folder / "config.json", ckpt / "config.json")
    result = cli("fix", tmp_path / target, "--vocab", V)
    assert result.exit_code == 0, result.output
    assert f"model.embed_tokens.weight: [65536, {HIDDEN}] -> [{V}, {HIDDEN}]" in result.stdout
    assert f"{tmp_path / target} (hf, tp=1) -> {tmp_path / fixed} (hf, tp=1)" in result.stdout
    assert_same_model(tmp_path / fixed, original)


def test_fix_of_a_sound_checkpoint_says_so_and_writes_nothing(cli, tmp_path, original):
    before = snapshot(original[1])
    result = cli("fix", original[1], "--vocab", V, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        f"{original[1]} (hf, tp=1): nothing to fix: no tensor changes shape and the vocab is already {V} "
        "(from --vocab); nothing written (--force writes a copy anyway)\n"
    )
    assert list(tmp_path.iterdir()) == [] and snapshot(original[1]) == before
    result = cli("fix", original[1], "-o", tmp_path / "out", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["written"] is False
    assert list(tmp_path.iterdir()) == []


def test_fix_force_of_a_sound_checkpoint_changes_nothing(cli, tmp_path, original):
    result = cli("fix", original[1], "--vocab", V, "--force", "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "  no tensor changed shape" in result.stdout
    assert "config.json vocab_size" not in result.stdout
    assert_same_model(tmp_path / "out", original)


def test_fix_names_the_missing_rank_folders_of_hf_ranks(cli, tmp_path, original):
    ckpt = tmp_path / "ckpt"
    assert cli("convert", original[1], "--tp", 2, "--pad-multiple", 128, "-o", ckpt).exit_code == 0
    shutil.rmtree(ckpt / "rank_01")
    (ckpt / MANIFEST_NAME).unlink()  # with it, hf-ranks itself names the missing folder
    result = cli("fix", ckpt, "--vocab", V)
    assert result.exit_code == 2
    assert "explained by tp=2: 32768 x 2 = 65536" in result.stderr
    assert "missing rank files for tp=2: rank_01/ (reshard never invents rows" in result.stderr
    assert not (tmp_path / "ckpt.fixed").exists()


@pytest.mark.parametrize("direct", [False, True], ids=["folder", "file"])
def test_fix_refuses_a_single_rank_slice(cli, tmp_path, original, direct):
    """Case 3: only rank 0 of tp 2 (32768 rows for 65535): exit 2, the diagnosis, and no output."""
    ckpt = write_ranks(original[1], tmp_path / "ckpt", 2, ranks=[0])
    target = ckpt / "pytorch_model_rank0.bin" if direct else ckpt
    result = cli("fix", target, "--vocab", V)
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: {ckpt / 'pytorch_model_rank0.bin'}: lm_head.weight, model.embed_tokens.weight: only 32768 of "
        "65535 vocab rows are present (1 rank slice of 32768 rows); explained by tp=2: 32768 x 2 = 65536 = 65535 "
        "padded to a multiple of m*2 for m in 1, 2, 4, 8, 16, 32, 64, 128; missing rank files for tp=2: "
        "pytorch_model_rank1.bin (reshard never invents rows: put every rank's file beside it and run fix again)\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", "pytorch_model_rank0.bin"]


def test_fix_refuses_half_of_the_ranks(cli, tmp_path, original):
    """Ranks 0 and 1 of a tp=4 save: 2 x 16384 rows; tp=4 explains them and ranks 2, 3 are named."""
    ckpt = write_ranks(original[1], tmp_path / "ckpt", 4, name="model-rank-{r}.safetensors", ranks=[0, 1])
    result = cli("fix", ckpt, "--vocab", V, "-o", tmp_path / "out")
    assert result.exit_code == 2
    assert "only 32768 of 65535 vocab rows are present (2 rank slices of 16384 + 16384 rows)" in result.stderr
    assert "tp=4: 16384 x 4 = 65536 = 65535 padded to a multiple of m*4" in result.stderr
    assert "missing rank files for tp=4: model-rank-2.safetensors, model-rank-3.safetensors" in result.stderr
    assert not (tmp_path / "out").exists()


def test_fix_refuses_a_slice_no_plan_rule_covers(cli, tmp_path):
    """A family without a plan (GPT-2 names): wte's 32768 rows are refused, wpe's 32768 positions are not."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    rows = torch.arange(32768 * 8, dtype=torch.float32).reshape(32768, 8)
    save_file({"transformer.wte.weight": rows, "transformer.wpe.weight": rows + 1}, ckpt / "model.safetensors")
    config = {"model_type": "gpt2", "vocab_size": V, "n_embd": 8, "n_positions": 32768}
    (ckpt / "config.json").write_text(json.dumps(config))
    result = cli("fix", ckpt, "-o", tmp_path / "out")
    assert result.exit_code == 2
    assert result.stderr.startswith(
        f"Error: {ckpt / 'model.safetensors'}: transformer.wte.weight: only 32768 of 65535 vocab rows are present"
    )
    assert "missing rank files for tp=2: those of rank 1 (reshard never invents rows" in result.stderr
    assert not (tmp_path / "out").exists()


def test_fix_sets_a_padded_config_vocab_back(cli, tmp_path, original):
    """Case 4: the trainer saved config.json with the padded 65536; the output says 65535, the manifest both."""
    config = json.loads((original[1] / "config.json").read_text()) | {"vocab_size": 65536}
    ckpt = write_ranks(original[1], tmp_path / "ckpt", 2, config=config)
    result = cli("fix", ckpt, "--vocab", V, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "config.json vocab_size 65536 -> 65535" in result.stdout
    assert_same_model(tmp_path / "out", original)
    vocab = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())["vocab"]
    assert vocab == {"original": V, "padded": V, "pad_multiple": 1, "source_padded": 65536, "source_config": 65536}


def test_fix_takes_the_vocab_from_reshard_json_before_config(cli, tmp_path, original):
    """Case 5: no --vocab; reshard.json beside the input says 65535 although config.json says 65536."""
    ckpt = tmp_path / "ckpt"
    result = cli("convert", original[1], "--tp", 2, "--pad-multiple", 128, "-o", ckpt)
    assert result.exit_code == 0, result.output
    config = json.loads((ckpt / "config.json").read_text()) | {"vocab_size": 65536}
    (ckpt / "config.json").write_text(json.dumps(config))
    result = cli("fix", ckpt, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "vocab 65535 (from reshard.json): 65536 rows in the source, 65535 written" in result.stdout
    assert_same_model(tmp_path / "out", original)


def test_fix_takes_the_vocab_from_config_json(cli, tmp_path, original):
    ckpt = write_ranks(original[1], tmp_path / "ckpt", 2)
    result = cli("fix", ckpt, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "vocab 65535 (from config.json): 65536 rows in the source, 65535 written" in result.stdout
    assert "note: vocab size 65535 taken from config.json: if that is a padded size, pass --vocab" in result.stdout
    assert_same_model(tmp_path / "out", original)


def test_fix_asks_for_the_vocab_when_nothing_tells_it(cli, tmp_path, original):
    ckpt = write_ranks(original[1], tmp_path / "ckpt", 2)
    (ckpt / "config.json").unlink()
    result = cli("fix", ckpt)
    assert result.exit_code == 2
    assert result.stderr == (
        f"Error: {ckpt}: the original vocab size is unknown: there is no reshard.json beside the checkpoint and "
        "there is no config.json (pass --vocab N, the tokenizer's vocab size)\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_fix_with_tp_reslices_the_repaired_checkpoint(cli, tmp_path, original):
    _, folder, state = original
    ckpt = write_ranks(folder, tmp_path / "ckpt", 2)
    result = cli("fix", ckpt, "--vocab", V, "--tp", 4, "-o", tmp_path / "out", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["layout"], report["tp"], report["vocab"]["target_padded"]) == ("hf-ranks", 4, 65536)
    embed = next(c for c in report["changed"] if c["tensor"] == "model.embed_tokens.weight")
    assert (embed["old"], embed["new"]) == ([[32768, HIDDEN]] * 2, [[16384, HIDDEN]] * 4)
    ranks = [load_folder(tmp_path / "out" / f"rank_{r:02d}") for r in range(4)]
    embed = torch.cat([r["model.embed_tokens.weight"] for r in ranks])
    assert torch.equal(embed[:V], state["model.embed_tokens.weight"])
    assert torch.equal(embed[V:], torch.zeros(1, HIDDEN))
    q = torch.cat([r["model.layers.0.self_attn.q_proj.weight"] for r in ranks])
    assert torch.equal(q, state["model.layers.0.self_attn.q_proj.weight"])


def test_fix_quiet_and_text_report_for_tp(cli, tmp_path, original):
    ckpt = write_ranks(original[1], tmp_path / "ckpt", 2)
    result = cli("fix", ckpt, "--vocab", V, "--tp", 4, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert f"model.embed_tokens.weight: 2 x [32768, {HIDDEN}] -> 4 x [16384, {HIDDEN}]" in result.stdout
    assert "  7 other tensor(s) re-sliced from tp=2 to tp=4" in result.stdout
    result = cli("fix", ckpt, "--vocab", V, "-q")
    assert (result.exit_code, result.stdout) == (0, "")
    assert (tmp_path / "ckpt.fixed" / "model.safetensors").is_file()


def test_fix_refuses_a_vocab_that_would_drop_data(cli, tmp_path, original):
    ckpt = write_ranks(original[1], tmp_path / "ckpt", 2)
    result = cli("fix", ckpt, "--vocab", 1000, "-o", tmp_path / "out")
    assert result.exit_code == 2
    assert "65536 rows for a vocab of 1000: dropping 64536 rows is more than padding (check --vocab)" in result.stderr
    assert not (tmp_path / "out").exists()


def test_fix_the_committed_sample(cli, tmp_path):
    """The README's command on sample_ckpts/tiny-llama-65535-tp2 gives back the weights make_samples.py drew."""
    result = cli("fix", SAMPLES / "tiny-llama-65535-tp2", "--vocab", V, "-o", tmp_path / "fixed")
    assert result.exit_code == 0, result.output
    assert "model.embed_tokens.weight: 2 x [32768, 8] -> [65535, 8]" in result.stdout
    expected = load_script(SAMPLES / "make_samples.py").padded_state()
    written = load_folder(tmp_path / "fixed")
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[k], v) for k, v in expected.items())


@pytest.mark.parametrize(
    ("tp", "name"),
    [(2, "pytorch_model_rank{r}.bin"), (4, "rank_{r:02d}/model.safetensors")],
    ids=["bin-tp2", "hf-ranks-tp4"],
)
def test_fix_vocab_above_the_rows_held_by_every_rank_says_so(cli, tmp_path, original, tp, name):
    """Every rank's file is present (as many as the config and the files record): --vocab 70000 exceeds the
    65536 rows they hold, and the message says that, not that rank files are missing."""
    ckpt = write_ranks(original[1], tmp_path / "ckpt", tp, name=name)
    before = snapshot(ckpt)
    result = cli("fix", ckpt, "--vocab", 70000, "-o", tmp_path / "out")
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "--vocab 70000 exceeds the 65536 vocab rows" in lines[0]
    assert "missing rank files" not in lines[0] and "put every rank's file" not in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"] and snapshot(ckpt) == before


def test_fix_vocab_above_the_rows_of_the_recorded_tp_says_so(cli, tmp_path, original):
    """reshard.json records tp=2 and both rank folders are there: --vocab 131000 (which tp=4 slices of 32768 rows
    would explain) exceeds the 65536 rows held, and no rank folder is called missing."""
    ckpt = tmp_path / "ckpt"
    assert cli("convert", original[1], "--tp", 2, "-o", ckpt).exit_code == 0
    before = snapshot(ckpt)
    result = cli("fix", ckpt, "--vocab", 131000, "-o", tmp_path / "out")
    assert result.exit_code == 2
    assert len(result.stderr.splitlines()) == 1
    assert "--vocab 131000 exceeds the 65536 vocab rows the 2 rank files hold" in result.stderr
    assert "missing rank files" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"] and snapshot(ckpt) == before


def test_fix_of_a_megatron_source_writes_hf_with_the_true_vocab(cli, tmp_path):
    """fix's purpose is a canonical checkpoint: a Megatron source at tp 2 (vocab 50 padded to 56) becomes an hf
    folder at tp 1 with 50 vocab rows, not Megatron at tp 1 with the pad rows kept (convert keeps Megatron)."""
    from fixtures.megatron import TINY, full_model, write_megatron

    full = full_model(TINY)
    src = write_megatron(tmp_path / "src", full, 2)
    before = snapshot(src)
    result = cli("fix", src, "--vocab", TINY.vocab, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert f"{src} (megatron, tp=2) -> {tmp_path / 'out'} (hf, tp=1)" in result.stdout
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"model.safetensors", "config.json", MANIFEST_NAME}
    written = load_file(tmp_path / "out" / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert written[name].shape[0] == TINY.vocab, name
    assert torch.equal(written["model.embed_tokens.weight"], full["emb"])
    assert torch.equal(written["lm_head.weight"], full["out"])
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == TINY.vocab
    assert snapshot(src) == before


def test_fix_of_a_megatron_source_at_tp_above_1_keeps_megatron(cli, tmp_path):
    from fixtures.megatron import TINY, full_model, write_megatron

    src = write_megatron(tmp_path / "src", full_model(TINY), 2)
    result = cli("fix", src, "--vocab", TINY.vocab, "--tp", 4, "-o", tmp_path / "out", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["layout"] == "megatron"


@pytest.mark.parametrize("command", ["fix", "convert"])
def test_an_hf_output_of_megatron_gets_only_the_notes_true_of_it(cli, tmp_path, command):
    """Written as hf with --vocab: Megatron's "load it with --no-load-optim" and "the args do not record the true
    vocab" are not true of it; written back as Megatron, the first is; inspect without --vocab says both."""
    from fixtures.megatron import TINY, full_model, write_megatron

    src = write_megatron(tmp_path / "src", full_model(TINY), 2)
    extra = ["--layout", "hf"] if command == "convert" else []
    result = cli(command, src, "--vocab", TINY.vocab, "--tp", 1, *extra, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "(hf, tp=1)" in result.stdout
    assert "--no-load-optim" not in result.stdout and "do not record the true vocab" not in result.stdout

    kept = cli("convert", src, "--vocab", TINY.vocab, "--tp", 1, "-o", tmp_path / "kept")
    assert kept.exit_code == 0, kept.output
    assert "(megatron, tp=1)" in kept.stdout
    assert "note: not carried over by convert: " in kept.stdout and "--no-load-optim" in kept.stdout
    assert "do not record the true vocab" not in kept.stdout
    inspected = cli("inspect", src)
    assert "note: not carried over by convert: " in inspected.stdout
    assert "note: the args do not record the true vocab size" in inspected.stdout
