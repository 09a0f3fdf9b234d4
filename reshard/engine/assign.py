"""Which worker writes which output file: a pure, deterministic share by bytes (every worker computes the same)."""

from __future__ import annotations

from collections.abc import Mapping


def assign(files: Mapping[str, int], workers: int) -> list[frozenset[str]]:
    """Share ``files`` (name -> bytes) among ``workers``: largest first, each to the worker with the fewest bytes so
    far (ties: the lower rank, then the name), so the shares differ by at most the largest file.

    Example:
        >>> assign({"a": 5, "b": 3, "c": 3, "d": 1}, 2)
        [frozenset({'a', 'd'}), frozenset({'b', 'c'})]
    """
    loads = [0] * workers
    shares: list[set[str]] = [set() for _ in range(workers)]
    for name, size in sorted(files.items(), key=lambda item: (-item[1], item[0])):
        worker = min(range(workers), key=lambda w: (loads[w], w))
        shares[worker].add(name)
        loads[worker] += size
    return [frozenset(share) for share in shares]
