"""One worker's share of a conversion that several processes run together (:mod:`reshard.engine.run.workers`): pure
filters of the output's :class:`~reshard.formats.file_plan.FilePlan`, the same on every worker.

The output's data files are shared out by bytes; a worker converts every tensor that has a piece in one of its
files (a tensor split over files of two workers is read by both, and each writes its own pieces), and leaves
the other files to their workers, as a resumed run leaves the files it kept. Rank 0 also converts the tensors
that land in no data file and writes the files that are not data (config, index, tracker), then the manifest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from reshard.engine.plan.planner import ConversionPlan
from reshard.engine.run.workers import Group
from reshard.formats.file_plan import FilePlan


def assign(files: Mapping[str, int], workers: int) -> list[frozenset[str]]:
    """Share ``files`` (name -> bytes) among ``workers``: largest first, each to the worker with the fewest bytes so
    far (ties: the lower rank, then the name), so the shares differ by at most the largest file.

    Example:
        >>> assign({"a": 5, "b": 3, "c": 3, "d": 1}, 2)
        [frozenset({'a', 'd'}), frozenset({'b', 'c'})]
    """
    loads = [0] * workers
    shares: list[set[str]] = [set() for _ in range(workers)]
    for name, size in sorted(files.items(), key=lambda item: (-item[1], item[0])):
        worker = min(range(workers), key=lambda w: (loads[w], w))
        shares[worker].add(name)
        loads[worker] += size
    return [frozenset(share) for share in shares]


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
