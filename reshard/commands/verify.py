"""``verify``: check a checkpoint against its manifest, compare two checkpoints, or prove a round trip.

Every check reads one canonical tensor at a time (per side) as the converter does, so a checkpoint is judged exactly
as reshard would read it: a manifest's digests stream from the slices
(:func:`~reshard.engine.move.stream.canonical_digest`, no torch for a tensor kept as its slices' bytes), anything else
goes through the same gather. A difference is a result (exit 1); a file that cannot be read at all is a
:class:`~reshard.errors.ReshardError` (exit 2).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from reshard.commands.verify_checks import Difference, check_files, files_of
from reshard.commands.verify_compare import Tolerance, compare_tensors, gather, on_threads
from reshard.commands.verify_ranks import check_ranks
from reshard.commands.verify_state import check_state, compare_states
from reshard.commands.verify_state_plan import state_tensors
from reshard.dtypes import name_of
from reshard.engine.move.digest import algorithm_of, all_finite_in_blocks, digest_of
from reshard.engine.move.stream import canonical_digest
from reshard.engine.plan.open import OpenedCheckpoint, open_checkpoint
from reshard.engine.plan.planner import SourceTensor
from reshard.engine.run.conversion import open_for_conversion, run_conversion
from reshard.errors import DivergentReplicaError, PlanError, ReshardError, ShapeMismatchError
from reshard.io.staging import temporary_folder
from reshard.layouts import canonical_layout
from reshard.layouts.training import split_state_name
from reshard.manifest import TensorEntry, find_manifest
from reshard.mappings import HF, naming_of
from reshard.options import ConvertOptions, ReadOptions, check_tp

__all__ = ["Difference", "VerifyOptions", "VerifyReport", "VerifyResult", "verify"]


@dataclass(frozen=True)
class VerifyOptions:
    """What to check and how to read the checkpoints.

    Attributes:
        roundtrip: tp sizes to convert to and back from (empty: no round trip).
        atol: absolute tolerance when comparing two checkpoints (0 with ``rtol`` 0: bit-exact).
        rtol: relative tolerance, as in ``torch.isclose``.
        read: how to read the checkpoints (:class:`ReadOptions`): its ``config`` applies to CKPT only, its ``plan``
            to every side.
        progress: tqdm progress bars on stderr.
        train_state: check the training state too (:mod:`reshard.commands.verify_state`): on its own, or against
            OTHER's bit for bit (``atol`` and ``rtol`` apply to the weights only).
    """

    roundtrip: tuple[int, ...] = ()
    atol: float = 0.0
    rtol: float = 0.0
    read: ReadOptions = field(default_factory=ReadOptions)
    progress: bool = False
    train_state: bool = False

    def __post_init__(self) -> None:
        for tp in self.roundtrip:
            check_tp(tp, what="--roundtrip")

    @property
    def tolerance(self) -> Tolerance:
        return Tolerance(self.atol, self.rtol)

    def reading(self, *, own_config: bool = True) -> ReadOptions:
        """How to open a checkpoint: ``config`` applies to CKPT only (``own_config``), not to OTHER."""
        return self.read if own_config else replace(self.read, config=None)

    def convert_options(self, read: ReadOptions, **options: Any) -> ConvertOptions:
        """A conversion of a round trip or of a renamed copy: reading with ``read``, bars as this check shows them."""
        return ConvertOptions(read=read, progress=self.progress, **options)


@dataclass
class VerifyReport:
    """One check: ``manifest`` (CKPT against reshard.json), ``compare`` (CKPT against OTHER) or ``roundtrip``."""

    check: str
    checkpoint: str
    against: str
    tensors: int = 0
    differences: list[Difference] = field(default_factory=list)
    tp: int | None = None

    @property
    def ok(self) -> bool:
        return not self.differences

    @property
    def title(self) -> str:
        if self.check == "roundtrip":
            return f"round trip through tp={self.tp}"
        if self.check == "train-state":
            return f"training state against {self.against}"
        return f"{self.check} against {self.against}"

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in self.__dict__.items() if k != "differences"}
        return data | {"ok": self.ok, "differences": [d.to_dict() for d in self.differences]}


@dataclass
class VerifyResult:
    """Every check ``verify`` ran; ``ok`` only when none found a difference."""

    checkpoint: str
    reports: list[VerifyReport] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.reports)

    def to_dict(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint, "ok": self.ok, "checks": [r.to_dict() for r in self.reports]}


def verify(ckpt: Path, other: Path | None = None, options: VerifyOptions | None = None) -> VerifyResult:
    """Check ``ckpt``: against ``other`` when given, else against its ``reshard.json``; plus round trips, and its
    training state (``options.train_state``) on its own or against ``other``'s.

    Without ``other``, the manifest check runs when there is a manifest or neither a round trip nor the training
    state was asked for (so ``verify(ckpt, options=VerifyOptions(roundtrip=(2,)))`` works on any checkpoint).

    Raises:
        ReshardError: a checkpoint cannot be read (truncated file, no manifest to check against, ...).

    Example:
        >>> verify(Path("ckpt-tp4"), options=VerifyOptions(roundtrip=(2, 8))).ok  # doctest: +SKIP
        True
    """
    ckpt, options = Path(ckpt), options or VerifyOptions()
    result = VerifyResult(str(ckpt))
    if options.train_state:  # first: a checkpoint without one is refused before the other checks run
        result.reports.append(training_report(ckpt, None if other is None else Path(other), options))
    if other is not None:
        result.reports.insert(0, compare_checkpoints(ckpt, Path(other), options))
    elif not (options.roundtrip or options.train_state) or find_manifest(ckpt) is not None:
        result.reports.insert(0, check_manifest(ckpt, options))
    missing = [d for r in result.reports for d in r.differences if d.kind == "missing-file"]
    if not any(d.kind in ("missing-file", "duplicate") for r in result.reports for d in r.differences):
        ranks = rank_report(ckpt, options)  # (files that cannot be read as a checkpoint are reported above)
        if ranks is not None:
            result.reports.append(ranks)
    for tp in options.roundtrip:
        if missing:  # the checkpoint cannot be read: say so per round trip instead of failing to read it
            cause = Difference("not-run", None, "files of the checkpoint are missing (see above)", missing[0].file)
            result.reports.append(VerifyReport("roundtrip", str(ckpt), f"tp={tp} and back", 0, [cause], tp))
        else:
            result.reports.append(roundtrip(ckpt, tp, options))
    return result


def training_report(ckpt: Path, other: Path | None, options: VerifyOptions) -> VerifyReport:
    """``ckpt``'s training state on its own, or against ``other``'s (:mod:`reshard.commands.verify_state`).

    Raises:
        ReshardError: ``ckpt`` (and ``other``) holds no training state with its tensors.
    """
    a = _open(ckpt, options.reading())
    if other is None:
        checked = check_state(a, progress=options.progress)
        against = "its own records"
    else:
        b = _open(other, options.reading(own_config=False))
        checked = compare_states(a, b, progress=options.progress)
        against = str(other)
    return VerifyReport("train-state", str(ckpt), against, checked.tensors, checked.differences)


def rank_report(ckpt: Path, options: VerifyOptions) -> VerifyReport | None:
    """Every rank's slice of every tensor against the plan's cut, and each rank's quantized tensors dequantized on
    their own (:mod:`reshard.commands.verify_ranks`); ``None`` for a checkpoint of one rank."""
    checked = check_ranks(ckpt, options.reading())
    if checked is None:
        return None
    return VerifyReport("ranks", str(ckpt), "the plan's cut on each rank", checked[0], checked[1])


def _open(path: Path, options: ReadOptions) -> OpenedCheckpoint:
    """Open a checkpoint to gather it whole, the way its ``reshard.json`` recorded it (when it has one)."""
    return open_checkpoint(path, options, target_tp=1, recorded_plan=True)


def check_manifest(ckpt: Path, options: VerifyOptions) -> VerifyReport:
    """Recompute every canonical tensor's digest (with the algorithm its entry names), shape, dtype and NaN/Inf,
    and compare with ``reshard.json``."""
    manifest = find_manifest(ckpt)
    if manifest is None:
        raise ReshardError(
            "no reshard.json beside it to verify against",
            path=ckpt,
            hint="compare with another checkpoint (verify CKPT OTHER) or use --roundtrip",
        )
    report = VerifyReport("manifest", str(ckpt), "reshard.json")
    report.differences = check_files(ckpt, manifest)
    if report.differences:  # tensors cannot be gathered while files are missing
        return report
    opened = _open(ckpt, options.reading())
    tensors = opened.by_name()
    training = opened.source.training
    if training is not None and any(split_state_name(n)[1] for n in manifest.tensors):  # written --with-optimizer
        tensors |= state_tensors(training, tensors)
    diffs = report.differences
    expected = manifest.tensors
    diffs += [Difference("missing", n, "in reshard.json, not in the checkpoint") for n in expected if n not in tensors]
    diffs += [
        Difference("extra", n, "not in reshard.json", files_of(tensors[n])) for n in tensors if n not in expected
    ]
    to_hash = []
    for name in (n for n in expected if n in tensors):
        tensor, entry = tensors[name], expected[name]
        if tensor.problem is None and (name_of(tensor.code) != entry.dtype):
            diffs.append(
                Difference("dtype", name, f"{name_of(tensor.code)}, reshard.json says {entry.dtype}", files_of(tensor))
            )
        elif tensor.shape is not None and tensor.shape != entry.shape:
            diffs.append(
                Difference(
                    "shape", name, f"{list(tensor.shape)}, reshard.json says {list(entry.shape)}", files_of(tensor)
                )
            )
        else:
            to_hash.append(name)
    for name, digest, finite in _digests(tensors, {n: expected[n] for n in to_hash}, options.progress, diffs):
        entry, files = expected[name], files_of(tensors[name])
        report.tensors += 1
        algorithm = algorithm_of(entry.digest)
        if digest != entry.digest:
            diffs.append(Difference(algorithm, name, f"bytes differ from the {algorithm} in reshard.json", files))
        if entry.finite and not finite:
            diffs.append(Difference("non-finite", name, "NaN/Inf present; reshard.json says it had none", files))
    return report


def _digests(
    tensors: Mapping[str, SourceTensor], entries: dict[str, TensorEntry], progress: bool, diffs: list[Difference]
) -> Iterator[tuple[str, str, bool | None]]:
    """Yield ``(name, digest, finite)`` of each canonical tensor in order, by the algorithm its manifest entry names
    (finite only when the entry records it). A tensor kept as its slices' bytes streams through a small buffer, as
    the conversion wrote it (:func:`~reshard.engine.move.stream.canonical_digest`), on a thread per core (the reads,
    the hash and the check release the interpreter; twice as many threads cost more CPU than the wall they save,
    measured: docs/performance.md); any other is gathered here, one at a time. Tensors that cannot be read whole become
    differences."""

    def streamed(name: str) -> tuple[str, bool | None] | None:
        tensor, entry = tensors[name], entries[name]
        if tensor.problem is not None:
            return None
        return canonical_digest(tensor, finite=bool(entry.finite), algorithm=algorithm_of(entry.digest))

    for name, future in on_threads(streamed, list(entries), progress):
        tensor, entry = tensors[name], entries[name]
        try:
            result = future.result()
        except DivergentReplicaError as err:
            diffs.append(Difference("inconsistent", name, err.detail, files_of(tensor)))
            continue
        if result is not None:
            yield name, *result
            continue
        full = gather(tensor, diffs)  # a problem is reported here
        if full is not None:
            finite = all_finite_in_blocks(full) if entry.finite else None
            yield name, digest_of(full, algorithm_of(entry.digest)), finite


def compare_checkpoints(ckpt: Path, other: Path, options: VerifyOptions) -> VerifyReport:
    """Compare two checkpoints of any layouts and tp sizes tensor by tensor: by the digests of their canonical bytes,
    streamed on a thread per core (:func:`_same_bytes`), and value by value for tensors those do not show equal.

    Bit-exact unless ``options.atol`` / ``options.rtol`` are set; with a tolerance, tensors of different
    dtypes are compared by value (in float64) instead of being reported as a dtype difference.
    """
    report = VerifyReport("compare", str(ckpt), str(other))
    a, b = _open(ckpt, options.reading()), _open(other, options.reading(own_config=False))
    with _same_names(a, b, options) as (a, b):
        compared = compare_tensors(
            a.by_name(),
            b.by_name(),
            names=(report.checkpoint, report.against),
            tolerance=options.tolerance,
            progress=options.progress,
        )
    report.tensors, report.differences = compared.tensors, compared.differences
    return report


@contextlib.contextmanager
def _same_names(
    a: OpenedCheckpoint, b: OpenedCheckpoint, options: VerifyOptions
) -> Iterator[tuple[OpenedCheckpoint, OpenedCheckpoint]]:
    """``a`` and ``b`` under the same names: when one names its tensors as transformers does and the other as
    Megatron or torchtitan do (a checkpoint and its own conversion), the other one converted to ``hf`` in a
    temporary folder (removed however this ends), through the same mapping ``convert`` applies."""
    namings = naming_of(a.source), naming_of(b.source)
    if None in namings or namings[0] == namings[1] or HF not in namings:
        yield a, b
        return
    hf, mapped = (a, b) if namings[0] == HF else (b, a)
    with temporary_folder("reshard-verify-names-") as tmp:
        out = tmp / "hf"
        read = replace(options.reading(own_config=False), vocab=hf.vocab.original)
        convert = options.convert_options(read, tp=1, layout=canonical_layout().name)
        run_conversion(open_for_conversion(mapped.path, out, convert), out, convert)
        renamed = _open(out, options.reading(own_config=False))
        yield (a, renamed) if mapped is b else (renamed, b)


def roundtrip(ckpt: Path, tp: int, options: VerifyOptions) -> VerifyReport:
    """Convert ``ckpt`` to ``tp`` ranks in a temporary folder, back to its own tp, and compare bit-exactly.

    The temporary folder (under ``$TMPDIR``) is removed however this ends, with the stopping signals held off
    while it is (:func:`~reshard.io.staging.temporary_folder`), so a second signal cannot cut it short. A tp the
    model cannot be split into is reported as a difference of this round trip, not raised.
    """
    opened = open_checkpoint(ckpt, options.reading(), target_tp=tp)
    own_tp, uneven = opened.source.tp, opened.uneven
    report = VerifyReport("roundtrip", str(ckpt), f"tp={tp} and back", tp=tp)
    with temporary_folder(f"reshard-verify-tp{tp}-") as tmp:
        there, back = tmp / f"tp{tp}", tmp / f"back-tp{own_tp}"
        try:
            # the source's names both ways: the round trip checks the slicing, not a mapping between namings
            read = replace(options.read, uneven=uneven)
            run_conversion(opened, there, options.convert_options(read, tp=tp, keep_names=True))
            back_options = options.convert_options(replace(read, config=None), tp=own_tp, keep_names=True)
            run_conversion(open_for_conversion(there, back, back_options), back, back_options)
        except PlanError as err:  # this tp cannot hold the model: a finding about this round trip
            report.differences = [Difference("plan", p.tensor, p.detail, p.path) for p in err.problems]
            return report
        except (DivergentReplicaError, ShapeMismatchError) as err:  # the ranks of CKPT do not gather
            report.differences = [Difference("inconsistent", err.tensor, err.detail, err.path)]
            return report
        compared = compare_checkpoints(ckpt, back, replace(options, atol=0.0, rtol=0.0))
        ranks = check_ranks(there, options.reading(own_config=False))  # each rank at tp as a runtime would load it
    report.tensors, report.differences = compared.tensors, compared.differences
    if ranks is not None:
        report.differences += ranks[1]
    return report
