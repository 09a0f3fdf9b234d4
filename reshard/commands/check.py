"""``reshard check``: can this model be split M ways, and if not, why? A pre-flight report.

:func:`check_model` is pure: parameter names and full shapes, the config and a plan in, a
:class:`CheckReport` out. It finds parameters no rule covers, dims and head counts that do not divide
by the tp (naming the heads), a depthwise ``conv1d`` whose channels would not match what its fused
input projection hands it on each rank, the vocab padding needed, and a model with no TP plan at all.
:func:`check` reads only headers (or, for a bare ``config.json``, builds the model on the ``meta``
device) and never tensor data.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from reshard.commands.check_findings import (
    ERROR,
    HEAD_COUNTS,
    NOT_IN_PLAN,
    NOTE,
    WARNING,
    CheckedTensor,
    HeadKey,
    Problem,
    check_convs,
    head_keys,
    head_problems,
    padded_vocab,
    quantization_findings,
    tensor_problems,
    vocab_problems,
)
from reshard.config import ModelConfig, load_config
from reshard.engine.plan.open import OpenedCheckpoint, open_checkpoint
from reshard.engine.plan.planner import matched_rule
from reshard.errors import AmbiguousPartitionError, ReshardError, ShapeMismatchError
from reshard.geometry import Partition, Replicate, Vocab, at_tp, partition_to_dict, rank_shapes, tps_that_split
from reshard.hub.source import HubCheckpoint
from reshard.options import ReadOptions, check_tp
from reshard.plans import FAMILIES, TRANSFORMERS, Plan, Rule, select_plan
from reshard.plans.lora import with_lora
from reshard.plans.skeleton import ModelSkeleton, build_skeleton
from reshard.plans.transformers_plan import plan_from_skeleton
from reshard.quantization import QuantizedTensors, quantized_tensors, read_scheme
from reshard.quantization.rules import runtime_rule
from reshard.quantization.stored import stored_shapes

__all__ = ["ERROR", "HEAD_COUNTS", "NOTE", "WARNING", "CheckOptions", "CheckReport", "CheckedTensor", "Problem"]
__all__ += ["check", "check_built", "check_model", "plan_for"]
Shape = tuple[int, ...]


@dataclass
class CheckReport:
    """Every parameter, its rule and per-rank shape, and every problem; ``ok`` when it splits ``tp`` ways."""

    source: str
    input: str  # "checkpoint" or "config"
    model_type: str | None
    plan: str
    tp: int
    uneven: bool
    tensors: list[CheckedTensor]
    problems: list[Problem]
    model_class: str | None = None  # the class transformers built from a bare config (None for a checkpoint)
    tp_sizes_that_work: list[int] | None = None  # when it cannot be split tp ways: the tps that split every tensor

    @property
    def ok(self) -> bool:
        return not any(p.severity == ERROR for p in self.problems)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self) | {"ok": self.ok}
        for key in ("model_class", "tp_sizes_that_work"):
            if data[key] is None:
                del data[key]
        return data


def check_model(
    shapes: dict[str, Shape],
    config: ModelConfig | None,
    plan: Plan,
    tp: int,
    *,
    vocab_size: int | None = None,
    uneven: bool = False,
    pad_multiple: int | None = None,
    source: str = "",
    kind: str = "checkpoint",
    skeleton: ModelSkeleton | None = None,
    quantized: QuantizedTensors | None = None,
) -> CheckReport:
    """Check every parameter of ``shapes`` (full, unpadded shapes) against ``plan`` at ``tp`` ranks.

    Sizes come from the sub-config that owns each tensor; ``skeleton`` (the model transformers builds for a
    bare config) names the sub-models a problem falls in, and those transformers' own plan leaves out.
    ``quantized``: the stored tensors of quantized linears are cut with their linear's weight, in whole
    blocks, groups and packed words (:mod:`reshard.quantization`).

    Example:
        >>> from reshard.plans.llama import LLAMA_PLAN
        >>> check_model({"lm_head.weight": (10, 4)}, None, LLAMA_PLAN, 4).problems[0].message
        'vocab 10 needs padding to 12 rows (a multiple of 4) for tp=4'
    """
    problems: list[Problem] = []
    if not plan.rules:
        what = config.model_type if config and config.model_type else "this model"
        problems.append(Problem(ERROR, f"no TP plan for {what}: nothing says how to split it (pass --plan FILE)"))
    vocab = vocab_size if vocab_size is not None else config.vocab_size if config else None
    multiple = pad_multiple or tp
    tensors: list[CheckedTensor] = []
    heads: dict[HeadKey, list[str]] = {}
    partitions: dict[str, tuple[Rule, Partition]] = {}
    for name, shape in shapes.items():
        scoped = config.for_tensor(name) if config is not None else None
        try:
            matched = matched_rule(name, plan, scoped, quantized)
        except AmbiguousPartitionError as err:
            tensors.append(CheckedTensor(name, list(shape), None, None, None, [err.detail]))
            continue
        rule = matched.rule if matched is not None else None
        label = None if rule is None else "(not in the plan: replicated)" if rule.implicit else rule.pattern
        companion = matched is not None and matched.quantized
        reason = matched.reason if matched is not None and matched.quantized else label
        row = CheckedTensor(name, list(shape), reason, None, None)
        tensors.append(row)
        if rule is None:
            if plan.rules:
                row.problems.append("no rule covers it" + _where(name, scoped, skeleton))
            continue
        try:
            partition = rule.resolve(scoped)
        except AmbiguousPartitionError as err:
            row.problems.append(err.detail)
            continue
        partitions[name] = (rule, partition)
        row.partition = partition_to_dict(at_tp(partition, shape, tp))
        if rule.implicit and len(shape) >= 2:
            where = _where(name, scoped, skeleton)
            row.problems.append(f"{NOT_IN_PLAN} {plan.name} plan{where}: every rank holds it whole")
        padded = padded_vocab(partition, shape, vocab, multiple, uneven)
        try:
            row.rank_shape = list(rank_shapes(partition, shape, tp, padded=padded, uneven=uneven)[0])
        except ShapeMismatchError as err:
            why = f"{runtime_rule(quantized.scheme)}: " if companion and quantized is not None else ""
            row.problems.append(f"{why}{partition.describe()} cannot be split {tp} ways: {err.detail}")
        if not isinstance(partition, Replicate) and not rule.gathered:  # gathered: computed whole after
            for key in head_keys(name):
                heads.setdefault((scoped.scope if scoped else "", key), []).append(name)
    problems += head_problems(heads, partitions, config, tp)
    check_convs(shapes, partitions, tp, uneven, tensors)
    problems += tensor_problems(tensors, heads, config, tp)
    problems += vocab_problems(partitions, shapes, vocab, tp, multiple, uneven)
    if quantized is not None:
        problems += quantization_findings(quantized.scheme, tp)
    if skeleton is not None:
        problems += _transformers_plan_notes(skeleton)
    model_type = config.model_type if config else None
    model_class = skeleton.model_class if skeleton is not None else None
    report = CheckReport(source, kind, model_type, plan.name, tp, uneven, tensors, problems, model_class)
    if not report.ok and any(row.rank_shape is None for row in tensors if row.name in partitions):
        planned = [(partition, shapes[name]) for name, (_, partition) in partitions.items()]
        report.tp_sizes_that_work = tps_that_split(
            planned, vocab_rows=_vocab_rows(planned, vocab), pad_multiple=pad_multiple, uneven=uneven
        )
    return report


def _vocab_rows(planned: list[tuple[Partition, Shape]], vocab: int | None) -> int:
    """The rows a vocab is padded from: the vocab, or a table already longer than it (:func:`padded_vocab`)."""
    rows = [shape[p.dim] for p, shape in planned if isinstance(p, Vocab)]
    return max([vocab or 0, *rows])


def _where(name: str, scoped: ModelConfig | None, skeleton: ModelSkeleton | None) -> str:
    """`` (sub-model thinker.model.audio_tower: Qwen2_5OmniAudioEncoder)`` for a tensor of a sub-model, named from
    the model transformers built or, from checkpoint headers, by the sub-config that sizes it."""
    if skeleton is not None:
        sub = skeleton.sub_model_of(name)
        return f" (sub-model {sub.prefix}: {sub.model_class})" if sub is not None else ""
    return f" (sub-model {scoped.scope})" if scoped is not None and scoped.scope else ""


def _transformers_plan_notes(skeleton: ModelSkeleton) -> list[Problem]:
    """What transformers' own TP plan covers of the model it builds: nothing, or all but some sub-models."""
    if not skeleton.tp_plan:
        what = "None" if skeleton.tp_plan is None else "empty"
        return [
            Problem(
                NOTE,
                f"transformers' {skeleton.model_class} has no TP plan (_tp_plan is {what}): "
                'from_pretrained(tp_plan="auto") cannot split it',
            )
        ]
    missing = skeleton.without_plan()
    if not missing:
        return []
    listed = ", ".join(f"{s.prefix} ({s.model_class})" for s in missing)
    message = f"transformers' TP plan leaves out {len(missing)} sub-model(s), held whole on every rank: {listed}"
    return [Problem(NOTE, message)]


