"""``fix``: repair a vocab-padded or TP-sliced checkpoint into a canonical one (the ``--vocab 65535`` case).

``fix`` is ``convert`` with the diagnosis a broken checkpoint needs first: the true vocab size must be
known (``--vocab``, else ``reshard.json``, else ``config.json``; never guessed from padded rows), and a
vocab tensor holding only some rank slices is refused with the tp and pad multiple that explain it and
the rank files that are missing. Then the usual pipeline gathers every tensor, cuts the vocab tensors to
the true size (dropping pad rows, whatever they hold), and writes a canonical ``hf`` folder (or, with
``tp > 1``, one re-sliced for that many ranks) whose ``config.json`` carries the true vocab size.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from reshard.engine.plan.open import OpenedCheckpoint
from reshard.engine.plan.planner import SourceTensor
from reshard.engine.plan.tokenizer import no_tokenizer_warning
from reshard.engine.run.conversion import open_for_conversion, run_conversion
from reshard.engine.run.route import Route
from reshard.engine.run.warmup import import_torch_in_background
from reshard.geometry import Vocab, rank_shapes
from reshard.hub.source import hub_origin
from reshard.io.staging import write_error
from reshard.layouts import canonical_layout, layout
from reshard.layouts.base import SourceCheckpoint
from reshard.manifest import find_manifest
from reshard.options import ConvertOptions
from reshard.vocab import check_vocab_rows, require_vocab, source_padded_rows

logger = logging.getLogger(__name__)
SUFFIX = ".fixed"


@dataclass
class FixReport(Route):
    """What ``fix`` changed: per tensor the source rank shapes and the written shapes, the config, the vocab."""

    vocab: dict[str, Any] = field(default_factory=dict)
    manifest: str = ""
    changed: list[dict[str, Any]] = field(default_factory=list)
    config_vocab: list[int | None] | None = None
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    written: bool = True  # False: the checkpoint needed nothing and no output was written (no --force)

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        if self.written:  # said only when nothing was written
            del data["written"]
        return data


def default_output(ckpt: Path) -> Path:
    """``CKPT.fixed`` beside the input: ``run/ckpt`` -> ``run/ckpt.fixed``, ``x/model.bin`` -> ``x/model.bin.fixed``.

    The output is always a folder (an HF checkpoint), also for a single input file. A Hub download is never
    written beside (inside the Hugging Face cache): its output is ``NAME.fixed`` in the working folder.
    """
    origin = hub_origin(ckpt)
    if origin is not None:
        return Path(origin["repo"].split("/")[-1] + SUFFIX)
    base = ckpt if ckpt.name not in ("", ".", "..") else ckpt.resolve()
    return base.with_name(base.name + SUFFIX)


def fix(ckpt: Path, out: Path | None = None, options: ConvertOptions | None = None) -> FixReport:
    """Repair ``ckpt`` into a canonical checkpoint at ``out`` (default ``CKPT.fixed``), never touching ``ckpt``.

    Gathers per-rank files (``hf-ranks``, loose ``*rank{r}*`` files, any layout ``discover`` reads),
    drops vocab padding down to the true size, and writes ``hf`` (``options.tp == 1``, whatever the source's
    layout: a Megatron or SAT source too, unlike ``convert``) or the source's layout family re-sliced for
    ``options.tp`` ranks, with ``config.json`` set to the true vocab size and
    a ``reshard.json`` recording the original, the padded sizes found and every tensor's digest.

    Args:
        ckpt: the checkpoint folder or file.
        out: the output folder; None writes ``CKPT.fixed`` beside the input.
        options: ``vocab`` (else from ``reshard.json``, then ``config.json``), ``tp``, ``overwrite``,
            ``config``, ``plan``, ``trust_pickle``, ``progress``, ``tokenizer`` (as ``convert``'s).

    Returns:
        A :class:`FixReport` of what changed.

    Raises:
        MissingRankError: vocab tensors hold only some rank slices (the message names the missing files).
        ReshardError: the vocab size is unknown, or anything :func:`reshard.convert` refuses.

    Example:
        >>> fix(Path("ckpt-tp2"), options=ConvertOptions(read=ReadOptions(vocab=65535)))  # doctest: +SKIP
    """
    options = options or ConvertOptions()
    if options.layout is None and options.tp == 1:  # a canonical hf folder, also from a Megatron or SAT source
        options = replace(options, layout=canonical_layout().name)
    ckpt = Path(ckpt)
    import_torch_in_background()
    out = Path(out) if out is not None else default_output(ckpt)
    opened = open_for_conversion(ckpt, out, options)
    source, vocab = opened.source, opened.vocab
    original = require_vocab(vocab, path=source.path, config=source.config)
    check_vocab_rows(
        opened.tensors,
        original,
        source_tp=source.tp,
        missing_files=lambda tp: layout(source.layout).missing_rank_files(source, tp),
        recorded_tp=_recorded_tp(source),
        origin=vocab.origin,
    )
    if not options.force and needs_nothing(opened, options):
        _refuse_unwritable(out)  # -o names a place --force could not write either: bad input, as on any fix
        return FixReport(
            source=str(ckpt),
            source_layout=source.layout,
            source_tp=source.tp,
            output=str(out),
            layout=source.layout,
            tp=options.tp,
            vocab={"original": vocab.original, "origin": vocab.origin, "source_padded": vocab.original},
            notes=["nothing to fix: no tensor changes shape and the vocab is already its true size; nothing written"],
            written=False,
        )
    run = run_conversion(opened, out, options)
    no_tokenizer_warning(out, run.target.layout, run.files)
    config_before = source.config.vocab_size if source.config else None
    notes = list(run.notes)
    if vocab.origin not in ("--vocab", "reshard.json"):
        notes.append(f"vocab size {vocab.original} taken from {vocab.origin}: if that is a padded size, pass --vocab")
    return FixReport(
        **run.route.to_dict(),
        vocab=run.vocab,
        manifest=str(run.manifest),
        changed=changed_tensors(opened.tensors, options.tp, run.vocab["target_padded"], uneven=opened.uneven),
        config_vocab=[config_before, vocab.original] if config_before != vocab.original else None,
        files=list(run.files),
        notes=notes,
    )


def _recorded_tp(source: SourceCheckpoint) -> int | None:
    """The tp the checkpoint's ``reshard.json`` records for its own layout (None: it records none)."""
    manifest = find_manifest(source.path)
    if manifest is None or manifest.target.get("layout") != source.layout:
        return None
    tp = manifest.target.get("tp")
    return tp if type(tp) is int else None


def _refuse_unwritable(out: Path) -> None:
    """Refuse ``out`` when the folder it would be created in may not be written (permission bits), as writing it
    would."""
    parent = out.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        raise write_error(PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(parent)), out)


