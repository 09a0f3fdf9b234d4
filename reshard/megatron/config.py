"""What a Megatron GPT is, in Megatron's terms, and the same model as the ``config.json`` transformers builds.

:class:`GPTShape` holds the architecture Megatron-LM records in its pickled ``args`` (and NeMo in
``model.yaml``): sizes, norm, activation, biases, rotary settings, tied embeddings, experts. From it,
:func:`hf_family` picks the transformers family that computes the same function, and :func:`hf_config`
writes its ``config.json``; :func:`gpt_shape_from_hf` and :func:`megatron_args` go the other way, for
writing a Megatron checkpoint from a transformers one. An architecture transformers' Llama-like families
cannot express (LayerNorm, GeLU, learned positions, interleaved rotary) is refused, naming what differs: a config
that loads but computes something else is the bug this module exists to avoid. Partial rotary (``rotary_percent``
< 1) is ``glm4_moe``'s (GLM-4.5), whose dense layers are Llama's and which rotates the first channels of each head
with rotate-half pairs, as Megatron-Core does.

A model with multi-latent attention is DeepSeek-V3 (``deepseek_v3``): its YaRN RoPE, softmax scale, sigmoid router
with the expert bias, group-limited routing, scaled top-k, shared experts and dense first layers are carried where
transformers computes what Megatron-Core 0.16.1 computes (a sigmoid router without the expert bias is DeepseekV3's
with a zero ``e_score_correction_bias``), and refused by name where it does not (no shared expert; Megatron scores a
group of experts by its top ``topk / group_topk``, transformers by its top 2; transformers' shared expert has no
gate and is ``n_shared_experts`` routed experts wide; its latent norms use eps 1e-6; it ignores ``mscale`` when
``mscale_all_dim`` is 0 and scales the softmax only under YaRN, where Megatron scales it under any RoPE).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

from reshard.config import ModelConfig
from reshard.errors import MappingError
from reshard.megatron.args import args_problems, check_args
from reshard.megatron.model import arg
from reshard.megatron.vocab import DEFAULT_MEGATRON_MULTIPLE

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "granite_swa": "GraniteSWAForCausalLM",
    "stablelm": "StableLmForCausalLM",
    "glm": "GlmForCausalLM",
}
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


@dataclass(frozen=True)
class Yarn:
    """YaRN RoPE as Megatron-Core's MLA computes it (``YarnRotaryEmbedding``; MLATransformerConfig's defaults)."""

    factor: float = 40.0  # rotary_scaling_factor
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class MLA:
    """Multi-latent attention's sizes (Megatron-LM's names) and its RoPE: YaRN, or plain RoPE (``yarn`` None) with
    the softmax scaled by YaRN's ``mscale_all_dim`` all the same (``softmax_mscale``)."""

    q_lora_rank: int | None = None  # None: one linear_q_proj
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    yarn: Yarn | None = Yarn()
    softmax_mscale: float = 1.0  # Megatron's mscale(rotary_scaling_factor, mscale_all_dim): squared on the softmax


