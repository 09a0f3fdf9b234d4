"""Headers -> every tensor's partition, canonical shape and target slices. Pure: no torch, no file opened.

:func:`plan_sources` decides, for every tensor of a source checkpoint, how its rank slices join (a plan
rule, else inference from shapes and the config) and the canonical shape they join into; a tensor that
cannot be planned carries its problem instead of raising, so ``inspect`` can show it beside the rest.
:func:`plan_conversion` adds the per-rank shapes at the target tp and raises every problem at once
(:class:`~reshard.errors.PlanError`) before any output exists. Bytes move in :mod:`reshard.engine.execute`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from reshard.config import ModelConfig
from reshard.dtypes import safetensors_order
from reshard.errors import AmbiguousPartitionError, PlanError, ReshardError, ShapeMismatchError
from reshard.layouts.base import SourceCheckpoint, TensorRef
from reshard.layouts.readers import TensorHeader
from reshard.partition import Packed, Partition, ReplicatedHeads, canonical_shape, rank_shapes
from reshard.plans import Plan, infer_partition
from reshard.vocab import VocabPlan, padded_size, source_padded_rows

if TYPE_CHECKING:
    import torch

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
    def dtype(self) -> torch.dtype:
        return self.refs[0].dtype


@dataclass(frozen=True)
class TensorPlan:
    """A source tensor plus the per-rank shapes it will have at the target."""

    source: SourceTensor
    target_shapes: tuple[Shape, ...]

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def nbytes(self) -> int:
        return TensorHeader(self.source.shape, self.source.code).nbytes


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
) -> list[SourceTensor]:
    """Decide, for every tensor, its partition (plan rule, else inference) and canonical shape.

    ``replicas_equal`` reads bytes when shapes alone cannot tell a replicated tensor from a split one;
    without it (``reshard check`` reads headers only) such a tensor gets a problem instead.
    """
    out = []
    for name in source.names():
        refs = [rank.get(name) for rank in source.ranks]
        absent = [r for r, ref in enumerate(refs) if ref is None]
        if absent:
            present = tuple(r for r in refs if r)
            problem = ShapeMismatchError(
                f"missing on rank(s) {absent} of {source.tp}",
                path=present[0].file,
                tensor=name,
                hint="every rank file must hold every tensor",
            )
            out.append(SourceTensor(name, present, None, "", None, problem))
            continue
        out.append(_plan_one(name, tuple(refs), plan, source.config, vocab_size, target_tp, uneven, replicas_equal))
    return out


def _plan_one(
    name: str,
    refs: tuple[TensorRef, ...],
    plan: Plan,
    config: ModelConfig | None,
    vocab_size: int | None,
    target_tp: int,
    uneven: bool,
    replicas_equal: ReplicaCheck | None,
) -> SourceTensor:
    shapes = [ref.shape for ref in refs]
    if len({ref.code for ref in refs}) > 1:
        problem = ShapeMismatchError(
            f"ranks disagree on dtype: {[str(r.dtype) for r in refs]}", path=refs[0].file, tensor=name
        )
        return SourceTensor(name, refs, None, "", None, problem)
    rule = plan.match(name)
    config = config.for_tensor(name) if config is not None else None  # a composite's sub-model sizes it
    try:
        if rule is not None:
            partition, reason = rule.resolve(config), f"rule '{rule.pattern}' ({plan.name})"
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


def plan_conversion(
    source: SourceCheckpoint,
    tensors: Sequence[SourceTensor],
    *,
    vocab: VocabPlan,
    target_tp: int,
    pad_multiple: int | None = None,
    uneven: bool = False,
) -> ConversionPlan:
    """Plan every tensor for ``target_tp`` ranks; all problems are raised together as a :class:`PlanError`."""
    problems = [t.problem for t in tensors if t.problem]
    source_padded = source_padded_rows(tensors)
    multiple = pad_multiple or target_tp
    target_padded = None
    if source_padded is not None:
        target_padded = padded_size(vocab.original or source_padded, multiple, uneven=uneven)
        if target_padded % target_tp and not uneven:
            problems.append(
                ReshardError(
                    f"vocab padded to {target_padded} does not divide by tp={target_tp}",
                    hint="choose --pad-multiple as a multiple of the tp",
                )
            )
    vocab = replace(
        vocab,
        source_padded=source_padded,
        target_padded=target_padded,
        pad_multiple=None if uneven or source_padded is None else multiple,
    )
    planned = []
    for tensor in tensors:
        if tensor.problem:
            continue
        try:
            shapes = rank_shapes(tensor.partition, tensor.shape, target_tp, padded=target_padded, uneven=uneven)
        except ShapeMismatchError as err:
            problems.append(
                ShapeMismatchError(
                    f"{tensor.partition.describe()} of {list(tensor.shape)} cannot be split {target_tp} ways: "
                    f"{err.detail}",
                    path=tensor.refs[0].file,
                    tensor=tensor.name,
                    hint=_tp_hint(tensor.partition),
                )
            )
            continue
        planned.append(TensorPlan(tensor, tuple(shapes)))
    if problems:
        raise PlanError(problems)
    planned.sort(key=lambda t: safetensors_order(t.name, t.source.code))
    return ConversionPlan(source, target_tp, tuple(planned), vocab, uneven)


def _tp_hint(partition: Partition) -> str:
    if isinstance(partition, ReplicatedHeads):
        return f"choose a tp that divides the {partition.heads} heads or is a multiple of them"
    return "choose a tp that divides it" + ("" if _whole_blocks(partition) else ", or --uneven")


def _whole_blocks(partition: Partition) -> bool:
    """True when the partition splits in blocks (heads) that ``--uneven`` must not cut either."""
    units = partition.part_units() if isinstance(partition, Packed) else (getattr(partition, "unit", 1),)
    return any(unit != 1 for unit in units)
