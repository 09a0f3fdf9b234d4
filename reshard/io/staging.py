"""Output folders are written under a temporary sibling name and renamed into place only when complete.

Nothing is left behind however a run ends: on any error, on SIGINT / SIGTERM / SIGHUP / SIGQUIT (see
:mod:`.interrupts`), on a full disk or a read-only folder, the staged folder is removed and the output path is as it
was. Every removal runs with the signals held off (:func:`~.interrupts.deferred`), as the work it cleans up: a second
signal (torchrun's SIGTERM after a worker died, a second Ctrl-C) cannot cut it short. What this process made is
recorded until it is published or removed, so :func:`left_behind` can say, by looking, what is still there. Two runs to
one output cannot both publish: each holds a lock beside the output while it writes (a second run fails at once), and
the output is published by a ``rename`` that fails on a non-empty folder, so a finished output is never replaced
without ``--overwrite``, even by a run that took no lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from reshard.errors import OutputExistsError, ReshardError
from reshard.io.interrupts import deferred
from reshard.manifest import MANIFEST_NAME
from reshard.sizes import human_bytes

LOCK_SUFFIX = ".reshard-lock"
TMP_SUFFIX = ".reshard-tmp"  # a staged folder of a run without --resume: .OUT.<random>.reshard-tmp
logger = logging.getLogger(__name__)

# Staged folders, lock files and temporary folders this process made and has neither published nor removed.
_owned: set[Path] = set()


def _remove(path: Path) -> None:
    """Remove ``path`` (a folder or a file) with the stopping signals held off, and forget it once it is gone."""
    with deferred():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
        if not os.path.lexists(path):
            _owned.discard(path)


def remove_leftovers() -> list[Path]:
    """Remove whatever this process staged and still owns (a last sweep when a command ends); what remains."""
    for path in sorted(_owned):
        _remove(path)
    return left_behind()


def left_behind() -> list[Path]:
    """What this process made (staged output, lock, temporary folder) that is still on disk: looked for on disk."""
    return sorted(path for path in _owned if os.path.lexists(path))


def describe_left(paths: list[Path]) -> str:
    """The end of a message saying what a stopped run left: looked for on disk."""
    if not paths:
        return "no partial output or temporary files were left"
    return f"left behind: {', '.join(str(p) for p in paths)} (remove it)"


@contextlib.contextmanager
def temporary_folder(prefix: str) -> Iterator[Path]:
    """A private temporary folder, removed on the way out with signals held off (as :func:`staged_output`)."""
    with deferred():
        tmp = Path(tempfile.mkdtemp(prefix=prefix))
        _owned.add(tmp)
    try:
        yield tmp
    finally:
        _remove(tmp)


def check_output(out: Path, *, source: Path, overwrite: bool, resume: bool = False) -> None:
    """Refuse an output that is the input, contains it or lies inside it, or exists non-empty without ``overwrite``
    (with ``resume``, a folder holding a manifest is left to the run to judge: it may be this conversion, done)."""
    out_r, src_r = out.resolve(), source.resolve()
    if out_r == src_r or out_r in src_r.parents or src_r in out_r.parents:
        raise ReshardError(
            "the output overlaps the input checkpoint",
            path=out,
            hint="reshard never modifies its input: choose another -o",
        )
    if resume and (out / MANIFEST_NAME).is_file():
        return
    if out.exists() and not overwrite and (out.is_file() or any(out.iterdir())):
        raise OutputExistsError("output exists and is not empty", path=out, hint="pass --overwrite to replace it")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_error(err: OSError, out: Path, staging: Path | None = None, *, kept: bool = False) -> ReshardError:
    """An ``OSError`` met writing ``out``, as one line naming the output (a staged name shown as the final one);
    ``kept``: a resumable run's staged folder stays."""
    name = str(err.filename) if err.filename is not None else str(out)
    if staging is not None:
        name = name.replace(str(staging), str(out))
    why = err.strerror or str(err)
    hints: dict[int | None, str] = {
        errno.ENOSPC: "free some space or write elsewhere",
        errno.EDQUOT: "free some space or write elsewhere",
        errno.EROFS: "write to a writable folder",
        errno.EACCES: "write to a folder you may write to",
        errno.EPERM: "write to a folder you may write to",
    }
    hint = hints.get(err.errno)
    if kept:
        left = ""
    else:  # looked for, not assumed: a removal that failed is named
        remains = left_behind()
        left = f"; left behind: {', '.join(map(str, remains))}" if remains else "; nothing was left behind"
    return ReshardError(f"cannot write the output: {why}{left}", path=name, hint=hint)


def _is_output_error(err: OSError, staging: Path) -> bool:
    """An error of writing the output (no file name, as ``pwrite`` gives, or a file in the staged folder)."""
    return err.filename is None or str(err.filename).startswith(str(staging))


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    """Hold ``.OUT.reshard-lock`` beside ``out`` meanwhile (``flock``: the kernel frees it if the process dies)."""
    lock = out.parent / f".{out.name}{LOCK_SUFFIX}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with deferred():
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:  # named as the output: the lock file is reshard's business, not the user's
        raise write_error(OSError(err.errno, err.strerror), out) from err
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputExistsError(
                "another reshard run is writing this output", path=out, hint="wait for it, or choose another -o"
            ) from None
        _owned.add(lock)
        try:
            yield
        finally:
            _remove(lock)  # while still holding the lock: a run that opens it later takes a new file
    finally:
        os.close(fd)