@dataclass(frozen=True)
class GPTShape:
    """A decoder-only transformer as Megatron describes it (Megatron-LM argument names)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    max_position_embeddings: int = 4096
    norm_epsilon: float = 1e-5
    rotary_base: float = 10000.0
    rope_scaling_factor: float | None = None  # Llama 3.1 rope scaling (--use-rope-scaling)
    rope_interpolation_factor: float | None = None  # --rotary-seq-len-interpolation-factor: positions / factor
    rotary_percent: float = 1.0  # the share of each head's channels RoPE rotates (the first ones; the rest pass)
    sliding_window: int | None = None  # the keys a query sees, itself included: Megatron's window_size left + 1
    window_layers: tuple[int, ...] = ()  # the layers with the sliding window (window_attn_skip_freq)
    no_rope_layers: tuple[int, ...] = ()  # the layers without RoPE (no_rope_freq)
    softmax_type: str = "vanilla"  # off-by-one: a zero logit in every softmax; learnable: one per head (a sink)
    softmax_scale: float | None = None  # None: 1 / sqrt(kv_channels)
    normalization: str = "RMSNorm"  # or LayerNorm (with biases)
    rotary_interleaved: bool = False  # RoPE pairs channels 2i and 2i + 1 (GPT-J), not i and i + d/2
    hidden_act: str = "silu"  # the gated MLP's activation: silu (--swiglu) or quick_gelu (--quick-geglu)
    add_qkv_bias: bool = False
    add_bias_linear: bool = False
    qk_layernorm: bool = False
    untie_embeddings_and_output_weights: bool = True
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    moe_router_pre_softmax: bool = False  # softmax over every expert before the top-k (no renormalization)
    moe_router_score_function: str = "softmax"
    dense_layers: tuple[int, ...] = ()  # the layers of an MoE with a dense MLP (--moe-layer-freq)
    mla: MLA | None = None  # --multi-latent-attention (DeepSeek-V3)
    moe_router_enable_expert_bias: bool = False
    moe_router_topk_scaling_factor: float | None = None
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None


def gpt_shape_from_args(args: Any) -> GPTShape:
    """The model in Megatron-LM's ``args``; refuses what transformers' Llama-like families cannot compute."""
    problems = []
    mla = bool(arg(args, "multi_latent_attention", False))
    normalization = arg(args, "normalization", "LayerNorm")
    if normalization not in ("RMSNorm", "LayerNorm"):
        problems.append(f"normalization={normalization!r} (the families need RMSNorm, or LayerNorm as StableLM)")
    if not (arg(args, "swiglu", False) or arg(args, "quick_geglu", False)):
        what = "the families use gated SiLU MLPs" + (", LayerNorm ones too" if normalization == "LayerNorm" else "")
        problems.append(f"swiglu={arg(args, 'swiglu', False)!r} ({what}, or quick-GeGLU ones)")
    position = arg(args, "position_embedding_type", "learned_absolute")
    if position not in (("rope", "none") if mla else ("rope",)):
        problems.append(f"position_embedding_type={position!r} (the families use rope)")
    if problems:  # with every other argument the table refuses, in the same line
        raise MappingError(
            "this Megatron model has no transformers family: " + "; ".join(problems + args_problems(args)),
            hint="keep Megatron's names with --keep-names, or convert to --layout megatron",
        )
    check_args(args)
    percent = arg(args, "rotary_percent", 1.0)
    if isinstance(percent, bool) or not isinstance(percent, (int, float)) or not 0 < percent <= 1:
        raise MappingError(f"rotary_percent={percent!r}: not a number in (0, 1]")
    softmax_type, softmax_scale = arg(args, "softmax_type", "vanilla"), arg(args, "softmax_scale")
    if softmax_type not in SOFTMAX_TYPES:
        raise MappingError(f"softmax_type={softmax_type!r}: Megatron-Core computes {', '.join(SOFTMAX_TYPES)}")
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))):
        raise MappingError(f"softmax_scale={softmax_scale!r}: not a number")
    interpolation = arg(args, "rotary_seq_len_interpolation_factor")
    if interpolation is not None and (not isinstance(interpolation, (int, float)) or interpolation <= 0):
        raise MappingError(f"rotary_seq_len_interpolation_factor={interpolation!r}: not a positive number")
    if interpolation is not None and arg(args, "use_rope_scaling", False):
        raise MappingError(
            f"rotary_seq_len_interpolation_factor={interpolation!r} with use_rope_scaling: transformers' rope "
            "types are one or the other"
        )
    num_layers = int(arg(args, "num_layers"))
    heads = int(arg(args, "num_attention_heads"))
    hidden = int(arg(args, "hidden_size"))
    groups = arg(args, "num_query_groups") if arg(args, "group_query_attention", False) else None
    return GPTShape(
        num_layers=num_layers,
        hidden_size=hidden,
        ffn_hidden_size=int(arg(args, "ffn_hidden_size")),
        num_attention_heads=heads,
        num_query_groups=int(groups or heads),
        kv_channels=int(arg(args, "kv_channels") or hidden // heads),
        max_position_embeddings=int(arg(args, "max_position_embeddings") or arg(args, "seq_length") or 4096),
        norm_epsilon=float(arg(args, "norm_epsilon", arg(args, "layernorm_epsilon", 1e-5))),
        rotary_base=float(arg(args, "rotary_base", 10000)),
        rope_scaling_factor=float(arg(args, "rope_scaling_factor", 8.0))
        if arg(args, "use_rope_scaling", False)
        else None,
        add_qkv_bias=bool(arg(args, "add_qkv_bias", False) or arg(args, "add_bias_linear", True)),
        add_bias_linear=bool(arg(args, "add_bias_linear", True)),
        qk_layernorm=bool(arg(args, "qk_layernorm", False)),
        untie_embeddings_and_output_weights=bool(arg(args, "untie_embeddings_and_output_weights", False)),
        num_experts=arg(args, "num_experts"),
        moe_router_topk=int(arg(args, "moe_router_topk", 2)),
        moe_ffn_hidden_size=arg(args, "moe_ffn_hidden_size"),
        moe_shared_expert_intermediate_size=arg(args, "moe_shared_expert_intermediate_size"),
        moe_shared_expert_gate=bool(arg(args, "moe_shared_expert_gate", False)),
        moe_router_pre_softmax=bool(arg(args, "moe_router_pre_softmax", False)),
        moe_router_score_function=str(arg(args, "moe_router_score_function", "softmax")),
        rope_interpolation_factor=None if interpolation in (None, 1) else float(interpolation),
        rotary_percent=float(percent),
        **_layer_patterns(args, num_layers),
        softmax_type=softmax_type,
        softmax_scale=None if softmax_scale is None else float(softmax_scale),
        normalization=str(normalization),
        rotary_interleaved=bool(arg(args, "rotary_interleaved", False)),
        hidden_act="silu" if arg(args, "swiglu", False) else "quick_gelu",
        dense_layers=_dense_layers(arg(args, "moe_layer_freq", 1), num_layers) if arg(args, "num_experts") else (),
        mla=_mla_from_args(args) if mla else None,
        moe_router_enable_expert_bias=bool(arg(args, "moe_router_enable_expert_bias", False)),
        moe_router_topk_scaling_factor=arg(args, "moe_router_topk_scaling_factor"),
        moe_router_num_groups=arg(args, "moe_router_num_groups"),
        moe_router_group_topk=arg(args, "moe_router_group_topk"),
    )


def _mla_from_args(args: Any) -> MLA:
    """MLA's sizes and RoPE; an argument the args lack takes MLATransformerConfig's default, as Megatron-LM's
    ``core_transformer_config_from_args`` leaves it (``rope_type`` None is YaRN for MLA)."""
    rope_type = arg(args, "rope_type", "yarn")
    factor = float(arg(args, "rotary_scaling_factor", 40.0))
    all_dim = float(arg(args, "mscale_all_dim", 0.0))
    if rope_type not in ("rope", "yarn"):
        raise MappingError(f"rope_type={rope_type!r}: Megatron-Core's MLA computes rope or yarn")
    yarn = Yarn(
        factor=factor,
        original_max_position_embeddings=int(arg(args, "original_max_position_embeddings", 4096)),
        beta_fast=float(arg(args, "beta_fast", 32.0)),
        beta_slow=float(arg(args, "beta_slow", 1.0)),
        mscale=float(arg(args, "mscale", 1.0)),
        mscale_all_dim=all_dim,
    )
    q_lora = arg(args, "q_lora_rank")
    return MLA(
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(arg(args, "kv_lora_rank", 512)),
        qk_head_dim=int(arg(args, "qk_head_dim", 128)),
        qk_pos_emb_head_dim=int(arg(args, "qk_pos_emb_head_dim", 64)),
        v_head_dim=int(arg(args, "v_head_dim", 128)),
        yarn=yarn if rope_type == "yarn" else None,
        softmax_mscale=_yarn_mscale(factor, all_dim),
    )


def _yarn_mscale(factor: float, mscale: float) -> float:
    """Megatron-Core's (and transformers') ``yarn_get_mscale``."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _layer_patterns(args: Any, num_layers: int) -> dict[str, Any]:
    """The sliding window and the layers it applies to, and the layers without RoPE, as Megatron-Core reads them.

    ``window_size`` ``(left, right)``: a query at ``i`` sees the keys ``i - left .. i + right``
    (``get_sliding_window_causal_mask``), so ``left + 1`` keys with itself when ``right`` is 0; transformers'
    ``sliding_window`` W keeps the keys ``> i - W``, so W is ``left + 1``. ``window_attn_skip_freq`` N leaves every
    Nth layer (1-based) full; a list marks the windowed layers with 1 (``is_layer_window_attention``).
    ``no_rope_freq`` N drops RoPE in every Nth layer (1-based); a list marks those layers with 1
    (``TransformerConfig.__post_init__``, ``Attention.forward``).
    """
    window = arg(args, "window_size")
    patterns: dict[str, Any] = {}
    if window is not None:
        ok = isinstance(window, (list, tuple)) and len(window) == 2 and all(_is_int(w) for w in window)
        if not ok or window[0] < 0 or window[1] != 0:
            raise MappingError(
                f"window_size={window!r}: reshard carries a causal sliding window (left >= 0, right 0) only"
            )
        skip = arg(args, "window_attn_skip_freq")
        layers = (
            range(num_layers) if skip is None else _layers_marked(skip, num_layers, "window_attn_skip_freq", full=True)
        )
        patterns |= {"sliding_window": int(window[0]) + 1, "window_layers": tuple(layers)}
    no_rope = arg(args, "no_rope_freq")
    if no_rope is not None:
        patterns["no_rope_layers"] = _layers_marked(no_rope, num_layers, "no_rope_freq")
    return patterns


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _layers_marked(freq: Any, num_layers: int, name: str, *, full: bool = False) -> tuple[int, ...]:
    """The layers a Megatron layer pattern marks: an int N marks every Nth layer (1-based), or, ``full``, every
    other layer; a list of ``num_layers`` 0s and 1s marks those with 1."""
    if _is_int(freq) and freq > 0:
        return tuple(i for i in range(num_layers) if ((i + 1) % freq == 0) != full)
    if isinstance(freq, (list, tuple)) and len(freq) == num_layers and all(f in (0, 1) for f in freq):
        return tuple(i for i, f in enumerate(freq) if f == 1)
    raise MappingError(f"{name}={freq!r}: neither a positive int nor a list of {num_layers} 0s and 1s (one per layer)")


