"""Vocab tensors holding too few rows (only some rank slices) or too many (a vocab size that is too small).

The field case (ColossalAI#6108, #6167): a trainer pads the vocab to a multiple of ``m * tp`` and one
rank's slice is saved as if it were the whole tensor, e.g. 32768 rows for a vocab of 65535 at tp 2,
or 16064 rows for 128256 at tp 8 with ``m = 64``. The missing rows exist only in the other ranks'
files: reshard explains the shape and names those files, and never pads with invented rows.
Everything here is pure: source tensors and sizes in, a :class:`MissingRankError` (or nothing) out.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from reshard.engine.planner import SourceTensor
from reshard.errors import MissingRankError, ShapeMismatchError
from reshard.partition import Vocab, round_up
from reshard.plans.infer import MAX_VOCAB_PAD_PER_RANK

# Names of vocab tensors across families, for tensors no plan rule covers (GPT-2 wte, Megatron, Meta, NeoX).
VOCAB_NAME = re.compile(
    r"(^|\.)(embed_tokens|wte|word_embeddings|tok_embeddings|embed_in|embed_out|lm_head|output_layer|output)\.weight$"
)
# Per-rank pad multiples frameworks use (ColossalAI make_vocab_size_divisible_by 64, Megatron 128).
PAD_MULTIPLES = (1, 2, 4, 8, 16, 32, 64, 128)
MAX_TP = 64


@dataclass(frozen=True)
class ShortVocab:
    """Vocab tensors whose rank slices hold ``rows`` rows each, together fewer than the vocab."""

    names: tuple[str, ...]
    rows: tuple[int, ...]
    file: str


def explain(rows: int, present: int, vocab: int, multiples: Sequence[int] = PAD_MULTIPLES) -> dict[int, list[int]]:
    """``{tp: [m, ...]}`` for every tp above ``present`` at which ``rows`` is one rank's slice.

    That is ``rows * tp == round_up(vocab, m * tp)``: the vocab padded to a multiple of ``m * tp`` and
    split ``tp`` ways gives ``rows`` rows per rank.

    Example:
        >>> explain(16064, 1, 128256)
        {8: [64]}
    """
    found = {}
    for tp in range(present + 1, MAX_TP + 1):
        ms = [m for m in multiples if rows * tp == round_up(vocab, m * tp)]
        if ms:
            found[tp] = ms
    return found


def find_short(tensors: Sequence[SourceTensor], vocab: int) -> list[ShortVocab]:
    """Vocab tensors whose ranks hold fewer rows than ``vocab``, grouped by rank rows.

    A vocab tensor is one the plan splits as :class:`Vocab`, or, where no rule covers it, one with a vocab
    tensor's name whose rows are exactly one rank's slice of the padded vocab (inference keeps such a
    tensor whole, so it would otherwise pass).
    """
    groups: dict[tuple[int, ...], list[SourceTensor]] = {}
    for t in tensors:
        if isinstance(t.partition, Vocab):
            rows = tuple(ref.shape[t.partition.dim] for ref in t.refs)
        elif t.reason.startswith("inferred") and t.refs[0].shape and VOCAB_NAME.search(t.name):
            rows = tuple(ref.shape[0] for ref in t.refs)
            if len(set(rows)) != 1 or not explain(rows[0], len(rows), vocab):
                continue
        else:
            continue
        if sum(rows) < vocab:
            groups.setdefault(rows, []).append(t)
    return [
        ShortVocab(tuple(sorted(t.name for t in group)), rows, str(group[0].refs[0].file))
        for rows, group in groups.items()
    ]


def check_vocab_rows(
    tensors: Sequence[SourceTensor],
    vocab: int,
    *,
    source_tp: int,
    missing_files: Callable[[int], list[str] | None],
    multiples: Sequence[int] = PAD_MULTIPLES,
) -> None:
    """Refuse vocab tensors with too few rows (missing rank slices) or implausibly many (vocab too small).

    Args:
        tensors: the planned source tensors.
        vocab: the true vocab size.
        source_tp: how many ranks the source has.
        missing_files: for a tp, the names of the rank files that would complete it (None: unknown).
        multiples: the per-rank pad multiples to consider.

    Raises:
        MissingRankError: a vocab tensor holds only some rank slices; the message explains the shape.
        ShapeMismatchError: gathering would drop more rows than any framework pads with.
    """
    short = find_short(tensors, vocab)
    if short:
        raise MissingRankError(
            "; ".join(_diagnose(s, vocab, source_tp, missing_files, multiples) for s in short),
            path=short[0].file,
            hint="reshard never invents rows: put every rank's file beside it and run fix again",
        )
    for t in tensors:
        if isinstance(t.partition, Vocab) and not t.problem:
            total = sum(ref.shape[t.partition.dim] for ref in t.refs)
            if total - vocab >= MAX_VOCAB_PAD_PER_RANK * source_tp:
                raise ShapeMismatchError(
                    f"{total} rows for a vocab of {vocab}: dropping {total - vocab} rows is more than padding",
                    path=t.refs[0].file,
                    tensor=t.name,
                    hint="check --vocab",
                )


def _diagnose(
    short: ShortVocab, vocab: int, present: int, missing_files: Callable[[int], list[str] | None], multiples
) -> str:
    rows = short.rows
    head = (
        f"{', '.join(short.names)}: only {sum(rows)} of {vocab} vocab rows are present "
        f"({present} rank slice{'s' if present > 1 else ''} of {' + '.join(map(str, rows))} rows)"
    )
    found = explain(rows[0], present, vocab, multiples) if len(set(rows)) == 1 else {}
    if not found:
        return head + (
            f"; no tp up to {MAX_TP} with a pad multiple in {', '.join(map(str, multiples))} explains "
            f"{rows[0]} rows per rank: check --vocab"
        )
    parts = [
        f"tp={tp}: {rows[0]} x {tp} = {rows[0] * tp} = {vocab} padded to a multiple of m*{tp} for m in "
        f"{', '.join(map(str, ms))}"
        for tp, ms in found.items()
    ]
    tp = min(found)
    files = missing_files(tp)
    absent = (
        ", ".join(files)
        if files
        else f"those of rank{'s' if tp - present > 1 else ''} " + ", ".join(map(str, range(present, tp)))
    )
    more = " (more for a larger tp)" if len(found) > 1 else ""
    return f"{head}; explained by {' or '.join(parts)}; missing rank files for tp={tp}: {absent}{more}"
