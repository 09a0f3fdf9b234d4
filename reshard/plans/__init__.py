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
    "check_family",
    "judged_families",
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
    foreign: bool = False  # another framework's names: a config.json beside them describes the model they map to

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
    Family(megatron.MEGATRON_PLAN, megatron.MODEL_TYPES, megatron.SIGNATURE, foreign=True),
    Family(sat.SAT_PLAN, sat.MODEL_TYPES, sat.SIGNATURE, foreign=True),
    Family(torchtitan.TORCHTITAN_PLAN, torchtitan.MODEL_TYPES, torchtitan.SIGNATURE, own_names=True, foreign=True),
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


# Tensors that tell model types apart where a family's names do not: (pattern, the types that always have such a
# tensor, the types that never do). Types in neither set are not judged by that pattern.
TELLS: tuple[tuple[str, str, frozenset[str], frozenset[str]], ...] = (
    (
        gemma.SIGNATURE,
        "*.pre_feedforward_layernorm.weight",
        frozenset({"gemma2", "gemma3", "gemma3_text"}),
        frozenset({"gemma", *llama.MODEL_TYPES, *moe.MODEL_TYPES, *deepseek.MODEL_TYPES, *phi3.MODEL_TYPES}),
    ),
    (
        r"self_attn\.q_norm\.weight$",
        "*.self_attn.q_norm.weight",
        frozenset({"qwen3", "qwen3_moe"}),
        frozenset({"llama", "mistral", "qwen2", "mixtral", "qwen2_moe", *deepseek.MODEL_TYPES, *phi3.MODEL_TYPES}),
    ),
    (
        deepseek.SIGNATURE,
        "*.self_attn.kv_a_proj_with_mqa.weight",
        frozenset(deepseek.MODEL_TYPES),
        frozenset({*llama.MODEL_TYPES, *moe.MODEL_TYPES, *gemma.MODEL_TYPES, *phi3.MODEL_TYPES}),
    ),
    (
        phi3.SIGNATURE,
        "*.self_attn.qkv_proj.weight",
        frozenset(phi3.MODEL_TYPES),
        frozenset({*llama.MODEL_TYPES, *moe.MODEL_TYPES, *gemma.MODEL_TYPES, *deepseek.MODEL_TYPES}),
    ),
)


def judged_families(config: ModelConfig | None, names: list[str]) -> tuple[Family, Family] | None:
    """The config's family and the names' family, when a config can be judged against the names: its
    ``model_type`` is one a built-in family knows and the names are transformers' (not Megatron's, SAT's or
    torchtitan's, which a config describes after mapping); else None."""
    model_type = config.model_type if config is not None else None
    claimed = next((f for f in FAMILIES if model_type and model_type in f.model_types), None)
    if claimed is None or claimed.foreign:
        return None
    found = next((f for f in FAMILIES if any(re.search(f.signature, n) for n in names)), None)
    if found is None or found.foreign:
        return None
    return claimed, found


def check_family(config: ModelConfig | None, names: Iterable[str]) -> None:
    """Refuse a config of another family than the tensors (a Gemma2 ``config.json`` beside Llama tensors would
    publish a model whose extra norms transformers initialises at random).

    Judged only when the config's ``model_type`` is one a built-in family knows and the names are transformers'
    (not Megatron's, SAT's or torchtitan's, which a config describes after mapping): the names' signature family
    must be the config's (Llama's names are in every family's), and the tensors that tell model types apart
    (:data:`TELLS`) must be there exactly when the model type has them.

    Raises:
        ReshardError: the family or model type of the config does not match the tensors, naming both and a tensor.
    """
    names = sorted({plain_name(n) for n in names})
    judged = judged_families(config, names)
    if judged is None or config is None:  # judged only with a config
        return
    claimed, found = judged
    model_type = config.model_type
    where = f"{config.path}: " if config.path else ""
    hint = "pass the config.json of this checkpoint's model (--config)"
    example = next(n for n in names if re.search(found.signature, n))
    if found is not claimed and found.plan is not llama.LLAMA_PLAN:
        raise ReshardError(
            f"{where}the config is of model_type {model_type!r} (family {claimed.name}), but the tensors are of "
            f"family {found.name}: {example!r}",
            hint=hint,
        )
    for pattern, label, has, lacks in TELLS:
        present = [n for n in names if re.search(pattern, n)]
        if model_type in has and not present:
            raise ReshardError(
                f"{where}the config is of model_type {model_type!r}, whose models have tensors {label}, but none "
                f"of the {len(names)} tensors is one (they are of family {found.name}: {example!r})",
                hint=hint,
            )
        if model_type in lacks and present:
            raise ReshardError(
                f"{where}the config is of model_type {model_type!r}, whose models have no tensor {label}, but "
                f"{len(present)} of the tensors are (e.g. {present[0]!r})",
                hint=hint,
            )


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
