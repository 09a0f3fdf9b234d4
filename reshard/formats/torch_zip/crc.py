"""The CRC-32 of a record whose bytes arrive as parts, in any order.

A zip record's CRC-32 covers its bytes in order, but a streamed tensor reaches its file in byte ranges
(:meth:`~reshard.formats.torch_zip.writer.TorchZipWriter.write_part`). Each range gets its own CRC while it goes
out, and the ranges' CRCs are joined by zlib's ``crc32_combine`` (here in Python: zlib's module does not offer it),
whose cost depends on the number of parts, not on their bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

_POLY = 0xEDB88320  # CRC-32's polynomial, reflected
_TOP = 1 << 31


def _multiply(a: int, b: int) -> int:
    """``a * b`` modulo the CRC polynomial (zlib's ``multmodp``)."""
    product = 0
    mask = _TOP
    while mask:
        if a & mask:
            product ^= b
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
        mask >>= 1
    return product


def _powers() -> list[int]:
    """``x ** (2 ** n)`` modulo the polynomial, n = 0 ... 31 (zlib's ``x2n_table``)."""
    table = [1 << 30]  # x ** 1
    for _ in range(31):
        table.append(_multiply(table[-1], table[-1]))
    return table


_X2N = _powers()


def _shift(length: int) -> int:
    """``x ** (8 * length)`` modulo the polynomial (zlib's ``x2nmodp(length, 3)``): what appending ``length`` zero
    bytes does to a CRC."""
    power, k = _TOP, 3
    while length:
        if length & 1:
            power = _multiply(_X2N[k & 31], power)
        length >>= 1
        k += 1
    return power


def crc32_combine(first: int, second: int, second_length: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (zlib's ``crc32_combine``)."""
    return _multiply(_shift(second_length), first) ^ second


class PartsCrc:
    """The CRC-32 of ``size`` bytes given as ranges in any order (none twice); contiguous ranges in order, the
    usual case, extend one running CRC."""

    def __init__(self, size: int, crc32: Callable[[Any, int], int]) -> None:
        self.size = size
        self._crc32 = crc32
        self._runs: list[list[int]] = []  # [start, end, crc], the last one extended while ranges follow it

    def add(self, views: Sequence[memoryview], start: int) -> None:
        """Count bytes ``[start, start + len)``."""
        last = self._runs[-1] if self._runs else None
        if last is None or last[1] != start:
            last = [start, start, 0]
            self._runs.append(last)
        for view in views:
            last[2] = self._crc32(view, last[2])
            last[1] += len(view)

    def value(self) -> int:
        """The CRC-32 of all the bytes; ``ValueError`` unless the ranges cover ``[0, size)`` exactly once."""
        crc, end = 0, 0
        for start, stop, part in sorted(self._runs):
            if start != end:
                how = "twice" if start < end else "never"
                raise ValueError(f"bytes [{min(start, end)}, {max(start, end)}) were written {how}")
            crc, end = crc32_combine(crc, part, stop - start), stop
        if end != self.size:
            raise ValueError(f"bytes [{end}, {self.size}) were never written")
        return crc
