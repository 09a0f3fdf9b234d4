"""Two sets of tensors compared by name, as ``verify CKPT OTHER`` compares two checkpoints' weights and
``--train-state`` their optimizer states: by the digests of their canonical bytes, streamed from the slices on a
thread per core, and value by value for tensors those do not show equal; one tensor of each side held at a time."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from reshard.commands.verify_checks import Difference, files_of, value_difference
from reshard.dtypes import name_of
from reshard.engine.move.digest import ALGORITHM
from reshard.engine.move.stream import canonical_digest
from reshard.engine.plan.planner import SourceTensor
from reshard.errors import DivergentReplicaError
from reshard.io.progress import progress_bar
from reshard.options import cores

if TYPE_CHECKING:
    import torch

_Result = TypeVar("_Result")


@dataclass(frozen=True)
class Tolerance:
    """How close two values must be: bit for bit when both are 0 (``torch.isclose``'s ``atol`` and ``rtol``)."""

    atol: float = 0.0
    rtol: float = 0.0

    @property
    def exact(self) -> bool:
        return self.atol == 0 and self.rtol == 0


@dataclass
class Compared:
    """What a comparison found: the tensors compared, the differences (each naming its tensor)."""

    tensors: int = 0
    differences: list[Difference] = field(default_factory=list)


def compare_tensors(
    ours: Mapping[str, SourceTensor],
    theirs: Mapping[str, SourceTensor],
    *,
    names: tuple[str, str],
    tolerance: Tolerance,
    progress: bool,
) -> Compared:
    """Compare two sets of tensors by name: missing, extra, reshaped, dtype and value differences.

    Args:
        ours: one side's tensors by name.
        theirs: the other side's.
        names: how to call each side in a difference (the checkpoints' paths).
        tolerance: bit-exact unless set; with a tolerance, tensors of different dtypes are compared by value (in
            float64) instead of being reported as a dtype difference.
        progress: a progress bar on stderr.
    """
    ckpt, other = names
    found = Compared()
    diffs = found.differences
    diffs += [Difference("missing", n, f"not in {other}", files_of(t)) for n, t in ours.items() if n not in theirs]
    diffs += [Difference("extra", n, f"not in {ckpt}", files_of(t)) for n, t in theirs.items() if n not in ours]
    common = []
    for name in (n for n in ours if n in theirs):
        ta, tb = ours[name], theirs[name]
        if ta.shape is None or tb.shape is None:
            common.append(name)  # a problem: reported as inconsistent by gather
        elif ta.shape != tb.shape:
            diffs.append(Difference("reshaped", name, f"{list(ta.shape)} vs {list(tb.shape)}", files_of(tb)))
        elif ta.code != tb.code and tolerance.exact:
            diffs.append(Difference("dtype", name, f"{name_of(ta.code)} vs {name_of(tb.code)}", files_of(tb)))
        else:
            common.append(name)

    def same(name: str) -> bool:
        return same_bytes(ours[name], theirs[name])

    for name, equal in on_threads(same, common, progress):
        if equal.result():
            found.tensors += 1
            continue
        left = gather(ours[name], diffs)  # one tensor of each side at a time
        if left is None:
            continue
        right = gather(theirs[name], diffs)
        if right is None:
            continue
        found.tensors += 1
        difference = value_difference(left, right, atol=tolerance.atol, rtol=tolerance.rtol)
        if difference is not None:
            what = "bytes differ" if tolerance.exact else f"outside atol={tolerance.atol}, rtol={tolerance.rtol}"
            detail = f"{what}: max abs difference {difference:.6g}"
            diffs.append(Difference("values", name, detail, files_of(theirs[name]), difference))
    return found


def same_bytes(ours: SourceTensor, theirs: SourceTensor) -> bool:
    """Whether two tensors of one dtype hold the same canonical bytes, by their digests (BLAKE3) streamed from the
    slices (:func:`~reshard.engine.move.stream.canonical_digest`), with no gather and no torch: equal bytes are equal
    values at any tolerance. False when they differ, either does not stream, or its copies differ: then both are
    gathered, and compared (and reported) in torch."""
    if ours.problem or theirs.problem or ours.code != theirs.code:
        return False
    try:
        left = canonical_digest(ours, finite=False, algorithm=ALGORITHM)
        right = canonical_digest(theirs, finite=False, algorithm=ALGORITHM) if left else None
    except DivergentReplicaError:
        return False
    return left is not None and left == right


def gather(tensor: SourceTensor, diffs: list[Difference]) -> torch.Tensor | None:
    """One canonical tensor gathered whole (:func:`reshard.commands.verify_slices.gather`: a tensor that cannot be
    becomes a difference); imports torch, which a check whose every tensor streams never does."""
    from reshard.commands.verify_slices import gather as gather_slices

    return gather_slices(tensor, diffs)


def on_threads(
    work: Callable[[str], _Result], names: list[str], progress: bool
) -> Iterator[tuple[str, Future[_Result]]]:
    """``work(name)`` of every name on a thread per core, yielded in the order of ``names`` with a progress bar; on
    leaving (a file that cannot be read ends a check) the names not started are not."""
    pool = ThreadPoolExecutor(max_workers=cores(), thread_name_prefix="reshard-verify")
    bar = progress_bar(progress, total=len(names), desc="verify", unit="tensor", leave=False)
    try:
        for name, future in zip(names, [pool.submit(work, name) for name in names], strict=True):
            bar.update()
            yield name, future
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
