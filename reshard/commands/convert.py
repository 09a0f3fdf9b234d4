"""``convert`` (and the ``fix`` repair built on it): any layout and tp in, any layout and tp out."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reshard.dtypes import name_of
from reshard.engine.lora_merge import check_lora_replicas
from reshard.engine.open import OpenedCheckpoint, open_checkpoint
from reshard.engine.planner import ConversionPlan, TargetTensor, TensorPlan
from reshard.engine.resume import fingerprint, still_to_do
from reshard.engine.share import merged, share_of, staged, together
from reshard.engine.target import TargetPlan, plan_target, planned_tp, target_spec
from reshard.engine.warmup import import_torch_in_background
from reshard.engine.workers import Group, join
from reshard.errors import ReshardError
from reshard.hub.source import source_record
from reshard.io.journal import Journal, Resumed
from reshard.io.staging import check_output
from reshard.manifest import Manifest, TensorEntry, VocabRecord, write_manifest
from reshard.options import ConvertOptions
from reshard.partition import at_tp

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
    mapping: dict[str, Any] | None = None


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
    import_torch_in_background()
    check_output(out, source=ckpt, overwrite=options.overwrite)
    target_tp = planned_tp(options.layout, options.tp)
    return convert_opened(open_checkpoint(ckpt, options.read, target_tp=target_tp), out, options)


def convert_opened(opened: OpenedCheckpoint, out: Path, options: ConvertOptions) -> ConvertReport:
    """:func:`convert` of a checkpoint already opened (``fix`` opens it first to diagnose it)."""
    ckpt, source = opened.path, opened.source
    target = plan_target(opened, options)
    conversion, layout = target.conversion, target.layout
    if not (options.merge_lora or options.allow_divergent_replicas):
        check_lora_replicas(opened.tensors)
    vocab = conversion.vocab
    tp = conversion.target_tp  # options.tp, but 1 for a layout of global tensors (torch_dist)
    spec = target_spec(target, options)
    file_plan = layout.writer.file_plan(spec)
    group = join()
    first = group is None or group.rank == 0
    with staged(out, overwrite=options.overwrite, resume=options.resume, group=group) as staging:
        journal, resumed = _journal(staging, ckpt, conversion, layout.name, options, group)
        todo, done = conversion, resumed.files
        if group is not None:  # this worker's files; the others' are left to them as a resumed run leaves its own
            todo, others = share_of(group, conversion, file_plan)
            done = done | others
        spec = dataclasses.replace(
            spec, done_files=done, on_file_done=journal.file_done if journal else None, writes_shared=first
        )
        writer = layout.writer(staging, spec, file_plan)
        if journal is not None:
            todo = still_to_do(todo, file_plan, resumed)
        from reshard.engine.execute import execute  # imports torch: after planning, which does without it

        def run() -> tuple[dict[str, str], dict[str, bool | None], set[str], list[str]]:
            divergent: set[str] = set()
            finite: dict[str, bool | None] = {}

            def journaled(plan: TensorPlan, name: str, digest: str, is_finite: bool | None) -> None:
                if journal is not None:
                    journal.tensor_done(name, digest, is_finite, any(s.name in divergent for s in plan.sources))

            hashes = execute(
                todo,
                writer,
                allow_divergent=options.allow_divergent_replicas,
                divergent=divergent,
                progress=options.progress and first,
                finite=finite,
                jobs=options.jobs,
                on_hashed=journaled if journal is not None else None,
            )
            files = [str(p) for p in writer.close()]
            return hashes, finite, _divergent_targets(todo, divergent), files

        if group is None:
            results = [run()]
        else:
            results = together(group, run)
            if not first:
                return _report(ckpt, out, opened, target, options, results[group.rank][3], set())
        hashes, finite, divergent_targets = merged([result[:3] for result in results])
        hashes |= {name: record.sha256 for name, record in resumed.tensors.items()}
        finite |= {name: record.finite for name, record in resumed.tensors.items()}
        divergent_targets |= {name for name, record in resumed.tensors.items() if record.divergent}
        files = results[0][3]
        for side in source.side_files:
            shutil.copy2(side, staging / side.name)
            files.append(side.name)
        manifest = Manifest(
            source={**source_record(ckpt), "layout": source.layout, "tp": source.tp},
            target={"layout": layout.name, "tp": tp},
            vocab=VocabRecord(
                vocab.original,
                vocab.target_padded,
                vocab.pad_multiple,
                source_padded=_if_differs(vocab.source_padded, vocab.original),
                source_config=_if_differs(source.config.vocab_size if source.config else None, vocab.original),
            ),
            tensors={
                t.name: TensorEntry(
                    t.shape,
                    name_of(t.code),
                    at_tp(t.partition, t.shape, options.tp),
                    hashes[t.name],
                    finite[t.name],
                    divergent=t.name in divergent_targets,
                )
                for _, t in sorted(_targets(conversion), key=lambda pair: pair[1].name)
            },
            mapping=_mapping_record(target),
        )
        write_manifest(staging, manifest)
        if journal is not None:
            journal.close(remove=True)
    return _report(ckpt, out, opened, target, options, files, divergent_targets)


def _report(
    ckpt: Path,
    out: Path,
    opened: OpenedCheckpoint,
    target: TargetPlan,
    options: ConvertOptions,
    files: list[str],
    divergent: set[str],
) -> ConvertReport:
    source, conversion, vocab = opened.source, target.conversion, target.conversion.vocab
    return ConvertReport(
        source=str(ckpt),
        source_layout=source.layout,
        source_tp=source.tp,
        output=str(out),
        layout=target.layout.name,
        tp=conversion.target_tp,
        tensors=sum(len(plan.targets) for plan in conversion.tensors),
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
        mapping=_mapping_summary(target),
        notes=list(source.notes)
        + (
            [f"replicated but different between ranks, rank 0's copy taken: {', '.join(sorted(divergent))}"]
            if divergent
            else []
        )
        + _global_note(target, options),
    )


def _divergent_targets(conversion: ConversionPlan, divergent: set[str]) -> set[str]:
    """The target tensors made from a source whose replicas differed (the manifest marks them)."""
    return {
        t.name for plan in conversion.tensors if any(s.name in divergent for s in plan.sources) for t in plan.targets
    }


def _journal(
    staging: Path, ckpt: Path, conversion: ConversionPlan, layout: str, options: ConvertOptions, group: Group | None
) -> tuple[Journal | None, Resumed]:
    """With ``--resume``: this worker's journal in the staged folder, and what an earlier run left there that still
    checks out (rank 0 checks it and tells the others: all must agree on it). Nothing without ``--resume``."""
    if not options.resume:
        return None, Resumed()
    mark = fingerprint(ckpt, conversion, layout, options)
    if group is None:
        return Journal.resume(staging, mark)
    if group.rank == 0:
        try:
            journal, resumed = Journal.resume(staging, mark)
        except ReshardError as err:
            group.broadcast(err.one_line())
            raise
        group.broadcast(resumed)
        return journal, resumed
    resumed = group.broadcast(None)
    if isinstance(resumed, str):  # rank 0 found the partial output unusable, and says why
        raise ReshardError(resumed)
    return Journal.start(staging, mark, rank=group.rank), resumed


def _global_note(target: TargetPlan, options: ConvertOptions) -> list[str]:
    """What --tp and --pp mean for a layout of global tensors."""
    if target.layout.global_tensors:
        return [
            f"{target.layout} holds global tensors that Megatron-Core loads at any tp/pp; its args record "
            f"tensor_model_parallel_size={options.tp}, pipeline_model_parallel_size={options.pp}"
        ]
    return []


def _if_differs(size: int | None, original: int | None) -> int | None:
    """A source vocab size worth recording: one that is not the true size."""
    return size if size != original else None


def _mapping_record(target: TargetPlan) -> dict[str, Any] | None:
    """What the manifest says of a mapping: the namings, every source name's target names, what was dropped."""
    if target.mapping is None:
        return None
    mapped = {
        source.name: [t.name for t in plan.targets] for plan in target.conversion.tensors for source in plan.sources
    }
    return {
        "from": target.mapping.mapping.source_family,
        "to": target.mapping.mapping.target_family,
        "tensors": dict(sorted(mapped.items())),
        "dropped": sorted(target.dropped),
    }


def _mapping_summary(target: TargetPlan) -> dict[str, Any] | None:
    """The report's view of a mapping: the namings, and how many tensors went in and came out."""
    if target.mapping is None:
        return None
    plans = target.conversion.tensors
    return {
        "from": target.mapping.mapping.source_family,
        "to": target.mapping.mapping.target_family,
        "sources": sum(len(p.sources) for p in plans),
        "targets": sum(len(p.targets) for p in plans),
        "dropped": len(target.dropped),
    }


def _targets(conversion: ConversionPlan) -> list[tuple[TensorPlan, TargetTensor]]:
    return [(plan, target) for plan in conversion.tensors for target in plan.targets]


def _changed_shapes(conversion: ConversionPlan) -> list[dict[str, Any]]:
    """Tensors kept under their name whose shape on disk changed, comparing source rank 0 with target rank 0."""
    changed = []
    for plan in sorted(conversion.tensors, key=lambda t: t.name):
        if plan.transform is not None:
            continue
        before, after = plan.sources[0].refs[0].shape, plan.targets[0].rank_shapes[0]
        if before != after:
            changed.append({"tensor": plan.name, "old": list(before), "new": list(after)})
    return changed
