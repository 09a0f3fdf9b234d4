"""A tiny CogAgent-like SwissArmyTransformer checkpoint, written per rank the way SAT lays it out.

Everything here is independent of reshard: full (canonical) tensors are made from ``torch.arange``;
each is split per rank by SAT's own rule (``sat/mpu/layers.py``: column = dim 0, strided column = each
part split on dim 0 and the rank's pieces concatenated, row = dim 1, the rest copied), and saved as
``<save>/<iteration>/mp_rank_XX_model_states.pt`` = ``{"module": ..., "iteration": ...}`` with ``latest``
and ``model_config.json``. LoRA (``sat/model/finetune/lora2.py``) wraps the attention layers of the trunk
and of the EVA tower: ``X.original.weight``, ``X.matrix_A.i`` ``[r, in_local]``, ``X.matrix_B.i``
``[part_i / tp, r]``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

RANK = 2  # LoRA rank


def config(*, gqa: bool = True, tp: int = 8) -> dict:
    """model_config.json of the tiny model: hidden 32, 16 heads of 2 (8 KV groups with ``gqa``)."""
    return {
        "model_class": "FineTuneTestCogAgentModel",
        "num_layers": 1,
        "hidden_size": 32,
        "num_attention_heads": 16,
        "num_multi_query_heads": 8 if gqa else 0,
        "inner_hidden_size": 64,
        "vocab_size": 1024,
        "is_decoder": True,
        "cross_attn_hidden_size": 16,
        "cross_compute_hidden_size": 32,
        "model_parallel_size": tp,
        "use_lora": True,
        "lora_rank": RANK,
        "eva_args": {
            "model_class": "EVA2CLIPModel",
            "num_layers": 1,
            "hidden_size": 16,
            "num_attention_heads": 8,
            "inner_hidden_size": 32,
            "vocab_size": 1,
            "max_sequence_length": 5,
        },
    }


def sizes(cfg: dict) -> dict[str, int]:
    """Row counts, computed the way SAT's SelfAttention / CrossAttention do."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    hd = h // heads
    g = cfg["num_multi_query_heads"] or heads
    return {
        "q": heads * hd,
        "kv": g * hd,
        "cross": cfg["cross_compute_hidden_size"],
        "eva": cfg["eva_args"]["hidden_size"],
    }


# name -> (shape, kind); kind: ("col",), ("row",), ("rep",), ("packed", parts), ("lora_A"/"lora_B", base kind, i)
def layout(cfg: dict) -> dict[str, tuple[tuple[int, ...], tuple]]:
    s = sizes(cfg)
    h, i, v, r = cfg["hidden_size"], cfg["inner_hidden_size"], cfg["vocab_size"], RANK
    qkv = (s["q"], s["kv"], s["kv"])
    cq, cin = s["cross"], cfg["cross_attn_hidden_size"]
    eh, ei = s["eva"], cfg["eva_args"]["inner_hidden_size"]
    t: dict[str, tuple[tuple[int, ...], tuple]] = {
        "transformer.word_embeddings.weight": ((v, h), ("col",)),
        "mixins.lm.lm_head.weight": ((v, h), ("col",)),
        "transformer.final_layernorm.weight": ((h,), ("rep",)),
        "mixins.eva.boi": ((1, 1, h), ("rep",)),
        "mixins.eva.eoi": ((1, 1, h), ("rep",)),
        "mixins.eva.pos_embed": ((4, eh), ("rep",)),
        "mixins.eva.linear_proj.linear_proj.weight": ((h, eh), ("rep",)),
        "mixins.eva.linear_proj.gate_proj.weight": ((i, h), ("rep",)),
        "mixins.eva.linear_proj.dense_h_to_4h.weight": ((i, h), ("rep",)),
        "mixins.encoder.vit.model.patch_embed.proj.weight": ((cin, 3, 2, 2), ("rep",)),
        "mixins.encoder.pos_embed": ((4, cin), ("rep",)),
        "mixins.eva.vit_model.transformer.word_embeddings.weight": ((1, eh), ("rep",)),
        "mixins.eva.vit_model.transformer.position_embeddings.weight": ((5, eh), ("rep",)),
        "mixins.eva.vit_model.mixins.patch_embedding.proj.weight": ((eh, 3, 2, 2), ("rep",)),
    }
    L = "transformer.layers.0."
    t |= {
        L + "input_layernorm.weight": ((h,), ("rep",)),
        L + "post_attention_layernorm.weight": ((h,), ("rep",)),
        L + "post_cross_attention_layernorm.weight": ((h,), ("rep",)),
        L + "mlp.dense_h_to_4h.weight": ((i, h), ("col",)),
        L + "mlp.dense_4h_to_h.weight": ((h, i), ("row",)),
        "mixins.mlp.gate_proj.0.weight": ((i, h), ("col",)),
        "mixins.mlp.vision_dense_h_to_4h_list.0.weight": ((i, h), ("col",)),
        "mixins.mlp.vision_gate_proj.0.weight": ((i, h), ("col",)),
        "mixins.mlp.vision_dense_4h_to_h_list.0.weight": ((h, i), ("row",)),
        "mixins.rotary.vision_query_key_value_list.0.weight": ((sum(qkv), h), ("packed", qkv)),
        "mixins.rotary.vision_dense_list.0.weight": ((h, s["q"]), ("row",)),
    }
    t |= lora(L + "attention.query_key_value", (sum(qkv), h), ("packed", qkv), r)
    t |= lora(L + "attention.dense", (h, s["q"]), ("row",), r)
    t |= lora(L + "cross_attention.query", (cq, h), ("col",), r)
    t |= lora(L + "cross_attention.key_value", (2 * cq, cin), ("packed", (cq, cq)), r)
    t |= lora(L + "cross_attention.dense", (h, cq), ("row",), r)
    E = "mixins.eva.vit_model.transformer.layers.0."
    t |= {
        E + "input_layernorm.weight": ((eh,), ("rep",)),
        E + "input_layernorm.bias": ((eh,), ("rep",)),
        E + "mlp.dense_h_to_4h.weight": ((ei, eh), ("col",)),
        E + "mlp.dense_h_to_4h.bias": ((ei,), ("col",)),
        E + "mlp.dense_4h_to_h.weight": ((eh, ei), ("row",)),
        E + "mlp.dense_4h_to_h.bias": ((eh,), ("rep",)),
    }
    t |= lora(E + "attention.query_key_value", (3 * eh, eh), ("packed", (eh, eh, eh)), r, bias=True)
    t |= lora(E + "attention.dense", (eh, eh), ("row",), r, bias=True)
    return t


