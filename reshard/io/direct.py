"""Tensor bytes between files and memory with ``O_DIRECT``, many blocks in flight at once.

Why: on a VM the page cache is the dearest part of moving a checkpoint, and the disk reaches its speed only
with several requests in flight (docs/performance.md has the measurements). Nothing reads a source slice
twice or a converted checkpoint back soon, so caching either is wasted memory too.

``O_DIRECT`` needs the file offset, the length and the memory address aligned to the device's block,
and tensors sit anywhere in a file and in a gathered buffer. So bytes go through aligned staging
buffers, one block of :data:`STAGING_BYTES` per request, each request carried out by one of a small
pool of threads shared by every file, each thread with its own staging buffer (so the staging memory
is :data:`IO_THREADS` blocks, and the copies in and out of it run on those threads, in parallel). A
read takes the aligned blocks that cover its range and copies the wanted bytes out; a write copies
into staging and writes whole blocks, and the first and last partial blocks of its range, which it
may share with ranges written by other threads, go through the page cache on an ordinary descriptor
(every block is written one way only, so the two paths never touch the same page).

Memory on the same 4 KB phase as its file range skips staging: the whole blocks inside the range are read
into it or written from it directly (:func:`in_phase`). Gather buffers are allocated on the phase of the
slices read into them (:func:`reshard.engine.move.gather.read_phase`), and the thread's scratch copies of
column blocks on the phase of the file range they come from or go to, so that every read and the column
blocks' writes skip the staging copy.

A direct read goes to the device even for bytes the page cache holds, so each block first asks the kernel which of its
pages the cache holds (``mincore``, :func:`cached_prefix`) and reads those from there (``preadv`` with
``RWF_NOWAIT``); what it holds (a checkpoint just downloaded or written) comes from memory, the rest directly. The
question comes first because ``RWF_NOWAIT`` alone is no probe: on a page the cache lacks it returns ``EAGAIN`` but
starts the read-ahead of the whole range, so a cold checkpoint was read twice from the disk, once into the page cache.

Callers group the requests of one tensor in a :class:`Batch`: every read and write started inside
``with Batch():`` runs at once, and leaving the block waits for all of them. A call outside a batch
waits for its own blocks. Where the file system refuses ``O_DIRECT`` (tmpfs before Linux 6.6, some
network and FUSE file systems), and on tmpfs and ramfs (:func:`in_memory`), everything goes through the page
cache, synchronously, straight between the caller's memory and the file.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import mmap
import os
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

from reshard.errors import CorruptFileError
from reshard.io.memory import HUGE_PAGE, huge_bytes
from reshard.io.vectored import pwrite_all, read_all

logger = logging.getLogger(__name__)

# Offsets, lengths and addresses of direct requests are multiples of this: the largest logical block
# size of common devices, and the page size (so staging buffers from mmap are aligned already).
ALIGN = 4096
# Bytes per request: large enough for the disk's full speed, small enough that the buffers in flight cost
# little next to a tensor.
STAGING_BYTES = 8 << 20
# Threads that carry out requests, shared by every file and caller; each holds one staging buffer.
IO_THREADS = 8
_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)
# preadv's flag for a read from the page cache only (Linux 4.14+; None elsewhere).
_NOWAIT = getattr(os, "RWF_NOWAIT", None)
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_batches = threading.local()
_io_thread = threading.local()


class Batch:
    """The direct requests started by this thread inside ``with Batch():``; leaving waits for them all.

    Leaving raises the first error a request met (unless the block is already raising). Batches nest:
    an inner one waits for its own requests only.
    """

    def __init__(self) -> None:
        self._futures: list[Future[None]] = []

    def __enter__(self) -> Batch:
        _stack().append(self)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        _stack().pop()
        failure = self.wait()
        if failure is not None and kind is None:
            raise failure

    def start(self, request: Callable[[], None]) -> None:
        """Run ``request()`` on the I/O threads."""
        self._futures.append(_threads().submit(request))

    def wait(self) -> BaseException | None:
        """Wait for every request started so far; the first error one met, if any."""
        futures, self._futures = self._futures, []
        errors = [future.exception() for future in futures]
        return next((error for error in errors if error is not None), None)


def _stack() -> list[Batch]:
    if not hasattr(_batches, "stack"):
        _batches.stack = []
    return _batches.stack


@contextlib.contextmanager
def _current_batch() -> Iterator[Batch]:
    """This thread's innermost batch; outside any, a batch of the caller's own, waited for on leaving."""
    stack = _stack()
    if stack:
        yield stack[-1]
        return
    with Batch() as own:
        yield own


class DirectSource:
    """An input file read into caller buffers: with ``O_DIRECT`` in blocks where the file system allows,
    else with ``preadv`` through the page cache."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        self._direct_fd = _open_direct(path, os.O_RDONLY)
        # Cleared when a direct read is refused; the descriptor stays open (another thread may be using it).
        self.direct = self._direct_fd is not None
        self._closer = weakref.finalize(self, _close_all, self._fd, self._direct_fd)
        if not self.direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger read-ahead window

    def read(self, views: Sequence[memoryview], position: int, *, error: Callable[[str], Exception]) -> None:
        """Fill the buffers (1-d byte views), in order, from the file's bytes at ``position`` on.

        Inside a :class:`Batch` the blocks may still be arriving when this returns. A failure (an I/O
        error, the file ending early) is raised as ``error(why)``, from here or when the batch is left.
        """
        views = [view for view in views if len(view)]
        if not self.direct:
            self._read_buffered(views, position, error)
            return
        with _current_batch() as batch:
            if len(views) == 1 and in_phase(views[0], position):
                self._read_in_place(views[0], position, batch, error)
            else:
                self._read_staged(views, position, batch, error)

    def _read_staged(
        self, views: list[memoryview], position: int, batch: Batch, error: Callable[[str], Exception]
    ) -> None:
        """Every block read into staging and copied out."""
        end = position + sum(len(view) for view in views)
        destinations = _Cursor(views)
        for block in range(position // ALIGN * ALIGN, end, STAGING_BYTES):
            block_end = min(block + STAGING_BYTES, -(-end // ALIGN) * ALIGN)
            first, last = max(block, position), min(block_end, end)
            block_views = destinations.take(last - first)
            batch.start(functools.partial(self._fill, block, block_end - block, first - block, block_views, error))

    def _read_in_place(self, view: memoryview, position: int, batch: Batch, error: Callable[[str], Exception]) -> None:
        """The whole aligned blocks inside the range read straight into ``view`` (its memory is on the same 4 KB
        phase as the file); only the partial blocks at either end go through staging, where the aligned block
        reaches past ``view``. Saves the copy out of staging, a large share of a conversion's CPU time."""
        end = position + len(view)
        inner, inner_end = -(-position // ALIGN) * ALIGN, end // ALIGN * ALIGN
        if inner_end <= inner:
            self._read_staged([view], position, batch, error)
            return
        if position < inner:
            self._read_staged([view[: inner - position]], position, batch, error)
        for block in range(inner, inner_end, STAGING_BYTES):
            size = min(STAGING_BYTES, inner_end - block)
            batch.start(
                functools.partial(self._read_into, view[block - position : block - position + size], block, error)
            )
        if inner_end < end:
            self._read_staged([view[inner_end - position :]], inner_end, batch, error)

    def _read_buffered(self, views: list[memoryview], position: int, error: Callable[[str], Exception]) -> None:
        try:
            complete = read_all(self._fd, views, position)
        except OSError as err:
            raise error(str(err)) from err
        if not complete:
            raise error("file ends before the tensor's bytes")

    def _fill(
        self, position: int, size: int, offset: int, views: list[memoryview], error: Callable[[str], Exception]
    ) -> None:
        """One request: read the aligned block ``[position, position + size)``, copy its bytes from
        ``offset`` on into ``views``."""
        staging = _staging(size)
        self._read_into(staging, position, error, needed=offset + sum(len(view) for view in views))
        for view in views:
            copy_bytes(view, staging[offset : offset + len(view)])
            offset += len(view)

    def _read_into(
        self, view: memoryview, position: int, error: Callable[[str], Exception], *, needed: int | None = None
    ) -> None:
        """One request: read the aligned block at ``position`` straight into ``view`` (aligned too); raise
        ``error`` unless the first ``needed`` bytes (all of them by default) were there to read."""
        try:
            count = self.read_block(view, position)
        except OSError as err:
            raise error(str(err)) from err
        if count < (len(view) if needed is None else needed):
            raise error("file ends before the tensor's bytes")

    def read_block(self, staging: memoryview, position: int) -> int:
        """Read up to ``len(staging)`` bytes at ``position`` (aligned); the count read (short at the file's end)."""
        count = self._read_cached(staging, position) if self.direct else 0
        while count < len(staging):
            got = self._pread_direct(staging[count:], position + count) if self.direct else None
            direct = got is not None
            if got is None:
                got = os.preadv(self._fd, [staging[count:]], position + count)
            if got == 0:
                break
            count += got
            if direct and count % ALIGN:  # a direct read stops off the block grid only at the file's end
                break
        return count

    def _read_cached(self, view: memoryview, position: int) -> int:
        """The whole blocks at the start of the range that the page cache holds, read from there; the count read, 0
        when the first block is not cached (or the platform cannot tell). A direct read goes to the disk even for
        cached bytes: a checkpoint just downloaded or written is read again from memory, not from the device
        (measured: docs/performance.md). Only the pages :func:`cached_prefix` finds are asked for, with
        ``RWF_NOWAIT`` (no waiting for the disk should one be dropped meanwhile): a page the cache lacks would
        start its read-ahead. The count is rounded down to the block grid, where the direct read of the rest must
        start (at the file's end, its last partial block is read again, directly)."""
        held = cached_prefix(self._fd, position, len(view)) if _NOWAIT is not None else 0
        if not held or _NOWAIT is None:
            return 0
        try:
            got = os.preadv(self._fd, [view[:held]], position, _NOWAIT)
        except OSError:  # EAGAIN: dropped since; EOPNOTSUPP: no RWF_NOWAIT on this file system
            return 0
        return got // ALIGN * ALIGN

    def _pread_direct(self, view: memoryview, position: int) -> int | None:
        """One direct read; None (and no more direct reads of this file) if it was refused."""
        fd = self._direct_fd
        assert fd is not None  # only while self.direct: opened with O_DIRECT
        try:
            return os.preadv(fd, [view], position)
        except OSError as err:
            if err.errno not in _REFUSED:
                raise
            if self.direct:
                logger.info("%s: O_DIRECT read refused (%s); reading through the page cache", self.path.name, err)
            self.direct = False
            return None

    def advise(self, position: int, length: int, advice: str) -> None:
        """A ``posix_fadvise`` hint (``advice`` names it, e.g. ``"POSIX_FADV_WILLNEED"``) for the page
        cache, which only buffered reads use; nothing where the platform has no ``posix_fadvise``."""
        if not self.direct and hasattr(os, "posix_fadvise") and length:
            os.posix_fadvise(self._fd, position, length, getattr(os, advice))

    def close(self) -> None:
        """Close the descriptors now (else they close when this object is collected)."""
        self._closer()
        self._fd = self._direct_fd = None  # type: ignore[assignment]  # closed: a late use fails loudly


class OpenSources:
    """Data files opened for reading on demand by a lazy reader, the least recently used closed past ``limit``
    (reads in flight keep theirs: a :class:`DirectSource` closes when collected); safe across threads."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._files: OrderedDict[Path, DirectSource] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, path: Path) -> DirectSource:
        """``path`` open for reading.

        Raises:
            CorruptFileError: the file cannot be opened.
        """
        with self._lock:
            source = self._files.pop(path, None)
            if source is None:
                try:
                    source = DirectSource(path)
                except OSError as err:
                    raise CorruptFileError(f"cannot open: {err.strerror}", path=path) from err
            self._files[path] = source
            while len(self._files) > self._limit:
                self._files.popitem(last=False)
            return source


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
        self._direct_fd = _open_direct(path, os.O_WRONLY) if direct else None
        # Cleared when a direct write is refused; the descriptor stays open (another thread may be using it).
        self._direct = self._direct_fd is not None
        # Closes the descriptors if the file is dropped unclosed (a conversion that failed midway).
        self._closer = weakref.finalize(self, _close_all, self._fd, self._direct_fd)
        self._in_flight = 0
        self._settled = threading.Condition()
        self._buffered = threading.Lock()

    def write(self, views: Sequence[memoryview], position: int) -> None:
        """Write the buffers (1-d byte views), in order, from ``position`` on.

        Inside a :class:`Batch` the whole blocks may still be on their way when this returns.
        """
        end = position + sum(len(view) for view in views)
        first = min(-(-position // ALIGN) * ALIGN, end)
        last = max(end // ALIGN * ALIGN, first)
        if not self._direct or last == first:
            self._write_buffered(views, position)
            return
        pieces = _Cursor(views)
        self._write_buffered(pieces.take(first - position), position)
        with _current_batch() as batch:
            for block in range(first, last, STAGING_BYTES):
                block_views = pieces.take(min(STAGING_BYTES, last - block))
                self._settle(+1)
                try:
                    batch.start(functools.partial(self._write_block, block_views, block))
                except BaseException:
                    self._settle(-1)
                    raise
        self._write_buffered(pieces.take(end - last), last)

    def _write_buffered(self, views: Sequence[memoryview], position: int) -> None:
        """Write through the page cache, one thread at a time: the kernel holds the file's inode lock for a buffered
        write anyway, and a thread waiting for it there spins on a core (``rwsem_spin_on_owner``; measured:
        docs/performance.md); here it sleeps."""
        if views:
            with self._buffered:
                pwrite_all(self._fd, views, position)

    def _write_block(self, views: list[memoryview], position: int) -> None:
        """One request: copy ``views`` into staging and write them as one aligned block at ``position``, with
        ``O_DIRECT`` while the file system takes it, then through the page cache."""
        try:
            if len(views) == 1 and in_phase(views[0], position):
                view = views[0]  # straight from the caller's memory
            else:
                view = _staging(sum(len(piece) for piece in views))
                filled = 0
                for piece in views:
                    copy_bytes(view[filled : filled + len(piece)], piece)
                    filled += len(piece)
            written = 0
            while written < len(view):
                count = self._pwrite_direct(view[written:], position + written) if self._direct else None
                if count is None:
                    self._write_buffered([view[written:]], position + written)
                    break
                written += count
            with self._settled:
                self.direct_bytes += written
        finally:
            self._settle(-1)

    def _settle(self, change: int) -> None:
        """Count a block started (+1) or landed (-1), for :meth:`close`."""
        with self._settled:
            self._in_flight += change
            self._settled.notify_all()

    def _pwrite_direct(self, view: memoryview, position: int) -> int | None:
        """One direct write; None (and no more direct writes to this file) if it was refused."""
        fd = self._direct_fd
        assert fd is not None  # only while self._direct: opened with O_DIRECT
        try:
            count = os.pwrite(fd, view, position)
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
        """Close the file once the blocks still on their way to it have landed."""
        with self._settled:
            self._settled.wait_for(lambda: self._in_flight == 0)
        self._closer()
        self._fd = self._direct_fd = None  # type: ignore[assignment]  # closed: a late use fails loudly


def copy_bytes(destination: memoryview, source: memoryview) -> None:
    """``destination[:] = source`` for byte views of one length, letting other threads run meanwhile
    (``ctypes.memmove`` releases the GIL; slice assignment holds it for the whole copy)."""
    target, origin = _address(destination), _address(source)
    if target is None or origin is None:
        destination[:] = source
        return
    ctypes.memmove(target, origin, len(source))


def in_phase(view: memoryview, position: int) -> bool:
    """Whether ``view``'s memory and file offset ``position`` are on the same :data:`ALIGN` phase, so the whole
    blocks of a range read there can go straight into it (False for a read-only or empty view)."""
    address = _address(view)
    return address is not None and (address - position) % ALIGN == 0


def _address(view: memoryview) -> int | None:
    """Where a view's first byte is in memory; None for a read-only or empty view (ctypes takes neither)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):
        return None


def cached_prefix(fd: int, position: int, length: int) -> int:
    """How many of the ``length`` bytes from ``position`` on the page cache holds without a gap from the start, in
    whole pages (the file's end cuts the last one); 0 where the platform cannot tell. Asked with ``mincore`` of a
    private mapping of the range, which reads nothing in and starts no read-ahead."""
    if _LIBC is None:
        return 0
    size = min(length, os.fstat(fd).st_size - position)
    if size <= 0:
        return 0
    skip = position % mmap.ALLOCATIONGRANULARITY  # a mapping starts on that grid
    mapping = mmap.mmap(fd, skip + size, access=mmap.ACCESS_COPY, offset=position - skip)
    pages = (ctypes.c_ubyte * (-(-(skip + size) // mmap.PAGESIZE)))()
    try:
        start = ctypes.c_char.from_buffer(mapping)
        try:
            failed = _LIBC.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(skip + size), pages)
        finally:
            del start
    finally:
        mapping.close()
    if failed:
        return 0
    first = skip // mmap.PAGESIZE
    missing = bytes(pages).translate(_RESIDENT).find(0, first)  # mincore's low bit: the page is resident
    held = (len(pages) if missing < 0 else missing) * mmap.PAGESIZE - skip
    return max(0, min(held, size))


# A mincore byte -> 1 when its page is resident (the low bit; the others are reserved).
_RESIDENT = bytes(value & 1 for value in range(256))


def _close_all(*fds: int | None) -> None:
    for fd in fds:
        if fd is not None:
            os.close(fd)


def _open_direct(path: Path, flags: int) -> int | None:
    """A second descriptor of ``path`` opened with ``O_DIRECT``; None where the platform or file system
    has none, or where the file lives in memory (:func:`in_memory`)."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None or in_memory(path):
        return None
    try:
        return os.open(path, flags | flag)
    except OSError as err:
        if err.errno not in _REFUSED:
            raise
        logger.info("%s: no O_DIRECT here (%s); going through the page cache", path.name, err.strerror)
        return None


def in_memory(path: Path) -> bool:
    """Whether ``path`` is on tmpfs or ramfs, whose files are their page cache.

    Since Linux 6.6 tmpfs takes ``O_DIRECT`` but carries it out as a buffered copy, so the direct path only
    adds its costs: every write whose memory is off the file range's 4 KB phase is copied into staging first,
    and every 8 MB block is a task for an I/O thread (measured: docs/performance.md).
    """
    if _LIBC is None:
        return False
    buffer = ctypes.create_string_buffer(256)  # struct statfs: f_type, a long, comes first
    if _LIBC.statfs(os.fsencode(path), buffer) != 0:
        return False
    return ctypes.c_long.from_buffer(buffer).value in _IN_MEMORY


# statfs f_type of the file systems whose files live in memory: TMPFS_MAGIC, RAMFS_MAGIC.
_IN_MEMORY = (0x01021994, 0x858458F6)


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()


def _threads() -> ThreadPoolExecutor:
    """The threads that carry out requests, shared by every file (created on first use)."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="reshard-direct")
        return _pool


def _staging(size: int) -> memoryview:
    """The first ``size`` bytes of this I/O thread's staging buffer (on a 2 MB boundary, so aligned; in 2 MB pages
    where the kernel has them, so that a request goes to the device whole: :mod:`reshard.io.memory`)."""
    buffer = getattr(_io_thread, "staging", None)
    if buffer is None or len(buffer) < size:
        # At least a huge page, so that the buffer is one of huge_bytes's mappings, aligned, whatever the block size.
        buffer = _io_thread.staging = huge_bytes(max(size, STAGING_BYTES, HUGE_PAGE)).data
    return buffer[:size]


class _Cursor:
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
