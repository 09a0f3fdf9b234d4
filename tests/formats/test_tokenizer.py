"""What a tokenizer's files say, read without executing anything: len(tokenizer) and the bos / eos ids, as
transformers gives them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures.tokenizer import tiny_tokenizer

from reshard.errors import CorruptFileError, ReshardError
from reshard.formats import tokenizer as tokenizer_module
from reshard.formats.tokenizer import generation_config, read_tokenizer


@pytest.mark.parametrize("extra", [(), ("<tool>",), ("<tool>", "cat", "<call>")], ids=["none", "one", "in-vocab"])
def test_size_and_special_ids_are_transformers(tmp_path: Path, extra: tuple[str, ...]) -> None:
    """Added tokens count once each, a special token already in the vocab not again: transformers' len()."""
    from transformers import AutoTokenizer

    folder = tiny_tokenizer(tmp_path / "tok", extra=extra)
    loaded = AutoTokenizer.from_pretrained(folder)
    read = read_tokenizer(folder, "test")
    assert read.size == len(loaded)
    assert (read.bos_token_id, read.eos_token_id) == (loaded.bos_token_id, loaded.eos_token_id) == (1, 2)
    assert generation_config(read) == {"bos_token_id": 1, "eos_token_id": 2}
    assert [p.name for p in read.files] == ["tokenizer.json", "tokenizer_config.json"]


def test_a_bpe_vocab_json_with_added_tokens(tmp_path: Path) -> None:
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "<|end|>": 2}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n")
    (tmp_path / "added_tokens.json").write_text(json.dumps({"<|end|>": 2, "<|pad|>": 3}))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|end|>"}}))
    read = read_tokenizer(tmp_path, "test")
    assert (read.size, read.bos_token_id, read.eos_token_id) == (4, None, 2)
    assert generation_config(read) == {"eos_token_id": 2}


def test_no_tokenizer_a_damaged_file_and_an_oversized_one_are_refused(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ReshardError, match="no tokenizer here"):
        read_tokenizer(tmp_path, "test")
    (tmp_path / "tokenizer.json").write_text('{"model": {"vocab": ')
    with pytest.raises(CorruptFileError, match="not JSON"):
        read_tokenizer(tmp_path, "test")
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": "zero"}}, "added_tokens": []}))
    with pytest.raises(CorruptFileError, match="not a token and its id"):
        read_tokenizer(tmp_path, "test")
    monkeypatch.setattr(tokenizer_module, "MAX_FILE_BYTES", 8)
    with pytest.raises(ReshardError, match="larger than any tokenizer file"):
        read_tokenizer(tmp_path, "test")
