"""NeMo 2 checkpoints: Megatron-Core ``torch_dist`` files under ``weights/`` and the model's config in
``context/model.yaml`` (written by NeMo's ``io_dump``: the model's ``config`` under Megatron-Core's
``TransformerConfig`` names, e.g. ``gated_linear_unit``, ``share_embeddings_and_output_weights``,
``layernorm_epsilon``, ``num_moe_experts``).

:func:`nemo_args` translates that config into Megatron-LM's ``args`` names, so the plans, the mapping to
transformers and the Megatron writers read a NeMo model as they read a Megatron-LM one. NeMo keeps the
tokenizer, not the vocab size, in the context (:func:`nemo_tokenizer`): the true vocab size comes from that
tokenizer when it is there, else from ``--vocab`` (or a manifest).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from reshard.errors import CorruptFileError, ReshardError, shown
from reshard.formats.tokenizer import GENERATION_CONFIG, NamedTokenizer

NEMO_WEIGHTS = "weights"
# NeMo's PEFT checkpoint IO writes it beside an adapter-only save (nemo/lightning/pytorch/callbacks/peft.py).
ADAPTER_METADATA = "adapter_metadata.json"
MODEL_YAML = Path("context") / "model.yaml"
NEMO_TOKENIZER = "nemo_tokenizer"  # where NeMo's import (save_hf_tokenizer_assets) puts a Hugging Face tokenizer
# Megatron-Core TransformerConfig / NeMo GPTConfig names -> Megatron-LM args names (same meaning). Every other
# field of ``config`` keeps its name (Megatron-Core's config and Megatron-LM's args share them) and meets the
# closed table of :mod:`reshard.megatron.args` like a Megatron-LM argument: carried, irrelevant, or
# refused when set (an unknown field included).
RENAMED = {
    "layernorm_epsilon": "norm_epsilon",
    "num_moe_experts": "num_experts",
    "seq_length": "max_position_embeddings",
    "seq_len_interpolation_factor": "rotary_seq_len_interpolation_factor",
    "scale_factor": "rope_scaling_factor",  # Llama31Config: Llama 3.1 RoPE scaling, always applied
    "first_pipeline_num_layers": "num_layers_in_first_pipeline_stage",
    "last_pipeline_num_layers": "num_layers_in_last_pipeline_stage",
}
# Fields read here and translated (not passed on under their own name).
TRANSLATED = ("gated_linear_unit", "activation_func", "share_embeddings_and_output_weights")
# NeMo-only fields of ``config`` that do not change what the model computes (name pattern, why; ``re.fullmatch``).
NEMO_IRRELEVANT: tuple[tuple[str, str], ...] = (
    (r"_.*_", "fiddle's bookkeeping (_target_, _call_, _partial_): the config's class, not a field"),
    (r"forward_step_fn|data_step_fn", "the training step's functions"),
    (r"generation_config", "default sampling settings, not the forward pass"),
    (r"scatter_embedding_sequence_parallel", "parallelism: how the embeddings are split over devices"),
    (r"use_transformer_engine_full_layer_spec|use_transformer_engine_op_fuser", "kernels: the same layers fused"),
)
_NEMO_IRRELEVANT = [re.compile(pattern) for pattern, _ in NEMO_IRRELEVANT]
# The top-level keys of ``model.yaml`` (the model class's constructor arguments: ``GPTModel(config, optim, tokenizer,
# model_transform, model_context_managers)``), each read, irrelevant (why), or refused when set (why). Any other
# key is refused by name: nothing NeMo puts there is dropped unread.
TOP_READ = "config"
TOP_IRRELEVANT = {
    "_target_": "the model's class: what it computes is its config",
    "_partial_": "fiddle's bookkeeping",
    "_call_": "fiddle's bookkeeping",
    "optim": "the optimizer: training only",
    "tokenizer": "the tokenizer: which text the ids stand for, not what the model computes from them",
}
TOP_REFUSED_WHEN_SET = {
    "model_transform": "the model is transformed after it is built (PEFT such as LoRA: the weights are adapters "
    "or a wrapped model, not the plain model)",
    "model_context_managers": "the model is built under context managers (e.g. FP8 parameters) whose effect on the "
    "weights is not known",
}
# Llama31Config's RoPE scaling: Megatron-Core's (and transformers' llama3 as reshard writes it) fixed values.
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "old_context_len": 8192}
# NeMo's GPT layer specs (Transformer Engine's or the local one, chosen by num_moe_experts and qk_layernorm): the
# model the table describes. Any other ``transformer_layer_spec`` is Megatron's refused custom ``spec``.
STANDARD_SPECS = frozenset(
    "default_layer_spec transformer_engine_layer_spec transformer_engine_full_layer_spec local_layer_spec "
    "get_gpt_layer_with_transformer_engine_spec get_gpt_layer_local_spec".split()
)
# The carried arguments (``megatron/args.CARRIED``) reshard's readers take as one value: a list or a
# mapping there (a YAML alias bomb) is refused here, by name. ``LISTS`` may be flat lists (a layer pattern, a
# window's ``(left, right)``).
SINGLE = frozenset(
    (
        "num_layers hidden_size ffn_hidden_size num_attention_heads group_query_attention num_query_groups "
        "kv_channels max_position_embeddings seq_length norm_epsilon layernorm_epsilon normalization swiglu "
        "position_embedding_type use_rotary_position_embeddings add_position_embedding rotary_base rotary_percent "
        "rotary_interleaved rotary_seq_len_interpolation_factor use_rope_scaling rope_scaling_factor "
        "add_bias_linear add_qkv_bias qk_layernorm untie_embeddings_and_output_weights vocab_size "
        "padded_vocab_size make_vocab_size_divisible_by true_vocab_size num_experts moe_router_topk "
        "moe_ffn_hidden_size moe_shared_expert_intermediate_size moe_shared_expert_gate moe_router_pre_softmax "
        "moe_router_score_function low_freq_factor high_freq_factor old_context_len q_lora_rank kv_lora_rank "
        "qk_head_dim qk_pos_emb_head_dim v_head_dim rotary_scaling_factor original_max_position_embeddings "
        "beta_fast beta_slow mscale mscale_all_dim quick_geglu softmax_type softmax_scale"
    ).split()
)
LISTS = frozenset({"moe_layer_freq", "window_size", "window_attn_skip_freq", "no_rope_freq"})
# Any other field is passed on as it is (the table ignores an irrelevant one and prints a refused or unknown one
# that is set): a value of more than this many items and characters is no config's, and is refused by name.
MAX_ITEMS = 4096


def nemo_args(checkpoint: Path) -> argparse.Namespace | None:
    """Megatron-LM ``args`` for the model in a NeMo 2 checkpoint's ``context/model.yaml`` (None without one).

    Every field of ``config`` is passed on under Megatron-LM's name (:data:`RENAMED`, :data:`TRANSLATED`),
    except the NeMo-only ones :data:`NEMO_IRRELEVANT` declares, so the closed table of Megatron's arguments
    carries, passes or refuses each one.

    Raises:
        ReshardError: a top-level key that is set and changes the model (PEFT's ``model_transform``), or unknown.
        CorruptFileError: the file is not YAML, holds no ``config`` mapping, a field read as one value holds a
            list or mapping, or a field holds more than a config does (a YAML alias bomb): refused by name, the
            value never printed whole.
    """
    path = checkpoint / MODEL_YAML
    data = _model_yaml(checkpoint)
    if data is None:
        return None
    if isinstance(data, dict):
        _check_top_level(data, path)
    config = data.get(TOP_READ) if isinstance(data, dict) else None
    if not isinstance(config, dict):
        raise CorruptFileError("no 'config' mapping (NeMo writes the model's config there)", path=path)
    args: dict[str, Any] = {}
    for key, value in config.items():
        if not isinstance(key, str):
            raise CorruptFileError(f"a field named {shown(key)}, not a name", path=path)
        if key in TRANSLATED or any(pattern.fullmatch(key) for pattern in _NEMO_IRRELEVANT):
            continue
        if key == "transformer_layer_spec":
            spec = _target(value, key, path)
            if spec is not None and spec.rsplit(".", 1)[-1] not in STANDARD_SPECS:
                args["spec"] = spec
            continue
        args[RENAMED.get(key, key)] = _checked(value, key, RENAMED.get(key, key), path)
    args["swiglu"] = bool(config.get("gated_linear_unit")) and _activation(config, path) == "silu"
    args["untie_embeddings_and_output_weights"] = not config.get("share_embeddings_and_output_weights", True)
    groups, heads = config.get("num_query_groups"), config.get("num_attention_heads")
    args["group_query_attention"] = groups is not None and groups != heads
    if args.get("rope_scaling_factor") is not None:
        args["use_rope_scaling"] = True
        for key, wanted in LLAMA3_ROPE.items():  # Megatron-Core and transformers' llama3 as written: fixed values
            if args.pop(key, wanted) != wanted:
                args[key] = config[key]  # an argument the table does not know: refused, by name and value
    return argparse.Namespace(**args)


def refuse_adapters(weights: Path) -> None:
    """A NeMo PEFT checkpoint holds the adapters only (the base model is another checkpoint): refused by name.

    Raises:
        ReshardError: ``weights`` holds NeMo's ``adapter_metadata.json``.
    """
    if (weights / ADAPTER_METADATA).is_file():
        raise ReshardError(
            f"a NeMo PEFT checkpoint ({ADAPTER_METADATA}): its weights are adapters for a base model, not a model",
            path=weights,
            hint="merge the adapters into the base model in NeMo (llm.peft.merge_lora) and convert that",
        )


def _check_top_level(data: dict[Any, Any], path: Path) -> None:
    """Every top-level key of ``model.yaml`` is read, irrelevant, or refused (:data:`TOP_REFUSED_WHEN_SET` when
    it holds anything, any unknown key), by name.

    Raises:
        ReshardError: a transform or context manager is set, or a key is not known.
    """
    for key, value in data.items():
        if key == TOP_READ or key in TOP_IRRELEVANT:
            continue
        if key in TOP_REFUSED_WHEN_SET:
            if value is None or value == [] or value == {}:
                continue
            named = _target(value, key, path) if isinstance(value, (dict, str)) else None
            raise ReshardError(
                f"{key}={shown(named or value)}: {TOP_REFUSED_WHEN_SET[key]}",
                path=path,
                hint="convert the checkpoint of the model without it (for PEFT, merge the adapters in NeMo first)",
            )
        raise ReshardError(
            f"unknown top-level key {shown(key)}: not known to leave the model unchanged",
            path=path,
            hint=f"reshard reads {TOP_READ} and knows {', '.join([*TOP_IRRELEVANT, *TOP_REFUSED_WHEN_SET])}",
        )


def nemo_tokenizer(checkpoint: Path) -> NamedTokenizer | None:
    """The tokenizer a NeMo 2 checkpoint keeps in its context: the folder ``model.yaml``'s
    ``tokenizer.pretrained_model_name`` names (NeMo's ``io_dump`` copies a local tokenizer folder into
    ``context/`` and writes its name there, e.g. ``nemo_tokenizer``), else ``context/nemo_tokenizer/``. A name that
    is not a folder of the context (a Hub id) is returned without a folder."""
    context = checkpoint / MODEL_YAML.parent
    data = _model_yaml(checkpoint)
    section = data.get("tokenizer") if isinstance(data, dict) else None
    name = section.get("pretrained_model_name") if isinstance(section, dict) else None
    if isinstance(name, dict):  # DirOrStringArtifact of a plain string: {_target_: ..., attr: NAME, skip: true}
        name = name.get("attr")
    for candidate in ([name] if isinstance(name, str) and name else []) + [NEMO_TOKENIZER]:
        try:
            folder = (context / candidate[:4096]).resolve()
            inside = folder.is_relative_to(context.resolve()) and folder.is_dir()
        except (OSError, ValueError):  # a name no file system holds (NUL, too long)
            inside = False
        if inside:
            return NamedTokenizer(str(folder), "the NeMo context", folder)
    return NamedTokenizer(name[:4096], "the NeMo context") if isinstance(name, str) and name else None


def nemo_side_files(checkpoint: Path) -> list[Path]:
    """Files of the context that go beside an HF output: the generation config NeMo's import keeps."""
    found = checkpoint / MODEL_YAML.parent / "artifacts" / GENERATION_CONFIG
    return [found] if found.is_file() else []


def _model_yaml(checkpoint: Path) -> Any:
    """``context/model.yaml`` parsed (None without one).

    Raises:
        CorruptFileError: the file is not YAML.
    """
    path = checkpoint / MODEL_YAML
    if not path.is_file():
        return None
    import yaml  # here, not at the top: every command imports this module, few read a NeMo checkpoint

    try:
        return yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError, ValueError) as err:  # ValueError: an
        # integer past Python's 4300 digits
        why = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise CorruptFileError(f"unreadable model config: {why[:200]}", path=path) from err