# ---------------------------------------------------------------- reading the input (headers only)


@dataclass(frozen=True)
class CheckOptions:
    """What ``check`` asks: the tp, how to read the input (``read``: its config, plan, ``--uneven``), the vocab's pad
    multiple."""

    tp: int
    read: ReadOptions = field(default_factory=ReadOptions)
    pad_multiple: int | None = None

    def __post_init__(self) -> None:
        check_tp(self.tp)


def check(path: Path | HubCheckpoint, options: CheckOptions) -> CheckReport:
    """Check a checkpoint (its headers: a Hub repo's over HTTP) or a bare ``config.json`` (its model built on
    ``meta``).

    Raises:
        ReshardError: unreadable input, rank shapes that do not join, or a config transformers cannot build.
    """
    path = path if isinstance(path, HubCheckpoint) else Path(path)
    if isinstance(path, Path) and path.is_file() and path.suffix == ".json":
        loaded = load_config(options.read.config or path)
        return check_built(loaded, build_skeleton(loaded), options, source=str(path))
    opened = open_checkpoint(path, options.read, target_tp=options.tp, read_bytes=False)
    path = opened.path  # a Hub repo: at the commit read
    config = opened.source.config
    shapes = _full_shapes(opened)
    report = check_model(
        shapes,
        config,
        opened.plan,
        options.tp,
        vocab_size=opened.vocab.original,
        uneven=options.read.uneven,
        pad_multiple=options.pad_multiple,
        source=str(path),
        quantized=quantized_tensors(config, shapes),
    )
    return _note_family(report, config, opened.plan, options)


