"""What a resumed conversion still has to do (``convert --resume``; the journal is :mod:`reshard.io.journal`), and
the journal a run keeps.

Two facts decide it: the fingerprint (is the partial output of this very conversion?) and, per tensor, whether
the journal holds its manifest facts and every data file it is written into was found complete.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from reshard.engine.planner import ConversionPlan, TensorPlan
from reshard.engine.workers import Group
from reshard.errors import ReshardError
from reshard.io.journal import Journal, Resumed
from reshard.layouts.file_plan import FilePlan
from reshard.options import ConvertOptions

# Options that change no byte of the output: a resumed run may differ in them.
NEUTRAL_OPTIONS = ("progress", "jobs", "overwrite", "resume")


def fingerprint(ckpt: Path, conversion: ConversionPlan, layout: str, options: ConvertOptions) -> str:
    """sha256 of what the output's bytes depend on: the source files (names, sizes, modification times), the
    target layout, every target tensor (name, dtype, per-rank shapes) and the options that change bytes."""
    ckpt = Path(ckpt)
    files = [ckpt] if ckpt.is_file() else sorted(p for p in ckpt.rglob("*") if p.is_file())
    facts = {
        "source": [[p.relative_to(ckpt).as_posix() if p != ckpt else p.name, *_stat(p)] for p in files],
        "layout": layout,
        "tensors": sorted(
            [t.name, t.code, [list(shape) for shape in t.rank_shapes]]
            for plan in conversion.tensors
            for t in plan.targets
        ),
        "options": {
            f.name: str(getattr(options, f.name)) for f in dataclasses.fields(options) if f.name not in NEUTRAL_OPTIONS
        },
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def _stat(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def still_to_do(conversion: ConversionPlan, file_plan: FilePlan, resumed: Resumed) -> ConversionPlan:
    """``conversion`` without the tensors an earlier run finished: journaled, and in kept files only."""
    if not resumed.files and not resumed.tensors:
        return conversion
    pending = file_plan.tensors_in(file for file in file_plan.files if file not in resumed.files)

    def finished(plan: TensorPlan) -> bool:
        return all(t.name in resumed.tensors and t.name not in pending for t in plan.targets)

    return dataclasses.replace(conversion, tensors=tuple(plan for plan in conversion.tensors if not finished(plan)))


def open_journal(
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
