"""``verify``'s per-rank check: every rank holds exactly its slice of each tensor, as the plan cuts it.

A comparison of gathered tensors cannot see a wrong cut: rank slices taken on the wrong axis gather back into
the same bytes. Here each tensor is gathered the way its ``reshard.json`` recorded it, cut again the way the
plan says a runtime expects (the model's plan, and for a quantized linear its weight's cut carried through the
format's table), and every rank's own slice compared with that piece, bit for bit. Where that cut gives each rank
exactly the rows the gather placed from its own slice (the recorded cut of an unquantized tensor split along a dim,
:func:`_own_rows`), the comparison would read a slice's bytes to compare them with themselves: the numbers prove it
without a read (a 4.17 GB tp 4 output in tmpfs: 8.4 -> 1.1 CPU-s). For each quantized linear,
each rank's stored tensors are also dequantized on their own (the format's arithmetic,
:mod:`reshard.commands.verify_dequant`) and compared with the rank's slice of the dequantized whole weight; a
linear's tensors are checked together, each gathered once for both checks.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from reshard.commands.verify_checks import Difference
from reshard.commands.verify_dequant import dequantize
from reshard.config import ModelConfig
from reshard.engine.gather import gather_canonical
from reshard.engine.open import OpenedCheckpoint, open_checkpoint
from reshard.engine.planner import SourceTensor
from reshard.engine.work import copy_plan
from reshard.errors import AmbiguousPartitionError, DivergentReplicaError, ReshardError, ShapeMismatchError
from reshard.options import ReadOptions
from reshard.partition import Partition, Replicate, Vocab, norm_dim, rank_rows
from reshard.plans import Plan
from reshard.quantization import QuantizedTensors, quantized_tensors
from reshard.quantization.plan import companion_partition, linear_partition, split_name
from reshard.slicing import bitwise_equal, split


def check_ranks(path: Path, read: ReadOptions) -> tuple[int, list[Difference]] | None:
    """How many tensors were checked on every rank, and what differs; ``None`` for a checkpoint of one rank.

    A tensor's expected cut is the one its ``reshard.json`` recorded (so a checkpoint written with ``--plan``
    verifies without it), except for a quantized linear's tensors: those follow the cut the plan a runtime
    loads with (the built-in plan, or ``--plan``) gives the linear's weight, through the format's table.
    """
    written = open_checkpoint(path, read, target_tp=1, recorded_plan=True)
    tp = written.source.tp
    if tp == 1:
        return None
    runtime = open_checkpoint(path, read, target_tp=tp).plan
    config = written.source.config
    quantized = quantized_tensors(config, {n: ref.shape for n, ref in written.source.ranks[0].items()})
    linears = quantized.linears if quantized is not None else {}
    units: dict[str, list[str]] = defaultdict(list)  # a quantized linear's tensors together, any other alone
    for name in written.by_name():
        module, _ = split_name(name)
        units[module if module in linears else name].append(name)
    diffs: list[Difference] = []
    checked = 0
    tensors = written.by_name()
    for unit, names in units.items():
        if unit not in linears and _own_rows(tensors[unit], written.uneven):
            checked += 1
            continue
        whole = {}  # a quantized linear's gathered tensors, kept for its dequantized check: each is gathered once
        for name in names:
            tensor = tensors[name]
            expected: tuple[Partition | None, str] = (tensor.partition, tensor.reason)
            if unit in linears:
                expected = _quantized_cut(quantized, name, runtime, config, diffs) or expected
            full = _gather(tensor, written, diffs)
            if full is not None and _same_slices(full, tensor, expected, diffs):
                checked += 1
            whole[split_name(name)[1]] = full
        if unit in linears and all(full is not None for full in whole.values()):  # else reported by the slice check
            _check_dequantized(unit, names, whole, written, runtime, quantized, diffs)
    return checked, diffs


def _own_rows(tensor: SourceTensor, uneven: bool) -> bool:
    """Whether the tensor's recorded cut gives every rank exactly the rows the gather places from its own slice (the
    gather's :func:`~reshard.engine.work.copy_plan` against the split's :func:`~reshard.partition.rank_rows`, every
    other dim the canonical one's): then each rank's piece is its own slice's bytes. Not for a replicated tensor or
    replicated heads (their copies are compared), nor a vocab (its pad rows are not data)."""
    partition, shapes = tensor.partition, [tuple(ref.shape) for ref in tensor.refs]
    if tensor.problem is not None or isinstance(partition, (Replicate, Vocab)) or not shapes:
        return False
    dim = norm_dim(partition.dim, len(tensor.shape))
    if any(len(shape) != len(tensor.shape) or _without(shape, dim) != _without(tensor.shape, dim) for shape in shapes):
        return False
    try:
        runs = rank_rows(partition, tensor.shape, len(shapes), uneven=len(set(shapes)) > 1)
        copies, _ = copy_plan(partition, shapes, uneven=uneven)
    except (ReshardError, ValueError):
        return False
    placed: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    for copy in copies:
        if copy.length:
            placed[copy.rank].append((copy.src, copy.dst, copy.length))
    for rank, shape in enumerate(shapes):
        mine = sorted(placed[rank])
        sources = [src for src, _, _ in mine]
        lengths = [length for _, _, length in mine]
        if sources != [sum(lengths[:i]) for i in range(len(mine))] or sum(lengths) != shape[dim]:
            return False  # the gather does not take the whole slice, in order
        if [(dst, length) for _, dst, length in mine] != [run for run in runs[rank] if run[1]]:
            return False
    return True


def _without(shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
    return shape[:dim] + shape[dim + 1 :]


def _quantized_cut(
    quantized: QuantizedTensors, name: str, plan: Plan, config: ModelConfig | None, diffs: list[Difference]
) -> tuple[Partition, str] | None:
    scoped = config.for_tensor(name) if config is not None else None
    try:
        return companion_partition(quantized.scheme, name, plan, scoped, quantized.linears)
    except AmbiguousPartitionError as err:
        diffs.append(Difference("rank-slice", name, f"no cut planned: {err.detail}"))
        return None


def _gather(tensor: SourceTensor, written: OpenedCheckpoint, diffs: list[Difference]) -> torch.Tensor | None:
    if tensor.problem is not None:
        diffs.append(Difference("inconsistent", tensor.name, tensor.problem.detail, _files(tensor)))
        return None
    try:
        with torch.inference_mode():
            return gather_canonical(tensor, uneven=written.uneven)
    except (DivergentReplicaError, ShapeMismatchError) as err:
        diffs.append(Difference("inconsistent", tensor.name, err.detail, _files(tensor)))
        return None


def _same_slices(
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
        diffs.append(Difference("rank-slice", written.name, what, _files(written)))
        return False
    rows = _data_rows(partition, full, pieces)
    wrong = [
        r
        for r, (ref, piece) in enumerate(zip(written.refs, pieces, strict=True))
        if not _equal(ref.read(), piece, None if rows is None else rows[r])
    ]
    if wrong:
        what = f"rank(s) {wrong} do not hold their {partition.describe()} slice ({reason})"
        diffs.append(Difference("rank-slice", written.name, what, _files(written)))
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


def _check_dequantized(
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
                        _files(tensors[names[0]]),
                    )
                )


def _files(tensor: SourceTensor) -> str:
    return ", ".join(dict.fromkeys(str(ref.file) for ref in tensor.refs))