def needs_nothing(opened: OpenedCheckpoint, options: ConvertOptions) -> bool:
    """Whether ``fix`` would write a copy of ``opened`` and nothing else: a canonical ``hf`` safetensors checkpoint
    at tp 1 read as it is (no ``--config``, ``--tokenizer``, ``--tp``, ``--merge-lora``), no pad rows, the config's
    vocab true."""
    source, vocab = opened.source, opened.vocab
    config_vocab = source.config.vocab_size if source.config else None
    return (
        source.layout == canonical_layout().name
        and source.tp == options.tp == 1
        and options.read.config is None
        and options.read.tokenizer is None
        and not options.read.merge_lora
        and not opened.problems
        and all(path.suffix == ".safetensors" for path in source.files)
        and source_padded_rows(opened.tensors) in (None, vocab.original)
        and config_vocab in (None, vocab.original)
        and not changed_tensors(opened.tensors, options.tp, vocab.original, uneven=opened.uneven)
    )


def changed_tensors(
    tensors: Sequence[SourceTensor], tp: int, padded: int | None, *, uneven: bool = False
) -> list[dict[str, Any]]:
    """Tensors whose slice shapes change (a replica kept whole is not a change): ``{tensor, old, new, vocab}``."""
    changed = []
    for t in sorted(tensors, key=lambda t: (not isinstance(t.partition, Vocab), t.name)):
        old = [list(ref.shape) for ref in t.refs]
        partition, shape = t.planned
        new = [list(s) for s in rank_shapes(partition, shape, tp, padded=padded, uneven=uneven)]
        if {tuple(s) for s in old} != {tuple(s) for s in new}:
            changed.append({"tensor": t.name, "old": old, "new": new, "vocab": isinstance(t.partition, Vocab)})
    return changed
