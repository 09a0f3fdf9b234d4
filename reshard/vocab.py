"""The vocab: its true size and where that came from, padded sizes, pad rows, and vocab tensors that do not add up.

Everything vocab-specific is here, so that "where is the vocab unpadded" has one answer:

* **The true size** (:func:`resolve_vocab`): ``--vocab``, else the ``reshard.json`` beside the checkpoint,
  else the config. Never guessed from padded rows: frameworks pad the embedding and output tables at
  the tail (Megatron to ``make_vocab_size_divisible_by * tp``, ColossalAI to ``64 * tp``, reshard to tp).
* **Padded sizes and pad rows**: the arithmetic is :mod:`reshard.geometry.padding` (one geometry for every cut);
  Megatron's multiple is :mod:`reshard.megatron.vocab`.
* **The short-slice diagnosis** (:func:`check_vocab_rows`), the field case of ColossalAI#6108 / #6167: a
  trainer pads the vocab to a multiple of ``m * tp`` and one rank's slice is saved as if it were the
  whole tensor, e.g. 32768 rows for a vocab of 65535 at tp 2, or 16064 rows for 128256 at tp 8 with
  ``m = 64``. The missing rows exist only in the other ranks' files: reshard explains the shape and
  names those files, and never pads with invented rows.

Pure: sizes, headers and planned tensors in; sizes, records and errors out. No torch import.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from reshard.errors import MissingRankError, ReshardError, ShapeMismatchError
from reshard.geometry import Partition, Vocab
from reshard.geometry.padding import MAX_VOCAB_PAD_PER_RANK, padded_size, round_up
from reshard.megatron.vocab import megatron_pad_multiple

if TYPE_CHECKING:
    from reshard.config import ModelConfig
    from reshard.manifest import Manifest


class RankSlice(Protocol):
    """One rank's slice of a tensor, as the vocab checks read it (a :class:`reshard.layouts.base.TensorRef`)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def file(self) -> Path: ...


class PlannedTensor(Protocol):
    """A planned source tensor, as the vocab checks read it (:class:`reshard.engine.plan.planner.SourceTensor`): typed
    structurally, because the planner calls this module."""

    @property
    def name(self) -> str: ...

    @property
    def refs(self) -> Sequence[RankSlice]: ...

    @property
    def partition(self) -> Partition | None: ...

    @property
    def reason(self) -> str: ...

    @property
    def problem(self) -> ReshardError | None: ...


# Names of vocab tensors across families, for tensors no plan rule covers (GPT-2 wte, Megatron, Meta, NeoX).
VOCAB_NAME = re.compile(
    r"(^|\.)(embed_tokens|wte|word_embeddings|tok_embeddings|embed_in|embed_out|lm_head|output_layer|output)\.weight$"
)
# Per-rank pad multiples frameworks use (ColossalAI make_vocab_size_divisible_by 64, Megatron 128).
PAD_MULTIPLES = (1, 2, 4, 8, 16, 32, 64, 128)
MAX_TP = 64


@dataclass(frozen=True)
class VocabPlan:
    """The true vocab size and where it came from; the padded sizes found in the source and planned for the
    target, and the multiple the target is padded to (None when split unevenly or when there is no vocab)."""

    original: int | None
    origin: str
    source_padded: int | None = None
    target_padded: int | None = None
    pad_multiple: int | None = None


def finish_vocab(
    vocab: VocabPlan,
    *,
    known: tuple[int, str] | None,
    source_padded: int | None,
    multiple: int,
    tp: int,
    uneven: bool,
) -> tuple[VocabPlan, ReshardError | None]:
    """The vocab a conversion writes, finished in one place: the true size (``known``, ``(size, origin)``, when a
    mapping knows it and nothing before said it), the rows the source's vocab tensors hold (``source_padded``), and
    the rows the target pads them to: a multiple of ``multiple``, or none at all when split ``uneven``. The problem,
    when those rows do not divide by ``tp``."""
    if vocab.original is None and known is not None:
        vocab = replace(vocab, original=known[0], origin=known[1])
    target_padded, problem = None, None
    if source_padded is not None:
        target_padded = padded_size(vocab.original or source_padded, multiple, uneven=uneven)
        if target_padded % tp and not uneven:
            problem = ReshardError(
                f"vocab padded to {target_padded} does not divide by tp={tp}",
                hint="choose --pad-multiple as a multiple of the tp",
            )
    pad_multiple = None if uneven or source_padded is None else multiple
    return replace(vocab, source_padded=source_padded, target_padded=target_padded, pad_multiple=pad_multiple), problem


def resolve_vocab(explicit: int | None, manifest: Manifest | None, config: ModelConfig | None) -> VocabPlan:
    """The true vocab size: ``explicit`` (``--vocab``), else the manifest's original size, else the config's."""
    if explicit is not None:
        return VocabPlan(explicit, "--vocab")
    if manifest is not None and manifest.vocab.original is not None:
        return VocabPlan(manifest.vocab.original, "reshard.json")
    if config is not None and config.vocab_size:
        return VocabPlan(config.vocab_size, config.path.name if config.path else "config")
    return VocabPlan(None, "unknown")