PARTIAL_SUFFIX = ".reshard-partial"
KEPT = "the work done is kept in {staging}: run the same command with --resume to finish it"


def partial_folder(out: Path) -> Path:
    """Where a resumable run stages ``out``: a fixed name beside it, so that ``--resume`` finds it again."""
    return out.parent / f".{out.name}{PARTIAL_SUFFIX}"


@contextlib.contextmanager
def staged_output(out: Path, *, overwrite: bool = True, resume: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside ``out``; on success it becomes ``out``, on any error it is removed.

    With ``overwrite`` (the default) a finished output replaces what is at ``out``; without it (``convert``
    without ``--overwrite``) an ``out`` that is not empty, found now or when publishing, is left as it is.
    With ``resume`` the folder is :func:`partial_folder` (found again if an earlier run left it), and an
    error or a signal leaves it in place, saying so, for the next ``--resume``.

    Raises:
        OutputExistsError: another run holds the output's lock, or finished it first (without ``overwrite``).
        ReshardError: the output cannot be written (full disk, read-only or forbidden folder), in one line.
    """
    with _locked(out):
        if out.exists() and not overwrite and (out.is_file() or any(out.iterdir())):
            raise OutputExistsError("output exists and is not empty", path=out, hint="pass --overwrite to replace it")
        _sweep_orphans(out, resume=resume)
        with deferred():  # a signal now would leave the folder behind before the cleanup below owns it
            try:
                staging = _make_staging(out, resume=resume)
            except OSError as err:
                raise write_error(OSError(err.errno, err.strerror), out) from err
        try:
            yield staging
            with deferred():
                _publish(staging, out, overwrite=overwrite)
        except OSError as err:
            if resume and _is_output_error(err, staging):
                raise _kept(write_error(err, out, staging, kept=True), staging) from err
            if resume:
                _kept(err, staging)
                raise
            _remove(staging)
            if _is_output_error(err, staging):
                raise write_error(err, out, staging) from err
            raise
        except BaseException as err:
            if resume:
                _kept(err, staging)
                raise
            _remove(staging)
            raise
        if not resume:  # an earlier --resume run's partial output is stale now
            _remove(partial_folder(out))


def _sweep_orphans(out: Path, *, resume: bool) -> None:
    """What runs killed outright (SIGKILL, a lost node: no cleanup could run) left beside ``out``, found while this
    run holds the output's lock, so no live run on this machine owns it: a staged folder of a run without
    ``--resume`` cannot be continued and is removed; a ``--resume`` run's partial output is continued by
    ``--resume``, and a run without it says it is there, how large, and that it starts over (and removes it when it
    publishes). Each is said on stderr."""
    for orphan in sorted(out.parent.glob(f".{glob.escape(out.name)}.*{TMP_SUFFIX}")):
        if orphan.is_dir() and not orphan.is_symlink():
            size = _size(orphan)
            _remove(orphan)
            logger.warning("removed %s (%s), left by a run that was killed before it could clean up", orphan, size)
    partial = partial_folder(out)
    if not resume and partial.is_dir():
        logger.warning(
            "%s (%s) holds the work of an earlier --resume run; this run starts over without it and removes it once "
            "it publishes (stop it and run the same command with --resume to continue that work instead)",
            partial,
            _size(partial),
        )


def _size(folder: Path) -> str:
    """How much a folder holds, for a message."""
    total = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
    return human_bytes(total)


def _make_staging(out: Path, *, resume: bool) -> Path:
    if resume:
        staging = partial_folder(out)
        staging.mkdir(exist_ok=True)
    else:
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=TMP_SUFFIX, dir=out.parent))
        _owned.add(staging)
    staging.chmod(0o777 & ~_umask())  # mkdtemp makes it private; the output is an ordinary folder
    return staging


def _kept(err: BaseException, staging: Path) -> BaseException:
    """``err`` of a resumable run, saying where the work done is kept (``kept``, for the command line's message)."""
    if isinstance(err, ReshardError):
        note = KEPT.format(staging=staging)
        err.hint = f"{err.hint}; {note}" if err.hint else note
        err.args = (err.one_line(),)
    # Any exception (a signal's KeyboardInterrupt too) carries where the work is kept, for the command line.
    err.kept = staging  # type: ignore[attr-defined]
    return err


def _publish(staging: Path, out: Path, *, overwrite: bool) -> None:
    """Rename ``staging`` to ``out``: onto nothing or an empty folder, or (``overwrite``) in place of ``out``."""
    if overwrite and out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".reshard-old", dir=out.parent))
        old.rmdir()
        out.rename(old)
        staging.rename(out)
        _owned.discard(staging)
        shutil.rmtree(old) if old.is_dir() else old.unlink()
        return
    try:
        os.rename(staging, out)  # replaces an empty folder; fails on a non-empty one (a run that finished first)
        _owned.discard(staging)
    except OSError as err:
        if err.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise
        _remove(staging)
        raise OutputExistsError(
            "another run finished this output first; it was left as it is", path=out, hint="pass --overwrite"
        ) from None
