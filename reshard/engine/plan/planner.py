"""Headers -> every tensor's partition, canonical shape and target slices. Pure: no torch, no file opened.

:func:`plan_sources` decides, for every tensor of a source checkpoint, how its rank slices join (a plan
rule, else inference from shapes and the config) and the canonical shape they join into; a tensor that
cannot be planned carries its problem instead of raising, so ``inspect`` can show it beside the rest.
:func:`plan_conversion` adds the per-rank shapes at the target tp and raises every problem at once
(:class:`~reshard.errors.PlanError`) before any output exists. Bytes move in :mod:`reshard.engine.move.execute`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING

from reshard.config import ModelConfig
from reshard.dtypes import TensorHeader, safetensors_order
from reshard.errors import AmbiguousPartitionError, PlanError, ReshardError, ShapeMismatchError
from reshard.geometry import (
    Cut,
    Heads,
    Packed,
    Partition,
    Replicate,
    ReplicatedHeads,
    Shard,
    canonical_shape,
    rank_shapes,
    slices_cut,
)
from reshard.layouts.base import SourceCheckpoint, TensorRef
from reshard.plans import Plan, Rule, infer_partition
from reshard.quantization import QuantizedTensors, quantized_tensors
from reshard.quantization.dequant_plan import COMPANIONS
from reshard.vocab import VocabPlan, finish_vocab, source_padded_rows

if TYPE_CHECKING:
    import torch

    from reshard.mappings.base import MappedGroup
    from reshard.mappings.transforms import Transform

Shape = tuple[int, ...]
# Reads the rank slices of one tensor and says whether they are bitwise equal (None: headers only).
ReplicaCheck = Callable[[Sequence[TensorRef]], bool]


@dataclass(frozen=True)
class SourceTensor:
    """How one tensor sits in the source: its rank slices, partition, the reason, the canonical shape.

    ``problem`` is set (and ``partition`` / ``shape`` may be None) when it cannot be gathered.
    """

    name: str
    refs: tuple[TensorRef, ...]
    partition: Partition | None
    reason: str
    shape: Shape | None
    problem: ReshardError | None = None

    @property
    def code(self) -> str:
        """The safetensors dtype code, e.g. ``"BF16"``."""
        return self.refs[0].code

    @property
    def planned(self) -> tuple[Partition, Shape]:
        """``(partition, canonical shape)`` of a tensor planned without a problem.

        Raises:
            ReshardError: the tensor's problem, when it could not be planned.
        """
        if self.partition is None or self.shape is None:
            raise self.failure
        return self.partition, self.shape

    @property
    def failure(self) -> ReshardError:
        """Why it could not be planned: its problem (every tensor without a partition or a shape has one)."""
        return self.problem or ReshardError("not planned", tensor=self.name)

    @cached_property
    def cut(self) -> Cut:
        """Where each rank slice's rows go in the canonical tensor: what the gather places, the stream reads and
        ``verify`` proves (only for a tensor planned without a problem)."""
        partition, shape = self.planned
        return slices_cut(partition, shape, [ref.shape for ref in self.refs])

    @property
    def dtype(self) -> torch.dtype:
        return self.refs[0].dtype


@dataclass(frozen=True)
class TargetTensor:
    """One tensor of the output: its name, canonical shape and dtype, its partition and per-rank shapes."""

    name: str
    shape: Shape
    code: str
    partition: Partition
    rank_shapes: tuple[Shape, ...] = ()

    @property
    def nbytes(self) -> int:
        return TensorHeader(self.shape, self.code).nbytes

    @cached_property
    def cut(self) -> Cut:
        """Which canonical rows each target rank's slice holds (a vocab padded to the rows its rank shapes add up
        to): what the gather's split, the stream's writes and a transform's output split all follow."""
        return slices_cut(self.partition, self.shape, self.rank_shapes)


@dataclass(frozen=True)
class TensorPlan:
    """One unit of work: source tensors gathered together, turned into target tensors, split for the target.

    Without a ``transform`` it is one source tensor written as one target tensor of the same name (a
    re-slice); with one (a mapping between namings), the gathered sources go through it first.
    """

    sources: tuple[SourceTensor, ...]
    targets: tuple[TargetTensor, ...]
    transform: Transform | None = None

    @property
    def name(self) -> str:
        return self.targets[0].name

    @property
    def code(self) -> str:
        return self.targets[0].code

    @property
    def nbytes(self) -> int:
        """Bytes of the canonical target tensors."""
        return sum(t.nbytes for t in self.targets)


