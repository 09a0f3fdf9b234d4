"""Built-in plans per model family, plan-file loading, and the choice of plan for a checkpoint."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from reshard.config import ModelConfig
from reshard.errors import ReshardError
from reshard.plans import (
    deepseek,
    gemma,
    glm4,
    llama,
    megatron,
    moe,
    phi3,
    qwen2_vl,
    qwen3_5,
    qwen3_next,
    sat,
    torchtitan,
)
from reshard.plans.base import EMPTY_PLAN, Plan, Rule
from reshard.plans.infer import infer_partition
from reshard.plans.lora import plain_name, with_lora
from reshard.plans.plan_file import load_plan_file
from reshard.plans.transformers_plan import NAME as TRANSFORMERS
from reshard.plans.transformers_plan import transformers_plan

__all__ = [
    "TRANSFORMERS",
    "EMPTY_PLAN",
    "FAMILIES",
    "Family",
    "Plan",
    "Rule",
    "infer_partition",
    "load_plan_file",
    "select_plan",
]


@dataclass(frozen=True)
class Family:
    """A built-in plan and how to recognise its checkpoints."""

    plan: Plan
    model_types: tuple[str, ...]
    signature: str  # a regex some tensor name of the family always matches
    own_names: bool = False  # names no transformers model uses: they win over a config.json's model_type

    @property
    def name(self) -> str:
        return self.plan.name


# Signatures are tried in order: the hybrid, multimodal, MLA, fused and MoE families (which also have
# Llama-like attention names) come before Llama.
FAMILIES: list[Family] = [
    Family(qwen3_next.QWEN3_NEXT_PLAN, qwen3_next.MODEL_TYPES, qwen3_next.SIGNATURE),
    Family(qwen3_5.QWEN3_5_PLAN, qwen3_5.MODEL_TYPES, qwen3_5.SIGNATURE),
    Family(qwen2_vl.QWEN2_VL_PLAN, qwen2_vl.MODEL_TYPES, qwen2_vl.SIGNATURE),
    Family(deepseek.DEEPSEEK_PLAN, deepseek.MODEL_TYPES, deepseek.SIGNATURE),
    Family(phi3.PHI3_PLAN, phi3.MODEL_TYPES, phi3.SIGNATURE),
    Family(glm4.GLM4_PLAN, glm4.MODEL_TYPES, glm4.SIGNATURE),
    Family(gemma.GEMMA_PLAN, gemma.MODEL_TYPES, gemma.SIGNATURE),
    Family(moe.MOE_PLAN, moe.MODEL_TYPES, moe.SIGNATURE),
    Family(llama.LLAMA_PLAN, llama.MODEL_TYPES, llama.SIGNATURE),
    Family(megatron.MEGATRON_PLAN, megatron.MODEL_TYPES, megatron.SIGNATURE),
    Family(sat.SAT_PLAN, sat.MODEL_TYPES, sat.SIGNATURE),
    Family(torchtitan.TORCHTITAN_PLAN, torchtitan.MODEL_TYPES, torchtitan.SIGNATURE, own_names=True),
]


def builtin_plan(name: str) -> Plan:
    """A built-in plan by family name (``none``: no rules, so a plan file can stand alone)."""
    if name == EMPTY_PLAN.name:
        return EMPTY_PLAN
    for family in FAMILIES:
        if family.name == name:
            return family.plan
    raise ReshardError(f"no built-in plan {name!r}", hint=f"built-in plans: {', '.join(f.name for f in FAMILIES)}")


def detect_family(config: ModelConfig | None, names: Iterable[str]) -> Family | None:
    """The family from ``config.json`` ``model_type``, else from parameter-name signatures (names of a family
    with ``own_names`` first: a config.json beside them describes the model they map to, not them)."""
    names = [plain_name(n) for n in names]  # LoRA-wrapped bases count under their plain names
    for family in FAMILIES:
        if family.own_names and any(re.search(family.signature, n) for n in names):
            return family
    if config is not None and config.model_type:
        for family in FAMILIES:
            if config.model_type in family.model_types:
                return family
    for family in FAMILIES:
        pattern = re.compile(family.signature)
        if any(pattern.search(n) for n in names):
            return family
    return None


def select_plan(config: ModelConfig | None, names: Iterable[str], *, plan_file: Path | str | None = None) -> Plan:
    """The plan for a checkpoint: the user's rules first (if any), then the detected family's.

    LoRA tensors (SAT ``matrix_A``/``matrix_B``, peft ``lora_A``/``lora_B``) follow their base layer's rule.
    ``plan_file="transformers"`` takes the installed transformers' own TP plan for the config instead.
    """
    if plan_file == TRANSFORMERS:
        return with_lora(transformers_plan(config))
    family = detect_family(config, names)
    base = family.plan if family else EMPTY_PLAN
    if plan_file is None:
        return with_lora(base)
    user, extends = load_plan_file(Path(plan_file))
    return with_lora(user.then(builtin_plan(extends) if extends else base))