def _dense_layers(freq: Any, num_layers: int) -> tuple[int, ...]:
    """The layers ``--moe-layer-freq`` leaves dense: every layer not a multiple of an int N, the 0s of a list."""
    if isinstance(freq, int) and not isinstance(freq, bool) and freq > 0:
        return tuple(i for i in range(num_layers) if i % freq)
    if isinstance(freq, (list, tuple)) and len(freq) == num_layers and all(f in (0, 1) for f in freq):
        return tuple(i for i, f in enumerate(freq) if f == 0)
    raise MappingError(
        f"moe_layer_freq={freq!r}: neither a positive int nor a list of {num_layers} 0s and 1s (one per layer)"
    )


def _rope_scaling(args: Any) -> float | None:
    """Llama 3.1's rope scaling factor when ``--use-rope-scaling`` was on."""
    return float(arg(args, "rope_scaling_factor", 8.0)) if arg(args, "use_rope_scaling", False) else None


def hf_family(shape: GPTShape) -> str:
    """The transformers family that computes what this Megatron GPT computes (refused, naming why, if none)."""
    if shape.mla is not None:
        _check_deepseek_v3(shape)
        return "deepseek_v3"
    if shape.normalization == "LayerNorm":
        _check_stablelm(shape)
        return "stablelm"
    if shape.rotary_interleaved:
        _check_glm(shape)
        return "glm"
    if shape.rotary_percent != 1.0:
        _check_glm4_moe(shape)
        return "glm4_moe"
    if shape.softmax_type != "vanilla":
        _check_llama_like(shape, "granite_swa", "an attention sink")
        return "granite_swa"
    if shape.softmax_scale is not None:
        _no_family(
            f"softmax_scale={shape.softmax_scale} with softmax_type 'vanilla' (granite_swa, the family with a softmax "
            "scale, always has attention sinks)"
        )
    if shape.window_layers or shape.no_rope_layers:
        _check_llama_like(
            shape, "smollm3", "sliding-window attention" if shape.window_layers else "layers without RoPE"
        )
        return "smollm3"
    if shape.num_experts:
        return _moe_family(shape)
    if shape.qk_layernorm:
        if shape.add_qkv_bias or shape.add_bias_linear:
            _no_family("qk_layernorm=True with add_bias_linear / add_qkv_bias (query/key norms with linear biases)")
        return "qwen3"
    if shape.add_qkv_bias and not shape.add_bias_linear:
        return "qwen2"
    return "llama"


def _moe_family(shape: GPTShape) -> str:
    if shape.add_bias_linear:
        _no_family("add_bias_linear=True with num_experts (MoE with linear biases)")
    if shape.dense_layers and not (shape.qk_layernorm or shape.moe_shared_expert_intermediate_size):
        layers = list(shape.dense_layers)
        _no_family(f"dense layers {layers} among MoE layers without query/key norms (Mixtral has none)")
    if shape.moe_router_score_function != "softmax":
        _no_family(f"a {shape.moe_router_score_function} router")
    if shape.moe_shared_expert_intermediate_size:
        if not shape.moe_shared_expert_gate:  # Qwen2-MoE always gates its shared expert
            _no_family("shared experts without a gate")
        if shape.qk_layernorm:
            _no_family("shared experts with query/key norms")
        return "qwen2_moe"
    if shape.qk_layernorm:
        return "qwen3_moe"
    if shape.moe_router_pre_softmax:  # Mixtral renormalizes the top-k weights
        _no_family(
            "moe_router_pre_softmax=True without qk_layernorm (a router that takes the softmax before the top-k: "
            "Qwen3-MoE computes it, Mixtral does not)"
        )
    if shape.add_qkv_bias:
        _no_family("MoE with QKV biases and no shared experts")
    return "mixtral"


def _check_deepseek_v3(shape: GPTShape) -> None:
    """Refuse, by argument, what Megatron's MLA model computes and transformers' DeepseekV3 does not."""
    mla = shape.mla
    assert mla is not None
    problems = []
    if shape.add_bias_linear or shape.add_qkv_bias:
        problems.append("add_bias_linear / add_qkv_bias: linear biases (DeepseekV3 has none)")
    if not shape.qk_layernorm:
        problems.append("qk_layernorm=False: MLA without its latent norms (DeepseekV3 always has them)")
    if shape.norm_epsilon != 1e-6:
        problems.append(f"norm_epsilon={shape.norm_epsilon}: DeepseekV3's latent norms use eps 1e-6")
    if shape.rope_interpolation_factor is not None or shape.rope_scaling_factor is not None:
        problems.append("rotary_seq_len_interpolation_factor / use_rope_scaling with MLA (it reads neither)")
    if mla.yarn is not None and mla.yarn.mscale_all_dim == 0 and mla.yarn.mscale != 1:
        problems.append(f"mscale={mla.yarn.mscale} with mscale_all_dim=0 (transformers' YaRN ignores mscale then)")
    if mla.yarn is None and mla.softmax_mscale != 1:
        problems.append(
            "rope_type='rope' with mscale_all_dim: Megatron scales the softmax by YaRN's mscale under plain RoPE, "
            "transformers does not"
        )
    if shape.num_experts:
        problems += _deepseek_router_problems(shape, shape.num_experts)
    problems += _pattern_problems(shape, "DeepseekV3")
    if problems:
        _no_family("; ".join(problems))