def identity_plan(source: SourceTensor) -> TensorPlan:
    """A source tensor kept under its name and partition (rank shapes are filled by :func:`plan_conversion`)."""
    partition, shape = source.planned
    return TensorPlan((source,), (TargetTensor(source.name, shape, source.code, partition),))


@dataclass(frozen=True)
class ConversionPlan:
    source: SourceCheckpoint
    target_tp: int
    tensors: tuple[TensorPlan, ...]
    vocab: VocabPlan
    uneven: bool


def plan_sources(
    source: SourceCheckpoint,
    plan: Plan,
    *,
    vocab_size: int | None,
    target_tp: int = 1,
    uneven: bool = False,
    replicas_equal: ReplicaCheck | None = None,
    dequantize: bool = False,
) -> list[SourceTensor]:
    """Decide, for every tensor, its partition (plan rule, else inference) and canonical shape.

    ``dequantize`` (``--dtype``): a quantization scale of a one-rank source is read whole as stored, consumed by its
    weight's dequantization or dropped, never split (the cut its name or shape would get, a padded vocab's, say,
    does not apply).

    ``replicas_equal`` reads bytes when shapes alone cannot tell a replicated tensor from a split one;
    without it (``reshard check`` reads headers only) such a tensor gets a problem instead.
    """
    out = []
    quantized = quantized_tensors(source.config, {n: ref.shape for n, ref in source.ranks[0].items()}, ranks=source.tp)
    for name in source.names():
        refs = [rank.get(name) for rank in source.ranks]
        present = tuple(ref for ref in refs if ref is not None)
        if len(present) < len(refs):
            absent = [r for r, ref in enumerate(refs) if ref is None]
            problem = ShapeMismatchError(
                f"missing on rank(s) {absent} of {source.tp}",
                path=present[0].file,
                tensor=name,
                hint="every rank file must hold every tensor",
            )
            out.append(SourceTensor(name, present, None, "", None, problem))
            continue
        if dequantize and len(present) == 1 and name.rpartition(".")[2] in COMPANIONS:
            out.append(SourceTensor(name, present, Replicate(), "read with its FP8 weight", present[0].shape))
            continue
        out.append(
            _plan_one(name, present, plan, source.config, vocab_size, target_tp, uneven, replicas_equal, quantized)
        )
    return out


@dataclass(frozen=True)
class Matched:
    """The rule that cuts a tensor and why; ``quantized``: a stored tensor of a quantized linear, whose rule (for its
    own name) the format's table made from the linear's weight's cut."""

    rule: Rule
    reason: str
    quantized: bool = False


def matched_rule(
    name: str,
    plan: Plan,
    config: ModelConfig | None,
    quantized: QuantizedTensors | None,
    *,
    whole_at_tp1: bool = False,
) -> Matched | None:
    """The one decision of which rule cuts ``name`` (for a conversion and for ``check`` alike): a stored tensor of a
    quantized linear is cut with the linear's weight, any other by the plan's first matching rule; None when no rule
    covers it (inference's turn in a conversion, a finding in ``check``). ``config``: the sub-config that sizes it.

    Raises:
        AmbiguousPartitionError: a quantized linear's tensor that no table covers, and that would be cut.
    """
    companion = _quantized_partition(quantized, name, plan, config, whole_at_tp1=whole_at_tp1)
    if companion is not None:
        return Matched(Rule(f"^{re.escape(name)}$", companion[0]), companion[1], quantized=True)
    rule = plan.match(name)
    return None if rule is None else Matched(rule, f"rule '{rule.pattern}' ({plan.name})")


def _quantized_partition(
    quantized: QuantizedTensors | None, name: str, plan: Plan, config: ModelConfig | None, *, whole_at_tp1: bool
) -> tuple[Partition, str] | None:
    """``name``'s cut when it is a stored tensor of a quantized linear. One no rule covers is refused when it
    would be cut, and read whole when nothing is (one rank read at tp 1: ``--dtype`` dequantizes it there)."""
    if quantized is None:
        return None
    try:
        return quantized.partition(name, plan, config)
    except AmbiguousPartitionError as err:
        if whole_at_tp1:
            return Replicate(), f"read whole at tp 1 ({err.detail})"
        raise


