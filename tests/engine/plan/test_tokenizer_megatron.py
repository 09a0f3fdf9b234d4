"""Megatron-LM's own tokenizers (GPT-2 BPE files, SentencePiece models) carried into an HF output as the transformers
tokenizer of the same ids: transformers' AutoTokenizer on the output against the reference libraries themselves
(the ``tokenizers`` library's byte-level BPE for GPT-2; sentencepiece's own ``encode``, in its own venv, with
Megatron-LM's rules for each SentencePiece type), ``generation_config.json`` with Megatron's bos and eod; the
``hf-ranks`` layout carries it at its top; types that cannot be carried keep the warning."""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path

import pytest
import torch
from fixtures.megatron import Sizes, full_model, megatron_args, write_megatron
from fixtures.sentencepiece import sentencepiece_python, train_sentencepiece
from fixtures.tokenizer import WORDS, tiny_tokenizer, tiny_tokenizer_size

TEXTS = [
    "the red cat runs over the river",
    "  Hello  World!\n\tIt's 2026.  ",
    "naïve café ©® ½ ﬁ 123",
    "x</s>y <s> z<unk>",
    "the cat<EOD>the dog <MASK> end<|endoftext|>",
    "<extra_id_1> and <PAD>",
]
# Megatron-LM's legacy tokenizers (megatron/training/tokenizer/tokenizer.py before 3257093930, 2025), their
# tokenize() and special ids as written there, over sentencepiece; and transformers' AutoTokenizer on each output.
SP_CHECK = """
import json, sys
import sentencepiece
from transformers import AutoTokenizer

def megatron(kind, model_file, extra_ids):
    sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
    if kind == "GPTSentencePieceTokenizer":
        return sp.encode_as_ids, len(sp), sp.bos_id(), sp.eos_id()
    if kind == "Llama2Tokenizer":
        return (lambda s: [sp.bos_id()] + sp.encode(s)), len(sp), sp.bos_id(), sp.eos_id()
    vocab = {sp.id_to_piece(i): i for i in range(len(sp))}
    special = {}
    def add(t):
        if t not in vocab:
            vocab[t] = len(vocab)
        special[t] = vocab[t]
    for t in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"):
        add(t)
    for get, fallback in ((sp.pad_id, "<PAD>"), (sp.bos_id, "<BOS>"), (sp.eos_id, "<EOS>")):
        try:
            add(sp.id_to_piece(get()))
        except IndexError:
            add(fallback)
    for i in range(extra_ids):
        add(f"<extra_id_{i}>")
    def tokenize(text):
        ids, idx = [], 0
        while 1:
            indices = {}
            for token in special:
                try:
                    indices[token] = text[idx:].index(token)
                except ValueError:
                    continue
            if len(indices) == 0:
                break
            next_token = min(indices, key=indices.get)
            next_idx = idx + indices[next_token]
            ids.extend(sp.encode_as_ids(text[idx:next_idx]))
            ids.append(special[next_token])
            idx = next_idx + len(next_token)
        ids.extend(sp.encode_as_ids(text[idx:]))
        return ids
    return tokenize, len(vocab), vocab[sp.id_to_piece(sp.bos_id())], special["<EOD>"]

cases, texts = json.loads(sys.argv[1]), json.loads(sys.argv[2])
result = {}
for name, (kind, model_file, extra_ids, out) in cases.items():
    tokenize, size, bos, eod = megatron(kind, model_file, extra_ids)
    loaded = AutoTokenizer.from_pretrained(out)
    result[name] = {
        "megatron": [tokenize(t) for t in texts], "transformers": [loaded(t).input_ids for t in texts],
        "sizes": [size, len(loaded)], "bos_eod": [bos, eod], "class": type(loaded).__name__,
    }
print("RESULT " + json.dumps(result))
"""


def sizes_for(vocab: int) -> Sizes:
    return Sizes(hidden=32, heads=8, groups=2, head_dim=4, ffn=48, layers=2, vocab=vocab, multiple=4, bias=True)


def megatron_checkpoint(folder: Path, vocab: int, **args: object) -> Path:
    sizes = sizes_for(vocab)
    return write_megatron(folder, full_model(sizes), 2, sizes=sizes, args=megatron_args(sizes, 2, **args))


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    """A tiny GPT-2 byte-level BPE vocab and merges (as Megatron-LM's ``--vocab-file``, ``--merge-file`` name them),
    trained by the ``tokenizers`` library with ``<|endoftext|>``."""
    from tokenizers import ByteLevelBPETokenizer

    folder = tmp_path_factory.mktemp("gpt2")
    trainer = ByteLevelBPETokenizer()
    corpus = [" ".join(WORDS) * 3, "Hello, world! It's 2026: naïve café."]
    trainer.train_from_iterator(corpus, vocab_size=400, min_frequency=1, special_tokens=["<|endoftext|>"])
    trainer.save_model(str(folder))
    (folder / "vocab.json").rename(folder / "gpt2-vocab.json")
    (folder / "merges.txt").rename(folder / "gpt2-merges.txt")
    size = len(json.loads((folder / "gpt2-vocab.json").read_text()))
    return folder / "gpt2-vocab.json", folder / "gpt2-merges.txt", size


