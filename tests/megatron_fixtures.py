"""Megatron-LM checkpoints written the way Megatron lays them out, from a canonical full model.

Everything here is computed independently of reshard: the per-rank slices follow Megatron's own
rules (reference notes 1.2-1.6): fused QKV interleaved per query group and cut in contiguous row
chunks (a group spread over ``tp / ng`` ranks when tp > ng), SwiGLU fc1 as ``[gate_r; up_r]``,
vocab tables padded to ``make_vocab_size_divisible_by * tp`` at the tail, row-parallel on dim 1.
"""

from __future__ import annotations

import argparse
import enum
import io
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch

H, NH, NG, D, F, LAYERS, V, MULTIPLE = 32, 8, 2, 4, 48, 2, 50, 4
PAD_FILL = -7.0  # Megatron's pad rows are trained rows, not zeros: make them visible
ITERATION = 1000


def padded_vocab(tp: int, vocab: int = V, multiple: int = MULTIPLE) -> int:
    step = multiple * tp
    return -(-vocab // step) * step


@dataclass
class FullModel:
    """Canonical full tensors, by part: q/k/v, gate/up kept apart (as HF would hold them)."""

    t: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(cls) -> FullModel:
        shapes = {"emb": (V, H), "out": (V, H), "final_norm": (H,)}
        for i in range(LAYERS):
            shapes |= {
                f"{i}.in_norm": (H,),
                f"{i}.q": (NH * D, H),
                f"{i}.k": (NG * D, H),
                f"{i}.v": (NG * D, H),
                f"{i}.q_b": (NH * D,),
                f"{i}.k_b": (NG * D,),
                f"{i}.v_b": (NG * D,),
                f"{i}.proj": (H, NH * D),
                f"{i}.proj_b": (H,),
                f"{i}.mlp_norm": (H,),
                f"{i}.gate": (F, H),
                f"{i}.up": (F, H),
                f"{i}.gate_b": (F,),
                f"{i}.up_b": (F,),
                f"{i}.fc2": (H, F),
                f"{i}.fc2_b": (H,),
            }
        model = cls()
        for n, (key, shape) in enumerate(shapes.items()):
            numel = 1
            for s in shape:
                numel *= s
            model.t[key] = torch.arange(numel, dtype=torch.float32).reshape(shape) + 10_000 * (n + 1)
        return model


def qkv_rank(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tp: int, r: int) -> torch.Tensor:
    """Rank r's rows of the fused QKV: whole groups when tp <= ng, else a 1/(tp/ng) piece of one group."""
    qd = NH // NG * D
    groups = [torch.cat([q[g * qd : (g + 1) * qd], k[g * D : (g + 1) * D], v[g * D : (g + 1) * D]]) for g in range(NG)]
    if tp <= NG:
        per = NG // tp
        return torch.cat(groups[r * per : (r + 1) * per])
    spread = tp // NG
    block = groups[r // spread]
    size = block.shape[0] // spread
    return block[(r % spread) * size : (r % spread + 1) * size]


def chunk(t: torch.Tensor, tp: int, r: int, dim: int = 0) -> torch.Tensor:
    size = t.shape[dim] // tp
    return t.narrow(dim, r * size, size)


def vocab_rank(table: torch.Tensor, tp: int, r: int, fill: float) -> torch.Tensor:
    vp = padded_vocab(tp)
    padded = torch.cat([table, torch.full((vp - table.shape[0], table.shape[1]), fill)])
    return chunk(padded, tp, r)


MCORE = {
    "emb": "embedding.word_embeddings.weight",
    "out": "output_layer.weight",
    "final_norm": "decoder.final_layernorm.weight",
    "layer": "decoder.layers.{i}.",
    "in_norm": "self_attention.linear_qkv.layer_norm_weight",
    "qkv": "self_attention.linear_qkv.weight",
    "qkv_b": "self_attention.linear_qkv.bias",
    "proj": "self_attention.linear_proj.weight",
    "proj_b": "self_attention.linear_proj.bias",
    "mlp_norm": "mlp.linear_fc1.layer_norm_weight",
    "fc1": "mlp.linear_fc1.weight",
    "fc1_b": "mlp.linear_fc1.bias",
    "fc2": "mlp.linear_fc2.weight",
    "fc2_b": "mlp.linear_fc2.bias",
}
LEGACY = {
    "emb": "language_model.embedding.word_embeddings.weight",
    "out": "language_model.output_layer.weight",
    "final_norm": "language_model.encoder.final_norm.weight",
    "layer": "language_model.encoder.layers.{i}.",
    "in_norm": "input_norm.weight",
    "qkv": "self_attention.query_key_value.weight",
    "qkv_b": "self_attention.query_key_value.bias",
    "proj": "self_attention.dense.weight",
    "proj_b": "self_attention.dense.bias",
    "mlp_norm": "post_attention_norm.weight",
    "fc1": "mlp.dense_h_to_4h.weight",
    "fc1_b": "mlp.dense_h_to_4h.bias",
    "fc2": "mlp.dense_4h_to_h.weight",
    "fc2_b": "mlp.dense_4h_to_h.bias",
}


def rank_state(full: FullModel, tp: int, r: int, names: dict[str, str], fill: float = PAD_FILL) -> dict:
    """Rank r's flat state dict (tensors only) at tp, under ``names``."""
    t = full.t
    out = {names["emb"]: vocab_rank(t["emb"], tp, r, fill)}
    for i in range(LAYERS):
        p = names["layer"].format(i=i)
        out |= {
            p + names["in_norm"]: t[f"{i}.in_norm"],
            p + names["qkv"]: qkv_rank(t[f"{i}.q"], t[f"{i}.k"], t[f"{i}.v"], tp, r),
            p + names["qkv_b"]: qkv_rank(t[f"{i}.q_b"], t[f"{i}.k_b"], t[f"{i}.v_b"], tp, r),
            p + names["proj"]: chunk(t[f"{i}.proj"], tp, r, dim=1),
            p + names["proj_b"]: t[f"{i}.proj_b"],
            p + names["mlp_norm"]: t[f"{i}.mlp_norm"],
            p + names["fc1"]: torch.cat([chunk(t[f"{i}.gate"], tp, r), chunk(t[f"{i}.up"], tp, r)]),
            p + names["fc1_b"]: torch.cat([chunk(t[f"{i}.gate_b"], tp, r), chunk(t[f"{i}.up_b"], tp, r)]),
            p + names["fc2"]: chunk(t[f"{i}.fc2"], tp, r, dim=1),
            p + names["fc2_b"]: t[f"{i}.fc2_b"],
        }
    out[names["final_norm"]] = t["final_norm"]
    out[names["out"]] = vocab_rank(t["out"], tp, r, fill)
    return {k: v.clone() for k, v in out.items()}


def extra_states(tp: int, r: int) -> dict:
    """Transformer Engine's per-module ``_extra_state`` entries (BytesIO blobs, or None)."""
    out = {}
    for i in range(LAYERS):
        p = f"decoder.layers.{i}."
        out[p + "self_attention.linear_qkv._extra_state"] = io.BytesIO(f"fp8 qkv l{i} r{r}/{tp}".encode())
        out[p + "mlp.linear_fc2._extra_state"] = io.BytesIO(f"fp8 fc2 l{i} r{r}/{tp}".encode())
        out[p + "self_attention.core_attention._extra_state"] = None
        out[p + "mlp.linear_fc1._extra_state"] = torch.tensor(list(f"te l{i} r{r}".encode()), dtype=torch.uint8)
    return out


def nest_legacy(flat: dict) -> dict:
    """Legacy Megatron nesting: language_model -> embedding / encoder (flat layer keys) / output_layer."""
    lm: dict = {"embedding": {"word_embeddings": {}}, "encoder": {}, "output_layer": {}}
    for name, value in flat.items():
        rest = name.removeprefix("language_model.")
        if rest.startswith("embedding."):
            lm["embedding"]["word_embeddings"]["weight"] = value
        elif rest.startswith("output_layer."):
            lm["output_layer"]["weight"] = value
        else:
            lm["encoder"][rest.removeprefix("encoder.")] = value
    return {"language_model": lm}


class ModelType(enum.Enum):
    """Stands in for ``megatron.core.enums.ModelType`` when the fixture is pickled."""

    encoder_or_decoder = 1


def fake_megatron_enums() -> dict[str, types.ModuleType]:
    """Modules ``megatron.core.enums`` holding :class:`ModelType`, so pickle records Megatron's path."""
    ModelType.__module__ = "megatron.core.enums"
    mods = {name: types.ModuleType(name) for name in ("megatron", "megatron.core", "megatron.core.enums")}
    mods["megatron.core.enums"].ModelType = ModelType
    return mods


def make_args(tp: int, **extra: object) -> argparse.Namespace:
    return argparse.Namespace(
        num_layers=LAYERS,
        hidden_size=H,
        ffn_hidden_size=F,
        num_attention_heads=NH,
        group_query_attention=True,
        num_query_groups=NG,
        kv_channels=D,
        swiglu=True,
        normalization="RMSNorm",
        position_embedding_type="rope",
        add_bias_linear=True,
        add_qkv_bias=True,
        untie_embeddings_and_output_weights=True,
        make_vocab_size_divisible_by=MULTIPLE,
        padded_vocab_size=padded_vocab(tp),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        params_dtype=torch.float32,
        vocab_size=None,
        **extra,
    )


def write_megatron(
    root: Path,
    full: FullModel,
    tp: int,
    *,
    legacy: bool = False,
    stages: int = 1,
    args: argparse.Namespace | None = None,
    model_type: bool = True,
) -> Path:
    """Write ``root`` as Megatron's ``torch`` format at ``tp`` (optionally split in ``stages`` pipeline stages)."""
    args = args or make_args(tp)
    args.pipeline_model_parallel_size = stages
    mods = fake_megatron_enums() if model_type else {}
    if model_type:
        args.model_type = ModelType.encoder_or_decoder
    sys.modules.update(mods)
    try:
        for r in range(tp):
            flat = rank_state(full, tp, r, LEGACY if legacy else MCORE)
            if not legacy:
                flat |= extra_states(tp, r)
            for p in range(stages):
                keep = {k: v for k, v in flat.items() if stages == 1 or _stage_of(k) == p}
                if stages > 1:  # layer numbers are local to the stage
                    keep = {k.replace(f".layers.{p}.", ".layers.0."): v for k, v in keep.items()}
                folder = root / f"iter_{ITERATION:07d}" / (f"mp_rank_{r:02d}" + (f"_{p:03d}" if stages > 1 else ""))
                folder.mkdir(parents=True)
                obj = {
                    "args": args,
                    "checkpoint_version": 3.0,
                    "iteration": ITERATION,
                    "model": nest_legacy(keep) if legacy else keep,
                    "optimizer": {"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": [{"lr": 1e-4}]},
                    "rng_state": [{"torch_rng_state": torch.zeros(4, dtype=torch.uint8)}],
                }
                torch.save(obj, folder / "model_optim_rng.pt")
    finally:
        for name in mods:
            sys.modules.pop(name, None)
    (root / "latest_checkpointed_iteration.txt").write_text(f"{ITERATION}\n")
    return root


def _stage_of(name: str) -> int | None:
    """Two stages: layer 0 and the embedding on stage 0; layer 1, final norm and output on stage 1."""
    if name.startswith("embedding") or ".layers.0." in name:
        return 0
    return 1


class NotAllowed:
    """A class outside every allow-list, pickled into ``args`` by the unsafe-pickle test."""

    def __init__(self, value: int = 3) -> None:
        self.value = value