def _plan_one(
    name: str,
    refs: tuple[TensorRef, ...],
    plan: Plan,
    config: ModelConfig | None,
    vocab_size: int | None,
    target_tp: int,
    uneven: bool,
    replicas_equal: ReplicaCheck | None,
    quantized: QuantizedTensors | None = None,
) -> SourceTensor:
    shapes = [ref.shape for ref in refs]
    problem: ReshardError
    if len({ref.code for ref in refs}) > 1:
        problem = ShapeMismatchError(
            f"ranks disagree on dtype: {[str(r.dtype) for r in refs]}", path=refs[0].file, tensor=name
        )
        return SourceTensor(name, refs, None, "", None, problem)
    rule = plan.match(name)
    config = config.for_tensor(name) if config is not None else None  # a composite's sub-model sizes it
    try:
        matched = matched_rule(name, plan, config, quantized, whole_at_tp1=target_tp == 1 and len(refs) == 1)
        if matched is not None:
            partition, reason = matched.rule.resolve(config), matched.reason
        else:
            partition, reason = infer_partition(
                shapes,
                config,
                vocab_size=vocab_size,
                target_tp=target_tp,
                replicas_equal=_bytes_check(refs, replicas_equal),
            )
        shape = canonical_shape(partition, shapes, vocab_size=vocab_size, uneven=uneven)
    except AmbiguousPartitionError as err:
        problem = AmbiguousPartitionError(
            f"no plan rule, and {err.detail}"
            if rule is None
            else f"rule '{rule.pattern}' ({plan.name}): {err.detail}",
            path=refs[0].file,
            tensor=name,
            hint="add a rule for it with --plan FILE"
            if rule is None
            else "give the model's config with --config FILE",
        )
        return SourceTensor(name, refs, None, "", None, problem)
    except ShapeMismatchError as err:
        problem = ShapeMismatchError(
            f"{partition.describe()} ({reason}): {err.detail}", path=refs[0].file, tensor=name
        )
        return SourceTensor(name, refs, partition, reason, None, problem)
    return SourceTensor(name, refs, partition, reason, shape)


def _bytes_check(refs: tuple[TensorRef, ...], replicas_equal: ReplicaCheck | None) -> Callable[[], bool]:
    def check() -> bool:
        if replicas_equal is None:
            raise AmbiguousPartitionError(f"rank shapes {[list(r.shape) for r in refs]} need its bytes to tell")
        return replicas_equal(refs)

    return check


def mapped_plans(
    tensors: Sequence[SourceTensor],
    groups: Sequence[MappedGroup],
    target_plan: Plan,
    target_config: ModelConfig | None,
    *,
    target_tp: int,
) -> tuple[list[TensorPlan], list[ReshardError]]:
    """The units of work of a mapping: each group's source tensors, transform, and target tensors with the
    partitions the target's plan gives them (at tp 1 a tensor the target plan does not name stays whole)."""
    by_name = {t.name: t for t in tensors}
    plans: list[TensorPlan] = []
    problems: list[ReshardError] = []
    for group in groups:
        sources = tuple(by_name[name] for name in group.sources)
        if len({s.code for s in sources}) > 1:
            problems.append(
                ShapeMismatchError(
                    f"{', '.join(group.sources)} have different dtypes and cannot be fused", tensor=group.targets[0]
                )
            )
            continue
        targets = []
        for name, shape in zip(group.targets, group.shapes, strict=True):
            rule = target_plan.match(name)
            try:
                if rule is None and target_tp > 1:
                    raise AmbiguousPartitionError(f"the {target_plan.name} plan has no rule for it")
                config = target_config.for_tensor(name) if target_config is not None else None
                partition = Replicate() if rule is None else rule.resolve(config)
            except AmbiguousPartitionError as err:
                problems.append(AmbiguousPartitionError(err.detail, tensor=name, hint="add a rule with --plan FILE"))
                continue
            targets.append(TargetTensor(name, shape, sources[0].code, partition))
        if len(targets) == len(group.targets):
            plans.append(TensorPlan(sources, tuple(targets), group.transform))
    return plans, problems


