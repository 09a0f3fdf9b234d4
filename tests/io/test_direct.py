"""``reshard.io.direct``: ranges written from several threads with O_DIRECT (whole blocks) and the page
cache (the edges) make exactly the file their bytes say; ranges read in blocks land exactly where their
views say; a file system that refuses O_DIRECT still works; errors on the I/O threads reach the caller."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from reshard.io import direct as direct_io
from reshard.io.direct import ALIGN, Batch, DirectFile, DirectSource, in_memory


def ranges_of(size: int, seed: int) -> list[tuple[int, int]]:
    """Cut ``[0, size)`` into ranges of every kind: inside one block, across a block edge, many blocks
    long, starting and ending off the block grid."""
    rng = random.Random(seed)
    cuts, position = [], 0
    lengths = [1, 7, ALIGN - 1, ALIGN, ALIGN + 1, 3 * ALIGN, 5 * ALIGN + 123, 40 * ALIGN + 5, 2]
    while position < size:
        length = min(rng.choice(lengths), size - position)
        cuts.append((position, position + length))
        position += length
    return cuts


def write_in_threads(file: DirectFile, data: bytes, cuts: list[tuple[int, int]], seed: int) -> None:
    order = list(cuts)
    random.Random(seed).shuffle(order)

    def write(cut: tuple[int, int]) -> None:
        start, stop = cut
        middle = (start + stop) // 2  # two views per range: the writer must stitch them
        file.write([memoryview(data)[start:middle], memoryview(data)[middle:stop]], start)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(write, order))
    file.close()


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "page-cache"])
@pytest.mark.parametrize("seed", [0, 1])
def test_ranges_from_threads_make_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool, seed: int
) -> None:
    monkeypatch.setattr(direct_io, "STAGING_BYTES", 2 * ALIGN)  # long ranges take several direct writes
    size = 300 * ALIGN + 77
    data = random.Random(seed).randbytes(size)
    file = DirectFile(tmp_path / "out.bin", size, direct=direct)
    supported = file._direct
    write_in_threads(file, data, ranges_of(size, seed), seed)
    assert (tmp_path / "out.bin").read_bytes() == data
    if direct and supported:
        assert 0 < file.direct_bytes < size and file.direct_bytes % ALIGN == 0
    else:
        assert file.direct_bytes == 0


@pytest.fixture
def no_o_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system that refuses to open files with O_DIRECT (tmpfs before Linux 6.6, some FUSE)."""
    real_open = os.open

    def refuse_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct_io.os, "open", refuse_direct)


def fail_direct_calls(
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    fd: int,
    *,
    after: int,
    short_at: int | None = None,
    error: tuple[int, str] = (errno.EINVAL, "Invalid argument"),
) -> list[int]:
    """Make ``os.<name>`` (pwrite or preadv) on descriptor ``fd`` fail with ``error`` once it was called ``after``
    times, as a file system that accepts the O_DIRECT open and then refuses the I/O does; the call numbered
    ``short_at`` moves only its first block (a short, aligned transfer). Returns the positions of the calls."""
    real, calls = getattr(os, name), []

    def failing(call_fd, data, position, *flags):
        if call_fd == fd:
            calls.append(position)
            if len(calls) == short_at:
                return real(call_fd, data[:ALIGN], position)
            if len(calls) > after:
                raise OSError(*error)
        return real(call_fd, data, position, *flags)

    monkeypatch.setattr(direct_io.os, name, failing)
    return calls


@pytest.mark.usefixtures("no_o_direct")
def test_a_file_system_without_o_direct_is_written_through_the_page_cache(tmp_path: Path) -> None:
    size = 50 * ALIGN + 3
    data = random.Random(2).randbytes(size)
    file = DirectFile(tmp_path / "out.bin", size)
    write_in_threads(file, data, ranges_of(size, 2), 2)
    assert (tmp_path / "out.bin").read_bytes() == data and file.direct_bytes == 0


def test_direct_writes_refused_midway_fall_back_without_losing_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system may accept the O_DIRECT open and refuse the writes (EINVAL), or write short."""
    monkeypatch.setattr(direct_io, "STAGING_BYTES", 4 * ALIGN)
    size = 64 * ALIGN + 9
    data = random.Random(3).randbytes(size)
    file = DirectFile(tmp_path / "out.bin", size)
    if not file._direct:
        pytest.skip("this file system has no O_DIRECT")
    fail_direct_calls(monkeypatch, "pwrite", file._direct_fd, after=3, short_at=2)  # the short write is resumed
    file.write([memoryview(data)[: size // 2]], 0)
    file.write([memoryview(data)[size // 2 :]], size // 2)
    file.close()
    assert (tmp_path / "out.bin").read_bytes() == data
    assert not file._direct and 0 < file.direct_bytes < size


def test_a_failed_block_write_is_raised_not_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks are written on other threads; a disk error there (here ENOSPC) must reach the caller."""
    monkeypatch.setattr(direct_io, "STAGING_BYTES", 2 * ALIGN)
    file = DirectFile(tmp_path / "out.bin", 64 * ALIGN)
    if not file._direct:
        pytest.skip("this file system has no O_DIRECT")
    fail_direct_calls(monkeypatch, "pwrite", file._direct_fd, after=0, error=(errno.ENOSPC, "No space left on device"))
    with pytest.raises(OSError, match="No space left"):
        file.write([memoryview(bytes(64 * ALIGN))], 0)
    file.close()


class Unreadable(Exception):
    """The error a reader asks for when a read fails (reshard's own readers pass CorruptFileError)."""


def read_ranges(source: DirectSource, size: int, seed: int, *, batched: bool) -> bytearray:
    """Read ``[0, size)`` back range by range, each range into two views of one output buffer, in a
    shuffled order from four threads; with ``batched``, each thread's reads are waited for together."""
    out = bytearray(size)
    cuts = ranges_of(size, seed)
    random.Random(seed).shuffle(cuts)

    def read(part: list[tuple[int, int]]) -> None:
        with Batch() if batched else contextlib.nullcontext():
            for start, stop in part:
                middle = (start + stop) // 2
                views = [memoryview(out)[start:middle], memoryview(out)[middle:stop]]
                source.read(views, start, error=Unreadable)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(read, [cuts[k::4] for k in range(4)]))
    return out


def random_source(path: Path, size: int, seed: int, *, needs_direct: bool = False) -> tuple[DirectSource, bytes]:
    """``size`` random bytes written to ``path`` (and dropped from the page cache, so they are read from the disk),
    and a :class:`DirectSource` on them; with ``needs_direct``, the test is skipped where the file system refuses
    ``O_DIRECT``."""
    data = random.Random(seed).randbytes(size)
    path.write_bytes(data)
    uncache(path, 0)
    source = DirectSource(path)
    if needs_direct and not source.direct:
        pytest.skip("this file system has no O_DIRECT")
    return source, data


def uncache(path: Path, start: int) -> None:
    """Drop the file's pages from ``start`` on from the page cache (written to the disk first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, start, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def direct_reads(source: DirectSource, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Record ``(position, length)`` of every direct read of ``source``."""
    reads: list[tuple[int, int]] = []
    real = source._pread_direct

    def reading(view: memoryview, position: int) -> int | None:
        reads.append((position, len(view)))
        return real(view, position)

    monkeypatch.setattr(source, "_pread_direct", reading)
    return reads


def cache_start(path: Path, length: int) -> None:
    """Put the file's first ``length`` bytes in the page cache, and no more (no read-ahead past them)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        done = 0
        while done < length:
            done += len(os.pread(fd, min(length - done, 1 << 16), done)) or length
    finally:
        os.close(fd)


def resident_pages(path: Path) -> list[bool]:
    """Which 4 KB pages of the file the page cache holds (``mincore`` of a private mapping: mapping faults nothing in).
    The kernel drops and reads whole folios, which may be larger than a page, so a test asks rather than assumes."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        mapping = mmap.mmap(file.fileno(), size, access=mmap.ACCESS_COPY)
    pages = (ctypes.c_ubyte * (-(-size // mmap.PAGESIZE)))()
    start = ctypes.c_char.from_buffer(mapping)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size), pages) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
    finally:
        del start
        mapping.close()
    return [bool(page & 1) for page in pages]


@pytest.mark.parametrize("cached", [40 * ALIGN + 5, 16 * ALIGN + 100], ids=["whole-file", "first-16-blocks"])
def test_bytes_the_page_cache_holds_are_read_from_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cached: int
) -> None:
    """A direct read goes to the device even for bytes the page cache holds (a checkpoint just downloaded or
    written): the whole blocks it holds are read from it, from the first one it lacks on the rest directly (and
    the file's short last block, read again directly)."""
    monkeypatch.setattr(direct_io, "STAGING_BYTES", 8 * ALIGN)
    size = 40 * ALIGN + 5
    source, data = random_source(tmp_path / "in.bin", size, 9, needs_direct=True)
    if direct_io._NOWAIT is None:
        pytest.skip("no RWF_NOWAIT on this platform")
    cache_start(tmp_path / "in.bin", cached)
    whole = size // ALIGN * ALIGN  # the short last block is always read directly
    held = resident_pages(tmp_path / "in.bin")
    first_direct = next((page * ALIGN for page, there in enumerate(held) if not there), whole)
    reads = direct_reads(source, monkeypatch)
    memory = mmap.mmap(-1, size + ALIGN)
    with Batch():
        source.read([memoryview(memory)[:size]], 0, error=Unreadable)
    assert memory[:size] == data
    assert source.direct
    assert reads and min(position for position, _ in reads) == min(first_direct, whole)
    source.close()


def test_a_read_of_bytes_the_page_cache_lacks_leaves_it_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Asking the page cache with ``RWF_NOWAIT`` alone started the read-ahead of every block it lacked: a cold
    checkpoint was read twice from the disk and filled the page cache (a 2.8 GB ZeRO checkpoint: 790 MB cached
    by one conversion). Only the pages ``mincore`` finds are asked for now."""
    monkeypatch.setattr(direct_io, "STAGING_BYTES", 16 * ALIGN)
    size = 200 * ALIGN + 5
    source, data = random_source(tmp_path / "in.bin", size, 6, needs_direct=True)
    if any(resident_pages(tmp_path / "in.bin")):
        pytest.skip("the page cache kept the file's pages")
    memory = mmap.mmap(-1, size + ALIGN)
    with Batch():
        source.read([memoryview(memory)[:size]], 0, error=Unreadable)
    assert memory[:size] == data
    assert not any(resident_pages(tmp_path / "in.bin"))
    source.close()


@pytest.mark.parametrize("cached", [0, 7 * ALIGN, 7 * ALIGN + 9, 300 * ALIGN])
def test_cached_prefix_is_what_mincore_says_from_the_start(tmp_path: Path, cached: int) -> None:
    """The bytes from a position on that the page cache holds without a gap, cut at the range and the file's end."""
    path = tmp_path / "in.bin"
    size = 40 * ALIGN + 5
    source, _ = random_source(path, size, 2, needs_direct=True)
    cache_start(path, min(cached, size))
    held = resident_pages(path)
    for position in (0, 3 * ALIGN):
        gaps = (page * ALIGN for page, there in enumerate(held) if not there and page * ALIGN >= position)
        expected = next(gaps, size)
        got = direct_io.cached_prefix(source._fd, position, 20 * ALIGN)
        assert got == max(0, min(expected - position, 20 * ALIGN, size - position))
    source.close()


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "one-by-one"])
@pytest.mark.parametrize("seed", [0, 1])
def test_ranges_read_in_blocks_land_where_their_views_say(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batched: bool, seed: int
) -> None:
    monkeypatch.setattr(direct_io, "STAGING_BYTES", 2 * ALIGN)  # long ranges take several blocks
    size = 300 * ALIGN + 77  # the file ends off the block grid: the last block reads short
    source, data = random_source(tmp_path / "in.bin", size, seed)
    direct = source.direct
    assert read_ranges(source, size, seed, batched=batched) == data
    assert source.direct == direct  # reading the file's short last block does not count as a refusal
    source.close()


@pytest.mark.usefixtures("no_o_direct")
def test_reads_refused_at_open_go_through_the_page_cache(tmp_path: Path) -> None:
    size = 50 * ALIGN + 3
    source, data = random_source(tmp_path / "in.bin", size, 5)
    assert not source.direct
    assert read_ranges(source, size, 5, batched=True) == data


def test_reads_refused_midway_fall_back_without_losing_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system may accept the O_DIRECT open and refuse the reads (EINVAL)."""
    monkeypatch.setattr(direct_io, "STAGING_BYTES", 2 * ALIGN)
    size = 80 * ALIGN + 5
    source, data = random_source(tmp_path / "in.bin", size, 4, needs_direct=True)
    calls = fail_direct_calls(monkeypatch, "preadv", source._direct_fd, after=10)
    assert read_ranges(source, size, 4, batched=True) == data
    assert not source.direct and len(calls) > 10


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "one-by-one"])
def test_a_file_shorter_than_its_ranges_is_the_callers_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batched: bool
) -> None:
    """Headers are checked against the file size up front, but a file can still shrink under us."""
    monkeypatch.setattr(direct_io, "STAGING_BYTES", 2 * ALIGN)
    (tmp_path / "in.bin").write_bytes(bytes(10 * ALIGN))
    source = DirectSource(tmp_path / "in.bin")
    out = bytearray(12 * ALIGN)
    with pytest.raises(Unreadable, match="file ends before"):
        with Batch() if batched else contextlib.nullcontext():
            source.read([memoryview(out)], 100, error=Unreadable)


def test_a_failed_block_read_is_raised_after_every_block_has_landed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An I/O error on one block reaches the caller as its error; leaving the batch first waits for the
    other blocks, so none is still being copied into a buffer the caller reuses next."""
    monkeypatch.setattr(direct_io, "STAGING_BYTES", 2 * ALIGN)
    source, data = random_source(tmp_path / "in.bin", 64 * ALIGN, 6)
    real_read_block, finished = source.read_block, []

    def failing_block(staging, position):
        if position == 8 * ALIGN:
            raise OSError(errno.EIO, "Input/output error")
        time.sleep(0.001)
        count = real_read_block(staging, position)
        finished.append(position)
        return count

    monkeypatch.setattr(source, "read_block", failing_block)
    out = bytearray(len(data))
    with pytest.raises(Unreadable, match="Input/output error"):
        with Batch():
            source.read([memoryview(out)], 0, error=Unreadable)
    assert len(finished) == 31  # every other block of the 32 had landed when the error was raised
    assert out[: 8 * ALIGN] == data[: 8 * ALIGN] and out[10 * ALIGN :] == data[10 * ALIGN :]


def copies_out_of_staging(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the length of every copy between staging and the caller's memory."""
    copied: list[int] = []
    real = direct_io.copy_bytes

    def counting(destination: memoryview, source: memoryview) -> None:
        copied.append(len(source))
        real(destination, source)

    monkeypatch.setattr(direct_io, "copy_bytes", counting)
    return copied


@pytest.mark.parametrize("offset", [200, 201], ids=["same-phase", "other-phase"])
def test_whole_blocks_read_on_the_files_phase_skip_staging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offset: int
) -> None:
    """Memory on the 4 KB phase of its file range gets the whole blocks read straight into it; only the
    partial blocks at either end are copied out of staging. Memory on another phase gets every byte copied."""
    monkeypatch.setattr(direct_io, "STAGING_BYTES", 2 * ALIGN)
    size = 40 * ALIGN + 5
    source, data = random_source(tmp_path / "in.bin", size, 7, needs_direct=True)
    position, length = 3 * ALIGN + 200, 20 * ALIGN + 99
    memory = mmap.mmap(-1, length + 2 * ALIGN)  # page-aligned: offset 200 is the file range's phase
    copied = copies_out_of_staging(monkeypatch)
    with Batch():
        source.read([memoryview(memory)[offset : offset + length]], position, error=Unreadable)
    assert memory[offset : offset + length] == data[position : position + length]
    edges = (ALIGN - 200) + (position + length) % ALIGN
    assert sum(copied) == (edges if offset == 200 else length)
    source.close()


@pytest.mark.parametrize("offset", [64, 65], ids=["same-phase", "other-phase"])
def test_whole_blocks_written_on_the_files_phase_skip_staging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offset: int
) -> None:
    monkeypatch.setattr(direct_io, "STAGING_BYTES", 2 * ALIGN)
    size, position, length = 30 * ALIGN, 2 * ALIGN + 64, 20 * ALIGN + 10
    data = random.Random(8).randbytes(length)
    memory = mmap.mmap(-1, length + 2 * ALIGN)
    memory[offset : offset + length] = data
    file = DirectFile(tmp_path / "out.bin", size)
    if not file._direct:
        pytest.skip("this file system has no O_DIRECT")
    copied = copies_out_of_staging(monkeypatch)
    file.write([memoryview(memory)[offset : offset + length]], position)
    file.close()
    assert (tmp_path / "out.bin").read_bytes()[position : position + length] == data
    whole_blocks = (position + length) // ALIGN * ALIGN - (-(-position // ALIGN) * ALIGN)
    assert file.direct_bytes == whole_blocks
    assert sum(copied) == (0 if offset == 64 else whole_blocks)  # the edges go through the page cache


def test_files_in_memory_skip_o_direct() -> None:
    """On tmpfs ``O_DIRECT`` is a buffered copy behind an aligned staging copy: files there are written and read
    straight through the page cache, and a file on the disk is not taken for one in memory."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK) and in_memory(shm)):
        pytest.skip("no writable tmpfs at /dev/shm")
    assert not in_memory(Path("/proc"))
    data = os.urandom(3 * ALIGN + 123)
    with tempfile.TemporaryDirectory(dir=shm) as folder:
        path = Path(folder) / "out.bin"
        file = DirectFile(path, len(data))
        file.write([memoryview(data)[1:]], 1)
        file.write([memoryview(data)[:1]], 0)
        file.close()
        assert file.direct_bytes == 0 and path.read_bytes() == data
        source = DirectSource(path)
        assert not source.direct
        back = bytearray(len(data) - 5)
        source.read([memoryview(back)], 5, error=OSError)
        source.close()
        assert bytes(back) == data[5:]