def gpt2_megatron(tmp_path: Path, gpt2_files: tuple[Path, Path, int], **args: object) -> Path:
    vocab_file, merge_file, size = gpt2_files
    return megatron_checkpoint(
        tmp_path / "megatron", size, vocab_file=str(vocab_file), merge_file=str(merge_file), **args
    )


def assert_gpt2_ids(folder: Path, gpt2_files: tuple[Path, Path, int]) -> None:
    """transformers' tokenizer on ``folder`` gives the ids of GPT-2's byte-level BPE over Megatron's files, with
    ``<|endoftext|>`` in text encoded as text, as Megatron-LM's GPT2Tokenizer (no special tokens) does."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import AutoTokenizer

    vocab_file, merge_file, size = gpt2_files
    reference = ByteLevelBPETokenizer(str(vocab_file), str(merge_file))
    loaded = AutoTokenizer.from_pretrained(folder)
    assert len(loaded) == size
    for text in TEXTS:
        assert loaded(text).input_ids == reference.encode(text).ids, text
    assert len(loaded(TEXTS[-2]).input_ids) > 10  # "<|endoftext|>" was BPE text, not one token


def test_gpt2_bpe_files_become_a_gpt2_tokenizer_with_megatrons_ids(
    cli, tmp_path: Path, gpt2_files: tuple[Path, Path, int]
) -> None:
    from transformers import AutoModelForCausalLM

    src = gpt2_megatron(tmp_path, gpt2_files)
    out = tmp_path / "hf"
    result = cli("convert", src, "--tp", 1, "--layout", "hf", "-o", out, "--json")
    assert result.exit_code == 0, result.output
    notes = json.loads(result.stdout)["notes"]
    assert any("carries the tokenizer of the args' vocab_file and merge_file" in n for n in notes), notes
    assert (out / "vocab.json").read_bytes() == gpt2_files[0].read_bytes()
    assert (out / "merges.txt").read_bytes() == gpt2_files[1].read_bytes()
    eod = json.loads(gpt2_files[0].read_text())["<|endoftext|>"]
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": eod, "eos_token_id": eod}
    assert_gpt2_ids(out, gpt2_files)
    _, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


def test_hf_ranks_carries_the_tokenizer_at_its_top(cli, tmp_path: Path, gpt2_files: tuple[Path, Path, int]) -> None:
    """One tokenizer and generation config beside the top-level config.json (where AutoTokenizer reads the model's
    folder), none inside the rank folders, which hold only weights."""
    src = gpt2_megatron(tmp_path, gpt2_files)
    out = tmp_path / "ranks"
    result = cli("convert", src, "--tp", 2, "--layout", "hf-ranks", "-o", out)
    assert result.exit_code == 0, result.output
    top = {p.name for p in out.iterdir() if p.is_file()}
    assert {"config.json", "vocab.json", "merges.txt", "tokenizer_config.json", "generation_config.json"} <= top
    assert sorted(p.name for p in (out / "rank_00").iterdir()) == ["model.safetensors"]
    eod = json.loads(gpt2_files[0].read_text())["<|endoftext|>"]
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (eod, eod)
    assert_gpt2_ids(out, gpt2_files)


def test_sentencepiece_types_give_megatrons_ids_in_transformers(
    cli, pytestconfig: pytest.Config, tmp_path: Path
) -> None:
    """Each SentencePiece type of Megatron-LM (and Megatron-Core's system) over a Unigram (NFKC) and a byte-fallback
    BPE model: AutoTokenizer on the output gives Megatron's ids, len() and bos / eod for every text."""
    python = sentencepiece_python(pytestconfig)
    models = tmp_path / "models"
    models.mkdir()
    pieces = train_sentencepiece(python, models)
    cases = {  # name: (type, model, vocab_extra_ids, size Megatron gives, extra args)
        "legacy-sentencepiece": ("SentencePieceTokenizer", "unigram", 2, pieces["unigram"] + 7, {}),
        "gpt-sentencepiece": ("GPTSentencePieceTokenizer", "bpe", 0, pieces["bpe"], {}),
        "llama2": ("Llama2Tokenizer", "bpe", 0, pieces["bpe"], {}),
        "core-sentencepiece": ("SentencePieceTokenizer", "unigram", 0, pieces["unigram"], {"legacy_tokenizer": False}),
    }
    checked = {}
    for name, (kind, model, extra_ids, size, extra) in cases.items():
        model_file = models / f"{model}.model"
        src = megatron_checkpoint(
            tmp_path / name,
            size,
            tokenizer_type=kind,
            tokenizer_model=str(model_file),
            vocab_extra_ids=extra_ids,
            **extra,
        )
        out = tmp_path / f"{name}-hf"
        result = cli("convert", src, "--tp", 1, "--layout", "hf", "-o", out, "--json")
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["vocab"]["original"] == size
        assert (out / "tokenizer.model").read_bytes() == model_file.read_bytes()
        checked[name] = (kind if not extra else "GPTSentencePieceTokenizer", str(model_file), extra_ids, str(out))
    run = subprocess.run(
        [str(python), "-c", SP_CHECK, json.dumps(checked), json.dumps(TEXTS)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    for name, got in json.loads(lines[-1].removeprefix("RESULT ")).items():
        assert got["class"] == "SentencePieceBackend", name
        assert got["transformers"] == got["megatron"], name
        assert got["sizes"][0] == got["sizes"][1] == cases[name][3], name
        bos, eod = got["bos_eod"]
        out = tmp_path / f"{name}-hf"
        assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": bos, "eos_token_id": eod}
        starts = {ids[0] for ids in got["transformers"]}
        assert (starts == {bos}) == (name == "llama2"), name  # only Llama2Tokenizer prepends bos


def test_tokenizers_that_cannot_be_carried_keep_the_warning(
    cli, tmp_path: Path, gpt2_files: tuple[Path, Path, int], caplog
) -> None:
    size = gpt2_files[2]
    cases = {
        "tiktoken": ({"tokenizer_type": "TikTokenizer", "tokenizer_model": "tok.json"}, "Megatron-LM's TikTokenizer"),
        "null": ({"tokenizer_type": "NullTokenizer"}, "Megatron-LM's NullTokenizer"),
        "unnamed": ({}, "the args name Megatron-LM's GPT2BPETokenizer but not its files"),
        "gone": (
            {"vocab_file": str(tmp_path / "gone.json"), "merge_file": "m.txt"},
            "gone.json and m.txt, not files here",
        ),
        "core-special": (
            {
                "vocab_file": str(gpt2_files[0]),
                "merge_file": str(gpt2_files[1]),
                "legacy_tokenizer": False,
                "special_tokens": ["<tool>"],
            },
            "Megatron-Core's GPT2BPETokenizer with the args' special_tokens",
        ),
    }
    for name, (args, said) in cases.items():
        src = megatron_checkpoint(tmp_path / name, size, **args)
        out = tmp_path / f"{name}-hf"
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            result = cli("convert", src, "--tp", 1, "--layout", "hf", "-o", out, "--vocab", size, "--json")
        assert result.exit_code == 0, result.output
        assert any(said in n for n in json.loads(result.stdout)["notes"]), (name, result.stdout)
        assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
            f"{out} has no tokenizer: vLLM and other runtimes will not load it; pass --tokenizer DIR|REPO"
        ]
        assert not (out / "tokenizer_config.json").exists() and not (out / "generation_config.json").exists()


def test_fix_takes_tokenizer_as_convert_does(cli, tmp_path: Path) -> None:
    tokenizer = tiny_tokenizer(tmp_path / "tok")
    src = megatron_checkpoint(
        tmp_path / "megatron", tiny_tokenizer_size(), tokenizer_type="HuggingFaceTokenizer", tokenizer_model="org/x"
    )
    out = tmp_path / "fixed"
    result = cli("fix", src, "-o", out, "--tokenizer", tokenizer, "--json")
    assert result.exit_code == 0, result.output
    assert (out / "tokenizer.json").read_bytes() == (tokenizer / "tokenizer.json").read_bytes()
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}
    assert json.loads((out / "config.json").read_text())["vocab_size"] == tiny_tokenizer_size()
    again = tmp_path / "again"  # a canonical hf folder needs nothing, but a tokenizer to add is a change
    result = cli("fix", out, "-o", again, "--tokenizer", tiny_tokenizer(tmp_path / "other", extra=()))
    assert result.exit_code == 0, result.output
    assert (again / "tokenizer.json").read_bytes() == (tmp_path / "other" / "tokenizer.json").read_bytes()
    wrong = cli("fix", src, "-o", tmp_path / "x", "--tokenizer", tmp_path / "missing")
    assert wrong.exit_code == 2 and not (tmp_path / "x").exists()
    assert "missing" in wrong.output