def _check_glm4_moe(shape: GPTShape) -> None:
    """Refuse, by argument, what a Megatron GPT with partial rotary computes and transformers' ``glm4_moe`` does not.

    ``glm4_moe`` (GLM-4.5) is the family that rotates the first ``head_dim x partial_rotary_factor`` channels of each
    head with rotate-half pairs and passes the rest, as Megatron-Core's ``RotaryEmbedding`` with ``rotary_percent``
    does (its ``dim = int(kv_channels * rotary_percent)``, the same ``inv_freq``); its dense layers are Llama's, with
    q/k/v biases only (``attention_bias``) and optional per-head query/key norms (``use_qk_norm``).
    """
    problems = []
    if shape.add_bias_linear:
        problems.append("add_bias_linear=True with partial rotary (glm4_moe has biases on q, k and v only)")
    if shape.num_experts:
        problems.append(
            f"num_experts={shape.num_experts} with partial rotary (glm4_moe's experts are not carried yet)"
        )
    problems += _pattern_problems(shape, "glm4_moe")
    if problems:
        _no_family(f"rotary_percent={shape.rotary_percent}: " + "; ".join(problems))


def _pattern_problems(shape: GPTShape, family: str) -> list[str]:
    """Sliding-window or RoPE-less layers, attention sinks or a softmax scale in a model that becomes ``family``,
    which computes none of them."""
    problems = []
    if shape.rotary_interleaved and family != "glm":
        problems.append(f"rotary_interleaved=True: interleaved RoPE pairs ({family} rotates halves; glm pairs)")
    if shape.softmax_type != "vanilla":
        problems.append(f"softmax_type={shape.softmax_type!r}: attention sinks ({family} has none)")
    if shape.softmax_scale is not None:
        problems.append(f"softmax_scale={shape.softmax_scale}: another softmax scale ({family} has none)")
    if shape.window_layers:
        problems.append(f"window_size: sliding-window attention ({family} has none; smollm3 has, without {family}'s)")
    if shape.no_rope_layers:
        problems.append(f"no_rope_freq: layers without RoPE ({family} has none; smollm3 has, without {family}'s)")
    return problems


def _check_glm(shape: GPTShape) -> None:
    """Refuse, by argument, what a Megatron GPT with interleaved rotary pairs computes and transformers' ``glm``
    (GLM-4) does not.

    ``glm`` rotates channel pairs (2i, 2i + 1) of the first ``head_dim x partial_rotary_factor`` channels (its
    ``rotate_half`` and ``repeat_interleave``d cos / sin), as Megatron-Core's ``_rotate_half`` and ``get_emb`` with
    ``rotary_interleaved``; its MLP is SwiGLU with ``gate_up_proj`` ``[gate; up]`` (Megatron's ``linear_fc1`` as it
    is), RMSNorm, biases on q, k and v only; no query/key norms, no experts.
    """
    problems = []
    if shape.add_bias_linear:
        problems.append("add_bias_linear=True with rotary_interleaved (glm has biases on q, k and v only)")
    if shape.qk_layernorm:
        problems.append("qk_layernorm=True with rotary_interleaved (glm has no query/key norms)")
    if shape.num_experts:
        problems.append(f"num_experts={shape.num_experts} with rotary_interleaved (glm has no experts)")
    problems += _pattern_problems(shape, "glm")
    if problems:
        _no_family("; ".join(problems))


def _check_stablelm(shape: GPTShape) -> None:
    """Refuse, by argument, what a Megatron GPT with LayerNorm computes and transformers' ``stablelm`` does not.

    ``stablelm`` is Llama with ``nn.LayerNorm`` (weight and bias: input, post-attention and final norms, Megatron's
    LayerNorm), partial rotary (``partial_rotary_factor``, rotate-half on the first channels, as ``glm4_moe``), and
    biases on q, k and v only (``use_qkv_bias``); its heads are ``hidden_size / num_attention_heads`` wide and its
    query/key norms are one LayerNorm per head, where Megatron shares one across heads.
    """
    problems = []
    if shape.add_bias_linear:
        problems.append("add_bias_linear=True with LayerNorm (stablelm has biases on q, k and v only)")
    if shape.qk_layernorm:
        problems.append("qk_layernorm=True with LayerNorm (stablelm's query/key norms are one per head, not shared)")
    if shape.kv_channels * shape.num_attention_heads != shape.hidden_size:
        problems.append(f"kv_channels={shape.kv_channels} with LayerNorm (stablelm's heads are hidden / heads wide)")
    if shape.num_experts:
        problems.append(f"num_experts={shape.num_experts} with LayerNorm (stablelm has no experts)")
    problems += _pattern_problems(shape, "stablelm")
    if problems:
        _no_family("normalization='LayerNorm': " + "; ".join(problems))


def _check_llama_like(shape: GPTShape, family: str, what: str) -> None:
    """Refuse, by argument, what a Megatron GPT with ``what`` computes and ``family`` does not.

    ``smollm3`` is Llama with two per-layer patterns: ``layer_types`` (``sliding_attention`` masks with
    ``sliding_window``) and ``no_rope_layers`` (0: the layer skips RoPE). ``granite_swa`` has the same patterns
    (``layer_rope_theta`` 0: no RoPE) and a learnable sink per head (``sinks``: a logit beside every softmax's, as
    Megatron-Core's ``SoftmaxOne``) and its softmax scale (``attention_multiplier``). Both have Llama's
    ``attention_bias`` (q, k, v, o) and ``mlp_bias``; no query/key norms, no experts, full rotary only.
    """
    problems = []
    if shape.qk_layernorm:
        problems.append(f"qk_layernorm=True with {what} ({family} has no query/key norms)")
    if shape.add_qkv_bias and not shape.add_bias_linear:
        problems.append(
            f"add_qkv_bias=True without add_bias_linear with {what} ({family} biases every linear or none)"
        )
    if shape.num_experts:
        problems.append(f"num_experts={shape.num_experts} with {what} ({family} has no experts)")
    if shape.rotary_interleaved:
        problems.append(f"rotary_interleaved=True with {what} ({family} rotates halves; glm pairs)")
    if problems:
        _no_family("; ".join(problems))


