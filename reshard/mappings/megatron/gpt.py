"""Megatron-LM / Megatron-Core GPT <-> the transformers families it trains: Llama, Mistral, Qwen2, Qwen3,
their MoE cousins Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 (multi-latent attention), and GLM-4.5 (``glm4_moe``:
partial rotary; its dense layers have Llama's names).

What the table does (and why each row is not a plain rename):

* ``linear_qkv`` (legacy ``query_key_value``) is fused and interleaved per query group (``[ng, q/ng + 2, d,
  h]``): split into ``q_proj`` / ``k_proj`` / ``v_proj``, biases too (Qwen2). Megatron's rotary
  embedding uses transformers' ``rotate_half`` convention, so no RoPE permutation is needed.
* ``linear_fc1`` (legacy ``dense_h_to_4h``) under SwiGLU is ``[gate; up]``: split in two halves.
* Norms: Transformer Engine fuses the input norm into ``linear_qkv`` (``linear_qkv.layer_norm_weight``) and
  the MLP norm into ``linear_fc1``; the local spec names them ``input_layernorm`` / ``pre_mlp_layernorm``; a
  MoE layer keeps ``pre_mlp_layernorm`` (its router comes first). All become ``input_layernorm`` /
  ``post_attention_layernorm``. Qwen3's ``q_layernorm`` / ``k_layernorm`` become ``q_norm`` / ``k_norm``.
* ``output_layer`` becomes ``lm_head``; a model with tied embeddings has neither.
* MoE: the router becomes ``gate`` (``block_sparse_moe.gate`` for Mixtral), expert ``{E}`` of
  ``local_experts`` (global expert numbers, as reshard presents every expert-parallel layout) becomes
  ``experts.{E}``, its fc1 split into gate and up (Mixtral's ``w1`` / ``w3``, ``w2`` down); Qwen2-MoE's
  ``shared_experts`` become ``shared_expert`` and ``shared_experts.gate_weight`` ``shared_expert_gate``; the dense
  layers of a Qwen2/3-MoE (``mlp_only_layers``, Megatron's ``--moe-layer-freq``) keep the dense MLP's rows.
* DeepSeek-V3 (MLA): plain renames, no transform: ``linear_q_proj`` (no ``q_lora_rank``) is ``q_proj``,
  ``linear_q_down_proj`` / ``linear_q_up_proj`` are ``q_a_proj`` / ``q_b_proj``, ``linear_kv_down_proj`` (``[kv
  latent | shared rope key]``) is ``kv_a_proj_with_mqa``, ``linear_kv_up_proj`` (per head ``[k_nope | v]``) is
  ``kv_b_proj``; the latent norms ``q_layernorm`` / ``kv_layernorm`` (Transformer Engine fuses them into
  ``linear_q_up_proj.layer_norm_weight`` / ``linear_kv_up_proj.layer_norm_weight``) are ``q_a_layernorm`` /
  ``kv_a_layernorm``; both specs keep a separate ``input_layernorm``. The router's ``expert_bias`` is
  ``gate.e_score_correction_bias`` (a sigmoid router without one gets a zero bias: the same choice of experts),
  the ungated ``shared_experts`` are ``shared_experts``.
* Legacy (pre-mcore) names under ``language_model.`` are read too.
* Dropped on purpose: Transformer Engine's ``_extra_state`` (FP8 scaling metadata), rotary ``inv_freq``.

The vocab tables keep their names' partition (``vocab``): pad rows are cut to the true vocab size when
gathered, like everywhere else.
"""

from __future__ import annotations

from reshard.config import ModelConfig
from reshard.errors import MappingError
from reshard.mappings.base import Entry, Mapping, rename
from reshard.mappings.transforms import Chunk, Invertible, SplitGroupedQKV, WithZeros

DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "granite_swa", "stablelm", "glm")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
MLA_FAMILIES = ("deepseek_v3",)
PARTIAL_ROTARY_FAMILIES = ("glm4_moe",)
MEGATRON = "megatron"

