"""What a conversion writes: the target layout, the names (mapped or kept), the target's config, every target
tensor's partition and slices. Pure planning from an opened checkpoint; raises every problem at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from reshard.config import ModelConfig
from reshard.dtypes import name_of
from reshard.engine.open import OpenedCheckpoint
from reshard.engine.planner import ConversionPlan, TensorPlan, identity_plan, mapped_plans, plan_conversion
from reshard.errors import MappingError, PlanError, ReshardError
from reshard.layouts import SourceCheckpoint, writer_class
from reshard.layouts.megatron_args import arg, config_from_args
from reshard.layouts.torch_dist_keys import check_names
from reshard.layouts.torch_dist_writer import RECORDED_TP
from reshard.mappings import MappingChoice, choose_mapping, naming_of, require_true_vocab
from reshard.mappings.megatron_gpt import MEGATRON
from reshard.mappings.torchtitan_llama import TORCHTITAN
from reshard.options import ConvertOptions, Layout
from reshard.partition import Vocab, head_replicas
from reshard.plans import select_plan
from reshard.vocab import megatron_pad_multiple, padded_sizes_possible, source_padded_rows

HEAD = "lm_head.weight"


@dataclass(frozen=True)
class TargetPlan:
    """A planned conversion and what its writer needs beyond the tensors.

    Attributes:
        conversion: every unit of work, with target shapes per rank.
        layout: the target layout.
        config: the target's config (``config.json`` content), if any.
        mapping: the mapping applied, when names change.
        dropped: source tensors the mapping drops on purpose.
        meta: layout facts decided here (``args`` for a Megatron target whose source has none).
    """

    conversion: ConversionPlan
    layout: Layout
    config: dict[str, Any] | None
    mapping: MappingChoice | None = None
    dropped: tuple[str, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)


def default_layout(source: SourceCheckpoint, tp: int) -> Layout:
    """The source's own layout family: ``megatron``/``sat`` stay so; HF-named checkpoints become ``hf`` at
    tp 1 and ``hf-ranks`` above."""
    if source.layout in (Layout.MEGATRON, Layout.SAT):
        return source.layout
    return Layout.HF if tp == 1 else Layout.HF_RANKS


def tp_is_recorded_only(layout: Layout | str | None) -> bool:
    """Whether the layout holds global tensors, whatever ``--tp`` says (``torch_dist`` records it in its args)."""
    return layout == Layout.TORCH_DIST


def planned_tp(layout: Layout | str | None, tp: int) -> int:
    """The tp a conversion is planned at: 1 for a layout of global tensors, else ``tp``."""
    return 1 if tp_is_recorded_only(layout) else tp


def plan_target(opened: OpenedCheckpoint, options: ConvertOptions) -> TargetPlan:
    """Plan the conversion of ``opened`` as ``options`` ask (raises every planning problem at once)."""
    source = opened.source
    if source.meta.get("cannot_convert"):  # a layout read it for inspect, but cannot convert it
        raise source.meta["cannot_convert"]
    layout = options.layout or default_layout(source, options.tp)
    if options.pp > 1 and layout not in (Layout.MEGATRON, Layout.TORCH_DIST):
        raise ReshardError(f"the {layout} layout has no pipeline stages", hint="--pp applies to --layout megatron")
    tp = planned_tp(layout, options.tp)
    choice = choose_mapping(
        source,
        layout,
        vocab_size=opened.vocab.original,
        dtype=_dtype(opened),
        keep_names=options.keep_names,
        shapes=_shapes(opened),
    )
    vocab = opened.vocab
    if choice is not None and choice.config is not None:
        if choice.config.get("vocab_size") is None:
            require_true_vocab(source, vocab.original)
        elif vocab.original is None:  # the mapping knows it (torchtitan never pads its vocab)
            vocab = replace(vocab, original=choice.config["vocab_size"], origin=choice.mapping.name)
    meta = {"args": choice.args} if choice is not None and choice.args is not None else {}
    groups, dropped, problems = None, (), []
    if choice is not None:
        groups, dropped, problems = _mapped(opened, choice, layout, tp)
    if layout == Layout.TORCH_DIST:
        meta[RECORDED_TP] = options.tp
        _check_torch_dist_names(opened, groups)
    pad_multiple = options.pad_multiple or writer_class(layout).pad_multiple(options.tp, source, meta)
    if layout == Layout.MEGATRON and opened.vocab.original is None:
        problems += _unknown_megatron_vocab(opened, pad_multiple or options.tp)
    conversion = plan_conversion(
        source,
        opened.tensors,
        vocab=vocab,
        target_tp=tp,
        pad_multiple=pad_multiple,
        uneven=opened.uneven,
        groups=groups,
        problems=problems,
    )
    _refuse_copied_heads(conversion, layout, source)
    return TargetPlan(conversion, layout, _config(opened, choice), choice, dropped, meta)


def _refuse_copied_heads(conversion: ConversionPlan, layout: Layout, source: SourceCheckpoint) -> None:
    """KV heads copied over ranks (tp a multiple of their count) are what vLLM runs; a layout whose runtime
    cannot load copies says why (``replicated_heads_refusal``)."""
    refusal = writer_class(layout).replicated_heads_refusal
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
    opened: OpenedCheckpoint, choice: MappingChoice, layout: Layout, tp: int
) -> tuple[list[TensorPlan], tuple[str, ...], list[ReshardError]]:
    try:
        groups, dropped = choice.mapping.plan(_shapes(opened), opened.source.config)
    except PlanError as err:
        return [], (), list(err.problems)
    target_config = choice.target_config
    if layout in (Layout.MEGATRON, Layout.TORCH_DIST):  # Megatron's names: sized by the args (mapped or own)
        target_config = config_from_args(choice.args, None) if choice.args is not None else opened.source.config
    names = [name for group in groups for name in group.targets]
    plan = select_plan(target_config, names)
    plans, problems = mapped_plans(opened.tensors, groups, plan, target_config, target_tp=tp)
    problems += _tie_problems(choice, names)
    return plans, tuple(dropped), problems


def _check_torch_dist_names(opened: OpenedCheckpoint, groups: list[TensorPlan] | None) -> None:
    """Refuse, before any output exists, names Megatron-Core's ``torch_dist`` cannot hold (legacy, grouped GEMM).

    The targets keep the names reshard reads a ``torch_dist`` checkpoint under (the ``torch`` format's, which
    ``layouts/torch_dist.py`` gives the stored norms back), so the manifest and ``verify`` agree with the reader;
    the writer stores them under Transformer Engine's names (``torch_dist_keys.plan_global``).
    """
    plans = groups if groups is not None else [identity_plan(t) for t in opened.tensors if not t.problem]
    check_names([t.name for plan in plans for t in plan.targets], opened.source.path)


def _unknown_megatron_vocab(opened: OpenedCheckpoint, target_multiple: int) -> list[ReshardError]:
    """Megatron pads the vocab from the true size at start-up (``make_vocab_size_divisible_by * tp``): when
    nothing records the true size and the rows found could pad to different sizes at the target tp, the
    output would not load (``size mismatch for embedding.word_embeddings.weight``). Refuse, saying which."""
    rows = source_padded_rows(opened.tensors)
    source = opened.source
    if rows is None or not source.meta.get("megatron"):
        return []
    divisible_by = arg(source.meta.get("args"), "make_vocab_size_divisible_by")
    possible = padded_sizes_possible(rows, megatron_pad_multiple(divisible_by, source.tp), target_multiple)
    if len(possible) > 1:
        sizes = "; ".join(f"{padded} rows for a true size of {r.start}-{r.stop - 1}" for padded, r in possible.items())
        return [
            ReshardError(
                f"the true vocab size is unknown and Megatron pads it for the target tp: the {rows} rows here "
                f"could become {sizes}",
                path=source.path,
                hint="pass --vocab N (the tokenizer's size, which Megatron-LM recomputes at start-up)",
            )
        ]
    return []


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
            opened.source, Layout.HF, vocab_size=opened.vocab.original, dtype=_dtype(opened), shapes=shapes
        )
        if choice is None:  # names that stay (a --keep-names output nothing describes)
            return None, {}, None
        groups, _ = choice.mapping.plan(shapes, opened.source.config)
    except (MappingError, PlanError) as err:
        return None, {}, f"no mapping to transformers' names: {err.one_line()}"
    targets = {name: list(group.targets) for group in groups for name in group.sources}
    return choice.mapping.name, targets, None
