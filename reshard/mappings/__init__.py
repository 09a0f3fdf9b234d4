"""Mappings between the names of training frameworks and the names transformers builds from ``config.json``.

:func:`choose_mapping` decides, from the source's naming and the target layout, whether tensors are
renamed (and fused tensors split or merged) on the way, and what the target's config is: the target
layout decides the names (``hf`` and ``hf-ranks`` mean transformers' names, loadable by
``from_pretrained``; ``megatron`` means Megatron's), and ``--keep-names`` keeps the source's. Each family
pair is a table in its own module (``megatron/gpt.py``, ``torchtitan_llama.py``); configs are translated in
:mod:`reshard.megatron.config` and ``torchtitan_config.py``.

torchtitan's names are mapped to transformers' only: no target layout means torchtitan's (the ``dcp`` layout is
read, not written), and torchtitan reads transformers' checkpoints itself (``initial_load_in_hf``, through the
same state-dict adapter), so a transformers checkpoint keeps its names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping as MappingType
from dataclasses import dataclass
from typing import Any, Protocol

from reshard.config import ModelConfig, SourceFacts
from reshard.errors import MappingError
from reshard.layouts import SourceCheckpoint, find_layout
from reshard.mappings.base import Entry, MappedGroup, Mapping
from reshard.mappings.megatron.gpt import FAMILIES, MEGATRON, megatron_to_hf
from reshard.mappings.torchtitan_config import llama_config, titan_model
from reshard.mappings.torchtitan_llama import SIGNATURE as TORCHTITAN_SIGNATURE
from reshard.mappings.torchtitan_llama import TORCHTITAN, torchtitan_to_hf
from reshard.megatron.config import (
    config_disagreements,
    gpt_shape_from_args,
    gpt_shape_from_hf,
    hf_config,
    hf_family,
    megatron_args,
)
from reshard.megatron.facts import MegatronFacts, args_of
from reshard.megatron.model import config_from_args
from reshard.plans.megatron import SIGNATURE as MEGATRON_SIGNATURE

__all__ = [
    "HF",
    "Entry",
    "MappedGroup",
    "Mapping",
    "MAPPINGS",
    "MappingChoice",
    "MappingSpec",
    "choose_mapping",
    "naming_of",
    "require_true_vocab",
    "sizing_config",
]

HF = "hf"  # transformers' names (a layout's ``naming``)


@dataclass(frozen=True)
class MappingChoice:
    """The mapping to apply and what the target needs to be written: its config and the facts its layout's writer
    reads (:attr:`reshard.layouts.base.TargetSpec.layout_facts`: for Megatron, the args made for the target)."""

    mapping: Mapping
    config: dict[str, Any] | None = None
    layout_facts: SourceFacts | None = None

    @property
    def target_config(self) -> ModelConfig | None:
        return ModelConfig(self.config) if self.config is not None else None


class Chooser(Protocol):
    """How a mapping is chosen for a checkpoint: its table and the target's config, or None when the names stay."""

    def __call__(
        self,
        source: SourceCheckpoint,
        *,
        vocab_size: int | None,
        dtype: str,
        shapes: MappingType[str, tuple[int, ...]] | None,
    ) -> MappingChoice | None: ...


@dataclass(frozen=True)
class MappingSpec:
    """One entry of :data:`MAPPINGS`: a mapping from the names of one naming to those of another, and its chooser."""

    source: str
    target: str
    choose: Chooser


def naming_of(source: SourceCheckpoint) -> str | None:
    """``megatron``, ``torchtitan`` or ``hf`` (a transformers family reshard maps), from the names, else None."""
    for naming, signature in ((MEGATRON, MEGATRON_SIGNATURE), (TORCHTITAN, TORCHTITAN_SIGNATURE)):
        pattern = re.compile(signature)
        if any(pattern.search(name) for name in source.names()):
            return naming
    model_type = source.config.model_type if source.config else None
    if model_type in FAMILIES:
        return HF
    return None


def choose_mapping(
    source: SourceCheckpoint,
    target_naming: str | None,
    *,
    vocab_size: int | None,
    dtype: str,
    keep_names: bool = False,
    shapes: MappingType[str, tuple[int, ...]] | None = None,
) -> MappingChoice | None:
    """The mapping from ``source``'s names to ``target_naming`` (the target layout's), or None when the names stay.

    ``shapes`` are the canonical (whole) shapes by name (default: those of a tp=1 source's tensors).

    Raises:
        MappingError: the names must change but the model has no family on the other side.
    """
    if keep_names:
        return None
    source_naming = naming_of(source)
    if source_naming is None or target_naming is None or source_naming == target_naming:
        return None
    spec = next((m for m in MAPPINGS if (m.source, m.target) == (source_naming, target_naming)), None)
    if spec is None:
        reached = [m.target for m in MAPPINGS if m.source == source_naming]
        raise MappingError(
            f"no mapping from {source_naming}'s names to {target_naming}'s",
            path=source.path,
            hint=f"convert to {' or '.join(reached)} first" if reached else None,
        )
    return spec.choose(source, vocab_size=vocab_size, dtype=dtype, shapes=shapes)