def check_vocab_shrink(
    vocab: VocabPlan, manifest: Manifest | None, config: ModelConfig | None, *, source_tp: int, allow: bool = False
) -> None:
    """Refuse a ``--vocab`` below the true size the source records: it would drop real rows.

    What counts, first found: the manifest's original size; a config that records its padding (Megatron's args:
    ``vocab_size`` when given, else ``padded_vocab_size`` padded to ``make_vocab_size_divisible_by * tp``, which
    holds a true size of one multiple below it at most); an HF config's ``vocab_size``, which records no padding:
    it counts as true unless it could be ``--vocab`` padded (a multiple of ``m * source_tp`` or ``m``, ``m`` in
    :data:`PAD_MULTIPLES`, less than one multiple above it: a trainer that saved its padded size; nothing else in
    such a folder tells).

    Raises:
        ReshardError: ``--vocab`` is below the true size and ``allow`` (``--allow-vocab-shrink``) is off.
    """
    if vocab.origin != "--vocab" or allow or vocab.original is None:
        return
    asked = vocab.original
    record = _padding_record(config, source_tp)
    hint = "pass the true vocab size, or --allow-vocab-shrink to drop those rows on purpose"
    if manifest is not None and manifest.vocab.original is not None and asked < manifest.vocab.original:
        true, where, path = manifest.vocab.original, "the reshard.json beside it", None
    elif config is not None and config.vocab_size and asked < config.vocab_size:
        true, where, path = config.vocab_size, config.path.name if config.path else "the config", config.path
        if record is None and _could_be_padded(true, asked, source_tp):
            return
    elif config is not None and record is not None and round_up(asked, record[1]) < record[0]:
        padded, multiple = record
        lowest = padded - multiple + 1
        raise ReshardError(
            f"--vocab {asked} is below what the padded_vocab_size {padded} recorded in {_name(config)} can hold: "
            f"padded to a multiple of {multiple} (make_vocab_size_divisible_by x tp {source_tp}), its true size is "
            f"{lowest}..{padded}; the rows {asked}..{lowest - 1} of every vocab tensor would be dropped",
            path=config.path,
            hint=hint,
        )
    else:
        return
    raise ReshardError(
        f"--vocab {asked} is below the vocab size {true} that {where} gives: the {true - asked} rows "
        f"{asked}..{true - 1} of every vocab tensor would be dropped",
        path=path,
        hint=hint,
    )


def _padding_record(config: ModelConfig | None, tp: int) -> tuple[int, int] | None:
    """``(padded rows, pad multiple)`` when the config records how its vocab was padded (Megatron's args)."""
    if config is None:
        return None
    padded, divisible = config.raw.get("padded_vocab_size"), config.raw.get("make_vocab_size_divisible_by")
    sizes = (padded, divisible)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes):
        return None
    return cast(int, padded), megatron_pad_multiple(divisible, max(tp, 1))


def _name(config: ModelConfig) -> str:
    return config.path.name if config.path else "the config"


def _could_be_padded(padded: int, size: int, tp: int) -> bool:
    """``padded`` is ``size`` rounded up to some pad multiple (``m`` or ``m * tp``, at least 2)."""
    multiples = {m * t for m in PAD_MULTIPLES for t in {1, max(tp, 1)}} - {1}
    return any(padded % k == 0 and padded - size < k for k in multiples)


def require_vocab(vocab: VocabPlan, *, path: Any, config: ModelConfig | None) -> int:
    """The true vocab size, or an error saying that nothing tells it (for ``fix``, which must cut pad rows)."""
    if vocab.original is not None:
        return vocab.original
    where = f"{config.path} has no vocab_size" if config else "there is no config.json"
    raise ReshardError(
        f"the original vocab size is unknown: there is no reshard.json beside the checkpoint and {where}",
        path=path,
        hint="pass --vocab N, the tokenizer's vocab size",
    )


def padded_sizes_possible(rows: int, source_multiple: int, target_multiple: int) -> dict[int, range]:
    """For a table padded to ``rows`` (a multiple of ``source_multiple``) from an unknown true size: every
    size it could be padded to at the target, with the true sizes that give it.

    Example:
        >>> padded_sizes_possible(1008, 16, 8)
        {1000: range(993, 1001), 1008: range(1001, 1009)}
    """
    out: dict[int, list[int]] = {}
    for size in range(max(1, rows - source_multiple + 1), rows + 1):
        out.setdefault(round_up(size, target_multiple), []).append(size)
    return {padded: range(sizes[0], sizes[-1] + 1) for padded, sizes in sorted(out.items())}


