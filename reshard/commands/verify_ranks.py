"""``verify``'s per-rank check: every rank holds exactly its slice of each tensor, as the plan cuts it.

A comparison of gathered tensors cannot see a wrong cut: rank slices taken on the wrong axis gather back into
the same bytes. Here each tensor is gathered the way its ``reshard.json`` recorded it, cut again the way the
plan says a runtime expects (the model's plan, and for a quantized linear its weight's cut carried through the
format's table), and every rank's own slice compared with that piece, bit for bit. Where that cut gives each rank
exactly the rows the gather placed from its own slice (the recorded cut of an unquantized tensor split along a dim,
a vocab's data rows: :func:`_own_rows`), the comparison would read a slice's bytes to compare them with themselves:
the numbers prove it without a read. A replicated tensor's copies are compared block by block, as the manifest check
streams them (:func:`_same_copies`). The rest is read whole and compared in torch
(:mod:`reshard.commands.verify_slices`, imported only then): for each quantized linear, each rank's stored tensors
are also dequantized on their own (the format's arithmetic, :mod:`reshard.commands.verify_dequant`) and compared
with the rank's slice of the dequantized whole weight; a linear's tensors are checked together, each gathered once
for both checks. A check that proves every tensor by the numbers imports no torch (docs/performance.md).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from reshard.commands.verify_checks import Difference, files_of
from reshard.config import ModelConfig
from reshard.engine.move.digest import ALGORITHM
from reshard.engine.move.stream import canonical_digest
from reshard.engine.plan.open import open_checkpoint
from reshard.engine.plan.planner import SourceTensor
from reshard.errors import AmbiguousPartitionError, DivergentReplicaError, ReshardError
from reshard.geometry import Partition, Replicate
from reshard.options import ReadOptions
from reshard.plans import Plan
from reshard.quantization import QuantizedTensors, quantized_tensors
from reshard.quantization.plan import companion_partition, split_name


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
    quantized = quantized_tensors(config, {n: ref.shape for n, ref in written.source.ranks[0].items()}, ranks=tp)
    linears = quantized.linears if quantized is not None else {}
    units: dict[str, list[str]] = defaultdict(list)  # a quantized linear's tensors together, any other alone
    for name in written.by_name():
        module, _ = split_name(name)
        units[module if module in linears else name].append(name)
    diffs: list[Difference] = []
    checked = 0
    tensors = written.by_name()
    for unit, names in units.items():
        if unit not in linears:
            proven = _own_rows(tensors[unit]) or _same_copies(tensors[unit], diffs)
            if proven is not None:
                checked += proven
                continue
        from reshard.commands import verify_slices as slices  # torch: only for a unit read and compared

        whole = {}  # a quantized linear's gathered tensors, kept for its dequantized check: each is gathered once
        for name in names:
            tensor = tensors[name]
            expected: tuple[Partition | None, str] = (tensor.partition, tensor.reason)
            if quantized is not None and unit in linears:
                expected = _quantized_cut(quantized, name, runtime, config, diffs) or expected
            full = slices.gather(tensor, diffs)
            if full is not None and slices.same_slices(full, tensor, expected, diffs):
                checked += 1
            whole[split_name(name)[1]] = full
        gathered = {key: full for key, full in whole.items() if full is not None}
        if quantized is not None and unit in linears and len(gathered) == len(whole):  # else the slice check reported
            slices.check_dequantized(unit, names, gathered, written, runtime, quantized, diffs)
    return checked, diffs


def _own_rows(tensor: SourceTensor) -> bool:
    """Whether the tensor's recorded cut gives every rank exactly its own slice, each row once: a tensor split along
    a dim without copies. Its slices gathered by their cut and cut again by the same cut (as
    :mod:`~reshard.commands.verify_slices` would) give each rank its own bytes back, so there is nothing to read
    (a vocab's pad rows are not data, and not compared either way). Not for a replicated tensor or replicated heads:
    their copies are compared. The shapes are checked against the cut when it is made
    (:func:`~reshard.geometry.slices_cut`); slices that are not such a cut are read and reported."""
    if tensor.problem is not None or isinstance(tensor.partition, Replicate) or not tensor.refs:
        return False
    try:
        return tensor.cut.own_slices()
    except (ReshardError, ValueError):
        return False


def _same_copies(tensor: SourceTensor, diffs: list[Difference]) -> bool | None:
    """For a replicated tensor, whether every rank's copy (its piece of the cut) is the first one's, compared block
    by block as the manifest check streams them (:func:`~reshard.engine.move.stream.canonical_digest`), a difference
    recorded if not; None for any other tensor, or one that does not stream: it is read and compared in torch."""
    if tensor.problem is not None or not isinstance(tensor.partition, Replicate):
        return None
    try:
        streamed = canonical_digest(tensor, finite=False, algorithm=ALGORITHM)
    except DivergentReplicaError as err:
        diffs.append(Difference("inconsistent", tensor.name, err.detail, files_of(tensor)))
        return False
    return None if streamed is None else True


def _quantized_cut(
    quantized: QuantizedTensors, name: str, plan: Plan, config: ModelConfig | None, diffs: list[Difference]
) -> tuple[Partition, str] | None:
    scoped = config.for_tensor(name) if config is not None else None
    try:
        return companion_partition(quantized.scheme, name, plan, scoped, quantized.linears)
    except AmbiguousPartitionError as err:
        diffs.append(Difference("rank-slice", name, f"no cut planned: {err.detail}"))
        return None
