"""Megatron-LM's own tokenizers made into transformers tokenizers that give the same ids, for an HF output.

Megatron-LM's legacy tokenizers (``megatron/training/tokenizer/tokenizer.py``, what wrote nearly every
checkpoint) and Megatron-Core's system (``NamedTokenizer.core``), each as the transformers tokenizer of its ids:

* ``GPT2BPETokenizer`` (``vocab_file``, ``merge_file``): GPT-2's byte-level BPE, nothing added, eod
  ``<|endoftext|>``, which the legacy tokenizer encodes as text where it occurs in text (Megatron-Core's, a
  transformers tokenizer, as one token) -> ``GPT2Tokenizer`` over ``vocab.json`` + ``merges.txt``, bos = eos =
  unk ``<|endoftext|>``, ``split_special_tokens`` for the legacy one.
* ``GPTSentencePieceTokenizer``, and every SentencePiece type under Megatron-Core: ``encode``, eod = eos ->
  ``SentencePieceBackend`` over ``tokenizer.model`` (sentencepiece's own ``encode``), ``split_special_tokens``
  (``<s>`` in text is text to sentencepiece).
* ``Llama2Tokenizer``: bos, then ``encode``; eod = eos -> the same, adding bos (``special_tokens_pattern: bos``).
* ``SentencePieceTokenizer``: ``encode`` between its special tokens, which it finds in text: ``<CLS> <SEP> <EOD>
  <MASK>``, the model's pad, bos and eos pieces (``<PAD>``, ``<BOS>``, ``<EOS>`` when it has none) and
  ``vocab_extra_ids`` ``<extra_id_N>``, each at its id in the model or appended; eod ``<EOD>`` -> the same tokens as
  special added tokens at the same ids.

The generation config's eos is Megatron's eod (what its own generation stops at), its bos the bos the vocab has.
SentencePiece models go through sentencepiece itself (``SentencePieceBackend``, transformers 5), not a converted
fast tokenizer: conversions of Unigram models and normalizers are not exact.
"""

from __future__ import annotations

import json
from typing import Any

from reshard.errors import ReshardError
from reshard.formats.sentencepiece import SentencePieceModel, read_sentencepiece
from reshard.formats.tokenizer import MAX_FILE_BYTES, NamedTokenizer, Tokenizer, vocab_json
from reshard.megatron.model import GPT2_BPE

__all__ = ["megatron_tokenizer"]

CONFIG = "tokenizer_config.json"
ENDOFTEXT = "<|endoftext|>"
_LEGACY_SPECIALS = ("<CLS>", "<SEP>", "<EOD>", "<MASK>")


def megatron_tokenizer(named: NamedTokenizer) -> Tokenizer:
    """The transformers tokenizer giving the ids of the Megatron tokenizer ``named`` (its files on this machine).

    Raises:
        ReshardError: its files do not make that tokenizer (no ``<|endoftext|>`` in a GPT-2 vocab, a Llama-2 model
            without bos), or are damaged (:class:`~reshard.errors.CorruptFileError`).
    """
    system = "Megatron-Core" if named.core else "Megatron-LM"
    origin = f"{named.origin} {named.name} ({system}'s {named.kind})"
    if named.kind == GPT2_BPE:
        return _gpt2(named, origin)
    model = read_sentencepiece(named.files[0])
    kind = "GPTSentencePieceTokenizer" if named.core else named.kind  # Megatron-Core: plain encode, eod = eos
    if kind == "SentencePieceTokenizer":
        return _with_specials(named, model, origin)
    bos, eos = model.piece(model.bos_id), model.piece(model.eos_id)
    if kind == "Llama2Tokenizer" and bos is None:
        raise ReshardError("Llama2Tokenizer with a model that has no bos piece", path=named.files[0])
    config = _tokens(bos_token=bos, eos_token=eos, unk_token=model.piece(model.unk_id))
    config |= {"split_special_tokens": True}  # Megatron encodes "<s>" in text as text
    if kind == "Llama2Tokenizer":
        config["special_tokens_pattern"] = "bos"
    if model.piece(model.pad_id) is not None:
        config["pad_token"] = model.piece(model.pad_id)
    bos_id = model.bos_id if bos is not None else None
    eos_id = model.eos_id if eos is not None else None  # none: Megatron's eod is -1, no generation stop to name
    return _made(named, origin, len(model.pieces), bos_id, eos_id, config)


def _gpt2(named: NamedTokenizer, origin: str) -> Tokenizer:
    vocab_file, merge_file = named.files
    vocab = vocab_json(vocab_file)
    if ENDOFTEXT not in vocab:
        raise ReshardError(f"no {ENDOFTEXT} in the GPT-2 vocab (Megatron's eod)", path=vocab_file)
    eod = vocab[ENDOFTEXT]
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "add_prefix_space": False,
        **_tokens(bos_token=ENDOFTEXT, eos_token=ENDOFTEXT, unk_token=ENDOFTEXT),
        # Megatron-LM's GPT2Tokenizer encodes "<|endoftext|>" in text as text; Megatron-Core's is transformers'
        "split_special_tokens": not named.core,
        "added_tokens_decoder": {str(eod): _special(ENDOFTEXT, normalized=True)},
    }
    size = merge_file.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ReshardError(f"{size} bytes: larger than any tokenizer file", path=merge_file)
    text = json.dumps(config, indent=2) + "\n"
    copies = (("vocab.json", vocab_file), ("merges.txt", merge_file))
    return Tokenizer((), origin, len(vocab), eod, eod, copies=copies, made=((CONFIG, text),))


def _with_specials(named: NamedTokenizer, model: SentencePieceModel, origin: str) -> Tokenizer:
    """Megatron's legacy ``SentencePieceTokenizer``: its special tokens, each at its id in the model or appended."""
    ids = {piece: index for index, piece in reversed(list(enumerate(model.pieces)))}
    size = len(model.pieces)
    pad = model.piece(model.pad_id) or "<PAD>"
    bos = model.piece(model.bos_id) or "<BOS>"
    eos = model.piece(model.eos_id) or "<EOS>"
    specials = [*_LEGACY_SPECIALS, pad, bos, eos, *(f"<extra_id_{i}>" for i in range(named.extra_ids))]
    decoder: dict[str, Any] = {}
    for token in specials:
        if token not in ids:
            ids[token], size = size, size + 1
        decoder[str(ids[token])] = _special(token, normalized=False)
    # no unk_token: transformers would find it in text, which Megatron encodes as text
    config = _tokens(bos_token=bos, eos_token="<EOD>", pad_token=pad)
    config["added_tokens_decoder"] = dict(sorted(decoder.items(), key=lambda item: int(item[0])))
    return _made(named, origin, size, ids[bos], ids["<EOD>"], config)


def _made(
    named: NamedTokenizer, origin: str, size: int, bos: int | None, eos: int | None, config: dict[str, Any]
) -> Tokenizer:
    # legacy: sentencepiece's own encode, its dummy prefix on each piece of text (as Megatron calls it)
    config = {"tokenizer_class": "SentencePieceBackend", "legacy": True, **config}
    text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    return Tokenizer((), origin, size, bos, eos, copies=(("tokenizer.model", named.files[0]),), made=((CONFIG, text),))


def _tokens(**tokens: str | None) -> dict[str, Any]:
    return {key: value for key, value in tokens.items() if value is not None}


def _special(token: str, *, normalized: bool) -> dict[str, Any]:
    return {
        "content": token,
        "lstrip": False,
        "normalized": normalized,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }
