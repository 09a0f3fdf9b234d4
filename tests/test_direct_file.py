"""``DirectFile``: ranges written from several threads with O_DIRECT (whole blocks) and the page cache
(the edges) make exactly the file their bytes say, and a file system that refuses O_DIRECT still works."""

from __future__ import annotations

import errno
import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from reshard import direct_file
from reshard.direct_file import ALIGN, DirectFile


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
    monkeypatch.setattr(direct_file, "STAGING_BYTES", 2 * ALIGN)  # long ranges take several direct writes
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


def test_a_file_system_without_o_direct_is_written_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def refuse_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct_file.os, "open", refuse_direct)
    size = 50 * ALIGN + 3
    data = random.Random(2).randbytes(size)
    file = DirectFile(tmp_path / "out.bin", size)
    write_in_threads(file, data, ranges_of(size, 2), 2)
    assert (tmp_path / "out.bin").read_bytes() == data and file.direct_bytes == 0


def test_direct_writes_refused_midway_fall_back_without_losing_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system may accept the O_DIRECT open and refuse the writes (EINVAL), or write short."""
    monkeypatch.setattr(direct_file, "STAGING_BYTES", 4 * ALIGN)
    monkeypatch.setattr(direct_file, "IO_DEPTH", 1)  # blocks in order, so the second write is the short one
    size = 64 * ALIGN + 9
    data = random.Random(3).randbytes(size)
    file = DirectFile(tmp_path / "out.bin", size)
    if not file._direct:
        pytest.skip("this file system has no O_DIRECT")
    real_pwrite, calls = os.pwrite, []

    def refuse_after_two(fd, view, position):
        if fd == file._direct_fd:
            calls.append(position)
            if len(calls) == 2:
                return real_pwrite(fd, view[:ALIGN], position)  # a short (aligned) write: resumed
            if len(calls) > 3:
                raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, view, position)

    monkeypatch.setattr(direct_file.os, "pwrite", refuse_after_two)
    file.write([memoryview(data)[: size // 2]], 0)
    file.write([memoryview(data)[size // 2 :]], size // 2)
    file.close()
    assert (tmp_path / "out.bin").read_bytes() == data
    assert not file._direct and 0 < file.direct_bytes < size


def test_a_failed_block_write_is_raised_not_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks are written on other threads; a disk error there (here ENOSPC) must reach the caller."""
    monkeypatch.setattr(direct_file, "STAGING_BYTES", 2 * ALIGN)
    file = DirectFile(tmp_path / "out.bin", 64 * ALIGN)
    if not file._direct:
        pytest.skip("this file system has no O_DIRECT")
    real_pwrite = os.pwrite

    def disk_full(fd, view, position):
        if fd == file._direct_fd:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, view, position)

    monkeypatch.setattr(direct_file.os, "pwrite", disk_full)
    with pytest.raises(OSError, match="No space left"):
        file.write([memoryview(bytes(64 * ALIGN))], 0)
    file.close()
