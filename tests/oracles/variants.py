"""The tiny Megatron-Core GPT models the oracle builds, as plain data (importable without megatron or torch).

Both sides use this module: the torchrun script (``mcore_gpt.py``) builds the model from a ``Variant``, and
the pytest side (``oracles/__init__.py``) names checkpoints by it and passes overrides as ``--set key=value``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

SEED = 1234  # the writer's weights
BATCH_SEED = 4321  # the fixed batch of input ids
BATCH, SEQ = 2, 12
ITERATION = 10  # iter_0000010/


@dataclass(frozen=True)
class Variant:
    """Sizes and switches of one tiny GPT, with Megatron-LM's meaning (``args`` names in the comments).

    Every size divides by tp in {1, 2, 4} and every layer count by pp in {1, 2}.
    """

    name: str
    hidden: int = 64  # hidden_size
    layers: int = 4  # num_layers
    heads: int = 8  # num_attention_heads
    groups: int = 2  # num_query_groups (GQA: 4 query heads per group)
    head_dim: int = 8  # kv_channels
    ffn: int = 96  # ffn_hidden_size (per half of the SwiGLU fc1)
    vocab: int = 1000  # vocab_size (true); the tables hold padded_vocab_size rows
    divisible_by: int = 128  # make_vocab_size_divisible_by
    tied: bool = False  # not untie_embeddings_and_output_weights
    qkv_bias: bool = False  # add_qkv_bias (Qwen2-style); add_bias_linear stays False
    experts: int = 0  # num_experts (0: dense MLP)
    topk: int = 2  # moe_router_topk
    moe_ffn: int = 32  # moe_ffn_hidden_size
    shared_ffn: int = 0  # moe_shared_expert_intermediate_size (0: no shared expert)
    shared_gate: bool = False  # moe_shared_expert_gate (a sigmoid gate on the shared expert, as Qwen2-MoE has)
    qk_norm: bool = False  # qk_layernorm (Qwen3-style RMSNorm of each head's queries and keys)
    max_seq: int = 64  # max_position_embeddings, seq_length
    rotary_base: int = 10000
    norm_eps: float = 1e-5
    init_std: float = 0.05  # larger than Megatron's 0.02 so the logits are far from zero
    interpolation: float = 0.0  # rotary_seq_len_interpolation_factor (0: none): positions divided by it
    dense_first: int = 0  # the first layers with a dense MLP in an MoE (moe_layer_freq [0] * n + [1] * rest)
    # DeepSeek-V3: multi-latent attention (MLATransformerConfig), its YaRN RoPE and router.
    mla: bool = False  # multi_latent_attention (heads x head_dim are then v_head_dim's)
    q_lora: int = 0  # q_lora_rank (0: None, one linear_q_proj)
    kv_lora: int = 24  # kv_lora_rank
    qk_dim: int = 16  # qk_head_dim (the part of each query/key head without RoPE)
    pos_dim: int = 8  # qk_pos_emb_head_dim (the RoPE part, its key shared by all heads)
    yarn_factor: float = 4.0  # rotary_scaling_factor (rope_type yarn)
    yarn_original: int = 16  # original_max_position_embeddings
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    sigmoid: bool = False  # moe_router_score_function sigmoid
    expert_bias: bool = True  # moe_router_enable_expert_bias (with sigmoid)
    topk_scale: float = 0.0  # moe_router_topk_scaling_factor (0: None)
    router_groups: int = 0  # moe_router_num_groups (0: None)
    group_topk: int = 0  # moe_router_group_topk (0: None)
    te_names: bool = False  # files under Transformer Engine's names (the latent norms fused in the up projections)
    # The argument sweep (tests/mappings/test_megatron_sweep.py): one Megatron argument away from the Llama shape.
    act: str = "swiglu"  # swiglu (gated silu), gelu, squared_relu, quick_geglu (gated quick_gelu): their args flags
    bias: bool = False  # add_bias_linear (biases on qkv, proj, fc1, fc2)
    norm: str = "RMSNorm"  # normalization (RMSNorm, LayerNorm)
    rotary_percent: float = 1.0
    pos: str = "rope"  # position_embedding_type (rope, learned_absolute, none)
    softmax_scale: float = 0.0  # softmax_scale (0: None, 1/sqrt(head_dim))
    pre_softmax: bool = False  # moe_router_pre_softmax
    fp32_residual: bool = False  # fp32_residual_connection
    window: int = -1  # window_size (window, 0): a query sees itself and `window` keys before it (-1: None)
    window_skip: int = 0  # window_attn_skip_freq (0: None, every layer windowed): every Nth layer full
    no_rope: int = 0  # no_rope_freq (0: None): every Nth layer without RoPE
    interleaved: bool = False  # rotary_interleaved: RoPE pairs channels 2i, 2i + 1 (GPT-J), not i, i + d/2
    softmax: str = "vanilla"  # softmax_type: vanilla, off-by-one (a zero logit beside each row), learnable (per head)

    @property
    def window_size(self) -> tuple[int, int] | None:
        return (self.window, 0) if self.window >= 0 else None

    @property
    def moe_layer_freq(self) -> int | list[int]:
        return [0] * self.dense_first + [1] * (self.layers - self.dense_first) if self.dense_first else 1

    def padded_vocab(self, tp: int) -> int:
        """Megatron-LM's ``vocab_size_with_padding``: a multiple of ``make_vocab_size_divisible_by * tp``."""
        step = self.divisible_by * tp
        return -(-self.vocab // step) * step

    def with_overrides(self, overrides: dict[str, str]) -> Variant:
        """This variant with ``--set key=value`` overrides, each value parsed as its field's type."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        changes: dict[str, object] = {}
        for key, text in overrides.items():
            if key not in fields or key == "name":
                raise ValueError(f"unknown variant field {key!r}; known: {', '.join(sorted(set(fields) - {'name'}))}")
            default = getattr(self, key)
            if isinstance(default, bool):
                changes[key] = text.lower() in ("1", "true", "yes")
            else:
                changes[key] = type(default)(text)
        return dataclasses.replace(self, **changes)


VARIANTS: dict[str, Variant] = {
    # Llama-like: GQA 8 heads / 2 query groups, SwiGLU, RMSNorm, RoPE, no biases, untied, vocab 1000 -> 1024.
    "llama": Variant("llama"),
    "llama-tied": Variant("llama-tied", tied=True),
    # Mixtral-like: 4 experts, top-2, router, SequentialMLP (the local spec); 2 layers keep it cheap.
    "moe": Variant("moe", layers=2, experts=4),
    # The same plus a shared expert next to the routed ones (no gate: no transformers family has that).
    "moe-shared": Variant("moe-shared", layers=2, experts=4, shared_ffn=48),
    # Qwen2-MoE-like: a gated shared expert and QKV biases.
    "moe-shared-gate": Variant("moe-shared-gate", layers=2, experts=4, shared_ffn=48, shared_gate=True, qkv_bias=True),
    # Qwen3-like: query/key norms, tied embeddings.
    "qk-norm": Variant("qk-norm", layers=2, qk_norm=True, tied=True),
    # Llama-like with RoPE positions interpolated by 4 (transformers' rope_type linear).
    "rope-linear": Variant("rope-linear", layers=2, interpolation=4.0),
    # Qwen2-MoE-like whose first layer is dense (mlp_only_layers [0]), with the gated shared expert.
    "moe-shared-gate-dense-first": Variant(
        "moe-shared-gate-dense-first",
        layers=3,
        experts=4,
        shared_ffn=48,
        shared_gate=True,
        qkv_bias=True,
        dense_first=1,
    ),
    # Qwen3-MoE-like whose first layer is dense (transformers' mlp_only_layers [0]).
    "moe-dense-first": Variant("moe-dense-first", layers=3, experts=4, qk_norm=True, dense_first=1),
    # DeepSeek-V3-like: MLA with q_lora_rank, YaRN (mscale, mscale_all_dim), a dense first layer, 4 experts in 2
    # groups (top-2 of 1 group), a shared expert, the sigmoid router with its expert bias, top-k scaled by 2.5.
    "dsv3": Variant(
        "dsv3",
        layers=3,
        heads=4,
        groups=4,
        head_dim=16,
        experts=4,
        shared_ffn=32,
        qk_norm=True,
        dense_first=1,
        norm_eps=1e-6,
        mla=True,
        q_lora=32,
        mscale=0.9,
        mscale_all_dim=0.8,
        sigmoid=True,
        topk_scale=2.5,
        router_groups=2,
        group_topk=1,
    ),
    # The same without q_lora_rank (linear_q_proj), ungrouped, under Transformer Engine's names.
    "dsv3-te": Variant(
        "dsv3-te",
        layers=3,
        heads=4,
        groups=4,
        head_dim=16,
        experts=4,
        shared_ffn=64,
        qk_norm=True,
        dense_first=1,
        norm_eps=1e-6,
        mla=True,
        sigmoid=True,
        topk_scale=1.5,
        te_names=True,
    ),
}


def parse_overrides(pairs: list[str]) -> dict[str, str]:
    """``["vocab=1000", "tied=true"]`` -> ``{"vocab": "1000", "tied": "true"}``."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--set wants key=value, got {pair!r}")
        out[key.strip()] = value.strip()
    return out


