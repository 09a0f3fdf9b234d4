"""GLM-4 (``glm``: GLM-4-9B; ``glm4``: GLM-4-0414 with its extra post-attention / post-MLP norms).

The Llama attention (q/k/v with biases, split in whole heads, KV heads copied past their count) and a fused
``mlp.gate_up_proj`` [2I, H] ``packed`` in ``[gate | up]``. transformers' plan splits the fused MLP as
contiguous rows and gathers its output (``colwise_gather_output``); here each rank holds its gate and up rows.
"""

from __future__ import annotations

from reshard.plans.base import Plan, Rule
from reshard.plans.llama import LLAMA_PLAN
from reshard.plans.phi3 import gate_up_packed

MODEL_TYPES = ("glm", "glm4")
SIGNATURE = r"post_self_attn_layernorm\.weight$"

GLM4_PLAN = Plan("glm4", (Rule(r"mlp\.gate_up_proj\.weight$", gate_up_packed), *LLAMA_PLAN.rules))
