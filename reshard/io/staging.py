"""Output folders are written under a temporary sibling name and renamed into place only when complete."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from reshard.errors import OutputExistsError, ReshardError


def check_output(out: Path, *, source: Path, overwrite: bool) -> None:
    """Refuse an output that is the input, contains it or lies inside it, or exists non-empty without ``overwrite``."""
    out_r, src_r = out.resolve(), source.resolve()
    if out_r == src_r or out_r in src_r.parents or src_r in out_r.parents:
        raise ReshardError(
            "the output overlaps the input checkpoint",
            path=out,
            hint="reshard never modifies its input: choose another -o",
        )
    if out.exists() and not overwrite and (out.is_file() or any(out.iterdir())):
        raise OutputExistsError("output exists and is not empty", path=out, hint="pass --overwrite to replace it")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def staged_output(out: Path) -> Iterator[Path]:
    """Yield a temporary folder beside ``out``; on success it replaces ``out``, on any error it is removed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".reshard-tmp", dir=out.parent))
    staging.chmod(0o777 & ~_umask())  # mkdtemp makes it private; the output is an ordinary folder
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".reshard-old", dir=out.parent))
        old.rmdir()
        out.rename(old)
        staging.rename(out)
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    else:
        staging.rename(out)