def check_built(
    config: ModelConfig, skeleton: ModelSkeleton, options: CheckOptions, *, source: str = "", plan: Plan | None = None
) -> CheckReport:
    """:func:`check` of the model transformers built from ``config`` (``skeleton``): build once, check at many tps
    (``plan``, when given, is the one ``options.read.plan`` selects, chosen once too)."""
    plan = plan or plan_for(config, skeleton, options)
    shapes, quantized = skeleton.shapes, None
    scheme = read_scheme(config.raw, path=config.path)
    if scheme is not None:  # the tensors a checkpoint quantized so stores, cut as a runtime would cut them
        shapes = stored_shapes(scheme, shapes, plan, config)
        quantized = quantized_tensors(config, shapes)
    report = check_model(
        shapes,
        config,
        plan,
        options.tp,
        vocab_size=config.vocab_size,
        uneven=options.read.uneven,
        pad_multiple=options.pad_multiple,
        source=source,
        kind="config",
        skeleton=skeleton,
        quantized=quantized,
    )
    return _note_family(report, config, plan, options)


def plan_for(config: ModelConfig, skeleton: ModelSkeleton, options: CheckOptions) -> Plan:
    """The plan ``options.read.plan`` names for a model built from ``config``."""
    if options.read.plan == TRANSFORMERS:  # the model is built already: its plan, not a second build
        return with_lora(plan_from_skeleton(skeleton, config))
    return select_plan(config, skeleton.shapes, plan_file=options.read.plan)


def _note_family(report: CheckReport, config: ModelConfig | None, plan: Plan, options: CheckOptions) -> CheckReport:
    """Say so when no family claims the config's model_type and the plan was chosen by tensor names."""
    model_type = config.model_type if config is not None else None
    claimed = any(model_type in family.model_types for family in FAMILIES)
    if options.read.plan is None and model_type and plan.rules and not claimed:
        report.problems.insert(
            0, Problem(NOTE, f"no built-in plan for model_type {model_type}: the {plan.name} plan matches its names")
        )
    return report


def _full_shapes(opened: OpenedCheckpoint) -> dict[str, Shape]:
    """Every tensor's canonical shape as a conversion would gather it; a tensor no rule covers whose ranks hold
    one shape keeps it (``check_model`` reports the missing rule)."""
    shapes = {}
    for tensor in opened.tensors:
        rank = [ref.shape for ref in tensor.refs]
        if tensor.shape is not None:
            shapes[tensor.name] = tensor.shape
        elif len(rank) == opened.source.tp and len(set(rank)) == 1 and opened.plan.match(tensor.name) is None:
            shapes[tensor.name] = rank[0]
        else:
            raise ReshardError(
                f"rank shapes {rank} do not join: {tensor.failure.detail}",
                path=tensor.failure.path or (tensor.refs[0].file if tensor.refs else None),
                tensor=tensor.name,
            )
    return shapes
