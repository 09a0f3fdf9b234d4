"""The journal of a resumable conversion (``convert --resume``): what an interrupted run finished.

A conversion killed at 90 % of a terabyte should not start again from zero. With ``--resume`` the staged
folder has a fixed name beside the output and holds this journal: a first line with the fingerprint of
the conversion (what it reads, what it writes, the options that change bytes), then a line per tensor once
it is hashed (what the manifest records of it) and a line per output data file once its last byte is
written (its size and sha256, hashed from the disk). A line is appended and flushed as a whole, so a run
killed at any point leaves a journal whose every complete line is true; a torn last line is ignored. Each
worker of a run shared among processes keeps its own journal; a resumed run reads them all.

Resuming checks the fingerprint, then every file the journal calls complete, by size and by hashing it
again: a file that matches is kept and no byte of it is written again, anything else is written anew. A
tensor is read again unless its manifest facts are in the journal and every file holding it is kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reshard.errors import ReshardError

JOURNAL = ".reshard-journal-{rank}.jsonl"  # one per worker (one process: rank 0)
HASH_BLOCK = 8 << 20


@dataclass(frozen=True)
class TensorRecord:
    """What the manifest needs of a tensor that an earlier run hashed."""

    sha256: str
    finite: bool | None
    divergent: bool


@dataclass
class Resumed:
    """What a resumed run may keep: complete files (relative paths) and the tensors' manifest facts."""

    files: frozenset[str] = frozenset()
    tensors: dict[str, TensorRecord] = field(default_factory=dict)
    redone: list[str] = field(default_factory=list)  # files the journal named that did not match


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read in 8 MB blocks (and dropped from the page cache after)."""
    digest = hashlib.sha256()
    with path.open("rb", buffering=0) as handle:
        while block := handle.read(HASH_BLOCK):
            digest.update(block)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return digest.hexdigest()


class Journal:
    """Appends the lines of one conversion's journal, from any thread.

    Example:
        >>> journal = Journal.start(Path(staging), "fingerprint")  # doctest: +SKIP
        >>> journal.tensor_done("w", "ab12...", True, False)  # doctest: +SKIP
        >>> journal.file_done("model.safetensors")  # hashes the file, appends its line  # doctest: +SKIP
    """

    def __init__(self, staging: Path, handle: Any) -> None:
        self.staging = staging
        self._handle = handle
        self._lock = threading.Lock()

    @classmethod
    def start(cls, staging: Path, fingerprint: str, *, rank: int = 0) -> Journal:
        """A new journal for worker ``rank`` (one process is rank 0); an older one of that rank is replaced."""
        journal = cls(staging, (staging / JOURNAL.format(rank=rank)).open("w", encoding="utf-8"))
        journal._append({"fingerprint": fingerprint})
        return journal

    @classmethod
    def resume(cls, staging: Path, fingerprint: str) -> tuple[Journal, Resumed]:
        """What every worker's journal in ``staging`` calls complete and still checks out, and the journal of rank
        0 to append to, holding all of it (a staged folder without journals starts afresh). With several workers
        rank 0 calls this and hands the :class:`Resumed` on; the others :meth:`start` their own journals after.

        Raises:
            ReshardError: a journal is of another conversion (other source files, target or options).
        """
        journals = [_read_lines(path) for path in sorted(staging.glob(JOURNAL.format(rank="*")))]
        journals = [lines for lines in journals if lines]
        if any(lines[0]["fingerprint"] != fingerprint for lines in journals):
            raise ReshardError(
                "the partial output of an interrupted run is of another conversion (other source files, target "
                "or options)",
                path=staging,
                hint="run the command that made it, or remove that folder to start again",
            )
        resumed = Resumed()
        claimed: dict[str, tuple[int, str]] = {}
        for line in (line for lines in journals for line in lines[1:]):
            if "tensor" in line:
                resumed.tensors[line["tensor"]] = TensorRecord(line["sha256"], line["finite"], line["divergent"])
            else:
                claimed[line["file"]] = (line["size"], line["sha256"])
        kept = {name: facts for name, facts in claimed.items() if _digest(staging / name, facts[0]) == facts[1]}
        resumed.files = frozenset(kept)
        resumed.redone = sorted(set(claimed) - set(kept))
        journal = cls.start(staging, fingerprint)  # written again: no torn line stays inside
        for name, (size, sha256) in sorted(kept.items()):
            journal._append({"file": name, "size": size, "sha256": sha256})
        for name, record in resumed.tensors.items():
            journal._append({"tensor": name, **record.__dict__})
        return journal, resumed

    def tensor_done(self, name: str, sha256: str, finite: bool | None, divergent: bool) -> None:
        self._append({"tensor": name, "sha256": sha256, "finite": finite, "divergent": divergent})

    def file_done(self, relative: str) -> None:
        """Record a data file whose last byte is written: its size and the sha256 of what is on disk."""
        path = self.staging / relative
        self._append({"file": relative, "size": path.stat().st_size, "sha256": file_sha256(path)})

    def close(self, *, remove: bool = False) -> None:
        """Close the journal; ``remove`` deletes every worker's (the output is complete and about to be published)."""
        with self._lock:
            self._handle.close()
        if remove:
            for path in self.staging.glob(JOURNAL.format(rank="*")):
                path.unlink(missing_ok=True)

    def _append(self, line: dict[str, Any]) -> None:
        text = json.dumps(line, sort_keys=True) + "\n"
        with self._lock:
            self._handle.write(text)
            self._handle.flush()


def _digest(path: Path, size: int) -> str | None:
    """sha256 of the file at ``path`` when it is there with ``size`` bytes."""
    try:
        return file_sha256(path) if path.is_file() and path.stat().st_size == size else None
    except OSError:
        return None


def _read_lines(path: Path) -> list[dict[str, Any]]:
    """The journal's complete lines (a line torn by a kill, and anything after it, is dropped)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    lines = []
    for raw in text.split("\n")[:-1]:  # the part after the last newline was cut short
        try:
            line = json.loads(raw)
        except json.JSONDecodeError:
            break
        if not _well_formed(line, first=not lines):
            break
        lines.append(line)
    return lines


def _well_formed(line: Any, *, first: bool) -> bool:
    """A line as :class:`Journal` writes them (the folder is reshard's, but a damaged line must not crash)."""
    if not isinstance(line, dict):
        return False
    if first:
        return isinstance(line.get("fingerprint"), str)
    if isinstance(line.get("tensor"), str):
        return isinstance(line.get("sha256"), str) and isinstance(line.get("divergent"), bool)
    return (
        isinstance(line.get("file"), str)
        and ".." not in Path(line["file"]).parts
        and not Path(line["file"]).is_absolute()
        and isinstance(line.get("size"), int)
        and isinstance(line.get("sha256"), str)
    )
