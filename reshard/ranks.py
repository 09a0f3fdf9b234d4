"""Rank numbers from file and folder names, checked before any file is opened: within :data:`MAX_RANKS`, without
gaps, and agreeing with the tp the checkpoint records (Megatron's args, SAT's config).

Rank numbers come from names (``rank_999999999``, ``__7.metadata``) and are untrusted: the tp is never taken
from them before they are checked, and missing ranks are listed a few at a time, never enumerated.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path

from reshard.errors import MissingRankError, ReshardError
from reshard.options import MAX_RANKS

SHOWN = 4  # missing ranks named in a message; the rest are counted


def rank_count(
    found: Collection[int],
    *,
    path: Path,
    name: Callable[[int], str],
    declared: int | None = None,
    declared_by: str = "",
) -> tuple[int, list[int]]:
    """The tp that the ranks ``found`` (numbers from names) make, and the first missing ranks (at most :data:`SHOWN`).

    ``declared`` is the tp the checkpoint records (``declared_by`` says where); ranks at or past it are
    refused (an extra rank is a copy or a leftover, never data to gather).

    Raises:
        ReshardError: a rank number past :data:`MAX_RANKS`, or ranks past the declared tp.
    """
    if not found:
        raise MissingRankError("no rank files or folders", path=path)
    top = max(found)
    if top >= MAX_RANKS:
        raise ReshardError(
            f"{name(top)} carries rank {top}, beyond the {MAX_RANKS} ranks reshard reads",
            path=path,
            hint="remove or rename it",
        )
    tp = top + 1 if declared is None else declared
    extra = sorted(r for r in found if r >= tp)
    if extra:
        shown = ", ".join(name(r) for r in extra[:SHOWN]) + (
            f" and {len(extra) - SHOWN} more" if len(extra) > SHOWN else ""
        )
        raise ReshardError(
            f"{shown} {'is' if len(extra) == 1 else 'are'} beyond the tp={tp} {declared_by} records: "
            "a copy or a leftover of another run?",
            path=path,
            hint="remove the extra rank, or correct the recorded tp",
        )
    present = set(found)
    missing: list[int] = []
    for rank in range(tp):  # stops after SHOWN: at most len(found) + SHOWN steps
        if rank not in present:
            missing.append(rank)
            if len(missing) == SHOWN:
                break
    return tp, missing


def missing_count(found: Collection[int], tp: int) -> int:
    """How many of ranks ``0 .. tp-1`` are not in ``found``."""
    return tp - len({r for r in found if 0 <= r < tp})


def listed(names: list[str], total: int) -> str:
    """``a, b, c`` or ``a, b, c and 7 more`` (``total`` counts all of them)."""
    return ", ".join(names) + (f" and {total - len(names)} more" if total > len(names) else "")