@dataclass(frozen=True)
class Spec:
    """One model at one parallel layout: a variant name, its ``--set`` overrides, tp, pp and virtual stages."""

    variant: str = "llama"
    tp: int = 1
    pp: int = 1
    overrides: tuple[tuple[str, str], ...] = ()
    vpp: int = 1  # model chunks per pipeline rank (Megatron's virtual pipeline: model0, model1, ...)

    def model(self) -> Variant:
        return VARIANTS[self.variant].with_overrides(dict(self.overrides))

    @property
    def slug(self) -> str:
        """A directory name: ``llama-tp2-pp1`` (+ ``-vpp2``, ``-divisible_by8`` for virtual stages, overrides)."""
        parts = [self.variant, f"tp{self.tp}", f"pp{self.pp}"] + ([f"vpp{self.vpp}"] if self.vpp > 1 else [])
        return "-".join(parts + [f"{k}{v}" for k, v in self.overrides])

    def to_json(self) -> dict:
        return {
            "variant": self.variant,
            "tp": self.tp,
            "pp": self.pp,
            "vpp": self.vpp,
            "overrides": dict(self.overrides),
        }

    @classmethod
    def from_json(cls, data: dict) -> Spec:
        overrides = tuple(sorted((str(k), str(v)) for k, v in data.get("overrides", {}).items()))
        tp, pp, vpp = (int(data.get(k, 1)) for k in ("tp", "pp", "vpp"))
        return cls(data.get("variant", "llama"), tp, pp, overrides, vpp)
