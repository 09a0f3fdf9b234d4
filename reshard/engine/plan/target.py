"""What a conversion writes: the target layout, the names (mapped or kept), the target's config, every target
tensor's partition and slices. Pure planning from an opened checkpoint; raises every problem at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from reshard.config import ModelConfig, SourceFacts
from reshard.dtypes import TensorHeader, name_of
from reshard.engine.plan.open import OpenedCheckpoint
from reshard.engine.plan.planner import (
    ConversionPlan,
    SourceTensor,
    TargetTensor,
    TensorPlan,
    identity_plan,
    mapped_plans,
    plan_conversion,
)
from reshard.engine.plan.tokenizer import carried_tokenizer, with_token_ids
from reshard.engine.plan.training import plan_training
from reshard.errors import AmbiguousPartitionError, MappingError, PlanError, ReshardError
from reshard.formats.tokenizer import Tokenizer
from reshard.geometry import Partition, Vocab, head_replicas, tps_that_split
from reshard.layouts import LAYOUTS, LayoutSpec, SourceCheckpoint, TargetSpec, layout, target_layout
from reshard.layouts.training import CarriedState
from reshard.mappings import HF, MappingChoice, choose_mapping, naming_of, require_true_vocab, sizing_config
from reshard.mappings.megatron.gpt import MEGATRON
from reshard.mappings.torchtitan_llama import TORCHTITAN
from reshard.options import ConvertOptions
from reshard.plans import select_plan
from reshard.quantization import read_scheme
from reshard.quantization.dequant_plan import dequantized_config, recast
from reshard.quantization.plan import linear_partition
from reshard.vocab import finish_vocab, source_padded_rows

HEAD = "lm_head.weight"


@dataclass(frozen=True)
class TargetPlan:
    """A planned conversion and what its writer needs beyond the tensors.

    Attributes:
        conversion: every unit of work, with target shapes per rank.
        layout: the target layout.
        config: the target's config (``config.json`` content), if any.
        mapping: the mapping applied, when names change.
        dropped: source tensors the mapping (or ``--dtype``: quantization scales) drops on purpose.
        notes: what the user should know of the planned conversion (what ``--dtype`` dequantized).
        tokenizer: the tokenizer the output carries (only a layout transformers and runtimes read takes one); its
            bos / eos ids are in ``config`` where the config names none.
        training: the training state carried (``--with-optimizer``): its state tensors are units of ``conversion``.
    """

    conversion: ConversionPlan
    layout: LayoutSpec
    config: dict[str, Any] | None
    mapping: MappingChoice | None = None
    dropped: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    tokenizer: Tokenizer | None = None
    training: CarriedState | None = None

    @property
    def layout_facts(self) -> SourceFacts | None:
        """The facts the mapping made for the target (a Megatron target's args when its source has none)."""
        return self.mapping.layout_facts if self.mapping is not None else None


def planned_tp(name: str | None, tp: int) -> int:
    """The tp a conversion into the layout called ``name`` (None: the default, never one of global tensors) is
    planned at."""
    return layout(name).planned_tp(tp) if name is not None else tp


def plan_target(opened: OpenedCheckpoint, options: ConvertOptions) -> TargetPlan:
    """Plan the conversion of ``opened`` as ``options`` ask (raises every planning problem at once)."""
    source = opened.source
    if source.refusal is not None:  # a layout read it for inspect, but cannot convert it
        raise source.refusal
    spec = target_layout(options.layout, source, options.tp)
    if options.pp > 1 and not spec.pipeline_stages:
        raise ReshardError(f"the {spec} layout has no pipeline stages", hint="--pp applies to --layout megatron")
    tp = spec.planned_tp(options.tp)
    choice = choose_mapping(
        source,
        spec.naming,
        vocab_size=opened.vocab.original,
        dtype=_dtype(opened),
        keep_names=options.keep_names,
        shapes=_shapes(opened),
    )
    known_vocab = None  # the true size the mapping knows (torchtitan never pads its vocab)
    if choice is not None and choice.config is not None:
        if choice.config.get("vocab_size") is None:
            require_true_vocab(source, opened.vocab.original)
        else:
            known_vocab = (choice.config["vocab_size"], choice.mapping.name)
    groups: list[TensorPlan] | None
    dropped: tuple[str, ...]
    problems: list[ReshardError]
    notes: tuple[str, ...]
    groups, dropped, problems = None, (), []
    tensors, notes = opened.tensors, ()
    if choice is not None:
        if options.dtype is not None:
            raise ReshardError(
                f"--dtype with a mapping of names ({choice.mapping.name}) is not supported",
                path=source.path,
                hint="convert with --dtype to --layout hf or hf-ranks first, then to the other layout",
            )
        groups, dropped, problems = _mapped(opened, choice, spec, tp)
    elif options.dtype is not None:
        tensors, groups, dropped, problems, notes = _recast(opened, options.dtype)
    writer = spec.target_writer
    if options.with_optimizer:
        _check_carries_state(spec, options, source)
    writer.check_names(_target_names(opened, groups), source)
    facts = choice.layout_facts if choice is not None else None
    pad_multiple = options.pad_multiple or writer.pad_multiple(options.tp, source, facts)
    if opened.vocab.original is None:
        rows = source_padded_rows(opened.tensors)
        problems += writer.vocab_problems(source, padded_rows=rows, pad_multiple=pad_multiple or options.tp)
    try:
        conversion = plan_conversion(
            source,
            tensors,
            vocab=opened.vocab,
            known_vocab=known_vocab,
            target_tp=tp,
            pad_multiple=pad_multiple,
            uneven=opened.uneven,
            groups=groups,
            problems=problems,
        )
    except PlanError as err:
        if not err.unsplit:
            raise
        plans = groups if groups is not None else [identity_plan(t) for t in opened.tensors if not t.problem]
        vocab, _ = finish_vocab(  # the vocab the conversion would write, to pad at every tp
            opened.vocab,
            known=known_vocab,
            source_padded=source_padded_rows(opened.tensors),
            multiple=tp,
            tp=tp,
            uneven=opened.uneven,
        )
        works = tps_that_split(
            [(t.partition, t.shape) for plan in plans for t in plan.targets],
            vocab_rows=None if vocab.source_padded is None else vocab.original or vocab.source_padded,
            pad_multiple=options.pad_multiple,
            uneven=opened.uneven,
        )
        others = [p for p in err.problems if p not in err.unsplit]
        said = [*others, _unsplit_in_one(err.unsplit, tp, works, source.config)]
        summary = said[0].one_line() if len(said) == 1 else PlanError(said).detail
        raise PlanError(err.problems, unsplit=err.unsplit, summary=summary) from err
    _refuse_copied_heads(conversion, spec, source)
    training = None
    if options.with_optimizer:
        conversion, training = plan_training(conversion, dropped, drop=options.drop, carries=writer.carries)
        notes = (*notes, _carried_note(training, source, options.drop, writer.carries))
    config = _config(opened, choice)
    if options.dtype is not None and config is not None:
        config = dequantized_config(config, options.dtype)
    tokenizer = carried_tokenizer(opened.tokenizer, spec)
    config = with_token_ids(config, tokenizer)
    return TargetPlan(conversion, spec, config, choice, dropped, notes, tokenizer, training)


def _carried_note(
    training: CarriedState, source: SourceCheckpoint, drop: frozenset[str], carries: frozenset[str]
) -> str:
    """What the report says of the training state carried, of what the target takes over as it is, and of what
    ``--drop`` left behind."""
    trainable = sum(len(group.params) for group in training.groups)
    note = (
        f"training state carried: step {training.step}, {len(training.groups)} param group(s), "
        f"{', '.join(training.slots)} of {trainable} parameter(s) "
        f"({len(training.frozen)} frozen and {len(training.tied)} tied to another without state of their own)"
    )
    leftovers = source.training.not_carried if source.training else ()
    taken = [str(item) for item in leftovers if item.key in carries]
    left = [str(item) for item in leftovers if item.key not in carries and item.kind in drop]
    return (
        note
        + (f"; carried as it is: {', '.join(taken)}" if taken else "")
        + (f"; left behind (--drop): {', '.join(left)}" if left else "")
    )


def _check_carries_state(spec: LayoutSpec, options: ConvertOptions, source: SourceCheckpoint) -> None:
    """``--with-optimizer`` needs a target layout that holds an optimizer's state, and the weights as they are."""
    if not spec.target_writer.holds_training_state:
        holding = [s.name for s in LAYOUTS if s.writer is not None and s.writer.holds_training_state]
        raise ReshardError(
            f"the {spec} layout holds no optimizer state (--with-optimizer)",
            path=source.path,
            hint=f"--layout {' or '.join(holding)}" if holding else "no layout holds one yet",
        )
    if options.dtype is not None:
        raise ReshardError(
            "--dtype with --with-optimizer: the weights are the fp32 masters the moments belong to",
            path=source.path,
            hint="convert the training state first, then cast the weights alone",
        )


def target_spec(target: TargetPlan, options: ConvertOptions) -> TargetSpec:
    """What the writer is told before the first tensor: every rank's headers, the config, the vocab sizes, the
    shard size and the parallel sizes (a resumed or shared run adds its done files and callbacks)."""
    conversion, vocab = target.conversion, target.conversion.vocab
    tp = conversion.target_tp  # options.tp, but 1 for a layout of global tensors (torch_dist)
    return TargetSpec(
        tp=tp,
        rank_headers=[
            {t.name: TensorHeader(t.rank_shapes[r], t.code) for plan in conversion.tensors for t in plan.targets}
            for r in range(tp)
        ],
        config=target.config,
        vocab_size=vocab.original,
        padded_vocab_size=vocab.target_padded,
        max_shard_size=options.max_shard_size,
        source=conversion.source,
        layout_facts=target.layout_facts,
        requested_tp=options.tp,
        pp=options.pp,
        training=target.training,
    )


def _unsplit_in_one(
    unsplit: list[ReshardError], tp: int, works: list[int], config: ModelConfig | None
) -> ReshardError:
    """The tensors ``tp`` cannot split as one problem: the head counts it does not divide, how many tensors, one
    example per kind of cause (the hint tells them apart), and the tp sizes that split every tensor."""
    heads = [
        f"{key}={count}"
        for key in ("num_attention_heads", "num_key_value_heads")
        if config is not None and isinstance(count := config.get(key), int) and count > 0 and count % tp
    ]
    why = f" ({', '.join(heads)}: not divisible by {tp})" if heads else ""
    examples: dict[str | None, ReshardError] = {}
    for problem in unsplit:
        examples.setdefault(problem.hint, problem)
    return ReshardError(
        f"tp={tp} cannot split {len(unsplit)} tensor(s) of this model{why}; e.g. "
        + "; ".join(p.one_line() for p in examples.values()),
        hint=f"tp sizes that work: {', '.join(map(str, works))}" if works else "no tp up to 64 splits every tensor",
    )


def _refuse_copied_heads(conversion: ConversionPlan, spec: LayoutSpec, source: SourceCheckpoint) -> None:
    """KV heads copied over ranks (tp a multiple of their count) are what vLLM runs; a layout whose runtime
    cannot load copies says why (``replicated_heads_refusal``)."""
    refusal = spec.target_writer.replicated_heads_refusal
    copied = [
        t.name
        for plan in conversion.tensors
        for t in plan.targets
        if head_replicas(t.partition, conversion.target_tp) > 1
    ]
    if refusal and copied:
        more = f" and {len(copied) - 1} more" if len(copied) > 1 else ""
        raise ReshardError(
            f"tp={conversion.target_tp} copies KV heads ({copied[0]}{more}), but {refusal}",
            path=source.path,
            hint="choose a tp that divides the KV heads, or --layout hf-ranks",
        )


def _shapes(opened: OpenedCheckpoint) -> dict[str, tuple[int, ...]]:
    """Every tensor's canonical shape, by name."""
    return {t.name: t.shape for t in opened.tensors if t.shape is not None}


def _mapped(
    opened: OpenedCheckpoint, choice: MappingChoice, spec: LayoutSpec, tp: int
) -> tuple[list[TensorPlan], tuple[str, ...], list[ReshardError]]:
    try:
        groups, dropped = choice.mapping.plan(_shapes(opened), opened.source.config)
    except PlanError as err:
        return [], (), list(err.problems)
    target_config = sizing_config(choice, spec.naming, opened.source)
    names = [name for group in groups for name in group.targets]
    plan = select_plan(target_config, names)
    plans, problems = mapped_plans(opened.tensors, groups, plan, target_config, target_tp=tp)
    problems += _tie_problems(choice, names)
    return plans, tuple(dropped), problems


def _recast(
    opened: OpenedCheckpoint, dtype: str
) -> tuple[tuple[SourceTensor, ...], list[TensorPlan], tuple[str, ...], list[ReshardError], tuple[str, ...]]:
    """``--dtype``: every tensor's unit (FP8 weights dequantized with their scale, floats cast, the rest kept), the
    source tensors (a scale of a tp=1 source read whole: :func:`~reshard.engine.plan.planner.plan_sources`), the
    companions dropped, the problems, the note for the report."""
    source, tensors = opened.source, opened.tensors
    headers = {t.name: TensorHeader(t.shape, t.code) for t in tensors if t.shape is not None}
    config = source.config
    scheme = read_scheme(config.raw if config else None, path=config.path if config else None)
    plan = recast(headers, scheme, dtype, path=source.path)
    companions = {unit.sources[1] for unit in plan.units if len(unit.sources) > 1} | set(plan.dropped)
    by_name = {t.name: t for t in tensors}
    groups: list[TensorPlan] = []
    for unit in plan.units:
        sources = tuple(by_name[name] for name in unit.sources)
        if unit.transform is None:
            groups.append(identity_plan(sources[0]))
            continue
        weight = sources[0]
        partition, shape = weight.planned
        if len(sources) > 1:
            partition = _dequantized_partition(opened, weight)
        groups.append(TensorPlan(sources, (TargetTensor(unit.target, shape, unit.code, partition),), unit.transform))
    notes: tuple[str, ...] = ()
    if plan.dequantized:
        notes = (
            f"dequantized {plan.dequantized} FP8 weight(s) to {dtype}; dropped {len(companions)} scale tensor(s) "
            "and quantization_config",
        )
    return tensors, groups, plan.dropped, list(plan.problems), notes


def _dequantized_partition(opened: OpenedCheckpoint, weight: SourceTensor) -> Partition:
    """A dequantized weight's cut in the target: its plan rule's, as a plain weight's (the blocks its source was
    cut in whole are gone), else the source's."""
    config = opened.source.config.for_tensor(weight.name) if opened.source.config is not None else None
    try:
        return linear_partition(opened.plan, weight.name.rpartition(".")[0], config)
    except AmbiguousPartitionError:
        return weight.planned[0]


def _target_names(opened: OpenedCheckpoint, groups: list[TensorPlan] | None) -> list[str]:
    """Every target tensor's name (the writer refuses those its framework cannot hold before any output exists)."""
    plans = groups if groups is not None else [identity_plan(t) for t in opened.tensors if not t.problem]
    return [t.name for plan in plans for t in plan.targets]


def _tie_problems(choice: MappingChoice, names: list[str]) -> list[ReshardError]:
    """A transformers config whose ``tie_word_embeddings`` disagrees with the tensors found."""
    if choice.config is None:
        return []
    tied, head = bool(choice.config.get("tie_word_embeddings")), "lm_head.weight" in names
    if tied and head:
        return [
            MappingError("the model has an output layer, but its config ties the embeddings", tensor="lm_head.weight")
        ]
    if not tied and not head:
        return [
            MappingError("the config unties the embeddings, but there is no output layer", tensor="lm_head.weight")
        ]
    return []


def _config(opened: OpenedCheckpoint, choice: MappingChoice | None) -> dict[str, Any] | None:
    """The target's config: the mapping's, else the source's with the true vocab size."""
    if choice is not None:
        return choice.config
    config: ModelConfig | None = opened.source.config
    if config is None:
        return None
    vocab = opened.vocab.original
    return config.with_vocab_size(vocab) if vocab is not None and vocab != config.vocab_size else config.raw


def _dtype(opened: OpenedCheckpoint) -> str:
    """The dtype a transformers config states: that of the vocab tables (else of the first floating tensor: not
    torchtitan's complex ``freqs_cis``)."""
    floating = [t for t in opened.tensors if t.code in ("F16", "BF16", "F32", "F64")]
    tensors = [t for t in opened.tensors if isinstance(t.partition, Vocab)] or floating or list(opened.tensors)
    return name_of(tensors[0].code) if tensors else "float32"


def preview_mapping(opened: OpenedCheckpoint) -> tuple[str | None, dict[str, list[str]], str | None]:
    """For ``inspect``: the names a conversion to transformers (``--layout hf``) would give every tensor.

    Returns the mapping's name, ``{source name: target names}`` and, when there is no mapping, why not
    (None when the names are transformers' already).
    """
    if naming_of(opened.source) not in (MEGATRON, TORCHTITAN):
        return None, {}, None
    shapes = _shapes(opened)
    try:
        choice = choose_mapping(
            opened.source, HF, vocab_size=opened.vocab.original, dtype=_dtype(opened), shapes=shapes
        )
        if choice is None:  # names that stay (a --keep-names output nothing describes)
            return None, {}, None
        groups, _ = choice.mapping.plan(shapes, opened.source.config)
    except (MappingError, PlanError) as err:
        return None, {}, f"no mapping to transformers' names: {err.one_line()}"
    targets = {name: list(group.targets) for group in groups for name in group.sources}
    return choice.mapping.name, targets, None
