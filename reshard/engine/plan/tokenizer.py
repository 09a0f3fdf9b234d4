"""The tokenizer of a conversion: which one an HF output carries, the true vocab size it gives, and the files it adds.

The tokenizer is ``--tokenizer DIR|REPO`` when given (a Hub repo: its tokenizer files only, fetched into the cache),
else the one the checkpoint names when its folder is on this machine (Megatron's ``tokenizer_model``, NeMo's
context). An HF folder's own tokenizer files are side files, carried as they are. A tokenizer chosen here:

* gives the true vocab size when nothing else records it, and must agree with ``--vocab`` and Megatron's args
  (:func:`reshard.vocab.tokenizer_disagreement`: exit 2 with both numbers);
* is copied beside an output transformers loads, with a ``generation_config.json`` of its bos / eos ids unless the
  source has one, and those ids in ``config.json`` unless it names them.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from reshard.config import ModelConfig
from reshard.errors import ReshardError
from reshard.formats.tokenizer import (
    GENERATION_CONFIG,
    HF_TOKENIZER,
    TOKENIZER_FILES,
    Tokenizer,
    generation_config,
    read_tokenizer,
)
from reshard.layouts import LayoutSpec, SourceCheckpoint
from reshard.megatron.facts import args_of
from reshard.megatron.model import MODEL_TYPE, arg, true_vocab_size
from reshard.vocab import tokenizer_disagreement

logger = logging.getLogger(__name__)

__all__ = [
    "carried_tokenizer",
    "choose_tokenizer",
    "has_tokenizer",
    "no_tokenizer_warning",
    "runtime_files",
    "with_token_ids",
    "with_tokenizer_vocab",
]


def choose_tokenizer(source: SourceCheckpoint, option: Path | str | None) -> Tokenizer | None:
    """``--tokenizer`` (a folder, else a Hub repo), else the tokenizer the source names when its files are here: a
    Hugging Face folder as it is, a Megatron tokenizer made into the transformers tokenizer of the same ids
    (:mod:`reshard.mappings.megatron.tokenizer`). One that cannot be had exactly is said in the notes, never guessed.

    Raises:
        ReshardError: ``--tokenizer`` names no tokenizer, or a repo that cannot be fetched.
    """
    if option is not None:
        return read_tokenizer(_local(option), f"--tokenizer {option}")
    named = source.tokenizer
    if named is None:
        return None
    pass_one = "pass --tokenizer DIR|REPO for an HF output that runtimes load"
    if named.refused is not None:
        source.notes.append(f"{named.refused}: no transformers tokenizer is made for its ids here; {pass_one}")
        return None
    if named.kind == HF_TOKENIZER and named.folder is None:
        source.notes.append(f"{named.origin} names the tokenizer {named.name}, not a folder here: {pass_one}")
        return None
    if named.kind != HF_TOKENIZER and not named.files:
        where = f"with {named.name}, not files here" if named.name else "but not its files"
        source.notes.append(f"the args name Megatron-LM's {named.kind} {where}: {pass_one}")
        return None
    try:
        if named.folder is not None:
            return read_tokenizer(named.folder, f"{named.origin} {named.folder}")
        from reshard.mappings.megatron.tokenizer import megatron_tokenizer

        return megatron_tokenizer(named)
    except ReshardError as err:  # the files the args name do not make the tokenizer: said, not fatal
        source.notes.append(f"{named.origin} names {named.name}, which reshard cannot carry: {err.one_line()}")
        return None


def _local(option: Path | str) -> Path:
    from reshard.hub.source import HubCheckpoint, checkpoint_argument

    where = checkpoint_argument(str(option))
    if isinstance(where, HubCheckpoint):
        from reshard.hub.download import download_tokenizer

        return download_tokenizer(where)
    return where


def with_tokenizer_vocab(source: SourceCheckpoint, tokenizer: Tokenizer, explicit: int | None) -> ModelConfig | None:
    """The source's config, with the tokenizer's size as the true vocab size when the config has none.

    Raises:
        ReshardError: the tokenizer's size disagrees with ``--vocab``, Megatron's args, or the embedding.
    """
    config, args = source.config, args_of(source.facts)
    if tokenizer.size is None:
        return config
    from_args = config is not None and config.raw.get("model_type") == MODEL_TYPE
    problem = tokenizer_disagreement(
        tokenizer.size,
        tokenizer.origin,
        explicit=explicit,
        recorded=true_vocab_size(args) if args is not None else None,
        padded=_int(arg(args, "padded_vocab_size")),
        multiple=_int(arg(args, "make_vocab_size_divisible_by")),
        tp=_int(arg(args, "tensor_model_parallel_size")),
        embedding=config.vocab_size if config is not None and not from_args else None,
    )
    if problem is not None:
        raise ReshardError(
            problem, path=source.path, hint="pass the tokenizer the model was trained with (--tokenizer DIR|REPO)"
        )
    if config is None or config.vocab_size is not None:
        return config
    source.notes.append(f"the true vocab size {tokenizer.size} comes from the tokenizer ({tokenizer.origin})")
    return ModelConfig({**config.raw, "vocab_size": tokenizer.size}, config.path)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def carried_tokenizer(tokenizer: Tokenizer | None, layout: LayoutSpec) -> Tokenizer | None:
    """The tokenizer an output of ``layout`` carries: only a folder transformers (and runtimes) read takes one."""
    return tokenizer if layout.carries_tokenizer else None


def with_token_ids(config: dict[str, Any] | None, tokenizer: Tokenizer | None) -> dict[str, Any] | None:
    """``config.json`` with the tokenizer's bos / eos ids where it names none (a config a mapping wrote)."""
    ids = generation_config(tokenizer) if tokenizer is not None else None
    if config is None or ids is None:
        return config
    return {**config, **{key: value for key, value in ids.items() if config.get(key) is None}}


def runtime_files(staging: Path, source: SourceCheckpoint, tokenizer: Tokenizer | None) -> list[str]:
    """Copy the source's side files and the tokenizer's files into ``staging``, and write a
    ``generation_config.json`` from the tokenizer when the source has none; the names written.

    A chosen tokenizer replaces the source's own tokenizer files (never a mix of two tokenizers' files).
    """
    written = []
    for side in source.side_files:
        if tokenizer is not None and side.name in TOKENIZER_FILES:
            continue
        shutil.copy2(side, staging / side.name)
        written.append(side.name)
    if tokenizer is None:
        return written
    for name, path in [*((p.name, p) for p in tokenizer.files), *tokenizer.copies]:
        shutil.copyfile(path, staging / name)
        written.append(name)
    for name, text in tokenizer.made:
        (staging / name).write_text(text)
        written.append(name)
    ids = generation_config(tokenizer)
    if ids is not None and GENERATION_CONFIG not in written:
        (staging / GENERATION_CONFIG).write_text(json.dumps(ids, indent=2) + "\n")
        written.append(GENERATION_CONFIG)
    return written


def has_tokenizer(files: list[str] | tuple[str, ...]) -> bool:
    """Whether an output's files hold a tokenizer (a file with its vocabulary)."""
    return any(name in TOKENIZER_FILES and name not in _NOT_A_VOCAB for name in files)


def no_tokenizer_warning(out: Path, layout: LayoutSpec, files: list[str] | tuple[str, ...]) -> None:
    """One line on stderr (a logging warning) when an output transformers loads has no tokenizer (runtimes refuse
    it)."""
    if layout.carries_tokenizer and not has_tokenizer(files):
        logger.warning("%s has no tokenizer: vLLM and other runtimes will not load it; pass --tokenizer DIR|REPO", out)


_NOT_A_VOCAB = {
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
}
