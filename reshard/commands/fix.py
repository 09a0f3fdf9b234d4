"""``fix``: repair a vocab-padded or TP-sliced checkpoint into a canonical one (the ``--vocab 65535`` case).

``fix`` is ``convert`` with the diagnosis a broken checkpoint needs first: the true vocab size must be
known (``--vocab``, else ``reshard.json``, else ``config.json``; never guessed from padded rows), and a
vocab tensor holding only some rank slices is refused with the tp and pad multiple that explain it and
the rank files that are missing. Then the usual pipeline gathers every tensor, cuts the vocab tensors to
the true size (dropping pad rows, whatever they hold), and writes a canonical ``hf`` folder (or, with
``tp > 1``, one re-sliced for that many ranks) whose ``config.json`` carries the true vocab size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from reshard.commands.convert import convert, open_source
from reshard.engine.planner import SourceTensor, VocabPlan, plan_sources
from reshard.errors import ReshardError
from reshard.io.staging import check_output
from reshard.layouts import SourceCheckpoint
from reshard.layouts.loose import rank_template
from reshard.manifest import Manifest, find_manifest, written_uneven
from reshard.options import ConvertOptions
from reshard.partition import Vocab, rank_shapes
from reshard.plans import select_plan
from reshard.vocab import check_vocab_rows

logger = logging.getLogger(__name__)
SUFFIX = ".fixed"


@dataclass
class FixReport:
    """What ``fix`` changed: per tensor the source rank shapes and the written shapes, the config, the vocab."""

    source: str
    source_layout: str
    source_tp: int
    output: str
    layout: str
    tp: int
    vocab: dict[str, Any]
    manifest: str
    changed: list[dict[str, Any]] = field(default_factory=list)
    config_vocab: list[int | None] | None = None
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def default_output(ckpt: Path) -> Path:
    """``CKPT.fixed`` beside the input: ``run/ckpt`` -> ``run/ckpt.fixed``, ``x/model.bin`` -> ``x/model.bin.fixed``.

    The output is always a folder (an HF checkpoint), also for a single input file.
    """
    base = ckpt if ckpt.name not in ("", ".", "..") else ckpt.resolve()
    return base.with_name(base.name + SUFFIX)


def fix_vocab(explicit: int | None, source: SourceCheckpoint, manifest: Manifest | None) -> VocabPlan:
    """The true vocab size: ``--vocab``, else ``reshard.json`` beside the input, else ``config.json``.

    Raises:
        ReshardError: none of them tells it.
    """
    if explicit is not None:
        return VocabPlan(explicit, "--vocab", None)
    if manifest is not None and manifest.vocab.original:
        return VocabPlan(manifest.vocab.original, "reshard.json", None)
    if source.config is not None and source.config.vocab_size:
        return VocabPlan(source.config.vocab_size, "config.json", None)
    where = f"{source.config.path} has no vocab_size" if source.config else "there is no config.json"
    raise ReshardError(
        f"the original vocab size is unknown: there is no reshard.json beside the checkpoint and {where}",
        path=source.path,
        hint="pass --vocab N, the tokenizer's vocab size",
    )


def fix(ckpt: Path, out: Path | None = None, options: ConvertOptions | None = None) -> FixReport:
    """Repair ``ckpt`` into a canonical checkpoint at ``out`` (default ``CKPT.fixed``), never touching ``ckpt``.

    Gathers per-rank files (``hf-ranks``, loose ``*rank{r}*`` files, any layout ``discover`` reads),
    drops vocab padding down to the true size, and writes ``hf`` (``options.tp == 1``) or the source's
    layout family re-sliced for ``options.tp`` ranks, with ``config.json`` set to the true vocab size and
    a ``reshard.json`` recording the original, the padded sizes found and every tensor's sha256.

    Args:
        ckpt: the checkpoint folder or file.
        out: the output folder; None writes ``CKPT.fixed`` beside the input.
        options: ``vocab`` (else from ``reshard.json``, then ``config.json``), ``tp``, ``overwrite``,
            ``config``, ``plan``, ``trust_pickle``, ``progress``.

    Returns:
        A :class:`FixReport` of what changed.

    Raises:
        MissingRankError: vocab tensors hold only some rank slices (the message names the missing files).
        ReshardError: the vocab size is unknown, or anything :func:`reshard.commands.convert` refuses.

    Example:
        >>> fix(Path("ckpt-tp2"), options=ConvertOptions(vocab=65535))  # doctest: +SKIP
    """
    options = options or ConvertOptions()
    ckpt = Path(ckpt)
    out = Path(out) if out is not None else default_output(ckpt)
    check_output(out, source=ckpt, overwrite=options.overwrite)
    source = open_source(ckpt, options)
    manifest = find_manifest(ckpt)
    vocab = fix_vocab(options.vocab, source, manifest)
    plan = select_plan(source.config, source.names(), plan_file=options.plan)
    options = replace(options, uneven=options.uneven or written_uneven(manifest))
    tensors = plan_sources(source, plan, vocab=vocab, target_tp=options.tp, uneven=options.uneven)
    check_vocab_rows(
        tensors, vocab.original, source_tp=source.tp, missing_files=lambda tp: missing_rank_files(source, tp)
    )
    report = convert(ckpt, out, replace(options, vocab=vocab.original))
    config_before = source.config.vocab_size if source.config else None
    notes = list(report.notes)
    if vocab.origin == "config.json":
        notes.append(f"vocab size {vocab.original} taken from config.json: if that is a padded size, pass --vocab")
    return FixReport(
        source=report.source,
        source_layout=report.source_layout,
        source_tp=report.source_tp,
        output=report.output,
        layout=report.layout,
        tp=report.tp,
        vocab=report.vocab | {"origin": vocab.origin},
        manifest=report.manifest,
        changed=changed_tensors(tensors, options.tp, report.vocab["target_padded"], uneven=options.uneven),
        config_vocab=[config_before, vocab.original] if config_before != vocab.original else None,
        files=report.files,
        notes=notes,
    )


def changed_tensors(
    tensors: list[SourceTensor], tp: int, padded: int | None, *, uneven: bool = False
) -> list[dict[str, Any]]:
    """Tensors whose slice shapes change (a replica kept whole is not a change): ``{tensor, old, new, vocab}``."""
    changed = []
    for t in sorted(tensors, key=lambda t: (not isinstance(t.partition, Vocab), t.name)):
        old = [list(ref.shape) for ref in t.refs]
        new = [list(s) for s in rank_shapes(t.partition, t.shape, tp, padded=padded, uneven=uneven)]
        if {tuple(s) for s in old} != {tuple(s) for s in new}:
            changed.append({"tensor": t.name, "old": old, "new": new, "vocab": isinstance(t.partition, Vocab)})
    return changed


def missing_rank_files(source: SourceCheckpoint, tp: int) -> list[str] | None:
    """Names of the files or folders ranks ``source.tp .. tp-1`` would have, when the names tell them."""
    ranks = range(source.tp, tp)
    if source.layout == "hf-ranks":
        return [f"rank_{r:02d}/" for r in ranks]
    templates = source.meta.get("rank_templates")
    if templates is None and source.path.is_file():
        found = rank_template(source.path.name)
        templates = [found[1]] if found and found[0] == 0 else None
    if not templates:
        return None
    return [t.format(rank=r) for r in ranks for t in templates]
