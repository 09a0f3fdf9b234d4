"""A checkpoint's peft LoRA adapter: which one (of several), its rank, its alpha, and the source narrowed to it.

A trainer that wraps a model with PEFT saves the whole state dict: ``base_model.model.X.base_layer.weight`` beside
``X.lora_A.<adapter>.weight`` and ``X.lora_B.<adapter>.weight`` (every adapter it holds), and records the adapter's
settings in an ``adapter_config.json`` (:func:`reshard.formats.adapter_config.find_adapter_config`). The rank is
read from the tensors and checked against the record; alpha comes from the record or ``--lora-alpha`` and is never
assumed (SAT's own ``lora2`` names keep SAT's documented default, :mod:`reshard.engine.plan.lora_merge`).

Pure: names, headers and one small JSON file.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from reshard.config import ModelConfig
from reshard.errors import MappingError, ReshardError, ShapeMismatchError
from reshard.formats.adapter_config import AdapterFacts, LoraSettings, find_adapter_config, read_adapter_config
from reshard.layouts.base import SourceCheckpoint, TensorRef
from reshard.mappings import HF, naming_of
from reshard.options import ReadOptions
from reshard.plans.lora import BASE, MAGNITUDE, LoraName, parse_lora_name, plain_name

PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the wrapped model's names


@dataclass(frozen=True)
class PeftAdapter:
    """The peft adapter a conversion merges or writes.

    Attributes:
        name: the adapter's name in the keys (``default``); None where the keys carry none.
        others: the other adapters' names, whose tensors are left behind.
        settings: its settings, alpha known.
        r: its rank, as its A tensors have it.
    """

    name: str | None
    others: tuple[str | None, ...]
    settings: LoraSettings
    r: int

    @property
    def scaling(self) -> float:
        return self.settings.scaling(self.r)


def _peft_names(source: SourceCheckpoint) -> dict[str, LoraName]:
    found = {}
    for name in source.names():
        lora = parse_lora_name(name)
        if lora is not None and lora.peft and lora.role != BASE:
            found[name] = lora
    return found


def _shown(adapter: str | None) -> str:
    return "(unnamed)" if adapter is None else adapter


def peft_adapter(source: SourceCheckpoint, options: ReadOptions) -> PeftAdapter | None:
    """The peft adapter of ``source`` to merge or write, or None when it holds no peft LoRA tensors.

    Raises:
        ReshardError: several adapters and none chosen (``--adapter``), or one chosen that is not there; DoRA;
            ranks that differ between layers or from the recorded ``r``; an alpha neither recorded nor given, or
            given unlike the record.
    """
    names = _peft_names(source)
    if not names:
        return None
    held = sorted({lora.adapter for lora in names.values()}, key=lambda a: (a is not None, a or ""))
    folder = source.path if source.path.is_dir() else source.path.parent
    if options.adapter is not None and options.adapter not in held:
        raise ReshardError(
            f"no adapter {options.adapter!r}: it holds {', '.join(map(_shown, held))}", path=source.path
        )
    if options.adapter is None and len(held) > 1:
        raise ReshardError(
            f"holds {len(held)} LoRA adapters: {', '.join(map(_shown, held))}",
            path=source.path,
            hint="choose one with --adapter NAME",
        )
    chosen = options.adapter if options.adapter is not None else held[0]
    mine = {name: lora for name, lora in names.items() if lora.adapter == chosen}
    dora = any(lora.role == MAGNITUDE for lora in mine.values())
    r = _rank(source, mine)
    config = find_adapter_config(folder, chosen)
    settings = read_adapter_config(config) if config is not None else LoraSettings()
    if config is not None and settings.use_dora != dora:
        held_dora = "holds DoRA magnitudes (lora_magnitude_vector)" if dora else "holds no lora_magnitude_vector"
        raise ReshardError(f"use_dora = {str(settings.use_dora).lower()}, but the checkpoint {held_dora}", path=config)
    if settings.r is not None and settings.r != r:
        raise ShapeMismatchError(f"r = {settings.r}, but the adapter's tensors have rank {r}", path=config)
    alpha = settings.alpha if settings.alpha is not None else options.lora_alpha
    if alpha is None and settings.alpha_zero:
        raise ReshardError(
            "lora_alpha = 0 is recorded (verl wrote 0, verl#4553), not the alpha the adapter trained with",
            path=config,
            hint="pass --lora-alpha (the trainer's lora_alpha)",
        )
    if alpha is None:
        raise ReshardError(
            "no adapter_config.json records lora_alpha for its peft LoRA adapter, and reshard does not assume one",
            path=source.path,
            hint="pass --lora-alpha (the trainer's lora_alpha)",
        )
    if options.lora_alpha is not None and options.lora_alpha != alpha:
        raise ReshardError(
            f"--lora-alpha {options.lora_alpha:g}, but lora_alpha = {alpha:g} is recorded",
            path=config,
            hint="leave --lora-alpha out, or correct the adapter config",
        )
    others = tuple(a for a in held if a != chosen)
    return PeftAdapter(chosen, others, replace(settings, alpha=alpha, use_dora=dora), r)


def lora_hint(source: SourceCheckpoint) -> list[str]:
    """A note for a checkpoint that holds peft LoRA adapters, read as it is: what would merge or extract them."""
    held = sorted({_shown(lora.adapter) for lora in _peft_names(source).values()})
    wrapped = any((lora := parse_lora_name(name)) is not None and lora.role == BASE for name in source.names())
    if not held or not wrapped:  # an adapter alone (PEFT's own folder) has nothing to merge into
        return []
    return [
        f"holds peft LoRA adapter(s) {', '.join(held)} beside their base weights: --merge-lora merges them, "
        "--layout peft writes PEFT's adapter folder (docs/lora.md)"
    ]


def _rank(source: SourceCheckpoint, names: dict[str, LoraName]) -> int:
    """The one rank of the adapter: the rows of every A, the columns of every B."""
    ranks: dict[int, str] = {}
    for rank in source.ranks[:1]:
        for name, lora in names.items():
            ref = rank.get(name)
            if ref is None or len(ref.shape) != 2:
                continue
            ranks.setdefault(ref.shape[0] if lora.role == "A" else ref.shape[1], name)
    if len(ranks) != 1:
        shown = ", ".join(f"{r} ({name})" for r, name in sorted(ranks.items()))
        raise ShapeMismatchError(
            f"LoRA tensors of several ranks: {shown or 'none 2-d'}",
            path=source.path,
            hint="per-layer ranks (rank_pattern) are not supported",
        )
    return next(iter(ranks))


def peft_plain(name: str) -> str:
    """``name`` without PEFT's ``base_model.model.`` (the wrapped model's own name)."""
    return name.removeprefix(PEFT_PREFIX)


def adapter_source(source: SourceCheckpoint, adapter: PeftAdapter, options: ReadOptions) -> SourceCheckpoint:
    """``source`` narrowed to ``adapter``'s A and B, under the names ``get_peft_model_state_dict`` saves
    (``base_model.model.X.lora_A.weight``: no adapter name), with the facts its ``adapter_config.json`` needs.

    Raises:
        ReshardError: bias-training adapters (their biases are not in PEFT's saved A and B alone); an adapter on a
            training framework's names (Megatron's), which PEFT on transformers' model cannot load.
    """
    unwrapped = [{plain_name(name): ref for name, ref in rank.items()} for rank in source.ranks[:1]]
    naming = naming_of(replace(source, ranks=unwrapped))  # told by the base layers' own names
    if naming not in (None, HF):
        raise MappingError(
            f"a peft adapter on {naming}'s names has no exact transformers form: a fused linear_qkv (linear_fc1) "
            "LoRA has one A shared by q, k and v (gate and up), where PEFT on transformers' split projections has "
            "one A each",
            path=source.path,
            hint="write it merged with --merge-lora",
        )
    if adapter.settings.bias != "none":
        raise ReshardError(
            f"bias = {adapter.settings.bias!r}: an adapter folder of A and B alone would lose the trained biases",
            path=adapter.settings.path,
            hint="use --merge-lora",
        )
    names = {name: lora for name, lora in _peft_names(source).items() if lora.adapter == adapter.name}
    layers = {lora.layer for lora in names.values() if lora.embedding}
    dora_embedding = next((n for n, lora in names.items() if lora.role == MAGNITUDE and lora.layer in layers), None)
    if dora_embedding is not None:
        raise ReshardError("DoRA on an embedding is not supported", path=source.path, tensor=dora_embedding)
    ranks = []
    for rank in source.ranks:
        refs: dict[str, TensorRef] = {}
        for name, ref in rank.items():
            lora = names.get(name)
            if lora is not None:
                out = _saved_name(lora)
                refs[out] = TensorRef(out, ref.rank, ref.reader, ref.key, ref.header)
        ranks.append(refs)
    modules = sorted({lora.layer.rsplit(".", 1)[-1] for lora in names.values()})
    dora = "; DoRA magnitudes carried" if adapter.settings.use_dora else ""
    facts = AdapterFacts(
        adapter.settings,
        adapter.r,
        adapter.settings.target_modules or modules,
        options.base_model or adapter.settings.base_model or _name_or_path(source.config),
        adapter.settings.task_type or _task_type(source.config),
    )
    note = f"peft adapter {_shown(adapter.name)}: r = {adapter.r}, lora_alpha = {adapter.settings.alpha:g}{dora}" + (
        f"; left behind: {', '.join(map(_shown, adapter.others))}" if adapter.others else ""
    )
    return replace(source, ranks=ranks, side_files=[], adapter=facts, notes=[*source.notes, note])


def _saved_name(lora: LoraName) -> str:
    if lora.role == MAGNITUDE:
        kind = "lora_magnitude_vector"
    else:
        kind = f"lora_embedding_{lora.role}" if lora.embedding else f"lora_{lora.role}.weight"
    layer = lora.layer if lora.layer.startswith(PEFT_PREFIX) else PEFT_PREFIX + lora.layer
    return f"{layer}.{kind}"


def _name_or_path(config: ModelConfig | None) -> str | None:
    value = config.get("_name_or_path") if config is not None else None
    return value if isinstance(value, str) and value else None


def _task_type(config: ModelConfig | None) -> str | None:
    architectures = config.get("architectures") if config is not None else None
    causal = isinstance(architectures, list) and any(str(a).endswith("ForCausalLM") for a in architectures)
    return "CAUSAL_LM" if causal else None
