"""NeMo 2 checkpoints: Megatron-Core ``torch_dist`` files under ``weights/`` and the model's config in
``context/model.yaml`` (written by NeMo's ``io_dump``: the model's ``config`` under Megatron-Core's
``TransformerConfig`` names, e.g. ``gated_linear_unit``, ``share_embeddings_and_output_weights``,
``layernorm_epsilon``, ``num_moe_experts``).

:func:`nemo_args` translates that config into Megatron-LM's ``args`` names, so the plans, the mapping to
transformers and the Megatron writers read a NeMo model as they read a Megatron-LM one. NeMo keeps the
tokenizer, not the vocab size, in the context: the true vocab size comes from ``--vocab`` (or a manifest).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from reshard.errors import CorruptFileError, shown

NEMO_WEIGHTS = "weights"
MODEL_YAML = Path("context") / "model.yaml"
# Megatron-Core TransformerConfig / GPTConfig names -> Megatron-LM args names (same meaning).
RENAMED = {
    "layernorm_epsilon": "norm_epsilon",
    "num_moe_experts": "num_experts",
    "seq_length": "max_position_embeddings",
}
KEPT = (
    "num_layers hidden_size ffn_hidden_size num_attention_heads num_query_groups kv_channels normalization "
    "add_bias_linear add_qkv_bias qk_layernorm position_embedding_type rotary_base rotary_percent "
    "rotary_interleaved make_vocab_size_divisible_by moe_router_topk moe_ffn_hidden_size "
    "moe_shared_expert_intermediate_size moe_shared_expert_gate moe_router_pre_softmax "
    "moe_router_score_function seq_length"
).split()


def nemo_args(checkpoint: Path) -> argparse.Namespace | None:
    """Megatron-LM ``args`` for the model in a NeMo 2 checkpoint's ``context/model.yaml`` (None without one).

    Raises:
        CorruptFileError: the file is not YAML, or holds no ``config`` mapping.
    """
    path = checkpoint / MODEL_YAML
    if not path.is_file():
        return None
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError, ValueError) as err:  # ValueError: an
        # integer past Python's 4300 digits
        why = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise CorruptFileError(f"unreadable model config: {why[:200]}", path=path) from err
    config = data.get("config") if isinstance(data, dict) else None
    if not isinstance(config, dict):
        raise CorruptFileError("no 'config' mapping (NeMo writes the model's config there)", path=path)
    for key in [*KEPT, *RENAMED]:  # one value each: a list or mapping (a YAML alias bomb) is refused here, by name
        if isinstance(config.get(key), (list, dict)):
            raise CorruptFileError(f"{shown(config[key])} is not a single value", path=path, tensor=f"config.{key}")
    args: dict[str, Any] = {key: config[key] for key in KEPT if key in config}
    args |= {new: config[old] for old, new in RENAMED.items() if old in config}
    args["swiglu"] = bool(config.get("gated_linear_unit")) and _activation(config, path) == "silu"
    args["untie_embeddings_and_output_weights"] = not config.get("share_embeddings_and_output_weights", True)
    groups, heads = config.get("num_query_groups"), config.get("num_attention_heads")
    args["group_query_attention"] = groups is not None and groups != heads
    return argparse.Namespace(**args)


def _activation(config: dict[str, Any], path: Path) -> str | None:
    """The activation's function name (``torch.nn.functional.silu`` -> ``silu``); fiddle keeps it as ``_target_``."""
    activation = config.get("activation_func")
    target = activation.get("_target_") if isinstance(activation, dict) else activation
    if target is not None and not isinstance(target, str):  # str() of a YAML alias bomb would never end
        raise CorruptFileError(f"activation_func is {shown(target)}, not a function's name", path=path)
    return target.rsplit(".", 1)[-1] if target else None