FAMILIES = DENSE_FAMILIES + MOE_FAMILIES + MLA_FAMILIES + PARTIAL_ROTARY_FAMILIES
_L = "decoder.layers.{L}."
_LEGACY = "language_model.encoder.layers.{L}."
_HF = "model.layers.{L}."


def _need(config: ModelConfig | None, key: str) -> int:
    # head_dim as transformers' attention reads it: hidden_size // heads when the config has none (Qwen2, Mixtral)
    value = None if config is None else config.head_dim if key == "head_dim" else config.get(key)
    if not isinstance(value, int) or value <= 0:
        raise MappingError(f"splitting the fused QKV needs {key} from the model config", hint="pass --config FILE")
    return value


def split_qkv(config: ModelConfig | None) -> Invertible:
    """The fused QKV's split, from the head counts and head size of the config."""
    heads, groups = _need(config, "num_attention_heads"), _need(config, "num_key_value_heads")
    if heads % groups:
        raise MappingError(f"{heads} attention heads do not form {groups} query groups")
    return SplitGroupedQKV(groups, heads // groups, _need(config, "head_dim"))


def _attention() -> tuple[Entry, ...]:
    hf = _HF + "self_attn."
    rows = []
    for kind in ("weight", "bias"):
        targets = tuple(f"{hf}{p}_proj.{kind}" for p in "qkv")
        rows += [
            Entry((_L + f"self_attention.linear_qkv.{kind}",), targets, split_qkv),
            Entry((_LEGACY + f"self_attention.query_key_value.{kind}",), targets, split_qkv, alternative=True),
            rename(_L + f"self_attention.linear_proj.{kind}", hf + f"o_proj.{kind}"),
            rename(_LEGACY + f"self_attention.dense.{kind}", hf + f"o_proj.{kind}", alternative=True),
        ]
    return (
        *rows,
        rename(_L + "self_attention.linear_qkv.layer_norm_weight", _HF + "input_layernorm.weight"),
        rename(_L + "input_layernorm.weight", _HF + "input_layernorm.weight", alternative=True),
        rename(_LEGACY + "input_norm.weight", _HF + "input_layernorm.weight", alternative=True),
        rename(_LEGACY + "input_layernorm.weight", _HF + "input_layernorm.weight", alternative=True),
        rename(_L + "self_attention.q_layernorm.weight", hf + "q_norm.weight"),
        rename(_L + "self_attention.k_layernorm.weight", hf + "k_norm.weight"),
    )


def _mlp(
    megatron: str,
    hf: str,
    names: tuple[str, str, str],
    *,
    fc: tuple[str, str] = ("linear_fc1", "linear_fc2"),
    bias: bool = True,
    alternative: bool = False,
) -> tuple[Entry, ...]:
    """fc1 -> gate and up halves, fc2 -> down, for one MLP (dense, an expert, or the shared expert)."""
    gate, up, down = names
    fc1, fc2 = fc
    return tuple(
        row
        for kind in (("weight", "bias") if bias else ("weight",))
        for row in (
            Entry((f"{megatron}{fc1}.{kind}",), (f"{hf}{gate}.{kind}", f"{hf}{up}.{kind}"), Chunk(2), alternative),
            rename(f"{megatron}{fc2}.{kind}", f"{hf}{down}.{kind}", alternative=alternative),
        )
    )


HF_MLP = ("gate_proj", "up_proj", "down_proj")


def _dense_mlp() -> tuple[Entry, ...]:
    norm = _HF + "post_attention_layernorm.weight"
    return (
        *_mlp(_L + "mlp.", _HF + "mlp.", HF_MLP),
        *_mlp(_LEGACY + "mlp.", _HF + "mlp.", HF_MLP, fc=("dense_h_to_4h", "dense_4h_to_h"), alternative=True),
        rename(_L + "mlp.linear_fc1.layer_norm_weight", norm),
        rename(_L + "pre_mlp_layernorm.weight", norm, alternative=True),
        rename(_LEGACY + "post_attention_norm.weight", norm, alternative=True),
        rename(_LEGACY + "post_attention_layernorm.weight", norm, alternative=True),
    )


def _moe_mlp(family: str) -> tuple[Entry, ...]:
    experts = _L + "mlp.experts.local_experts.{E}."
    if family == "mixtral":
        moe = _HF + "block_sparse_moe."
        rows = _mlp(experts, moe + "experts.{E}.", ("w1", "w3", "w2"), bias=False)
        router = rename(_L + "mlp.router.weight", moe + "gate.weight")
    else:
        rows = _mlp(experts, _HF + "mlp.experts.{E}.", HF_MLP, bias=False)
        router = rename(_L + "mlp.router.weight", _HF + "mlp.gate.weight")
    shared: tuple[Entry, ...] = ()
    if family == "qwen2_moe":
        shared = (
            *_mlp(_L + "mlp.shared_experts.", _HF + "mlp.shared_expert.", HF_MLP, bias=False),
            rename(_L + "mlp.shared_experts.gate_weight", _HF + "mlp.shared_expert_gate.weight"),
        )
    dense: tuple[Entry, ...] = ()
    if family != "mixtral":  # Qwen2/3-MoE's mlp_only_layers: Megatron's dense layers (--moe-layer-freq)
        dense = (
            *_mlp(_L + "mlp.", _HF + "mlp.", HF_MLP, bias=False),
            rename(_L + "mlp.linear_fc1.layer_norm_weight", _HF + "post_attention_layernorm.weight", alternative=True),
        )
    norm = rename(_L + "pre_mlp_layernorm.weight", _HF + "post_attention_layernorm.weight")
    return (*rows, router, *shared, *dense, norm)


def _mla_attention() -> tuple[Entry, ...]:
    """Multi-latent attention: every row a rename; Transformer Engine's fused latent norms read as alternatives.

    The latent norms are written under Transformer Engine's names, as GPU runs store them (the local spec's
    ``q_layernorm`` / ``kv_layernorm`` are read)."""
    m, hf = _L + "self_attention.", _HF + "self_attn."
    pairs = {
        "linear_q_proj": "q_proj",
        "linear_q_down_proj": "q_a_proj",
        "linear_q_up_proj": "q_b_proj",
        "linear_kv_down_proj": "kv_a_proj_with_mqa",
        "linear_kv_up_proj": "kv_b_proj",
        "linear_proj": "o_proj",
    }
    return (
        *(rename(f"{m}{mine}.weight", f"{hf}{theirs}.weight") for mine, theirs in pairs.items()),
        rename(m + "linear_q_up_proj.layer_norm_weight", hf + "q_a_layernorm.weight"),
        rename(m + "q_layernorm.weight", hf + "q_a_layernorm.weight", alternative=True),
        rename(m + "linear_kv_up_proj.layer_norm_weight", hf + "kv_a_layernorm.weight"),
        rename(m + "kv_layernorm.weight", hf + "kv_a_layernorm.weight", alternative=True),
        rename(_L + "input_layernorm.weight", _HF + "input_layernorm.weight"),
    )


def _deepseek_v3_mlp(expert_bias: bool) -> tuple[Entry, ...]:
    """Routed experts, the sigmoid router and its expert bias (a zero one when ``expert_bias`` is off: transformers'
    router always adds one), the ungated shared expert, the dense first layers."""
    router, gate = _L + "mlp.router.", _HF + "mlp.gate."
    bias = gate + "e_score_correction_bias"
    routing = (
        (rename(router + "weight", gate + "weight"), rename(router + "expert_bias", bias))
        if expert_bias
        else (Entry((router + "weight",), (gate + "weight", bias), WithZeros()),)
    )
    return (
        *_mlp(_L + "mlp.experts.local_experts.{E}.", _HF + "mlp.experts.{E}.", HF_MLP, bias=False),
        *routing,
        *_mlp(_L + "mlp.shared_experts.", _HF + "mlp.shared_experts.", HF_MLP, bias=False),
        *_mlp(_L + "mlp.", _HF + "mlp.", HF_MLP, bias=False),
        rename(_L + "pre_mlp_layernorm.weight", _HF + "post_attention_layernorm.weight"),
        rename(_L + "mlp.linear_fc1.layer_norm_weight", _HF + "post_attention_layernorm.weight", alternative=True),
    )


def _norm_biases() -> tuple[Entry, ...]:
    """LayerNorm's biases, under the names its weights have (Transformer Engine's fused ones written)."""
    return (
        rename(_L + "self_attention.linear_qkv.layer_norm_bias", _HF + "input_layernorm.bias"),
        rename(_L + "input_layernorm.bias", _HF + "input_layernorm.bias", alternative=True),
        rename(_L + "mlp.linear_fc1.layer_norm_bias", _HF + "post_attention_layernorm.bias"),
        rename(_L + "pre_mlp_layernorm.bias", _HF + "post_attention_layernorm.bias", alternative=True),
        rename("decoder.final_layernorm.bias", "model.norm.bias"),
    )


def _sinks(zeros: bool) -> tuple[Entry, ...]:
    """granite_swa's ``sinks``: Megatron's learnable ``softmax_offset``, or (``zeros``: softmax_type off-by-one, a
    fixed zero logit) a zero vector of the heads, made beside ``linear_proj`` (whose rename it then replaces)."""
    sinks = _HF + "self_attn.sinks"
    if not zeros:
        return (rename(_L + "self_attention.core_attention.softmax_offset", sinks),)
    return (Entry((_L + "self_attention.linear_proj.weight",), (_HF + "self_attn.o_proj.weight", sinks), head_zeros),)


def head_zeros(config: ModelConfig | None) -> Invertible:
    """A zero vector of the attention heads beside the tensor (off-by-one's sinks)."""
    return WithZeros(_need(config, "num_attention_heads"))


def megatron_to_hf(family: str | None, *, expert_bias: bool = True, zero_sinks: bool = False) -> Mapping:
    """The Megatron GPT -> transformers table for one family (``llama``, ``qwen2``, ``mixtral``, ...);
    ``expert_bias`` off: DeepSeek-V3's sigmoid router has no expert bias (a zero one is written); ``zero_sinks``:
    granite_swa's sinks are zeros (Megatron's off-by-one softmax), else its learnable softmax offsets."""
    if family not in FAMILIES:
        raise MappingError(f"no Megatron mapping to the {family!r} family", hint=f"one of {FAMILIES}")
    if family in MLA_FAMILIES:
        layers = (*_mla_attention(), *_deepseek_v3_mlp(expert_bias))
    else:  # glm4_moe (partial rotary) without experts, smollm3, granite_swa: Llama's rows
        layers = (*_attention(), *(_moe_mlp(family) if family in MOE_FAMILIES else _dense_mlp()))
    if family == "glm":  # SwiGLU fused as Megatron's: gate_up_proj is linear_fc1 ([gate; up]) as it is
        fused = {_L + "mlp.linear_fc1.weight", _LEGACY + "mlp.dense_h_to_4h.weight"}
        gate_up = _HF + "mlp.gate_up_proj.weight"
        layers = tuple(
            rename(row.sources[0], gate_up, alternative=row.alternative) if row.sources[0] in fused else row
            for row in layers
        )
    if family == "stablelm":  # LayerNorm: the norms' biases
        layers = (*layers, *_norm_biases())
    if family == "granite_swa":
        proj = _L + "self_attention.linear_proj.weight"
        kept = (row for row in layers if not (zero_sinks and row.sources == (proj,)))
        layers = (*kept, *_sinks(zero_sinks))
    return Mapping(
        MEGATRON,
        family,
        (
            rename("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
            rename("language_model.embedding.word_embeddings.weight", "model.embed_tokens.weight", alternative=True),
            rename("decoder.final_layernorm.weight", "model.norm.weight"),
            rename("language_model.encoder.final_norm.weight", "model.norm.weight", alternative=True),
            rename("language_model.encoder.final_layernorm.weight", "model.norm.weight", alternative=True),
            rename("output_layer.weight", "lm_head.weight"),
            rename("language_model.output_layer.weight", "lm_head.weight", alternative=True),
            *layers,
        ),
        dropped=(r"_extra_state$", r"rotary_pos_emb\.inv_freq$"),
        dropped_in_target=(r"rotary_emb\.inv_freq$",),
    )
