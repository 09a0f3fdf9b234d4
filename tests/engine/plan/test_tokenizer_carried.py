"""The tokenizer an HF output carries: the one Megatron's args or NeMo's context name, else ``--tokenizer DIR|REPO``;
the true vocab size it gives and the exit 2 when it disagrees; ``generation_config.json``; the warning without one."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

from fixtures.megatron import TINY, full_model, megatron_args, write_megatron
from fixtures.tokenizer import tiny_tokenizer, tiny_tokenizer_size
from safetensors.torch import load_file

from reshard.layouts.dcp.nemo import nemo_side_files, nemo_tokenizer

SIZES = replace(TINY, vocab=tiny_tokenizer_size())


def megatron_with(tmp_path: Path, tokenizer_model: str, sizes=SIZES, **extra) -> Path:
    args = megatron_args(sizes, 2, tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tokenizer_model, **extra)
    return write_megatron(tmp_path / "megatron", full_model(sizes), 2, sizes=sizes, args=args)


def test_the_args_tokenizer_gives_the_vocab_and_goes_beside_the_output(cli, tmp_path: Path) -> None:
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    src = megatron_with(tmp_path, str(tokenizer))
    report = json.loads(cli("inspect", src, "--json").output)
    assert report["vocab"]["original"] == SIZES.vocab and any("comes from the tokenizer" in n for n in report["notes"])
    out = tmp_path / "hf"
    result = cli("convert", src, "--tp", 1, "--layout", "hf", "-o", out, "--json")
    assert result.exit_code == 0, result.output
    said = f"the output carries the tokenizer of the args' tokenizer_model {tokenizer}"
    assert said in json.loads(result.stdout)["notes"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (tokenizer / name).read_bytes()
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}
    config = json.loads((out / "config.json").read_text())
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (SIZES.vocab, 1, 2)
    assert load_file(out / "model.safetensors")["model.embed_tokens.weight"].shape[0] == SIZES.vocab
    result = cli("convert", src, "--tp", 1, "--layout", "megatron", "-o", tmp_path / "tp1", "--json")
    assert result.exit_code == 0, result.output
    assert any("the megatron layout carries no tokenizer" in n for n in json.loads(result.stdout)["notes"])
    assert not list((tmp_path / "tp1").rglob("tokenizer*"))


def test_a_tokenizer_that_disagrees_with_vocab_or_the_args_is_refused_with_both_numbers(cli, tmp_path: Path) -> None:
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    src = megatron_with(tmp_path, str(tokenizer))
    out = tmp_path / "hf"
    result = cli("convert", src, "--tp", 1, "--layout", "hf", "-o", out, "--vocab", SIZES.vocab + 1)
    assert result.exit_code == 2 and not out.exists()
    assert f"--vocab {SIZES.vocab + 1}, but the tokenizer" in result.output
    assert f"holds {SIZES.vocab} tokens" in result.output
    bigger = tiny_tokenizer(tmp_path / "bigger", extra=("<tool>", "<a>", "<b>", "<c>", "<d>", "<e>"))
    result = cli("convert", src, "--tp", 1, "--layout", "hf", "-o", out, "--tokenizer", bigger)
    assert result.exit_code == 2 and not out.exists()
    padded = SIZES.padded_vocab(2)
    assert f"padded_vocab_size={padded}, but the tokenizer (--tokenizer {bigger}) holds 51 tokens" in result.output
    recorded = megatron_with(tmp_path / "r", str(tokenizer), record_vocab=True, vocab_size=SIZES.vocab - 1)
    result = cli("convert", recorded, "--tp", 1, "--layout", "hf", "-o", out)
    assert result.exit_code == 2 and f"the args say vocab_size={SIZES.vocab - 1}, but" in result.output


def test_a_tokenizer_named_but_not_here_warns_and_tokenizer_dir_supplies_it(cli, tmp_path: Path, caplog) -> None:
    src = megatron_with(tmp_path, "meta-llama/Llama-3.1-8B")
    out = tmp_path / "hf"
    with caplog.at_level(logging.WARNING):
        result = cli("convert", src, "--tp", 1, "--layout", "hf", "-o", out, "--vocab", SIZES.vocab, "--json")
    assert result.exit_code == 0, result.output
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"{out} has no tokenizer: vLLM and other runtimes will not load it; pass --tokenizer DIR|REPO"]
    assert any("meta-llama/Llama-3.1-8B, not a folder here" in n for n in json.loads(result.stdout)["notes"])
    caplog.clear()
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    with caplog.at_level(logging.WARNING):
        result = cli("convert", src, "--tp", 1, "--layout", "hf", "-o", tmp_path / "with", "--tokenizer", tokenizer)
    assert result.exit_code == 0, result.output
    assert not caplog.records and (tmp_path / "with" / "tokenizer.json").is_file()


def test_tokenizer_repo_fetches_only_the_tokenizer_files(cli, hub, tmp_path: Path) -> None:
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    files = {p.name: p.read_bytes() for p in tokenizer.iterdir()}
    hub.publish("acme/tok", files | {"model.safetensors": b"not fetched", "config.json": b"{}"})
    src = megatron_with(tmp_path, "acme/tok")  # a Hub id: not fetched unless asked
    out = tmp_path / "hf"
    result = cli("convert", src, "--tp", 1, "--layout", "hf", "-o", out, "--tokenizer", "acme/tok")
    assert result.exit_code == 0, result.output
    assert (out / "tokenizer.json").read_bytes() == files["tokenizer.json"]
    fetched = {r.path.rsplit("/", 1)[-1] for r in hub.requests if "/resolve/" in r.path}
    assert fetched == {"tokenizer.json", "tokenizer_config.json"}
    missing = cli("convert", src, "--tp", 1, "--layout", "hf", "-o", tmp_path / "x", "--tokenizer", "acme/none")
    assert missing.exit_code == 2 and "acme/none" in missing.output and not (tmp_path / "x").exists()


def test_an_hf_source_keeps_its_generation_config_and_tokenizer_replaces_its_tokenizer(cli, tmp_path: Path) -> None:
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    src = megatron_with(tmp_path, str(tokenizer))
    hf = tmp_path / "hf"
    assert cli("convert", src, "--tp", 1, "--layout", "hf", "-o", hf).exit_code == 0
    (hf / "generation_config.json").write_text('{"eos_token_id": 2, "temperature": 0.6}')
    other = tiny_tokenizer(tmp_path / "other", extra=())
    out = tmp_path / "out"
    result = cli("convert", hf, "--tp", 1, "-o", out, "--tokenizer", other)
    assert result.exit_code == 0, result.output
    assert (out / "generation_config.json").read_text() == '{"eos_token_id": 2, "temperature": 0.6}'
    assert (out / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()


def test_nemo_keeps_its_tokenizer_and_generation_config_in_its_context(tmp_path: Path) -> None:
    """NeMo's import copies a local tokenizer folder into context/ and names it in model.yaml; a Hub id is a name."""
    context = tmp_path / "nemo" / "context"
    tiny_tokenizer(context / "nemo_tokenizer")
    (context / "artifacts").mkdir()
    (context / "artifacts" / "generation_config.json").write_text('{"eos_token_id": 2}')
    yaml = "config: {}\ntokenizer:\n  _target_: nemo.collections.common.tokenizers.AutoTokenizer\n"
    (context / "model.yaml").write_text(yaml + "  pretrained_model_name: nemo_tokenizer\n")
    found = nemo_tokenizer(tmp_path / "nemo")
    assert found is not None and found.folder == (context / "nemo_tokenizer").resolve()
    assert nemo_side_files(tmp_path / "nemo") == [context / "artifacts" / "generation_config.json"]
    (context / "model.yaml").write_text(yaml + "  pretrained_model_name: ../../elsewhere\n")
    assert nemo_tokenizer(tmp_path / "nemo").folder == (context / "nemo_tokenizer").resolve()  # never outside
    (context / "nemo_tokenizer" / "tokenizer.json").unlink()
    (context / "nemo_tokenizer").rename(context / "moved")
    (context / "model.yaml").write_text(yaml + "  pretrained_model_name: meta-llama/Llama-3.1-8B\n")
    named = nemo_tokenizer(tmp_path / "nemo")
    assert named is not None and named.folder is None and named.name == "meta-llama/Llama-3.1-8B"
    (context / "model.yaml").write_text(yaml + '  pretrained_model_name: "a\\0b"\n')  # NUL: no file system's name
    assert nemo_tokenizer(tmp_path / "nemo").folder is None