def _deepseek_router_problems(shape: GPTShape, experts: int) -> list[str]:
    problems = []
    if shape.moe_router_score_function != "sigmoid":
        problems.append(
            f"moe_router_score_function={shape.moe_router_score_function!r} (DeepseekV3 routes by sigmoid)"
        )
    expert = shape.moe_ffn_hidden_size or shape.ffn_hidden_size
    shared = shape.moe_shared_expert_intermediate_size
    if not shared:
        problems.append(
            f"moe_shared_expert_intermediate_size={shared!r}: no shared expert (transformers' DeepseekV3 always "
            "builds one, n_shared_experts x moe_intermediate_size wide; 0 gives empty weights reshard does not invent)"
        )
    elif shared % expert:
        problems.append(
            f"moe_shared_expert_intermediate_size={shared!r}: DeepseekV3's shared expert is a multiple of "
            f"moe_ffn_hidden_size {expert}"
        )
    if shape.moe_shared_expert_gate:
        problems.append("moe_shared_expert_gate=True (DeepseekV3's shared expert has no gate)")
    if shape.dense_layers != tuple(range(len(shape.dense_layers))):
        problems.append(f"moe_layer_freq: dense layers {list(shape.dense_layers)} are not the first ones")
    group_topk = shape.moe_router_group_topk
    if group_topk and shape.moe_router_topk != 2 * group_topk:
        problems.append(
            f"moe_router_group_topk={group_topk} with moe_router_topk={shape.moe_router_topk}: Megatron scores a "
            f"group by its top {shape.moe_router_topk // group_topk} experts, transformers by its top 2"
        )
    if group_topk and (not shape.moe_router_num_groups or experts % shape.moe_router_num_groups):
        problems.append(f"moe_router_num_groups={shape.moe_router_num_groups!r}: not a divisor of the experts")
    return problems


def _no_family(what: str) -> None:
    raise MappingError(
        f"this Megatron model has no transformers family: {what}",
        hint="keep Megatron's names with --keep-names, or convert to --layout megatron",
    )


def hf_config(shape: GPTShape, *, vocab_size: int | None, dtype: str, family: str | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``family`` (default :func:`hf_family`) for this model and true vocab size."""
    family = family or hf_family(shape)
    if family == "deepseek_v3":
        return _deepseek_v3_config(shape, vocab_size=vocab_size, dtype=dtype)
    rope = _rope_parameters(shape)
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.ffn_hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_query_groups,
        "head_dim": shape.kv_channels,
        "hidden_act": shape.hidden_act,
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.norm_epsilon,
        "rope_parameters": rope,
        "tie_word_embeddings": not shape.untie_embeddings_and_output_weights,
        "dtype": dtype,
    }
    if family == "llama":
        config |= {"attention_bias": shape.add_bias_linear, "mlp_bias": shape.add_bias_linear}
    if family in ("smollm3", "granite_swa"):  # their token ids default to their tokenizers' (past a small vocab)
        config |= {
            "pad_token_id": None,
            "bos_token_id": None,
            "eos_token_id": None,
            "attention_bias": shape.add_bias_linear,
            "mlp_bias": shape.add_bias_linear,
            "layer_types": [
                "sliding_attention" if i in shape.window_layers else "full_attention" for i in range(shape.num_layers)
            ],
        }
    if family == "granite_swa":  # sinks, the softmax scale; no multipliers; RoPE theta 0: the layer has none
        config |= {
            "attention_multiplier": shape.softmax_scale or shape.kv_channels**-0.5,
            "embedding_multiplier": 1.0,
            "residual_multiplier": 1.0,
            "logits_scaling": 1.0,
            "sliding_window": shape.sliding_window or shape.max_position_embeddings,  # unused when no layer slides
            "layer_rope_theta": [
                0 if i in shape.no_rope_layers else shape.rotary_base for i in range(shape.num_layers)
            ],
        }
    if family == "smollm3":
        config |= {
            "no_rope_layers": [int(i not in shape.no_rope_layers) for i in range(shape.num_layers)],
            "use_sliding_window": bool(shape.window_layers),
            "sliding_window": shape.sliding_window,
        }
    if family == "stablelm":  # partial_rotary_factor stated always: its config defaults it to 0.25
        rope["partial_rotary_factor"] = shape.rotary_percent
        config.pop("rms_norm_eps")
        config.pop("head_dim")
        config |= {
            "layer_norm_eps": shape.norm_epsilon,
            "use_qkv_bias": shape.add_qkv_bias,
            "qk_layernorm": False,
            "use_parallel_residual": False,
            "bos_token_id": None,
            "eos_token_id": None,
        }
    if family == "glm":  # partial_rotary_factor stated always: its config defaults it to 0.5
        rope["partial_rotary_factor"] = shape.rotary_percent
        config |= {"attention_bias": shape.add_qkv_bias, "pad_token_id": None, "bos_token_id": None}
        config["eos_token_id"] = None
    if family == "glm4_moe":  # stated always: glm4_moe's config defaults partial_rotary_factor to 0.5 when absent
        rope["partial_rotary_factor"] = shape.rotary_percent
        config |= {
            "attention_bias": shape.add_qkv_bias,
            "use_qk_norm": shape.qk_layernorm,
            "first_k_dense_replace": shape.num_layers,
            "num_mtp_layers": 0,
        }
    if family in ("mixtral", "qwen2_moe", "qwen3_moe"):
        config |= _moe_config(shape, family)
    return config


def _rope_parameters(shape: GPTShape) -> dict[str, Any]:
    """``rope_parameters`` of the Llama-like families: default, linear (interpolated positions) or llama3."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": shape.rotary_base}
    if shape.rope_interpolation_factor is not None:
        rope = {"rope_type": "linear", "rope_theta": shape.rotary_base, "factor": shape.rope_interpolation_factor}
    if shape.rope_scaling_factor is not None:
        rope = {
            "rope_type": "llama3",
            "rope_theta": shape.rotary_base,
            "factor": shape.rope_scaling_factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    return rope


def _moe_config(shape: GPTShape, family: str) -> dict[str, Any]:
    """The experts' part of a Mixtral / Qwen2-MoE / Qwen3-MoE ``config.json``."""
    expert_size = shape.moe_ffn_hidden_size or shape.ffn_hidden_size
    config: dict[str, Any] = {"num_experts_per_tok": shape.moe_router_topk}
    if family == "mixtral":
        return config | {"num_local_experts": shape.num_experts, "intermediate_size": expert_size}
    config |= {
        "num_experts": shape.num_experts,
        "moe_intermediate_size": expert_size,
        "norm_topk_prob": not shape.moe_router_pre_softmax,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(shape.dense_layers),
    }
    if family == "qwen2_moe":
        config |= {
            "shared_expert_intermediate_size": shape.moe_shared_expert_intermediate_size,
            "qkv_bias": shape.add_qkv_bias,
        }
    return config


def _deepseek_v3_config(shape: GPTShape, *, vocab_size: int | None, dtype: str) -> dict[str, Any]:
    """DeepseekV3's ``config.json``: MLA sizes, YaRN, the sigmoid router's settings, shared experts, dense prefix."""
    mla = shape.mla
    if mla is None:
        raise MappingError("deepseek_v3 needs multi-latent attention (multi_latent_attention in the args)")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": shape.rotary_base}
    if mla.yarn is not None:
        y = mla.yarn
        rope = {
            "rope_type": "yarn",
            "rope_theta": shape.rotary_base,
            "factor": y.factor,
            "original_max_position_embeddings": y.original_max_position_embeddings,
            "beta_fast": y.beta_fast,
            "beta_slow": y.beta_slow,
            "mscale": y.mscale,
            "mscale_all_dim": y.mscale_all_dim,
        }
    experts = shape.num_experts or 0
    expert_size = shape.moe_ffn_hidden_size or shape.ffn_hidden_size
    grouped = bool(shape.moe_router_group_topk)
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES["deepseek_v3"]],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.ffn_hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_attention_heads,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_head_dim,
        "qk_rope_head_dim": mla.qk_pos_emb_head_dim,
        "v_head_dim": mla.v_head_dim,
        "rope_interleave": True,  # Megatron's MLA de-interleaves the rope dims, as transformers does here
        "hidden_act": shape.hidden_act,
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.norm_epsilon,
        "rope_parameters": rope,
        "attention_bias": False,
        "tie_word_embeddings": not shape.untie_embeddings_and_output_weights,
        "first_k_dense_replace": len(shape.dense_layers) if experts else shape.num_layers,
        "num_mtp_layers": 0,
        "dtype": dtype,
    }
    if experts:
        config |= {
            "n_routed_experts": experts,
            "num_experts_per_tok": shape.moe_router_topk,
            "moe_intermediate_size": expert_size,
            "n_shared_experts": (shape.moe_shared_expert_intermediate_size or 0) // expert_size,
            "routed_scaling_factor": float(shape.moe_router_topk_scaling_factor or 1.0),
            "norm_topk_prob": shape.moe_router_topk > 1,  # Megatron renormalizes the sigmoid top-k when k > 1
            "n_group": shape.moe_router_num_groups if grouped else 1,
            "topk_group": shape.moe_router_group_topk if grouped else 1,
        }
    return config


