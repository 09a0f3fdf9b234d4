"""One worker's share of a conversion that several processes run together (:mod:`reshard.engine.workers`).

The output's data files are shared out by bytes; a worker converts every tensor that has a piece in one of its
files (a tensor split over files of two workers is read by both, and each writes its own pieces), and leaves
the other files to their workers, as a resumed run leaves the files it kept. Rank 0 also converts the tensors
that land in no data file and writes the files that are not data (config, index, tracker), then the manifest.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from reshard.engine.assign import assign
from reshard.engine.planner import ConversionPlan
from reshard.engine.workers import Group
from reshard.errors import ReshardError
from reshard.io.staging import staged_output
from reshard.layouts.file_plan import FilePlan

T = TypeVar("T")


def file_bytes(conversion: ConversionPlan, file_plan: FilePlan) -> dict[str, int]:
    """About how many bytes each data file holds: each target tensor's bytes spread over the files holding it."""
    holders: dict[str, int] = {}
    for names in file_plan.files.values():
        for name in names:
            holders[name] = holders.get(name, 0) + 1
    sizes = {t.name: t.nbytes for plan in conversion.tensors for t in plan.targets}
    return {
        file: sum(sizes.get(name, 0) // holders[name] for name in names) for file, names in file_plan.files.items()
    }


def share_of(group: Group, conversion: ConversionPlan, file_plan: FilePlan) -> tuple[ConversionPlan, frozenset[str]]:
    """What this worker converts, and the data files it leaves to the others."""
    mine = assign(file_bytes(conversion, file_plan), group.size)[group.rank]
    return tensors_for(conversion, file_plan, mine, first=group.rank == 0), frozenset(file_plan.files) - mine


def tensors_for(
    conversion: ConversionPlan, file_plan: FilePlan, mine: frozenset[str], *, first: bool
) -> ConversionPlan:
    """The part of ``conversion`` a worker converts: tensors with a piece in its files (and, for the ``first``
    worker, the tensors in no data file: their manifest facts must come from somewhere)."""
    in_mine, anywhere = file_plan.tensors_in(mine), file_plan.tensors
    kept = tuple(
        plan
        for plan in conversion.tensors
        if any(t.name in in_mine or (first and t.name not in anywhere) for t in plan.targets)
    )
    return dataclasses.replace(conversion, tensors=kept)


def together(group: Group, work: Callable[[], T]) -> list[T]:
    """``work()`` on every worker; every worker's result, in rank order. If any worker failed, every worker
    raises the same one line, naming the first that failed and why (a signal is not caught: the process ends,
    and the others find it lost at this gather)."""
    try:
        result, error = work(), None
    except ReshardError as err:
        result, error = None, err.one_line()
    except Exception as err:  # noqa: BLE001 - a worker's failure, of any kind, must reach the others
        where = f"{err.filename}: " if isinstance(err, OSError) and err.filename else ""
        result, error = None, f"{where}{getattr(err, 'strerror', None) or err}"
    outcomes = group.gather((error, result))
    for rank, (failure, _) in enumerate(outcomes):
        if failure is not None:
            raise ReshardError(f"worker {rank}: {failure}", hint="nothing was published")
    return [outcome for _, outcome in outcomes]


@contextlib.contextmanager
def staged(out: Path, *, overwrite: bool, resume: bool, group: Group | None) -> Iterator[Path]:
    """:func:`~reshard.io.staging.staged_output` for one process, or for a group: rank 0 makes (and in the end
    publishes or removes) the folder and tells the others where it is, or why there is none."""
    if group is None:
        with staged_output(out, overwrite=overwrite, resume=resume) as staging:
            yield staging
        return
    if group.rank != 0:
        failure, where = group.broadcast(None)
        if failure is not None:
            raise ReshardError(failure)
        yield Path(where)
        return
    told = False
    try:
        with staged_output(out, overwrite=overwrite, resume=resume) as staging:
            group.broadcast((None, str(staging)))
            told = True
            yield staging
    except ReshardError as err:
        if not told:
            group.broadcast((err.one_line(), None))
        raise


def merged(results: list[Any]) -> tuple[dict[str, str], dict[str, bool | None], set[str]]:
    """Every worker's ``(hashes, finite, divergent targets)`` as one."""
    hashes: dict[str, str] = {}
    finite: dict[str, bool | None] = {}
    divergent: set[str] = set()
    for worker_hashes, worker_finite, worker_divergent in results:
        hashes |= worker_hashes
        finite |= worker_finite
        divergent |= set(worker_divergent)
    return hashes, finite, divergent