def plan_conversion(
    source: SourceCheckpoint,
    tensors: Sequence[SourceTensor],
    *,
    vocab: VocabPlan,
    target_tp: int,
    pad_multiple: int | None = None,
    uneven: bool = False,
    groups: Sequence[TensorPlan] | None = None,
    problems: Sequence[ReshardError] = (),
    known_vocab: tuple[int, str] | None = None,
) -> ConversionPlan:
    """Plan every target tensor for ``target_tp`` ranks; all problems are raised together as a :class:`PlanError`.

    ``groups`` are the units of work when a mapping renames or fuses tensors (default: every source
    tensor kept as it is); ``problems`` found before (by the mapping) are raised with the rest. The vocab is finished
    here (:func:`~reshard.vocab.finish_vocab`; ``known_vocab``: the true size a mapping knows).
    """
    problems = [*problems, *(t.problem for t in tensors if t.problem)]
    vocab, vocab_problem = finish_vocab(
        vocab,
        known=known_vocab,
        source_padded=source_padded_rows(tensors),
        multiple=pad_multiple or target_tp,
        tp=target_tp,
        uneven=uneven,
    )
    if vocab_problem is not None:
        problems.append(vocab_problem)
    target_padded = vocab.target_padded
    if groups is None:
        groups = [identity_plan(t) for t in tensors if not t.problem]
    planned: list[TensorPlan] = []
    unsplit: list[ReshardError] = []
    for group in groups:
        if any(s.problem for s in group.sources):
            continue
        targets = []
        for target in group.targets:
            try:
                shapes = rank_shapes(target.partition, target.shape, target_tp, padded=target_padded, uneven=uneven)
            except ShapeMismatchError as err:
                source_tensor = group.sources[0]
                why = f"{source_tensor.reason}: " if _whole_units(target.partition) and source_tensor.reason else ""
                unsplit.append(
                    ShapeMismatchError(
                        f"{why}{target.partition.describe()} of {list(target.shape)} cannot be split {target_tp} "
                        f"ways: {err.detail}",
                        path=group.sources[0].refs[0].file,
                        tensor=target.name,
                        hint=_tp_hint(target.partition),
                    )
                )
                problems.append(unsplit[-1])
                continue
            targets.append(replace(target, rank_shapes=tuple(shapes)))
        if len(targets) == len(group.targets):
            planned.append(replace(group, targets=tuple(targets)))
    if problems:
        raise PlanError(problems, unsplit=unsplit)
    planned.sort(key=lambda t: safetensors_order(t.name, t.code))
    return ConversionPlan(source, target_tp, tuple(planned), vocab, uneven)


def mixed_runs(source: SourceCheckpoint, tensors: Sequence[SourceTensor]) -> ReshardError | None:
    """The rank files of runs at different tps mixed in one checkpoint (ranks 0-3 of a tp=4 run beside ranks 4-7
    of a tp=8 run), told by their shapes: the ranks fall into runs of consecutive ranks, at least two ranks each,
    that agree on every shape within a run and differ between runs. Only asked when some tensor could not be
    planned (then this is the cause to name, not each tensor's sizes or the vocab)."""
    if source.tp < 4 or not any(t.problem for t in tensors):
        return None
    names = sorted(set.intersection(*(set(rank) for rank in source.ranks)))
    signatures = [tuple(rank[n].shape for n in names) for rank in source.ranks]
    runs: list[list[int]] = []
    for r, signature in enumerate(signatures):
        if runs and signatures[runs[-1][0]] == signature:
            runs[-1].append(r)
        else:
            runs.append([r])
    if len(runs) < 2 or any(len(run) < 2 for run in runs) or len({signatures[run[0]] for run in runs}) < len(runs):
        return None
    name = next(n for i, n in enumerate(names) if len({signatures[run[0]][i] for run in runs}) > 1)
    held = ", ".join(f"ranks {run[0]}-{run[-1]} hold {list(source.ranks[run[0]][name].shape)}" for run in runs)
    return ShapeMismatchError(
        f"the rank files seem to be of {len(runs)} runs at different tps, mixed: {held}",
        path=source.path,
        tensor=name,
        hint="keep the rank files of one run together",
    )


def _tp_hint(partition: Partition) -> str:
    if _whole_units(partition):
        return "a quantized layer's blocks, groups and packed words are never cut, --uneven or not: choose a tp"
    if isinstance(partition, Heads):
        return f"choose a tp that divides the {partition.heads} heads"
    if isinstance(partition, ReplicatedHeads):
        return f"choose a tp that divides the {partition.heads} heads or is a multiple of them"
    return "choose a tp that divides it" + ("" if _whole_blocks(partition) else ", or --uneven")


def _whole_units(partition: Partition) -> bool:
    """True for the cut of a quantized tensor (:mod:`reshard.quantization.plan`)."""
    return isinstance(partition, (Shard, Packed)) and partition.whole


def _whole_blocks(partition: Partition) -> bool:
    """True when the partition splits in blocks (heads) that ``--uneven`` must not cut either."""
    units = partition.part_units() if isinstance(partition, Packed) else (getattr(partition, "unit", 1),)
    return any(unit != 1 for unit in units)