def _checked(value: Any, key: str, name: str, path: Path) -> Any:
    """``value`` when the readers can take it: one value for :data:`SINGLE` (a flat list for :data:`LISTS`), and
    at most :data:`MAX_ITEMS` items and characters for any field (so printing a refused one is bounded)."""
    flat = isinstance(value, list) and all(item is None or isinstance(item, (bool, int, float)) for item in value)
    if name in SINGLE and isinstance(value, (list, dict)) and not (name in LISTS and flat):
        raise CorruptFileError(f"{shown(value)} is not a single value", path=path, tensor=f"config.{key}")
    budget = [MAX_ITEMS]
    if not _small(value, budget, 0):
        raise CorruptFileError(
            f"{shown(value)} is larger or deeper than a config's value", path=path, tensor=f"config.{key}"
        )
    return value


def _small(value: Any, budget: list[int], depth: int) -> bool:
    """Whether ``value`` holds at most ``budget`` items and characters, 16 levels deep (an alias bomb does not)."""
    budget[0] -= 1 + (len(value) if isinstance(value, str) else 0)
    if budget[0] < 0 or depth > 16:
        return False
    if isinstance(value, dict):
        return all(_small(k, budget, depth + 1) and _small(v, budget, depth + 1) for k, v in value.items())
    if isinstance(value, list):
        return all(_small(item, budget, depth + 1) for item in value)
    return True


def _target(value: Any, key: str, path: Path) -> str | None:
    """The function or class a fiddle entry names (``{_target_: a.b.c}`` or the dotted name itself)."""
    target = value.get("_target_") if isinstance(value, dict) else value
    if target is not None and not isinstance(target, str):  # str() of a YAML alias bomb would never end
        raise CorruptFileError(f"{key} is {shown(target)}, not a function's name", path=path)
    return target


def _activation(config: dict[str, Any], path: Path) -> str | None:
    """The activation's function name (``torch.nn.functional.silu`` -> ``silu``); fiddle keeps it as ``_target_``."""
    target = _target(config.get("activation_func"), "activation_func", path)
    return target.rsplit(".", 1)[-1] if target else None
