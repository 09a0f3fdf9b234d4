"""A SentencePiece model file (``tokenizer.model``): its pieces and special ids, read from the protobuf without
``sentencepiece`` or ``protobuf`` (neither is a dependency of reshard).

Only what a converted tokenizer needs is read: the pieces in id order and the trainer's ``unk`` / ``bos`` / ``eos``
/ ``pad`` ids (``sentencepiece_model.proto``: ``ModelProto.pieces = 1`` with ``SentencePiece.piece = 1``,
``ModelProto.trainer_spec = 2`` with ``unk_id = 40``, ``bos_id = 41``, ``eos_id = 42``, ``pad_id = 43``, whose
defaults are 0, 1, 2 and -1). The file is untrusted: its size is bounded, every length is checked against the bytes
left, and anything else is refused as a :class:`~reshard.errors.CorruptFileError` naming the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from reshard.errors import CorruptFileError

__all__ = ["MAX_SENTENCEPIECE_BYTES", "SentencePieceModel", "read_sentencepiece"]

# The largest model read: Gemma's 256k pieces take 4.2 MB. The bound keeps what a hostile file can cost in parsing
# time to seconds (measured: docs/performance.md).
MAX_SENTENCEPIECE_BYTES = 32 << 20

_DEFAULT_IDS = {40: 0, 41: 1, 42: 2, 43: -1}  # unk, bos, eos, pad (proto2 defaults)


@dataclass(frozen=True)
class SentencePieceModel:
    """What a ``.model`` file says: ``pieces[i]`` is id ``i``'s piece; an id of -1 means none (as sentencepiece's
    ``pad_id()`` returns)."""

    pieces: tuple[str, ...]
    unk_id: int
    bos_id: int
    eos_id: int
    pad_id: int

    def piece(self, index: int) -> str | None:
        """Id ``index``'s piece, None when out of range (sentencepiece's ``id_to_piece`` raises IndexError)."""
        return self.pieces[index] if 0 <= index < len(self.pieces) else None


def read_sentencepiece(path: Path, *, max_bytes: int = MAX_SENTENCEPIECE_BYTES) -> SentencePieceModel:
    """Read the pieces and special ids of the SentencePiece model at ``path``.

    Raises:
        CorruptFileError: larger than ``max_bytes``, or not a SentencePiece model protobuf.
    """
    size = path.stat().st_size
    if size > max_bytes:
        raise CorruptFileError(f"{size} bytes: larger than any SentencePiece model", path=path)
    data = path.read_bytes()
    pieces: list[str] = []
    ids = dict(_DEFAULT_IDS)
    try:
        for field, value in _fields(data, path):
            if field == 1 and isinstance(value, bytes):
                piece = next((v for f, v in _fields(value, path) if f == 1 and isinstance(v, bytes)), None)
                if piece is None:
                    raise CorruptFileError(f"piece {len(pieces)} has no text", path=path)
                pieces.append(piece.decode("utf-8"))
            elif field == 2 and isinstance(value, bytes):
                for key, number in _fields(value, path):
                    if key in ids and isinstance(number, int):
                        ids[key] = number - (1 << 64) if number >= 1 << 63 else number
    except UnicodeDecodeError as err:
        raise CorruptFileError("a piece is not UTF-8: not a SentencePiece model", path=path) from err
    if not pieces:
        raise CorruptFileError("no pieces: not a SentencePiece model", path=path)
    for key, number in ids.items():
        if not -1 <= number < len(pieces):
            raise CorruptFileError(f"special id {number} (field {key}) outside the {len(pieces)} pieces", path=path)
    return SentencePieceModel(tuple(pieces), ids[40], ids[41], ids[42], ids[43])


def _fields(data: bytes, path: Path):
    """``(field number, value)`` of a protobuf message: an int for varints and fixed widths, bytes for lengths."""
    at, end = 0, len(data)
    while at < end:
        key, at = _varint(data, at, path)
        field, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, at = _varint(data, at, path)
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            if at + width > end:
                raise CorruptFileError("a field runs past the end: not a SentencePiece model", path=path)
            value, at = int.from_bytes(data[at : at + width], "little"), at + width
        elif wire == 2:
            length, at = _varint(data, at, path)
            if at + length > end:
                raise CorruptFileError("a field runs past the end: not a SentencePiece model", path=path)
            value, at = data[at : at + length], at + length
        else:
            raise CorruptFileError(f"wire type {wire}: not a SentencePiece model", path=path)
        yield field, value


def _varint(data: bytes, at: int, path: Path) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise CorruptFileError("a number runs past the end: not a SentencePiece model", path=path)
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            return value, at