def _given(config: ModelConfig, size: int | None, key: str) -> int:
    """A size of the model that ``config`` must give."""
    if size is None:
        raise MappingError(f"the transformers config has no {key}", path=config.path)
    return size


def gpt_shape_from_hf(config: ModelConfig) -> GPTShape:
    """The Megatron description of a transformers Llama-family or MoE config."""
    family = config.model_type
    if family not in _ARCHITECTURES and family != "mistral":
        raise MappingError(
            f"no Megatron mapping for model_type {family!r}", hint=f"one of {', '.join(_ARCHITECTURES)}"
        )
    if family == "deepseek_v3":
        return _deepseek_v3_shape(config)
    rope = config.get("rope_parameters") or {}
    partial = _partial_rotary(config, rope)
    scaling = rope.get("factor") if rope.get("rope_type") == "llama3" else None
    interpolation = rope.get("factor") if rope.get("rope_type") == "linear" else None
    if rope.get("rope_type", "default") not in ("default", "llama3", "linear"):
        raise MappingError(f"rope_type {rope.get('rope_type')!r}: Megatron's GPT has no such RoPE")
    layers = config.get("num_hidden_layers")
    step = config.get("decoder_sparse_step") or 1
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise MappingError(f"decoder_sparse_step {step!r}: not a positive integer", path=config.path)
    only = set(config.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(layers or 0) if i in only or (i + 1) % step) if family != "mixtral" else ()
    experts = config.get("num_local_experts") or config.get("num_experts")
    bias = bool(config.get("attention_bias", False))
    glm = family == "glm4_moe"
    if glm and (config.get("first_k_dense_replace") or 0) < (layers or 0):
        raise MappingError("glm4_moe with experts: not carried to Megatron yet", path=config.path)
    granite = _granite_swa(config, rope) if family == "granite_swa" else {}
    stablelm, glm_dense = family == "stablelm", family == "glm"
    act = config.get("hidden_act", "silu")
    if act not in ("silu", "quick_gelu"):
        raise MappingError(
            f"hidden_act {act!r}: Megatron's gated MLPs compute silu (--swiglu) or quick_gelu (--quick-geglu)",
            path=config.path,
        )
    if stablelm and (config.get("qk_layernorm", False) or config.get("use_parallel_residual", False)):
        raise MappingError(
            "stablelm with qk_layernorm (one norm per head) or use_parallel_residual: Megatron-Core computes neither",
            path=config.path,
        )
    if family in ("smollm3", "granite_swa") and bool(config.get("attention_bias")) != bool(config.get("mlp_bias")):
        raise MappingError("attention_bias without mlp_bias or the reverse: Megatron biases every linear or none")
    return GPTShape(
        num_layers=layers,
        hidden_size=config.get("hidden_size"),
        ffn_hidden_size=config.get("intermediate_size"),
        num_attention_heads=_given(config, config.num_attention_heads, "num_attention_heads"),
        num_query_groups=_given(config, config.num_key_value_heads, "num_key_value_heads"),
        kv_channels=_given(config, config.head_dim, "head_dim"),
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        norm_epsilon=config.get("layer_norm_eps", 1e-5) if stablelm else config.get("rms_norm_eps", 1e-6),
        normalization="LayerNorm" if stablelm else "RMSNorm",
        rotary_interleaved=glm_dense,
        hidden_act=act,
        rotary_base=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        rope_scaling_factor=scaling,
        rope_interpolation_factor=interpolation,
        rotary_percent=partial,
        **(_hf_layer_patterns(config, layers or 0) | granite),
        dense_layers=dense if experts and not glm else (),
        add_qkv_bias=family in ("qwen2", "qwen2_moe") or bias or bool(stablelm and config.get("use_qkv_bias")),
        add_bias_linear=bias and not glm and not glm_dense,  # glm / glm4_moe's attention_bias: q, k and v only
        qk_layernorm=family in ("qwen3", "qwen3_moe") or (glm and bool(config.get("use_qk_norm", False))),
        untie_embeddings_and_output_weights=not config.tie_word_embeddings,
        num_experts=None if glm else experts,
        moe_router_topk=config.get("num_experts_per_tok", 2),
        moe_ffn_hidden_size=config.get("moe_intermediate_size")
        or (config.get("intermediate_size") if experts else None),
        moe_shared_expert_intermediate_size=config.get("shared_expert_intermediate_size"),
        moe_shared_expert_gate=bool(config.get("shared_expert_intermediate_size")),
        moe_router_pre_softmax=bool(experts) and not config.get("norm_topk_prob", family == "mixtral"),
    )


