"""reshard's on-disk cache of answers that are dear to compute and the same every time for the same inputs (the model
transformers builds for a config: ``plans/skeleton.py``), as small JSON entries named by a key the caller makes.

Where: ``RESHARD_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/reshard``, else ``~/.cache/reshard``;
``RESHARD_CACHE_DIR=`` (set and empty) turns the cache off. A cache is never needed: a folder that cannot be made or
written (a read-only or missing home), an entry that cannot be read, is too large, is not a regular file of this
user's, is not JSON or was written for another key is a miss, silently, and a new answer is written over it. The
value an entry holds is the caller's to check, field by field, before it trusts it.

Writes are atomic (a temporary file in the same folder, then ``os.replace``), so a reader sees a whole entry or
none, whatever runs beside it; an entry is at most :data:`MAX_ENTRY_BYTES`, and a write that finds more than
:data:`MAX_ENTRIES` entries or :data:`MAX_TOTAL_BYTES` in its folder removes the oldest.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
import time
from pathlib import Path

ENV = "RESHARD_CACHE_DIR"
FORMAT = 1  # the envelope's version: an entry of another is a miss
MAX_ENTRY_BYTES = 4 << 20  # the largest model of transformers 5 (fused experts) gives ~0.2 MB
MAX_ENTRIES = 512
MAX_TOTAL_BYTES = 64 << 20
_TEMP_PREFIX = ".tmp-"
# an entry is read only as a regular file of this user's: no link followed, no FIFO waited on (where POSIX has them)
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_USER = os.geteuid() if hasattr(os, "geteuid") else 0  # Windows: st_uid is always 0


def cache_dir() -> Path | None:
    """The cache's folder (not created), or None when the cache is off or there is no home to put it in."""
    chosen = os.environ.get(ENV)
    if chosen is not None:
        return Path(chosen).expanduser() if chosen else None
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):  # the XDG spec: a relative path is to be ignored
        return Path(xdg) / "reshard"
    try:
        return Path.home() / ".cache" / "reshard"
    except (RuntimeError, KeyError, OSError):  # no home directory to be found
        return None


def load(kind: str, key: str) -> object | None:
    """The value stored under ``kind``/``key``, as JSON gave it (unchecked: the caller checks it), or None."""
    folder = cache_dir()
    if folder is None:
        return None
    try:
        fd = os.open(folder / kind / f"{key}.json", _READ_FLAGS)
    except (OSError, ValueError):
        return None
    try:
        with open(fd, "rb") as file:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != _USER or info.st_size > MAX_ENTRY_BYTES:
                return None
            entry = json.loads(file.read(MAX_ENTRY_BYTES + 1))
    except (OSError, ValueError, RecursionError):  # unreadable, not UTF-8, not JSON, nested past the parser
        return None
    if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("key") != key:
        return None
    return entry.get("value")


def save(kind: str, key: str, value: object) -> None:
    """Store ``value`` (made of JSON's types) under ``kind``/``key``; any failure leaves the cache as it was."""
    folder = cache_dir()
    if folder is None:
        return
    try:
        data = json.dumps({"format": FORMAT, "key": key, "value": value}, separators=(",", ":")).encode()
    except (TypeError, ValueError, RecursionError):
        return
    if len(data) > MAX_ENTRY_BYTES:
        return
    with contextlib.suppress(OSError, ValueError):
        where = folder / kind
        where.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(prefix=_TEMP_PREFIX, suffix=".json", dir=where)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            os.replace(temp, where / f"{key}.json")
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
        _prune(where)


def _prune(where: Path) -> None:
    """Remove the oldest entries past :data:`MAX_ENTRIES` or :data:`MAX_TOTAL_BYTES` (and temporary files a killed
    write left an hour ago)."""
    entries = []
    with os.scandir(where) as listing:
        for item in listing:
            with contextlib.suppress(OSError):
                info = item.stat(follow_symlinks=False)
                entries.append((info.st_mtime_ns, info.st_size, item.name))
    now = time.time_ns()
    entries.sort(reverse=True)
    kept = total = 0
    for mtime, size, name in entries:
        stale_temp = name.startswith(_TEMP_PREFIX) and now - mtime > 3600 * 10**9
        if name.startswith(_TEMP_PREFIX) and not stale_temp:
            continue
        kept, total = kept + 1, total + size
        if stale_temp or kept > MAX_ENTRIES or total > MAX_TOTAL_BYTES:
            with contextlib.suppress(OSError):
                os.unlink(where / name)
