"""The staged output folder of a conversion, for one process or for a group of workers that write into it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from reshard.engine.run.workers import Group
from reshard.errors import ReshardError
from reshard.io.staging import staged_output


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
