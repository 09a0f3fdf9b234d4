"""One conversion run, shared by every command that writes a checkpoint (``convert``, ``fix``, ``verify``'s round
trip): plan the target and its files, stage the output, keep the resume journal, share the files among workers,
move the bytes, write the manifest and the side files, publish.

The order is fixed: everything that can be refused is planned before the staged folder exists (the target, the
writer's :class:`~reshard.formats.file_plan.FilePlan`); resume and a worker's share are filters of that plan; only
:func:`~reshard.engine.move.execute.execute` moves bytes; rank 0 alone writes the manifest and publishes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from reshard.engine.move.execute import execute, needs_torch, plan_moves
from reshard.engine.plan.lora_merge import check_lora_replicas
from reshard.engine.plan.open import OpenedCheckpoint, open_checkpoint
from reshard.engine.plan.planner import ConversionPlan, TensorPlan
from reshard.engine.plan.target import TargetPlan, plan_target, planned_tp, target_spec
from reshard.engine.plan.tokenizer import has_tokenizer, runtime_files
from reshard.engine.run.conversion_manifest import conversion_manifest
from reshard.engine.run.group_staging import staged
from reshard.engine.run.resume import already_complete, conversion_facts, manifest_record, open_journal, still_to_do
from reshard.engine.run.route import Route
from reshard.engine.run.warmup import import_torch_in_background, wait_for_torch
from reshard.engine.run.worker_shares import share_of
from reshard.engine.run.workers import Group, join, together
from reshard.io.direct import in_memory
from reshard.io.journal import Resumed
from reshard.io.staging import check_output
from reshard.layouts import layout
from reshard.layouts.base import RunFiles
from reshard.manifest import MANIFEST_NAME, write_manifest
from reshard.options import ConvertOptions, default_jobs
from reshard.plans import built_family


@dataclass(frozen=True)
class ConversionRun:
    """What one conversion wrote.

    Attributes:
        route: where from and where to.
        target: the planned conversion (tensors, layout, config, mapping).
        files: the files written, relative to the output, sorted (a worker other than rank 0: its own data files).
        divergent: target tensors made from a source whose replicas differed (rank 0's copy taken).
        manifest: the output's ``reshard.json``.
        notes: what the user should know: the source's notes, divergent replicas, what tp/pp mean for the layout.
        tokenizer: where the output's tokenizer came from (None: it has none; ``"source"``: the source's own files).
        already_complete: ``--resume`` found the output complete, of this very conversion: nothing was written.
    """

    route: Route
    target: TargetPlan
    files: tuple[str, ...]
    divergent: frozenset[str]
    manifest: Path
    notes: tuple[str, ...]
    tokenizer: str | None = None
    already_complete: bool = False

    @property
    def vocab(self) -> dict[str, Any]:
        """The vocab sizes: the true one and where it came from, the source's padded and the target's padded."""
        vocab = self.target.conversion.vocab
        return {
            "original": vocab.original,
            "origin": vocab.origin,
            "source_padded": vocab.source_padded,
            "target_padded": vocab.target_padded,
        }


@dataclass(frozen=True)
class _Moved:
    """One worker's part of the run: every tensor it hashed, whether each is finite, the targets made from divergent
    replicas, and the files its writer wrote."""

    hashes: dict[str, str]
    finite: dict[str, bool | None]
    divergent: frozenset[str]
    files: tuple[str, ...]


def open_for_conversion(ckpt: Path, out: Path, options: ConvertOptions) -> OpenedCheckpoint:
    """Check ``out`` can be written, then open ``ckpt`` for the tp its target layout is planned at."""
    check_output(out, source=ckpt, overwrite=options.overwrite, resume=options.resume)
    read = options.read
    if options.layout is not None and layout(options.layout).lora_adapter:  # PEFT's folder: the adapter alone
        read = replace(read, lora_adapter=True)
    return open_checkpoint(
        ckpt, read, target_tp=planned_tp(options.layout, options.tp), dequantize=options.dtype is not None
    )


def run_conversion(opened: OpenedCheckpoint, out: Path, options: ConvertOptions) -> ConversionRun:
    """Convert ``opened`` into ``out`` as ``options`` ask: staged beside ``out`` and renamed into place when complete.

    Raises:
        ReshardError: any problem with the input or the output path, before or during writing (nothing is left at
            ``out`` then; with ``--resume``, the partial output is kept to resume from).
    """
    target = plan_target(opened, options)
    moves = plan_moves(target.conversion)  # once; execute moves this process's part by it
    if needs_torch(moves):  # the bytes need torch: imported while the rest is checked and staged
        import_torch_in_background()
    built_family.check_counts(opened.source.config, opened.source.names())  # every worker, no import
    tokenizer = target.tokenizer
    if opened.tokenizer is not None and tokenizer is None:
        opened.source.notes.append(
            f"the {target.layout} layout carries no tokenizer: {opened.tokenizer.origin} is not copied"
        )
    conversion, layout = target.conversion, target.layout
    if not (options.read.merge_lora or options.allow_divergent_replicas):
        check_lora_replicas(opened.tensors)
    spec = target_spec(target, options)
    file_plan = layout.target_writer.file_plan(spec)
    facts = conversion_facts(opened.path, conversion, layout.name, options)
    if options.resume and not options.overwrite:
        finished = already_complete(out, facts)
        if finished is not None:  # a retry of a run that finished: nothing to do
            held = tuple(sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()))
            divergent = frozenset(name for name, entry in finished.tensors.items() if entry.divergent)
            return _result(opened, target, out, options, held, divergent, None, already_complete=True)
    group = join()
    first = group is None or group.rank == 0
    # once per conversion, heard before publishing: rank 0's refusal reaches every worker through `together`
    wait_for_torch()  # the check forks only a process of one thread
    family = built_family.start(opened.source.config, opened.source.names()) if first else None
    _heard_early(family, group)  # a refusal the cache already knows: before any output exists
    with staged(out, overwrite=options.overwrite, resume=options.resume, group=group) as staging:
        journal, resumed = open_journal(staging, facts, options, group)
        todo, done = conversion, resumed.files
        if group is not None:  # this worker's files; the others' are left to them as a resumed run leaves its own
            todo, others = share_of(group, conversion, file_plan)
            done = done | others
        if journal is not None:
            todo = still_to_do(todo, file_plan, resumed)
        run_files = RunFiles(done, journal.file_done if journal else None, writes_shared=first)
        writer = layout.target_writer(staging, spec, file_plan, run_files)

        def move() -> _Moved:
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
                jobs=options.jobs or default_jobs(in_memory=in_memory(opened.path) and in_memory(staging)),
                on_hashed=journaled if journal is not None else None,
                moves=moves,
            )
            files = tuple(str(p) for p in writer.close())
            if family is not None:
                family.result()
            return _Moved(hashes, finite, frozenset(_divergent_targets(todo, divergent)), files)

        moved = [move()] if group is None else together(group, move)
        if not first and group is not None:
            return _result(opened, target, out, options, moved[group.rank].files, frozenset(), None)
        whole = _merged(moved, resumed)
        files = list(moved[0].files)
        files += runtime_files(staging, opened.source, tokenizer)
        manifest = conversion_manifest(
            opened.path,
            target,
            tp=options.tp,
            hashes=whole.hashes,
            finite=whole.finite,
            divergent=whole.divergent,
            resumable=manifest_record(facts),
        )
        write_manifest(staging, manifest)
        if journal is not None:
            journal.close(remove=True)
    said = tokenizer.origin if tokenizer is not None else "source" if has_tokenizer(files) else None
    return _result(opened, target, out, options, tuple(files), whole.divergent, said)


def _heard_early(family: built_family.FamilyCheck | None, group: Group | None) -> None:
    """Raise, before any output exists, a refusal of the config's family that the cache of meta builds already
    gave (``family.judged``). With workers, only rank 0 checks: every worker meets at one gather here, so all of
    them stop at once on rank 0's refusal, instead of moving their share of the bytes first."""
    heard = family.result if family is not None and family.judged else lambda: None
    if group is None:
        heard()
    else:
        together(group, heard)