def source_padded_rows(tensors: Sequence[PlannedTensor]) -> int | None:
    """Rows the source's vocab tensors hold along their vocab dim (all rank slices together), if it has any."""
    for tensor in tensors:
        if isinstance(tensor.partition, Vocab) and not tensor.problem:
            return sum(ref.shape[tensor.partition.dim] for ref in tensor.refs)
    return None


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


def find_short(tensors: Sequence[PlannedTensor], vocab: int) -> list[ShortVocab]:
    """Vocab tensors whose ranks hold fewer rows than ``vocab``, grouped by rank rows.

    A vocab tensor is one the plan splits as :class:`Vocab`, or, where no rule covers it, one with a vocab
    tensor's name whose rows are exactly one rank's slice of the padded vocab (inference keeps such a
    tensor whole, so it would otherwise pass).
    """
    groups: dict[tuple[int, ...], list[PlannedTensor]] = {}
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
    tensors: Sequence[PlannedTensor],
    vocab: int,
    *,
    source_tp: int,
    missing_files: Callable[[int], list[str] | None],
    multiples: Sequence[int] = PAD_MULTIPLES,
    recorded_tp: int | None = None,
    origin: str = "--vocab",
) -> None:
    """Refuse vocab tensors with too few rows (missing rank slices, or a vocab above the rows every rank holds)
    or implausibly many (vocab too small).

    Args:
        tensors: the planned source tensors.
        vocab: the true vocab size.
        source_tp: how many ranks the source has.
        missing_files: for a tp, the names of the rank files that would complete it (None: unknown).
        multiples: the per-rank pad multiples to consider.
        recorded_tp: the tp the checkpoint records for itself (its ``reshard.json``), if any.
        origin: where ``vocab`` came from (``--vocab``, ``reshard.json``, ``config.json``), for the message.

    Raises:
        MissingRankError: a vocab tensor holds only some rank slices; the message explains the shape.
        ShapeMismatchError: ``vocab`` exceeds the rows every rank's file holds together (nothing is missing),
            or gathering would drop more rows than any framework pads with.
    """
    short = find_short(tensors, vocab)
    if short and _all_ranks_held(short, vocab, source_tp, missing_files, multiples, recorded_tp):
        held = max(sum(s.rows) for s in short)
        asked = f"--vocab {vocab}" if origin == "--vocab" else f"the vocab size {vocab} (from {origin})"
        ranks = f"the {source_tp} rank files" if source_tp > 1 else "the checkpoint"
        raise ShapeMismatchError(
            f"{asked} exceeds the {held} vocab rows {ranks} hold ({', '.join(short[0].names)}); "
            "every rank's file is present",
            path=short[0].file,
            hint=f"pass the true vocab size, at most {held}",
        )
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


def _all_ranks_held(
    short: Sequence[ShortVocab],
    vocab: int,
    present: int,
    missing_files: Callable[[int], list[str] | None],
    multiples: Sequence[int],
    recorded_tp: int | None,
) -> bool:
    """Whether the rows are short because ``vocab`` is too large, not because rank files are missing: the tp the
    checkpoint records is the tp found, or (nothing recorded) every rank slice is whole and no larger tp explains
    the rows, from several rank files or from a file whose name carries no rank number (nothing to be missing)."""
    if recorded_tp is not None:
        return recorded_tp == present
    if any(len(set(s.rows)) != 1 or explain(s.rows[0], present, vocab, multiples) for s in short):
        return False
    return present > 1 or missing_files(present + 1) is None


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


def tokenizer_disagreement(
    size: int,
    origin: str,
    *,
    explicit: int | None,
    recorded: int | None,
    padded: int | None,
    multiple: int | None,
    tp: int | None,
    embedding: int | None,
) -> str | None:
    """Why a tokenizer of ``size`` tokens is not the model's, with both numbers (None: it is).

    Args:
        size: ``len(tokenizer)``, added tokens counted.
        origin: where the tokenizer came from, for the message.
        explicit: ``--vocab``.
        recorded: the true vocab size Megatron's args record (``--vocab-size``).
        padded: the padded size Megatron's args record: ``size`` rounded up to ``multiple * tp``, as Megatron-LM
            computes it at start-up from this tokenizer.
        multiple: ``make_vocab_size_divisible_by``.
        tp: the tensor-parallel size the args record.
        embedding: an HF config's ``vocab_size`` (the embedding's rows, which may exceed the tokenizer: never fewer).
    """
    said = f"the tokenizer ({origin}) holds {size} tokens"
    if explicit is not None and explicit != size:
        return f"--vocab {explicit}, but {said}"
    if recorded is not None and recorded != size:
        return f"the args say vocab_size={recorded}, but {said}"
    if padded is not None and tp is not None:
        step = megatron_pad_multiple(multiple, tp)
        if round_up(size, step) != padded:
            return (
                f"the args say padded_vocab_size={padded}, but {said}, which Megatron-LM pads to "
                f"{round_up(size, step)} (a multiple of {step})"
            )
    if embedding is not None and size > embedding:
        return f"the config says vocab_size={embedding}, but {said}: token ids past the embedding"
    return None