def _granite_swa(config: ModelConfig, rope: dict[str, Any]) -> dict[str, Any]:
    """The :class:`GPTShape` fields of a granite_swa config: its learnable sinks, its softmax scale, its windowed
    layers and those without RoPE (``layer_rope_theta`` 0); multipliers other than 1 and a per-layer RoPE theta other
    than the model's have no Megatron argument and are refused by field."""
    get, layers = config.get, config.get("num_hidden_layers") or 0
    problems = [
        f"{key} {get(key)}"
        for key in ("embedding_multiplier", "residual_multiplier", "logits_scaling")
        if get(key, 1.0) != 1.0
    ]
    theta = float(rope.get("rope_theta", get("rope_theta", 10000.0)))
    thetas = get("layer_rope_theta") or [theta] * layers
    if len(thetas) != layers or any(t not in (0, theta) for t in thetas):
        problems.append(f"layer_rope_theta {thetas} (Megatron has one rotary_base, or no RoPE in a layer)")
    types = get("layer_types") or ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(layers)]
    if len(types) != layers:
        problems.append(f"layer_types of {len(types)} layers, not {layers}")
    if problems:
        raise MappingError("this granite_swa model has no Megatron-Core equivalent: " + "; ".join(problems))
    scale = get("attention_multiplier", 1.0)
    head_dim = config.head_dim or 1
    window = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    return {
        "softmax_type": "learnable",
        "softmax_scale": None if math.isclose(scale, head_dim**-0.5, rel_tol=1e-12) else float(scale),
        "window_layers": window,
        "sliding_window": int(get("sliding_window", 128)) if window else None,
        "no_rope_layers": tuple(i for i, t in enumerate(thetas) if t == 0),
    }


def _hf_layer_patterns(config: ModelConfig, layers: int) -> dict[str, Any]:
    """The sliding window, its layers and the layers without RoPE of a transformers config, as :class:`GPTShape`
    holds them: smollm3's ``layer_types`` and ``no_rope_layers`` (their defaults as ``SmolLM3Config`` makes them:
    every 4th layer without RoPE, windowed when ``use_sliding_window``), Mistral's window on every layer (4096 when
    its config does not say, as ``MistralConfig`` defaults it)."""
    window = config.get("sliding_window", 4096 if config.model_type == "mistral" else None)
    if config.model_type == "mistral" and window is not None:
        return {"sliding_window": int(window), "window_layers": tuple(range(layers))}
    if config.model_type != "smollm3":
        return {}
    interval = config.get("no_rope_layer_interval", 4)
    rope = config.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    windowed = bool(config.get("use_sliding_window", False)) and window is not None
    types = config.get("layer_types") or [
        "sliding_attention" if windowed and not rope[i] else "full_attention" for i in range(layers)
    ]
    if len(rope) != layers or len(types) != layers:
        raise MappingError(f"no_rope_layers / layer_types do not list {layers} layers", path=config.path)
    sliding = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention") if windowed else ()
    return {
        "sliding_window": int(window) if sliding else None,
        "window_layers": sliding,
        "no_rope_layers": tuple(i for i, r in enumerate(rope) if not r),
    }


def _partial_rotary(config: ModelConfig, rope: dict[str, Any]) -> float:
    """The share of each head RoPE rotates: ``partial_rotary_factor`` (in ``rope_parameters`` or beside it), whose
    default is 0.5 for ``glm4_moe`` and 0.25 for ``stablelm`` (their configs', when absent) and 1 elsewhere; only they
    compute less."""
    default = {"glm4_moe": 0.5, "glm": 0.5, "stablelm": 0.25}.get(config.model_type or "", 1.0)
    factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", default))
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise MappingError(f"partial_rotary_factor {factor!r}: not a number in (0, 1]", path=config.path)
    if factor != 1 and config.model_type not in ("glm4_moe", "glm", "stablelm"):
        raise MappingError(
            f"partial_rotary_factor {factor} in a {config.model_type} config (reshard carries partial rotary as "
            "glm4_moe's)",
            path=config.path,
        )
    return float(factor)


def _deepseek_v3_shape(config: ModelConfig) -> GPTShape:
    """The Megatron MLA model of a transformers DeepseekV3 config; refuses, by field, what Megatron-Core computes
    otherwise (the reverse of :func:`_check_deepseek_v3`)."""
    get = config.get
    layers, heads = get("num_hidden_layers"), get("num_attention_heads")
    problems = []
    rope = get("rope_parameters") or get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    yarn = None
    if kind == "yarn":
        if rope.get("attention_factor") is not None or rope.get("truncate", True) is not True:
            problems.append("rope_parameters attention_factor / truncate (Megatron's YaRN computes neither)")
        all_dim = float(rope.get("mscale_all_dim") or 0.0)
        factor = rope.get("factor") or get("max_position_embeddings") / rope["original_max_position_embeddings"]
        yarn = Yarn(
            factor=float(factor),
            original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 4096)),
            beta_fast=float(rope.get("beta_fast") or 32.0),
            beta_slow=float(rope.get("beta_slow") or 1.0),
            mscale=float(rope.get("mscale") or 1.0) if all_dim else 1.0,  # transformers ignores mscale then
            mscale_all_dim=all_dim,
        )
    elif kind != "default":
        problems.append(f"rope_type {kind!r} (Megatron's MLA computes default RoPE or YaRN)")
    if get("rms_norm_eps", 1e-6) != 1e-6:
        problems.append(f"rms_norm_eps {get('rms_norm_eps')}: the latent norms use 1e-6, Megatron one eps for all")
    if get("attention_bias", False):
        problems.append("attention_bias (Megatron's MLA has no biases)")
    if get("rope_interleave", True) is not True:
        problems.append("rope_interleave false (Megatron's MLA de-interleaves the rope dims)")
    experts = get("n_routed_experts") if (get("first_k_dense_replace") or 0) < layers else None
    topk, groups, topk_group = get("num_experts_per_tok", 8), get("n_group") or 1, get("topk_group") or 1
    if experts and bool(get("norm_topk_prob", True)) != (topk > 1):
        problems.append(f"norm_topk_prob {get('norm_topk_prob')} with top-{topk} (Megatron renormalizes when k > 1)")
    if experts and groups > 1 and topk != 2 * topk_group:
        problems.append(
            f"n_group {groups}, topk_group {topk_group}, num_experts_per_tok {topk}: transformers scores a group by "
            f"its top 2 experts, Megatron by its top {topk // topk_group}"
        )
    if problems:
        raise MappingError(
            "this DeepseekV3 model has no Megatron-Core equivalent: " + "; ".join(problems), path=config.path
        )
    moe_size = get("moe_intermediate_size")
    return GPTShape(
        num_layers=layers,
        hidden_size=get("hidden_size"),
        ffn_hidden_size=get("intermediate_size"),
        num_attention_heads=heads,
        num_query_groups=heads,
        kv_channels=get("v_head_dim"),
        max_position_embeddings=get("max_position_embeddings", 4096),
        norm_epsilon=1e-6,
        rotary_base=float(rope.get("rope_theta", get("rope_theta", 10000.0))),
        qk_layernorm=True,
        untie_embeddings_and_output_weights=not config.tie_word_embeddings,
        num_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=moe_size if experts else None,
        moe_shared_expert_intermediate_size=moe_size * (get("n_shared_experts") or 0) if experts else None,
        moe_router_score_function="sigmoid" if experts else "softmax",
        dense_layers=tuple(range(get("first_k_dense_replace") or 0)) if experts else (),
        mla=MLA(
            q_lora_rank=get("q_lora_rank"),
            kv_lora_rank=get("kv_lora_rank"),
            qk_head_dim=get("qk_nope_head_dim"),
            qk_pos_emb_head_dim=get("qk_rope_head_dim"),
            v_head_dim=get("v_head_dim"),
            yarn=yarn,
            softmax_mscale=1.0,
        ),
        moe_router_enable_expert_bias=bool(experts),
        moe_router_topk_scaling_factor=float(get("routed_scaling_factor", 1.0)) if experts else None,
        moe_router_num_groups=groups if experts and groups > 1 else None,
        moe_router_group_topk=topk_group if experts and groups > 1 else None,
    )