def _merged(moved: list[_Moved], resumed: Resumed) -> _Moved:
    """Every worker's part, then what an earlier run journaled, as one (the files are rank 0's)."""
    hashes: dict[str, str] = {}
    finite: dict[str, bool | None] = {}
    divergent: set[str] = set()
    for part in moved:
        hashes |= part.hashes
        finite |= part.finite
        divergent |= part.divergent
    hashes |= {name: record.digest for name, record in resumed.tensors.items()}
    finite |= {name: record.finite for name, record in resumed.tensors.items()}
    divergent |= {name for name, record in resumed.tensors.items() if record.divergent}
    return _Moved(hashes, finite, frozenset(divergent), moved[0].files)


def _divergent_targets(conversion: ConversionPlan, divergent: set[str]) -> set[str]:
    """The target tensors made from a source whose replicas differed (the manifest marks them)."""
    return {
        t.name for plan in conversion.tensors if any(s.name in divergent for s in plan.sources) for t in plan.targets
    }


def _result(
    opened: OpenedCheckpoint,
    target: TargetPlan,
    out: Path,
    options: ConvertOptions,
    files: tuple[str, ...],
    divergent: frozenset[str],
    tokenizer: str | None,
    *,
    already_complete: bool = False,
) -> ConversionRun:
    source = opened.source
    route = Route(
        source=str(opened.path),
        source_layout=source.layout,
        source_tp=source.tp,
        output=str(out),
        layout=target.layout.name,
        tp=target.conversion.target_tp,
    )
    vocab_known = opened.vocab.original is not None
    notes = [*source.notes_for(layout=target.layout.name, vocab_known=vocab_known), *target.notes]
    if tokenizer not in (None, "source"):
        notes.append(f"the output carries the tokenizer of {tokenizer}")
    if divergent:
        notes.append(f"replicated but different between ranks, rank 0's copy taken: {', '.join(sorted(divergent))}")
    if target.layout.loaded_at_any_size:
        notes.append(target.layout.loaded_at_any_size.format(tp=options.tp, pp=options.pp))
    return ConversionRun(
        route, target, tuple(sorted(files)), divergent, out / MANIFEST_NAME, tuple(notes), tokenizer, already_complete
    )
