"""The floor of a streamed tmpfs conversion's CPU: one file read, hashed (BLAKE3) and written in 4 MB blocks.

Why: on tmpfs a conversion's bytes cost CPU only, and most of it is the kernel's copies; this measures, on the
machine at hand, what each way of getting the source bytes to the hash and the write costs per GB, so a change to
``reshard/engine/stream.py`` can be judged against it (docs/performance.md, "CPU per byte"):

* ``pread``: ``preadv`` into one reused buffer, hash it, ``pwrite`` it (what ``engine/stream.py`` did);
* ``pread-huge``: the same with the buffer in 2 MB pages (:func:`reshard.io.memory.huge_bytes`, what it does now);
* ``mmap``: the source mapped, hashed and written from the mapping (no read copy; page-table set-up and teardown);
* ``mmap-populate``: the same with ``MAP_POPULATE`` (the page tables filled in one call);
* ``fallocate``: ``pread`` with the output's pages allocated up front (``posix_fallocate``);
* ``copy_file_range``: what ``cp -r`` does (no hash), the yardstick;
* ``pwrite-only``: the same buffer written over and over (no read, no hash): the write copy alone.

Usage: ``python bench/tmpfs_floor.py SOURCE_FILE OUT_DIR [ROUNDS]`` (both in tmpfs; OUT_DIR gets one scratch file,
removed after each run). Prints each way's median user, system and total CPU seconds per GB over the rounds, run in
turn (A B C ... A B C ...) so that a drift of the machine's speed touches each alike.
"""

from __future__ import annotations

import mmap
import os
import resource
import statistics
import sys
from pathlib import Path

import blake3

from reshard.io.memory import huge_bytes

BLOCK = 4 << 20
WAYS = ("pread", "pread-huge", "mmap", "mmap-populate", "fallocate", "copy_file_range", "pwrite-only")


def _cpu() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def run(way: str, source: Path, out: Path) -> tuple[float, float]:
    """User and system CPU seconds of one pass over ``source`` the given way."""
    size = source.stat().st_size
    fd = os.open(source, os.O_RDONLY)
    target = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.ftruncate(target, size)
    hasher = blake3.blake3()
    user, system = _cpu()
    if way == "fallocate":
        os.posix_fallocate(target, 0, size)
    if way == "copy_file_range":
        at = 0
        while at < size:
            count = os.copy_file_range(fd, target, size - at, at, at)
            if count == 0:
                raise OSError(f"copy_file_range stopped at {at} of {size} bytes")
            at += count
    elif way == "pwrite-only":
        view = memoryview(bytearray(BLOCK))
        for at in range(0, size, BLOCK):
            os.pwrite(target, view[: min(BLOCK, size - at)], at)
    elif way in ("pread", "pread-huge", "fallocate"):
        view = memoryview(huge_bytes(BLOCK) if way == "pread-huge" else bytearray(BLOCK))
        for at in range(0, size, BLOCK):
            count = os.preadv(fd, [view[: min(BLOCK, size - at)]], at)
            hasher.update(view[:count])
            os.pwrite(target, view[:count], at)
    else:
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if way == "mmap-populate" else 0)
        mapping = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
        view = memoryview(mapping)
        for at in range(0, size, BLOCK):
            block = view[at : at + BLOCK]
            hasher.update(block)
            os.pwrite(target, block, at)
            block.release()
        view.release()
        mapping.close()
    after_user, after_system = _cpu()
    os.close(fd)
    os.close(target)
    out.unlink()
    return after_user - user, after_system - system


def main() -> None:
    source, folder = Path(sys.argv[1]), Path(sys.argv[2])
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 7
    out = folder / f"tmpfs-floor-{os.getpid()}"
    gb = source.stat().st_size / 1e9
    seen: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
    for _ in range(rounds):
        for way in WAYS:
            seen[way].append(run(way, source, out))
    for way, runs in seen.items():
        user = statistics.median(u for u, _ in runs) / gb
        system = statistics.median(s for _, s in runs) / gb
        total = statistics.median(u + s for u, s in runs) / gb
        print(f"{way:16s} user {user:.3f}  sys {system:.3f}  cpu {total:.3f} s/GB  ({rounds} rounds, {gb:.2f} GB)")


if __name__ == "__main__":
    main()
