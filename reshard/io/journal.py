"""The journal of a resumable conversion (``convert --resume``): what an interrupted run finished.

A conversion killed at 90 % of a terabyte should not start again from zero. With ``--resume`` the staged
folder has a fixed name beside the output and holds this journal: a first line with the fingerprint of
the conversion (what it reads, what it writes, the options that change bytes), then a line per tensor once
it is hashed (what the manifest records of it: its digest, ``"blake3:<hex>"``) and a line per output data file
once its last byte is written (its size and sha256, hashed from the disk). A line is appended and flushed as a
whole, so a run killed at any point leaves a journal whose every complete line is true; a torn last line is
ignored. Each worker of a run shared among processes keeps its own journal; a resumed run reads them all.

The journal is checked like a manifest before anything in it is trusted: every field's type and format (a sha256
is 64 hex digits, a tensor's digest names blake3 or sha256 before them, a size is a count of bytes, ``finite`` true,
false or null), and each line after the first carries ``check``, the sha256 of the fingerprint and the line's
own content, so a line edited or zeroed since (or of another conversion) is detected. A line that fails any
check is dropped, never a crash: its tensor is read again, its file written again. The first line also holds
the facts the fingerprint is the hash of, so that a partial output of another conversion is refused naming what
differs (an option, a source file, the target).

Resuming checks the fingerprint, then every file the journal calls complete, by size and by hashing it
again: a file that matches is kept and no byte of it is written again, anything else is written anew. A
tensor is read again unless its manifest facts are in the journal and every file holding it is kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reshard.errors import ReshardError

JOURNAL = ".reshard-journal-{rank}.jsonl"  # one per worker (one process: rank 0)
HASH_BLOCK = 8 << 20
SHA256 = re.compile(r"[0-9a-f]{64}")
DIGEST = re.compile(r"(blake3|sha256):[0-9a-f]{64}")  # a tensor's, as reshard.engine.move.digest.digest_of spells it


@dataclass(frozen=True)
class TensorRecord:
    """What the manifest needs of a tensor that an earlier run hashed."""

    digest: str
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

    def __init__(self, staging: Path, handle: Any, fingerprint: str = "") -> None:
        self.staging = staging
        self._handle = handle
        self._lock = threading.Lock()
        self._fingerprint = fingerprint

    @classmethod
    def start(cls, staging: Path, fingerprint: str, *, rank: int = 0, facts: dict[str, Any] | None = None) -> Journal:
        """A new journal for worker ``rank`` (one process is rank 0); an older one of that rank is replaced.
        ``facts``: what ``fingerprint`` is the hash of, kept so that another run can name what differs."""
        journal = cls(staging, (staging / JOURNAL.format(rank=rank)).open("w", encoding="utf-8"), fingerprint)
        journal._write({"fingerprint": fingerprint} | ({"facts": facts} if facts is not None else {}))
        return journal

    @classmethod
    def resume(
        cls,
        staging: Path,
        fingerprint: str,
        *,
        facts: dict[str, Any] | None = None,
        describe: Callable[[Any], str | None] | None = None,
    ) -> tuple[Journal, Resumed]:
        """What every worker's journal in ``staging`` calls complete and still checks out, and the journal of rank
        0 to append to, holding all of it (a staged folder without journals starts afresh). With several workers
        rank 0 calls this and hands the :class:`Resumed` on; the others :meth:`start` their own journals after.

        Args:
            staging: the staged folder.
            fingerprint: this conversion's.
            facts: what ``fingerprint`` is the hash of (written into the new journal's first line).
            describe: given the facts an earlier journal recorded, what differs from this conversion's.

        Raises:
            ReshardError: a journal is of another conversion (names what differs when its facts are there).
        """
        journals = [_read_lines(path, fingerprint) for path in sorted(staging.glob(JOURNAL.format(rank="*")))]
        journals = [lines for lines in journals if lines]
        other = next((lines[0] for lines in journals if lines[0]["fingerprint"] != fingerprint), None)
        if other is not None:
            difference = describe(other.get("facts")) if describe is not None else None
            raise ReshardError(
                "the partial output of an interrupted run is of another conversion ("
                + (difference or "other source files, target or options")
                + ")",
                path=staging,
                hint="run the command that made it, or remove that folder to start again",
            )
        resumed = Resumed()
        claimed: dict[str, tuple[int, str]] = {}
        for line in (line for lines in journals for line in lines[1:]):
            if "tensor" in line:
                resumed.tensors[line["tensor"]] = TensorRecord(line["digest"], line["finite"], line["divergent"])
            else:
                claimed[line["file"]] = (line["size"], line["sha256"])
        kept = {name: facts for name, facts in claimed.items() if _digest(staging / name, facts[0]) == facts[1]}
        resumed.files = frozenset(kept)
        resumed.redone = sorted(set(claimed) - set(kept))
        journal = cls.start(staging, fingerprint, facts=facts)  # written again: no torn line stays inside
        for name, (size, sha256) in sorted(kept.items()):
            journal._append({"file": name, "size": size, "sha256": sha256})
        for name, record in resumed.tensors.items():
            journal._append({"tensor": name, **record.__dict__})
        return journal, resumed

    def tensor_done(self, name: str, digest: str, finite: bool | None, divergent: bool) -> None:
        self._append({"tensor": name, "digest": digest, "finite": finite, "divergent": divergent})

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
        self._write(line | {"check": line_check(self._fingerprint, line)})

    def _write(self, line: dict[str, Any]) -> None:
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


def line_check(fingerprint: str, line: dict[str, Any]) -> str:
    """The ``check`` of a journal line: sha256 of the conversion's fingerprint and the line's other fields."""
    content = {key: value for key, value in line.items() if key != "check"}
    return hashlib.sha256((fingerprint + json.dumps(content, sort_keys=True)).encode()).hexdigest()


def _read_lines(path: Path, fingerprint: str) -> list[dict[str, Any]]:
    """The journal's first line and every later line that checks out (:func:`_well_formed`); a line torn by a
    kill, a damaged line and a line whose ``check`` does not match are dropped (their work is done again)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    lines: list[dict[str, Any]] = []
    for raw in text.split("\n")[:-1]:  # the part after the last newline was cut short
        try:
            line = json.loads(raw)
        except (ValueError, RecursionError):  # JSONDecodeError, and integers past the digit limit
            line = None
        if not lines:
            if not _well_formed(line, first=True):
                return []  # no fingerprint: nothing in this journal can be tied to a conversion
            lines.append(line)
        elif _well_formed(line, first=False) and line["check"] == line_check(fingerprint, line):
            lines.append(line)
    return lines


def _well_formed(line: Any, *, first: bool) -> bool:
    """A line as :class:`Journal` writes them, every field of its type and format (the folder is reshard's, but a
    damaged line must not crash)."""
    if not isinstance(line, dict):
        return False
    if first:
        return isinstance(line.get("fingerprint"), str) and isinstance(line.get("facts", {}), dict | None)
    if not isinstance(line.get("check"), str):
        return False
    if "tensor" in line:  # a line of a version that recorded sha256 has no digest: its tensor is hashed again
        return (
            set(line) == {"tensor", "digest", "finite", "divergent", "check"}
            and isinstance(line["tensor"], str)
            and isinstance(line["digest"], str)
            and DIGEST.fullmatch(line["digest"]) is not None
            and (line["finite"] is None or isinstance(line["finite"], bool))
            and isinstance(line["divergent"], bool)
        )
    return (
        set(line) == {"file", "size", "sha256", "check"}
        and _is_sha256(line["sha256"])
        and isinstance(line["file"], str)
        and bool(line["file"])
        and ".." not in Path(line["file"]).parts
        and not Path(line["file"]).is_absolute()
        and isinstance(line["size"], int)
        and not isinstance(line["size"], bool)
        and line["size"] >= 0
    )


def _is_sha256(value: Any) -> bool:
    return isinstance(value, str) and SHA256.fullmatch(value) is not None
