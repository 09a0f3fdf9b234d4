"""The tokenizer an HF output carries, so runtimes can load it (vLLM refuses a folder without one: "Couldn't
instantiate the backend tokenizer"), and what its files say: the true vocab size and the bos / eos ids.

Only the files a tokenizer is made of are read and copied (:data:`TOKENIZER_FILES`), each at most
:data:`MAX_FILE_BYTES`; nothing is executed (no ``tokenizer_class`` is imported, no remote code, no pickle): the
sizes and ids come from the JSON the ``tokenizers`` library and transformers write.

* **The true vocab size** (:attr:`Tokenizer.size`): what ``len(tokenizer)`` gives in transformers and Megatron-LM's
  ``HuggingFaceTokenizer`` (``vocab_size`` is ``len(self._tokenizer)``): every distinct token of ``tokenizer.json``'s
  model vocab and added tokens (``tokenizers``' ``get_vocab_size(with_added_tokens=True)``), else of ``vocab.json``
  and ``added_tokens.json``. None when only a SentencePiece model holds the vocab (a protobuf, not read).
* **bos / eos** (:attr:`Tokenizer.bos_token_id`): ``tokenizer_config.json``'s (else ``special_tokens_map.json``'s)
  ``bos_token`` / ``eos_token`` looked up in those vocabs, for ``generation_config.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.config import HF_TOKENIZER, NamedTokenizer
from reshard.errors import CorruptFileError, ReshardError, shown

__all__ = [
    "GENERATION_CONFIG",
    "HF_TOKENIZER",
    "MAX_FILE_BYTES",
    "TOKENIZER_FILES",
    "NamedTokenizer",
    "Tokenizer",
    "generation_config",
    "read_tokenizer",
    "tokenizer_files",
    "vocab_json",
]

# The files transformers' tokenizers are saved as (``save_pretrained``): the fast tokenizer, its config and special
# tokens, the slow tokenizers' vocabularies (SentencePiece, BPE, WordPiece, tiktoken) and the chat template.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tiktoken.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
)
GENERATION_CONFIG = "generation_config.json"
# The largest tokenizer file read or copied: Gemma 3's tokenizer.json, the largest in use, is 33 MB.
MAX_FILE_BYTES = 256 << 20
# Files that make a folder a tokenizer (a chat template or a config alone does not).
_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "tiktoken.model")


@dataclass(frozen=True)
class Tokenizer:
    """A tokenizer's files and what they say.

    Attributes:
        files: the tokenizer files found (names in :data:`TOKENIZER_FILES`), copied under their names.
        origin: where it came from, for notes and messages (``--tokenizer DIR``, the args' ``tokenizer_model``).
        size: ``len(tokenizer)``, added tokens counted; None when the files do not tell it.
        bos_token_id: the beginning-of-sequence token's id, when the files name one and hold its id.
        eos_token_id: the end-of-sequence token's id, likewise.
        copies: files copied under another name (a Megatron ``vocab_file`` as ``vocab.json``).
        made: files reshard writes (``tokenizer_config.json`` of a tokenizer made from Megatron's files): name, text.
    """

    files: tuple[Path, ...]
    origin: str
    size: int | None
    bos_token_id: int | None
    eos_token_id: int | None
    copies: tuple[tuple[str, Path], ...] = ()
    made: tuple[tuple[str, str], ...] = ()


def tokenizer_files(folder: Path) -> list[Path]:
    """The tokenizer files in ``folder`` (none unless one of them holds a vocabulary)."""
    found = [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]
    if not any(p.name in _VOCAB_FILES or p.name == "vocab.json" for p in found):
        return []
    return found


def read_tokenizer(folder: Path, origin: str) -> Tokenizer:
    """Read the tokenizer in ``folder`` (see the module docstring).

    Raises:
        ReshardError: ``folder`` holds no tokenizer file, or one larger than :data:`MAX_FILE_BYTES`.
        CorruptFileError: a JSON file that does not parse or holds the wrong types.
    """
    files = tokenizer_files(folder)
    if not files:
        raise ReshardError(
            f"no tokenizer here ({origin}): none of {', '.join(_VOCAB_FILES)}, vocab.json",
            path=folder,
            hint="name a folder (or Hub repo) holding tokenizer.json and tokenizer_config.json",
        )
    for path in files:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ReshardError(f"{size} bytes: larger than any tokenizer file", path=path)
    by_name = {p.name: p for p in files}
    fast = _json(by_name.get("tokenizer.json"), dict)
    vocab, added = _vocab(fast, by_name)
    config = _json(by_name.get("tokenizer_config.json"), dict) or {}
    special = _json(by_name.get("special_tokens_map.json"), dict) or {}
    added |= _decoder(config, by_name.get("tokenizer_config.json"))
    ids = {**vocab, **added}
    count = len(set(vocab) | set(added)) if vocab else None

    def token_id(key: str) -> int | None:
        token = _content(config.get(key)) or _content(special.get(key))
        return ids.get(token) if token is not None else None

    return Tokenizer(tuple(files), origin, count, token_id("bos_token"), token_id("eos_token"))


def vocab_json(path: Path) -> dict[str, int]:
    """A BPE ``vocab.json`` (token -> id), checked as :func:`read_tokenizer` checks it.

    Raises:
        ReshardError: larger than :data:`MAX_FILE_BYTES`.
        CorruptFileError: not a JSON object of tokens and their ids.
    """
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ReshardError(f"{size} bytes: larger than any tokenizer file", path=path)
    return _ids(_json(path, dict), path)


def generation_config(tokenizer: Tokenizer) -> dict[str, int] | None:
    """The ``generation_config.json`` of a model with this tokenizer: its bos and eos ids (None: it names neither)."""
    named = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    ids = {key: value for key, value in named.items() if value is not None}
    return ids or None


def _json(path: Path | None, kind: type) -> Any:
    if path is None:
        return None
    try:
        data = json.loads(path.read_bytes())
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise CorruptFileError(f"not JSON: {str(err)[:200]}", path=path) from err
    if not isinstance(data, kind):
        raise CorruptFileError(f"holds {type(data).__name__}, not a JSON {kind.__name__}", path=path)
    return data


def _vocab(fast: dict | None, by_name: dict[str, Path]) -> tuple[dict[str, int], dict[str, int]]:
    """``(model vocab, added tokens)``, token -> id, from ``tokenizer.json``, else ``vocab.json`` and
    ``added_tokens.json``."""
    if fast is not None:
        path = by_name["tokenizer.json"]
        model = fast.get("model")
        vocab = model.get("vocab") if isinstance(model, dict) else None
        if isinstance(vocab, list):  # Unigram: [[piece, score], ...], ids in order
            vocab = {_piece(entry, path): i for i, entry in enumerate(vocab)}
        added = fast.get("added_tokens") or []
        if not isinstance(vocab, dict) or not isinstance(added, list):
            raise CorruptFileError("no model vocab (a mapping or a list) and added_tokens list", path=path)
        return _ids(vocab, path), _ids({_field(t, "content", path): _field(t, "id", path) for t in added}, path)
    vocab = _json(by_name.get("vocab.json"), dict) or {}
    added = _json(by_name.get("added_tokens.json"), dict) or {}
    return _ids(vocab, by_name.get("vocab.json")), _ids(added, by_name.get("added_tokens.json"))


def _decoder(config: dict, path: Path | None) -> dict[str, int]:
    """``tokenizer_config.json``'s ``added_tokens_decoder`` (``{"id": {"content": ...}}``) as token -> id."""
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise CorruptFileError("added_tokens_decoder is not a mapping", path=path)
    out = {}
    for key, token in decoder.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) < 12):
            raise CorruptFileError(f"added_tokens_decoder key {shown(key)} is not an id", path=path)
        out[_field(token, "content", path)] = int(key)
    return out


def _ids(mapping: dict, path: Path | None) -> dict[str, int]:
    for token, index in mapping.items():
        if not isinstance(token, str) or not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise CorruptFileError(f"token {shown(token)} -> {shown(index)}: not a token and its id", path=path)
    return mapping


def _piece(entry: Any, path: Path) -> str:
    if not (isinstance(entry, list) and entry and isinstance(entry[0], str)):
        raise CorruptFileError(f"Unigram vocab entry {shown(entry)} is not [piece, score]", path=path)
    return entry[0]


def _field(token: Any, key: str, path: Path | None) -> Any:
    if not isinstance(token, dict) or key not in token:
        raise CorruptFileError(f"added token {shown(token)} has no {key}", path=path)
    return token[key]


def _content(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string, or an ``AddedToken`` mapping."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
