"""Gemma, Gemma 2, Gemma 3: the Llama layers (Gemma 2/3's extra pre/post-feedforward norms and Gemma 3's
``q_norm``/``k_norm`` replicated), embeddings vocab-parallel (``lm_head`` is tied and not saved).

Gemma 3's SigLIP vision tower and its projector are replicated, as transformers keeps them; sizes of the
language model come from ``text_config``.
"""

from __future__ import annotations

from reshard.geometry import Replicate
from reshard.plans.base import Plan, Rule
from reshard.plans.llama import LLAMA_PLAN

MODEL_TYPES = ("gemma", "gemma2", "gemma3", "gemma3_text")
SIGNATURE = r"pre_feedforward_layernorm\.weight$"

GEMMA_PLAN = Plan("gemma", (Rule(r"(^|\.)(vision_tower|multi_modal_projector)\.", Replicate()), *LLAMA_PLAN.rules))