def lora(layer: str, shape: tuple[int, int], kind: tuple, r: int, *, bias: bool = False) -> dict:
    """The lora2 tensors of one wrapped layer: base, one (A, B) pair per packed part."""
    out_rows, in_cols = shape
    parts = kind[1] if kind[0] == "packed" else (out_rows,)
    t = {f"{layer}.original.weight": (shape, kind)}
    if bias:
        t[f"{layer}.original.bias"] = ((out_rows,), kind if kind[0] != "row" else ("rep",))
    for i, part in enumerate(parts):
        t[f"{layer}.matrix_A.{i}"] = ((r, in_cols), ("lora_A", kind, i))
        t[f"{layer}.matrix_B.{i}"] = ((part, r), ("lora_B", kind, i))
    return t


def full_tensors(cfg: dict, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Canonical tensors: distinct arange values per tensor; LoRA A/B small integers (exact products)."""
    out = {}
    for n, (name, (shape, kind)) in enumerate(layout(cfg).items()):
        numel = 1
        for d in shape:
            numel *= d
        if kind[0] in ("lora_A", "lora_B"):
            values = (torch.arange(numel) + 3 * n) % 7 - 3
        else:
            values = torch.arange(numel) % 251 + 1000 * (n % 7)
        out[name] = values.reshape(shape).to(dtype)
    return out


def split_rank(full: torch.Tensor, kind: tuple, tp: int, rank: int) -> torch.Tensor:
    """SAT's partition of one full tensor: rank ``rank``'s slice."""
    match kind[0]:
        case "rep":
            return full.clone()
        case "col":
            return full.chunk(tp, 0)[rank].clone()
        case "row":
            return full.chunk(tp, 1)[rank].clone()
        case "packed":
            return torch.cat([p.chunk(tp, 0)[rank] for p in full.split(list(kind[1]), 0)], 0)
        case "lora_A":
            return full.chunk(tp, 1)[rank].clone() if kind[1][0] == "row" else full.clone()
        case "lora_B":
            return full.clone() if kind[1][0] == "row" else full.chunk(tp, 0)[rank].clone()
    raise ValueError(kind)


def write_sat(
    root: Path,
    cfg: dict,
    full: dict[str, torch.Tensor],
    tp: int,
    *,
    iteration: str = "400",
    divergent_b: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """Save ``full`` split for ``tp`` ranks; returns the per-rank state dicts written.

    ``divergent_b``: the "replicated" B of row-parallel layers differs per rank (rank r adds r), as
    SAT training leaves it (no all-reduce of ``x @ A_r`` in the forward pass).
    """
    kinds = layout(cfg)
    ranks = []
    for rank in range(tp):
        state = {}
        for name, tensor in full.items():
            piece = split_rank(tensor, kinds[name][1], tp, rank)
            if divergent_b and kinds[name][1][0] == "lora_B" and kinds[name][1][1][0] == "row":
                piece = piece + rank
            state[name] = piece.contiguous()
        ranks.append(state)
        folder = root / iteration
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(
            {"module": state, "iteration": int(iteration) if iteration.isdigit() else 0},
            folder / f"mp_rank_{rank:02d}_model_states.pt",
        )
    (root / "latest").write_text(iteration)
    (root / "model_config.json").write_text(json.dumps(cfg | {"model_parallel_size": tp}, indent=4))
    return ranks


def read_sat(root: Path) -> tuple[str, list[dict]]:
    """``(iteration, [rank file objects])`` of a SAT save folder, read with plain ``torch.load``."""
    iteration = (root / "latest").read_text().strip()
    tp = json.loads((root / "model_config.json").read_text())["model_parallel_size"]
    files = [root / iteration / f"mp_rank_{r:02d}_model_states.pt" for r in range(tp)]
    return iteration, [torch.load(f, weights_only=True) for f in files]
