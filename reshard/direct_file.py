"""An output file written with ``O_DIRECT`` wherever whole blocks allow, and through the page cache elsewhere.

Why: copying bytes into the page cache is the dearest part of writing a checkpoint. On the 2-core
bench VM, buffered writes of 2 GB cost 1.6-2.2 s of system time (plus 0.7 s of ``sync``), and
``O_DIRECT`` writes of the same bytes 0.25 s at 1.65 GB/s: the disk's speed, with the cores left for
reading and hashing. Nothing reads a converted checkpoint back soon, so caching it is wasted memory too.

``O_DIRECT`` needs the file offset, the length and the memory address aligned to the device's block.
The bytes of a range are therefore copied into aligned staging buffers (reused) and written from
there, several blocks at once by a small pool of threads. The range's first and last partial blocks,
which it may share with the ranges of other threads, go through the page cache on an ordinary
descriptor; every block is written one way only, so the two paths never touch the same page. Where
the file system refuses ``O_DIRECT`` (tmpfs before Linux 6.6, some network and FUSE file systems),
everything goes through the page cache.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from reshard._io import pwrite_all

logger = logging.getLogger(__name__)

# Offsets, lengths and addresses of direct writes are multiples of this: the largest logical block
# size of common devices, and the page size (so staging buffers from mmap are aligned already).
ALIGN = 4096
# Bytes per direct write: large enough for the disk's full speed (8 MB writes reached 1.65 GB/s on
# the bench VM), small enough that the staging buffers in flight (IO_DEPTH per writing thread) cost
# little next to a tensor.
STAGING_BYTES = 8 << 20
# Direct writes in flight per call, and the threads that wait for them (shared by all files and callers).
# One write at a time leaves the disk idle between writes: copying 4 GB from 8 rank files into one
# file took 6.6-7.3 s with 2 writing threads and 5.0-5.9 s with 8 on the bench VM.
IO_DEPTH = 4
WRITER_THREADS = 8
_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_free: list[memoryview] = []


class DirectFile:
    """A new file of known ``size``, filled by :meth:`write` of disjoint ranges, from several threads at once.

    ``direct=False`` (or a file system that refuses ``O_DIRECT``) writes everything through the page cache.
    """

    def __init__(self, path: Path, size: int, *, direct: bool = True) -> None:
        self.path = path
        self.direct_bytes = 0
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            # Writes inside the file's size never extend it, so they do not serialise on the inode lock.
            os.ftruncate(self._fd, size)
        except OSError:
            os.close(self._fd)
            raise
        self._direct_fd = _open_direct(path) if direct else None
        # Cleared when a direct write is refused; the descriptor stays open (another thread may be using it).
        self._direct = self._direct_fd is not None
        self._count_lock = threading.Lock()

    def write(self, views: Sequence[memoryview], position: int) -> None:
        """Write the buffers (1-d byte views), in order, from ``position`` on."""
        end = position + sum(len(view) for view in views)
        first = min(-(-position // ALIGN) * ALIGN, end)
        last = max(end // ALIGN * ALIGN, first)
        if not self._direct or last == first:
            pwrite_all(self._fd, views, position)
            return
        pieces = _Pieces(views)
        pwrite_all(self._fd, pieces.take(first - position), position)
        self._write_blocks(pieces, first, last)
        pwrite_all(self._fd, pieces.take(end - last), last)

    def _write_blocks(self, pieces: _Pieces, start: int, stop: int) -> None:
        """Write ``[start, stop)`` (both aligned) in staging-buffer blocks, up to :data:`IO_DEPTH` of them
        in flight at once: one synchronous direct write at a time leaves the disk idle in between."""
        in_flight: deque[tuple[Future[None], memoryview]] = deque()
        try:
            for position in range(start, stop, STAGING_BYTES):
                if len(in_flight) >= IO_DEPTH and (error := _finish(*in_flight.popleft())):
                    raise error
                size = min(STAGING_BYTES, stop - position)
                staging = _take_staging()
                filled = 0
                for piece in pieces.take(size):
                    staging[filled : filled + len(piece)] = piece
                    filled += len(piece)
                in_flight.append((_writers().submit(self._write_block, staging[:size], position), staging))
        finally:
            errors = [error for error in (_finish(*entry) for entry in in_flight) if error]
        if errors:
            raise errors[0]

    def _write_block(self, view: memoryview, position: int) -> None:
        """One aligned block: with ``O_DIRECT`` while the file system takes it, then through the page cache."""
        written = 0
        while written < len(view):
            count = self._pwrite_direct(view[written:], position + written) if self._direct else None
            if count is None:
                pwrite_all(self._fd, [view[written:]], position + written)
                break
            written += count
        with self._count_lock:
            self.direct_bytes += written

    def _pwrite_direct(self, view: memoryview, position: int) -> int | None:
        """One direct write; None (and no more direct writes to this file) if it was refused."""
        try:
            count = os.pwrite(self._direct_fd, view, position)
        except OSError as err:
            if err.errno not in _REFUSED:
                raise
            why = err.strerror
        else:
            if count > 0 and count % ALIGN == 0:
                return count
            why = f"wrote {count} of {len(view)} bytes"
        if self._direct:
            logger.info("%s: O_DIRECT refused (%s); writing through the page cache", self.path.name, why)
        self._direct = False
        return None

    def close(self) -> None:
        for fd in (self._fd, self._direct_fd):
            if fd is not None:
                os.close(fd)
        self._fd = self._direct_fd = None


def _open_direct(path: Path) -> int | None:
    """A second descriptor of ``path`` opened with ``O_DIRECT``; None where the platform or file system
    has none."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError as err:
        if err.errno not in _REFUSED:
            raise
        logger.info("%s: no O_DIRECT here (%s); writing through the page cache", path.name, err.strerror)
        return None


def _writers() -> ThreadPoolExecutor:
    """The threads that wait for direct writes, shared by every file (created on first use)."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=WRITER_THREADS, thread_name_prefix="reshard-direct")
        return _pool


def _take_staging() -> memoryview:
    """An aligned staging buffer (anonymous mappings start on a page boundary), reused once given back."""
    with _lock:
        while _free:
            staging = _free.pop()
            if len(staging) >= STAGING_BYTES:
                return staging
    return memoryview(mmap.mmap(-1, STAGING_BYTES))


def _finish(future: Future[None], staging: memoryview) -> BaseException | None:
    """Wait for one block's write and give its staging buffer back; returns the error it met, if any."""
    error = future.exception()
    with _lock:
        _free.append(staging)
    return error


class _Pieces:
    """A list of byte views consumed from the front, a given number of bytes at a time."""

    def __init__(self, views: Sequence[memoryview]) -> None:
        self._views = [view for view in views if len(view)]
        self._index = 0
        self._offset = 0

    def take(self, nbytes: int) -> list[memoryview]:
        return list(self._iter_take(nbytes))

    def _iter_take(self, nbytes: int) -> Iterator[memoryview]:
        while nbytes > 0:
            view = self._views[self._index]
            piece = view[self._offset : self._offset + nbytes]
            nbytes -= len(piece)
            self._offset += len(piece)
            if self._offset == len(view):
                self._index, self._offset = self._index + 1, 0
            yield piece