def sizing_config(choice: MappingChoice, target_naming: str | None, source: SourceCheckpoint) -> ModelConfig | None:
    """The config the target's names are sized by: Megatron's names by the args (the mapping's, else the source's
    own), transformers' by the mapping's config."""
    if target_naming == MEGATRON:
        args = args_of(choice.layout_facts)
        return config_from_args(args, None) if args is not None else source.config
    return choice.target_config


def require_true_vocab(source: SourceCheckpoint, vocab_size: int | None) -> int:
    """The true vocab size a transformers config must state; an error saying how to give it when unknown."""
    if vocab_size is not None:
        return vocab_size
    padded = source.config.get("padded_vocab_size") if source.config else None
    raise MappingError(
        "the true vocab size is unknown, and a transformers config.json must state it"
        + (f" (Megatron padded the tables to {padded} rows)" if padded else ""),
        path=source.path,
        hint="pass --vocab N (the tokenizer's vocab size)",
    )


def _megatron_to_hf(
    source: SourceCheckpoint,
    *,
    vocab_size: int | None,
    dtype: str,
    shapes: MappingType[str, tuple[int, ...]] | None,
) -> MappingChoice | None:
    """The mapping to transformers; its config states ``vocab_size`` (None until the true size is known).

    None for Megatron names outside a Megatron checkpoint with neither args nor a transformers config to
    describe the model (a folder written with ``--keep-names``): its names stay.
    """
    config = source.config
    args = args_of(source.facts)
    if config is not None and config.model_type in FAMILIES:  # --config gave the target's
        disagree = config_disagreements(config, args) if args is not None else []
        if disagree:
            raise MappingError(
                "--config and the Megatron args describe different models: " + "; ".join(disagree),
                path=source.path,
                hint="correct --config, or leave it out: the args describe the model",
            )
        target = config.raw if vocab_size is None else config.with_vocab_size(vocab_size)
        shape = gpt_shape_from_args(args) if args is not None else None
        bias = shape is None or shape.moe_router_enable_expert_bias
        zero = shape is not None and shape.softmax_type == "off-by-one"
        return MappingChoice(megatron_to_hf(config.model_type, expert_bias=bias, zero_sinks=zero), target)
    if args is None:  # Megatron's names without Megatron's files (written with --keep-names): they stay
        return None
    shape = gpt_shape_from_args(args)
    family = hf_family(shape)
    sinks = shape.softmax_type == "off-by-one"
    mapping = megatron_to_hf(family, expert_bias=shape.moe_router_enable_expert_bias, zero_sinks=sinks)
    return MappingChoice(mapping, hf_config(shape, vocab_size=vocab_size, dtype=dtype, family=family))


def _torchtitan_to_hf(
    source: SourceCheckpoint,
    *,
    vocab_size: int | None,
    dtype: str,
    shapes: MappingType[str, tuple[int, ...]] | None,
) -> MappingChoice | None:
    """The mapping to transformers for the model ``--config`` describes (a transformers config.json, or a torchtitan
    job TOML); torchtitan never pads its vocab, so the true size is the embedding's rows unless ``--vocab`` says.

    None for torchtitan's names in a transformers layout (written with ``--keep-names``) that nothing describes.
    """
    config = source.config
    described = config is not None and (config.model_type == "llama" or isinstance(config.raw.get("model"), dict))
    own = find_layout(source.layout)
    if not described and own is not None and own.naming == HF:  # written with --keep-names: they stay
        return None
    if shapes is None:
        if source.tp != 1:
            raise MappingError("torchtitan names across ranks: the whole shapes are unknown", path=source.path)
        shapes = {name: tuple(ref.shape) for name, ref in source.ranks[0].items()}
    model = titan_model(source.config, shapes, path=source.path)
    mapping = torchtitan_to_hf(model.n_heads, model.n_kv_heads, model.head_dim, tied=model.tied)
    rows = shapes.get("tok_embeddings.weight", (None,))[0]
    vocab = vocab_size if vocab_size is not None else rows
    if config is not None and config.model_type == "llama":  # --config gave the target's
        return MappingChoice(mapping, config.raw if vocab is None else config.with_vocab_size(vocab))
    return MappingChoice(mapping, llama_config(model, vocab_size=vocab, dtype=dtype))


def _hf_to_megatron(
    source: SourceCheckpoint,
    *,
    vocab_size: int | None,
    dtype: str,
    shapes: MappingType[str, tuple[int, ...]] | None,
) -> MappingChoice:
    """The mapping to Megatron's names (the Megatron table backwards) and the Megatron args of the target."""
    config = source.config
    if config is None:
        raise MappingError(
            "no transformers config: Megatron's args are made from it",
            path=source.path,
            hint="give it with --config FILE",
        )
    shape = gpt_shape_from_hf(config)
    facts = MegatronFacts(args=megatron_args(shape, vocab_size=vocab_size))
    return MappingChoice(megatron_to_hf(config.model_type).inverse(), None, facts)


# Every mapping reshard applies, as LAYOUTS lists the layouts: choose_mapping asks this table, by the source's naming
# (naming_of) and the target layout's. A new pair of namings is a table module in mappings/ and one line here.
MAPPINGS: tuple[MappingSpec, ...] = (
    MappingSpec(MEGATRON, HF, _megatron_to_hf),
    MappingSpec(HF, MEGATRON, _hf_to_megatron),
    MappingSpec(TORCHTITAN, HF, _torchtitan_to_hf),
)
