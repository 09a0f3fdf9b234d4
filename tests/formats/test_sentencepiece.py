"""A SentencePiece model's pieces and special ids read from its protobuf without sentencepiece, and damaged or
hostile files refused with the file named (the real models' reading is checked against sentencepiece in
tests/engine/test_tokenizer_megatron.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from reshard.errors import CorruptFileError
from reshard.formats.sentencepiece import read_sentencepiece


def varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int32 as protobuf writes it: ten bytes
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def field(number: int, value: int | bytes) -> bytes:
    if isinstance(value, int):
        return varint(number << 3) + varint(value)
    return varint(number << 3 | 2) + varint(len(value)) + value


def model(pieces: list[str], **ids: int) -> bytes:
    numbers = {"unk_id": 40, "bos_id": 41, "eos_id": 42, "pad_id": 43}
    body = b"".join(field(1, field(1, p.encode()) + field(3, 1)) for p in pieces)
    trainer = field(3, 2) + b"".join(field(numbers[k], v) for k, v in ids.items())
    return body + field(2, trainer) + field(3, field(1, b"identity"))


def test_pieces_and_ids_with_defaults_and_negative_ids(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.model"
    path.write_bytes(model(["<unk>", "<s>", "</s>", "▁the", "ï"]))
    read = read_sentencepiece(path, max_bytes=1 << 20)
    assert read.pieces == ("<unk>", "<s>", "</s>", "▁the", "ï")
    assert (read.unk_id, read.bos_id, read.eos_id, read.pad_id) == (0, 1, 2, -1)
    path.write_bytes(model(["<pad>", "<unk>", "<s>", "</s>"], pad_id=0, unk_id=1, bos_id=-1, eos_id=3))
    read = read_sentencepiece(path, max_bytes=1 << 20)
    assert (read.unk_id, read.bos_id, read.eos_id, read.pad_id) == (1, -1, 3, 0)
    assert read.piece(read.bos_id) is None and read.piece(0) == "<pad>"


@pytest.mark.parametrize(
    ("data", "said"),
    [
        (model(["a", "b", "c"])[:-3], "runs past the end"),
        (b"\x0f" + b"\x00" * 8, "wire type 7"),
        (b"\x08" + b"\xff" * 11, "a number runs past the end"),
        (model([]), "no pieces"),
        (model(["a", "b", "c"], eos_id=7), "special id 7 (field 42) outside the 3 pieces"),
        (field(1, field(1, b"\xff\xfe")), "not UTF-8"),
        (field(1, field(2, 5)), "piece 0 has no text"),
    ],
    ids=["truncated", "wire-type", "endless-varint", "empty", "id-out-of-range", "not-utf8", "no-text"],
)
def test_damaged_models_are_refused_naming_the_file(tmp_path: Path, data: bytes, said: str) -> None:
    path = tmp_path / "tokenizer.model"
    path.write_bytes(data)
    with pytest.raises(CorruptFileError, match=re.escape(said)) as err:
        read_sentencepiece(path, max_bytes=1 << 20)
    assert str(path) in err.value.one_line()


def test_an_oversized_model_is_refused_before_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.model"
    path.write_bytes(model(["a", "b", "c"]))
    with pytest.raises(CorruptFileError, match="larger than any SentencePiece model"):
        read_sentencepiece(path, max_bytes=8)
