"""``convert`` (and the ``fix`` repair built on it): any layout and tp in, any layout and tp out."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reshard.dtypes import name_of
from reshard.engine.execute import execute
from reshard.engine.lora_merge import check_lora_replicas
from reshard.engine.open import OpenedCheckpoint, open_checkpoint
from reshard.engine.planner import ConversionPlan, plan_conversion
from reshard.errors import ReshardError
from reshard.io.staging import check_output, staged_output
from reshard.layouts import SourceCheckpoint, TargetSpec, writer_class
from reshard.layouts.readers import TensorHeader
from reshard.manifest import Manifest, TensorEntry, VocabRecord, write_manifest
from reshard.options import ConvertOptions, Layout
from reshard.partition import at_tp, head_replicas

logger = logging.getLogger(__name__)


@dataclass
class Route:
    """Where a conversion went: the source, its layout and tp, and the output, its layout and tp."""

    source: str
    source_layout: str
    source_tp: int
    output: str
    layout: str
    tp: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class ConvertReport(Route):
    """What a conversion did: where from, where to, the vocab handling, and what changed shape."""

    tensors: int = 0
    bytes: int = 0
    vocab: dict[str, Any] = field(default_factory=dict)
    manifest: str = ""
    files: list[str] = field(default_factory=list)
    changed: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def default_layout(source: SourceCheckpoint, tp: int) -> str:
    """The source's own layout family: ``megatron``/``sat`` stay so; HF-named checkpoints become ``hf`` at
    tp 1 and ``hf-ranks`` above."""
    if source.layout in (Layout.MEGATRON, Layout.SAT):
        return source.layout
    return Layout.HF if tp == 1 else Layout.HF_RANKS


def plan_target(opened: OpenedCheckpoint, options: ConvertOptions) -> tuple[ConversionPlan, Layout]:
    """The target layout and every tensor's target slices (raises every planning problem at once).

    Without ``merge_lora`` (which merged the adapters when the checkpoint was opened), LoRA tensors that
    should be replicated but differ between ranks are refused.
    """
    source = opened.source
    if source.meta.get("cannot_convert"):  # a layout read it for inspect, but cannot convert it
        raise source.meta["cannot_convert"]
    layout = options.layout or default_layout(source, options.tp)
    conversion = plan_conversion(
        source,
        opened.tensors,
        vocab=opened.vocab,
        target_tp=options.tp,
        pad_multiple=options.pad_multiple or writer_class(layout).pad_multiple(options.tp, source),
        uneven=opened.uneven,
    )
    if not (options.merge_lora or options.allow_divergent_replicas):
        check_lora_replicas(conversion.tensors)
    refusal = writer_class(layout).replicated_heads_refusal
    copied = [t.name for t in conversion.tensors if head_replicas(t.source.partition, options.tp) > 1]
    if refusal and copied:
        more = f" and {len(copied) - 1} more" if len(copied) > 1 else ""
        raise ReshardError(
            f"tp={options.tp} copies KV heads ({copied[0]}{more}), but {refusal}",
            path=source.path,
            hint="choose a tp that divides the KV heads, or --layout hf-ranks",
        )
    return conversion, layout


def convert(ckpt: Path, out: Path, options: ConvertOptions) -> ConvertReport:
    """Re-slice ``ckpt`` for ``options.tp`` ranks into ``out`` in ``options.layout``.

    The output is written under a temporary name beside ``out`` and renamed into place when
    complete; ``reshard.json`` records the original vocab size, every tensor's partition and the
    sha256 of every canonical tensor.

    Raises:
        ReshardError: any problem with the input or the output path, before or during writing
            (nothing is left at ``out`` then).

    Example:
        >>> convert(Path("ckpt"), Path("ckpt-tp4"), ConvertOptions(tp=4))  # doctest: +SKIP
    """
    ckpt, out = Path(ckpt), Path(out)
    check_output(out, source=ckpt, overwrite=options.overwrite)
    return convert_opened(open_checkpoint(ckpt, options.read, target_tp=options.tp), out, options)


def convert_opened(opened: OpenedCheckpoint, out: Path, options: ConvertOptions) -> ConvertReport:
    """:func:`convert` of a checkpoint already opened (``fix`` opens it first to diagnose it)."""
    ckpt, source = opened.path, opened.source
    conversion, layout = plan_target(opened, options)
    vocab = conversion.vocab
    config = None
    if source.config is not None:
        config = source.config.raw
        if vocab.original is not None and vocab.original != source.config.vocab_size:
            config = source.config.with_vocab_size(vocab.original)
    spec = TargetSpec(
        tp=options.tp,
        rank_headers=[
            {t.name: TensorHeader(t.target_shapes[r], t.source.code) for t in conversion.tensors}
            for r in range(options.tp)
        ],
        config=config,
        vocab_size=vocab.original,
        padded_vocab_size=vocab.target_padded,
        max_shard_size=options.max_shard_size,
        source=source,
    )
    with staged_output(out) as staging:
        writer = writer_class(layout)(staging, spec)
        finite: dict[str, bool] = {}
        divergent: set[str] = set()
        hashes = execute(
            conversion,
            writer,
            allow_divergent=options.allow_divergent_replicas,
            divergent=divergent,
            progress=options.progress,
            finite=finite,
            jobs=options.jobs,
        )
        files = [str(p) for p in writer.close()]
        for side in source.side_files:
            shutil.copy2(side, staging / side.name)
            files.append(side.name)
        manifest = Manifest(
            source={"path": str(ckpt), "layout": source.layout, "tp": source.tp},
            target={"layout": layout, "tp": options.tp},
            vocab=VocabRecord(
                vocab.original,
                vocab.target_padded,
                vocab.pad_multiple,
                source_padded=_if_differs(vocab.source_padded, vocab.original),
                source_config=_if_differs(source.config.vocab_size if source.config else None, vocab.original),
            ),
            tensors={
                t.name: TensorEntry(
                    t.source.shape,
                    name_of(t.source.code),
                    at_tp(t.source.partition, t.source.shape, options.tp),
                    hashes[t.name],
                    finite[t.name],
                    divergent=t.name in divergent,
                )
                for t in sorted(conversion.tensors, key=lambda t: t.name)
            },
        )
        write_manifest(staging, manifest)
    return ConvertReport(
        source=str(ckpt),
        source_layout=source.layout,
        source_tp=source.tp,
        output=str(out),
        layout=layout,
        tp=options.tp,
        tensors=len(conversion.tensors),
        bytes=sum(t.nbytes for t in conversion.tensors),
        vocab={
            "original": vocab.original,
            "origin": vocab.origin,
            "source_padded": vocab.source_padded,
            "target_padded": vocab.target_padded,
        },
        manifest=str(out / "reshard.json"),
        files=sorted(files),
        changed=_changed_shapes(conversion),
        notes=list(source.notes)
        + (
            [f"replicated but different between ranks, rank 0's copy taken: {', '.join(sorted(divergent))}"]
            if divergent
            else []
        ),
    )


def _if_differs(size: int | None, original: int | None) -> int | None:
    """A source vocab size worth recording: one that is not the true size."""
    return size if size != original else None


def _changed_shapes(conversion: ConversionPlan) -> list[dict[str, Any]]:
    """Tensors whose shape on disk changed, comparing source rank 0 with target rank 0."""
    changed = []
    for t in sorted(conversion.tensors, key=lambda t: t.name):
        before, after = t.source.refs[0].shape, t.target_shapes[0]
        if before != after:
            changed.append({"tensor": t.name, "old": list(before), "new": list(after)})
    return changed
