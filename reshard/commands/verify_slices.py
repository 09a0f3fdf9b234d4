"""``verify``'s rank check, the part that reads: a tensor gathered, cut again by the expected cut, and each rank's
slice compared with its piece bit for bit; a quantized linear's tensors dequantized per rank
(:mod:`reshard.commands.verify_dequant`). Imported by :func:`~reshard.commands.verify_ranks.check_ranks` only for a
unit the numbers cannot prove, so a check that reads nothing imports no torch."""

from __future__ import annotations

import torch

from reshard.commands.verify_checks import Difference, files_of
from reshard.commands.verify_dequant import dequantize
from reshard.engine.move.gather import gather_canonical
from reshard.engine.plan.open import OpenedCheckpoint
from reshard.engine.plan.planner import SourceTensor
from reshard.errors import DivergentReplicaError, ReshardError, ShapeMismatchError
from reshard.geometry import Partition, Replicate, Vocab, norm_dim
from reshard.geometry.tensors import bitwise_equal, split
from reshard.plans import Plan
from reshard.quantization import QuantizedTensors
from reshard.quantization.plan import linear_partition, split_name


def gather(tensor: SourceTensor, diffs: list[Difference]) -> torch.Tensor | None:
    """The canonical tensor as its checkpoint records it; None, with an ``inconsistent`` difference, when its slices do
    not gather (a problem found while planning, copies that differ, shapes that do not fit)."""
    if tensor.problem is not None:
        diffs.append(Difference("inconsistent", tensor.name, tensor.problem.detail, files_of(tensor)))
        return None
    try:
        with torch.inference_mode():
            return gather_canonical(tensor)
    except (DivergentReplicaError, ShapeMismatchError) as err:
        diffs.append(Difference("inconsistent", tensor.name, err.detail, files_of(tensor)))
        return None


def same_slices(
    full: torch.Tensor, written: SourceTensor, expected: tuple[Partition | None, str], diffs: list[Difference]
) -> bool:
    """Whether every rank holds the piece of ``full`` the expected cut gives it (a difference if not)."""
    partition, reason = expected
    if partition is None:
        return False
    try:
        pieces = _pieces(full, partition, written)
    except (ShapeMismatchError, RuntimeError) as err:
        what = f"the ranks do not hold its {partition.describe()} cut ({reason}): {err}"
        diffs.append(Difference("rank-slice", written.name, what, files_of(written)))
        return False
    rows = _data_rows(partition, full, pieces)
    wrong = [
        r
        for r, (ref, piece) in enumerate(zip(written.refs, pieces, strict=True))
        if not _equal(ref.read(), piece, None if rows is None else rows[r])
    ]
    if wrong:
        what = f"rank(s) {wrong} do not hold their {partition.describe()} slice ({reason})"
        diffs.append(Difference("rank-slice", written.name, what, files_of(written)))
    return not wrong


def _pieces(full: torch.Tensor, partition: Partition, written: SourceTensor) -> list[torch.Tensor]:
    tp = len(written.refs)
    padded = None
    if isinstance(partition, Vocab):
        padded = sum(ref.shape[norm_dim(partition.dim, len(ref.shape))] for ref in written.refs)
    uneven = not isinstance(partition, Replicate) and len({ref.shape for ref in written.refs}) > 1
    return split(full, partition, tp, padded=padded, uneven=uneven)


def _data_rows(partition: Partition, full: torch.Tensor, pieces: list[torch.Tensor]) -> list[tuple] | None:
    """For a vocab-parallel tensor, each rank's ``(dim, start, length)`` of real rows: pad rows are not data
    (Megatron leaves them random), so they are not compared."""
    if not isinstance(partition, Vocab):
        return None
    dim = norm_dim(partition.dim, full.dim())
    out, start = [], 0
    for piece in pieces:
        size = piece.shape[dim]
        out.append((dim, 0, max(0, min(size, full.shape[dim] - start))))
        start += size
    return out


def _equal(a: torch.Tensor, b: torch.Tensor, rows: tuple | None = None) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if rows is not None:
        a, b = a.narrow(*rows), b.narrow(*rows)
    return bitwise_equal(a.contiguous(), b.contiguous())


def check_dequantized(
    module: str,
    names: list[str],
    whole: dict[str, torch.Tensor],
    written: OpenedCheckpoint,
    plan: Plan,
    quantized: QuantizedTensors,
    diffs: list[Difference],
) -> None:
    """Each rank's stored tensors of ``module`` dequantized on their own against the rank's slice of the whole
    (``whole``: the module's gathered tensors by suffix)."""
    tensors = written.by_name()
    config = written.source.config.for_tensor(f"{module}.weight") if written.source.config else None
    scheme = quantized.scheme
    with torch.inference_mode():
        try:
            partition = linear_partition(plan, module, config)
            slices = split(dequantize(scheme, whole), partition, written.source.tp)
        except (ReshardError, ShapeMismatchError, ValueError, RuntimeError) as err:
            diffs.append(Difference("dequantized", module, f"the whole weight does not dequantize: {err}"))
            return
        for rank, piece in enumerate(slices):
            stored = {split_name(n)[1]: tensors[n].refs[rank].read() for n in names}
            try:
                mine = dequantize(scheme, stored)
            except (ValueError, RuntimeError) as err:
                mine, why = None, str(err)
            if mine is None or mine.shape != piece.shape or not torch.equal(mine, piece):
                detail = why if mine is None else f"{list(mine.shape)} vs {list(piece.shape)}, values differ"
                diffs.append(
                    Difference(
                        "dequantized",
                        module,
                        f"rank {rank}'s {scheme.method} tensors do not dequantize to its {partition.describe()} "
                        f"slice of the weight: {detail}",
                        files_of(tensors[names[0]]),
                    )
                )