def _mla_args(shape: GPTShape) -> dict[str, Any]:
    """The Megatron-LM arguments of multi-latent attention and DeepSeek-V3's router (none for other models)."""
    mla = shape.mla
    if mla is None:
        return {}
    yarn = mla.yarn or Yarn(factor=1.0)
    return {
        "multi_latent_attention": True,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_head_dim": mla.qk_head_dim,
        "qk_pos_emb_head_dim": mla.qk_pos_emb_head_dim,
        "v_head_dim": mla.v_head_dim,
        "rope_type": "yarn" if mla.yarn is not None else "rope",
        "rotary_scaling_factor": yarn.factor,
        "original_max_position_embeddings": yarn.original_max_position_embeddings,
        "beta_fast": yarn.beta_fast,
        "beta_slow": yarn.beta_slow,
        "mscale": yarn.mscale,
        "mscale_all_dim": yarn.mscale_all_dim,
        "moe_router_score_function": shape.moe_router_score_function,
        "moe_router_enable_expert_bias": shape.moe_router_enable_expert_bias,
        "moe_router_topk_scaling_factor": shape.moe_router_topk_scaling_factor,
        "moe_router_num_groups": shape.moe_router_num_groups,
        "moe_router_group_topk": shape.moe_router_group_topk,
    }


def _pattern_args(shape: GPTShape) -> dict[str, Any]:
    """``window_size``, ``window_attn_skip_freq`` and ``no_rope_freq`` for the layer patterns (lists of 0s and 1s)."""
    every = range(shape.num_layers)
    window = shape.sliding_window if shape.window_layers else None
    return {
        "window_size": None if window is None else (window - 1, 0),
        "window_attn_skip_freq": None
        if window is None or len(shape.window_layers) == shape.num_layers
        else [int(i in shape.window_layers) for i in every],
        "no_rope_freq": [int(i in shape.no_rope_layers) for i in every] if shape.no_rope_layers else None,
    }


def megatron_args(
    shape: GPTShape, *, vocab_size: int | None, divisible_by: int = DEFAULT_MEGATRON_MULTIPLE
) -> argparse.Namespace:
    """Megatron-LM ``args`` for this model, as ``pretrain_gpt.py`` would record them (tp and padded vocab are
    set by the writer)."""
    return argparse.Namespace(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        group_query_attention=shape.num_query_groups != shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.kv_channels,
        max_position_embeddings=shape.max_position_embeddings,
        seq_length=shape.max_position_embeddings,
        normalization=shape.normalization,
        norm_epsilon=shape.norm_epsilon,
        rotary_interleaved=shape.rotary_interleaved,
        swiglu=shape.hidden_act == "silu",
        quick_geglu=shape.hidden_act == "quick_gelu",
        position_embedding_type="rope",
        rotary_base=int(shape.rotary_base) if float(shape.rotary_base).is_integer() else shape.rotary_base,
        rotary_percent=shape.rotary_percent,
        **_pattern_args(shape),
        softmax_type=shape.softmax_type,
        softmax_scale=shape.softmax_scale,
        use_rope_scaling=shape.rope_scaling_factor is not None,
        rope_scaling_factor=shape.rope_scaling_factor or 8.0,
        add_qkv_bias=shape.add_qkv_bias,
        add_bias_linear=shape.add_bias_linear,
        qk_layernorm=shape.qk_layernorm,
        untie_embeddings_and_output_weights=shape.untie_embeddings_and_output_weights,
        num_experts=shape.num_experts,
        moe_router_topk=shape.moe_router_topk,
        moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=shape.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=shape.moe_shared_expert_gate,
        moe_router_pre_softmax=shape.moe_router_pre_softmax,
        moe_layer_freq=[0 if i in shape.dense_layers else 1 for i in range(shape.num_layers)]
        if shape.dense_layers
        else 1,
        rotary_seq_len_interpolation_factor=shape.rope_interpolation_factor,
        make_vocab_size_divisible_by=divisible_by,
        vocab_size=vocab_size,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        transformer_impl="transformer_engine",
        **_mla_args(shape),
    )


_AGREE = ("num_hidden_layers", "num_experts_per_tok", "norm_topk_prob", "tie_word_embeddings")


def config_disagreements(given: ModelConfig, args: Any) -> list[str]:
    """Where a ``--config`` and the Megatron ``args`` describe different models: one line per field, both values.

    The args are checked as for a conversion (:func:`gpt_shape_from_args`): what they set and no config can carry
    is refused even with a ``--config``.
    """
    shape = gpt_shape_from_args(args)
    family = given.model_type if given.model_type in _ARCHITECTURES else None
    derived = hf_config(shape, vocab_size=None, dtype="float32", family=family)
    found = []
    given_rope = given.get("rope_parameters") or given.get("rope_scaling") or {}
    kind = given_rope.get("rope_type") or given_rope.get("type") or "default"
    rope = derived["rope_parameters"]
    if kind != rope["rope_type"] or (kind != "default" and given_rope.get("factor") != rope.get("factor")):
        found.append(
            f"RoPE {kind} factor {given_rope.get('factor')} in --config, {rope['rope_type']} factor "
            f"{rope.get('factor')} in the args"
        )
    theta = given_rope.get("rope_theta", given.get("rope_theta"))
    if theta is not None and float(theta) != rope["rope_theta"]:
        found.append(f"rope_theta {theta} in --config, rotary_base {rope['rope_theta']} in the args")
    keys = _AGREE + (("mlp_only_layers",) if "mlp_only_layers" in derived else ())
    for key in keys:
        if key in derived and (key in given.raw or key == "mlp_only_layers"):
            mine = given.get(key) if key != "mlp_only_layers" else list(given.get(key) or [])
            if mine != derived[key]:
                found.append(f"{key} {mine!r} in --config, {derived[key]!r} from the args")
    return found
