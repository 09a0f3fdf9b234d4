"""PEFT's ``adapter_config.json``: read as a closed world, and written for an adapter folder.

Every field PEFT's ``LoraConfig`` saves is either carried (it changes what the adapter computes and reshard does
it: ``r``, ``lora_alpha``, ``use_rslora``, ``use_dora``: DoRA's magnitudes are carried into an adapter folder, and
its merge refused by name), kept for the written config (which modules carry an adapter, the base
model's id), declared irrelevant (how training initialised or dropped out the adapter; how PEFT builds its parallel
layers, whose arithmetic is the same), or refused by name at any value but its default: a LoRA variant reshard does
not compute (aLoRA, LoRA biases, per-layer ranks or alphas, Conv1D bases, extra trainable modules).
A field this table does not know is refused the same way unless it holds a default (``None``, ``False``, empty).
Sources: ``peft/tuners/lora/config.py`` (``LoraConfig``), ``peft/config.py`` (``PeftConfigMixin``), peft 0.22.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.errors import CorruptFileError, ReshardError, shown

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# Fields read into LoraSettings, or kept as they are for the written config.
_CARRIED = {"peft_type", "r", "lora_alpha", "use_rslora", "use_dora", "fan_in_fan_out", "base_model_name_or_path"}
_KEPT = {"exclude_modules", "layers_to_transform", "layers_pattern", "revision"}
_RECORDED = {"target_modules", "task_type"}  # kept when recorded, else worked out from the tensors and the config
# Fields that do not change the weights an adapter makes: training-time or initialisation choices, PEFT's records.
_IRRELEVANT = {
    "lora_dropout": "dropout acts only in training",
    "init_lora_weights": "how A and B started; the trained tensors are read",
    "loftq_config": "an initialisation (LoftQ); the trained tensors are read",
    "eva_config": "an initialisation (EVA); the trained tensors are read",
    "corda_config": "an initialisation (CorDA); the trained tensors are read",
    "lora_ga_config": "an initialisation (LoRA-GA); the trained tensors are read",
    "megatron_config": "how PEFT builds Megatron-parallel LoRA layers; B A is the same product",
    "megatron_core": "the module PEFT imports for Megatron layers",
    "qalora_group_size": "read only with use_qalora",
    "inference_mode": "whether PEFT trains the adapter",
    "auto_mapping": "PEFT's record of the wrapped class",
    "peft_version": "the PEFT release that saved it",
    "runtime_config": "PEFT's runtime options (ephemeral GPU offload), not saved by PEFT; verl's asdict() keeps them",
    "bias": "bias tensors are the base model's own (an adapter folder refuses any but 'none')",
}
# Variants reshard does not compute: refused unless at their default.
_REFUSED = {
    "fan_in_fan_out": "a Conv1D (fan_in_fan_out) base",
    "lora_bias": "LoRA B biases (lora_bias)",
    "rank_pattern": "per-layer ranks (rank_pattern)",
    "alpha_pattern": "per-layer alphas (alpha_pattern)",
    "modules_to_save": "fully trained extra modules (modules_to_save)",
    "trainable_token_indices": "trainable token rows (trainable_token_indices)",
    "layer_replication": "replicated layers (layer_replication)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "ensure_weight_tying": "tied adapters (ensure_weight_tying)",
}


@dataclass(frozen=True)
class LoraSettings:
    """What an ``adapter_config.json`` (or the user) says of a LoRA adapter.

    Attributes:
        alpha: ``lora_alpha``; None when nothing recorded it, or recorded 0 (verl wrote 0, verl#4553): then
            ``--lora-alpha`` must give it.
        r: the recorded rank; None when unrecorded (the tensors say).
        use_rslora: scaling is ``alpha / sqrt(r)`` (rank-stabilised LoRA) instead of ``alpha / r``.
        path: the file read, if any.
        kept: the fields the written config keeps as they were (which layers, a revision, ...).
        base_model: ``base_model_name_or_path`` as recorded.
        target_modules: as recorded.
        task_type: as recorded.
        bias: which biases the adapter trained (``none``, ``all``, ``lora_only``).
        use_dora: DoRA: a magnitude per output row (``lora_magnitude_vector``) rescales ``W + B A``.
        alpha_zero: the file recorded ``lora_alpha: 0`` (a trainer's bug; the trained alpha is unknown).
    """

    alpha: float | None = None
    r: int | None = None
    use_rslora: bool = False
    path: Path | None = None
    kept: tuple[tuple[str, Any], ...] = ()
    base_model: str | None = None
    target_modules: list[str] | str | None = None
    task_type: str | None = None
    bias: str = "none"
    use_dora: bool = False
    alpha_zero: bool = False

    def scaling(self, r: int) -> float:
        """``alpha / r``, or ``alpha / sqrt(r)`` under rsLoRA (PEFT's ``LoraLayer.update_layer``)."""
        if self.alpha is None:
            raise ReshardError("lora_alpha is unknown")
        return self.alpha / (r**0.5 if self.use_rslora else r)


def _is_default(value: Any) -> bool:
    return value is None or value is False or value in ({}, [], "")


def read_adapter_config(path: Path) -> LoraSettings:
    """The settings of the LoRA adapter ``path`` describes.

    Raises:
        CorruptFileError: not a JSON object, a field of the wrong type.
        ReshardError: not a LoRA adapter, or a variant or field reshard does not compute, named.
    """
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise CorruptFileError(f"cannot read the adapter config: {str(err) or type(err).__name__}", path=path) from err
    if not isinstance(raw, dict):
        raise CorruptFileError("the adapter config is not a JSON object", path=path)
    if raw.get("peft_type") != "LORA":
        raise ReshardError(f"peft_type {shown(raw.get('peft_type'))} is not LORA", path=path)
    for key, value in raw.items():
        if key in _REFUSED and not _is_default(value):
            raise ReshardError(
                f"{_REFUSED[key]} is not supported: {key} = {shown(value)}",
                path=path,
                hint="merge it in PEFT (merge_and_unload) and convert the merged model",
            )
        if key not in _CARRIED | _KEPT | _RECORDED | set(_IRRELEVANT) | set(_REFUSED) and not _is_default(value):
            raise ReshardError(f"unknown LoRA field {key} = {shown(value)}", path=path, hint="reshard cannot judge it")
    alpha, r, rslora = raw.get("lora_alpha"), raw.get("r"), raw.get("use_rslora", False)
    dora = raw.get("use_dora", False)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha < 0:
        raise CorruptFileError(f"lora_alpha {shown(alpha)} is not a positive number", path=path)
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise CorruptFileError(f"r {shown(r)} is not a positive integer", path=path)
    for key, flag in (("use_rslora", rslora), ("use_dora", dora)):
        if not isinstance(flag, bool):
            raise CorruptFileError(f"{key} {shown(flag)} is not true or false", path=path)
    base, targets, task = raw.get("base_model_name_or_path"), raw.get("target_modules"), raw.get("task_type")
    kept = tuple((key, raw[key]) for key in sorted(_KEPT) if key in raw)
    return LoraSettings(
        float(alpha) if alpha else None,  # 0: what verl wrote (verl#4553), not the alpha it trained with
        r,
        rslora,
        path,
        kept,
        base if isinstance(base, str) else None,
        targets if isinstance(targets, (list, str)) else None,
        task if isinstance(task, str) else None,
        str(raw.get("bias") or "none"),
        dora,
        alpha == 0,
    )


def find_adapter_config(folder: Path, adapter: str | None) -> Path | None:
    """The ``adapter_config.json`` that records adapter ``adapter`` of a checkpoint in ``folder``: PEFT's
    ``save_pretrained`` puts a non-default adapter's in ``<adapter>/``; verl's checkpoint manager its LoRA's in
    ``lora_adapter/``; a trainer's may sit beside the checkpoint folder. None when there is none."""
    named = [folder / adapter / ADAPTER_CONFIG] if adapter not in (None, "default") else []
    for candidate in [*named, folder / ADAPTER_CONFIG, folder / "lora_adapter" / ADAPTER_CONFIG]:
        if candidate.is_file():
            return candidate
    beside = folder.parent / ADAPTER_CONFIG
    return beside if beside.is_file() else None


@dataclass(frozen=True)
class AdapterFacts:
    """What an adapter folder's writer needs: the settings, the rank the tensors have, and the config's fields that
    were worked out (target modules from the tensors, the base model and task from the source or the user)."""

    settings: LoraSettings
    r: int
    target_modules: list[str] | str
    base_model: str | None
    task_type: str | None

    def config_json(self) -> str:
        """The ``adapter_config.json`` of the adapter, in PEFT's spelling (``LoraConfig.to_dict``)."""
        alpha = self.settings.alpha
        config: dict[str, Any] = {
            "peft_type": "LORA",
            "r": self.r,
            "lora_alpha": int(alpha) if alpha is not None and alpha.is_integer() else alpha,  # as LoraConfig saves 16
            "use_rslora": self.settings.use_rslora,
            "use_dora": self.settings.use_dora,
            "fan_in_fan_out": False,
            "bias": "none",
            "lora_dropout": 0.0,
            "target_modules": self.target_modules,
            "base_model_name_or_path": self.base_model,
            "task_type": self.task_type,
            "inference_mode": True,
            **dict(self.settings.kept),
        }
        return json.dumps(config, indent=2, sort_keys=True) + "\n"
