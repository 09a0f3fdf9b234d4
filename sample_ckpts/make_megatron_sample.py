"""Regenerate ``tiny-megatron-tp8/``, deterministically (fixed seed, written the way Megatron-LM lays it out).

    python sample_ckpts/make_megatron_sample.py

A tiny mcore GPT (hidden 64, 8 heads in 2 query groups, SwiGLU, 2 layers, true vocab 500, float32)
saved at TP=8 in Megatron's ``torch`` format: ``latest_checkpointed_iteration.txt`` and
``iter_0000100/mp_rank_XX/model_optim_rng.pt`` holding ``args`` (an ``argparse.Namespace``),
``checkpoint_version``, ``iteration``, ``model`` and a stand-in ``optimizer``. The vocab tables are
padded to 512 rows (``make_vocab_size_divisible_by`` 64 x tp 8); the args do not record the true vocab.
"""

from __future__ import annotations

import argparse
import io
import shutil
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
OUT = HERE / "tiny-megatron-tp8"
TP, H, NH, NG, D, F, LAYERS, V, MULTIPLE, ITERATION = 8, 64, 8, 2, 8, 128, 2, 500, 64, 100
VP = -(-V // (MULTIPLE * TP)) * (MULTIPLE * TP)


def full_model(seed: int = 0) -> dict[str, torch.Tensor]:
    """Canonical tensors by part (q, k, v and gate, up apart), random from a fixed seed."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.05).contiguous()

    model = {"emb": rand(VP, H), "out": rand(VP, H), "final_norm": 1 + rand(H)}  # pad rows are trained rows too
    for i in range(LAYERS):
        model |= {
            f"{i}.in_norm": 1 + rand(H),
            f"{i}.q": rand(NH * D, H),
            f"{i}.k": rand(NG * D, H),
            f"{i}.v": rand(NG * D, H),
            f"{i}.proj": rand(H, NH * D),
            f"{i}.mlp_norm": 1 + rand(H),
            f"{i}.gate": rand(F, H),
            f"{i}.up": rand(F, H),
            f"{i}.fc2": rand(H, F),
        }
    return model


def rank_state(m: dict[str, torch.Tensor], r: int) -> dict[str, object]:
    """Rank r's mcore state dict: QKV interleaved per group and cut in contiguous rows, fc1 = [gate_r; up_r]."""
    qd = NH // NG * D

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(TP)[r].clone()

    def cols(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(TP, dim=1)[r].clone()

    state: dict[str, object] = {"embedding.word_embeddings.weight": rows(m["emb"])}
    for i in range(LAYERS):
        p = f"decoder.layers.{i}."
        groups = [
            torch.cat(
                [
                    m[f"{i}.q"][g * qd : (g + 1) * qd],
                    m[f"{i}.k"][g * D : (g + 1) * D],
                    m[f"{i}.v"][g * D : (g + 1) * D],
                ]
            )
            for g in range(NG)
        ]
        state |= {
            p + "self_attention.linear_qkv.layer_norm_weight": m[f"{i}.in_norm"].clone(),
            p + "self_attention.linear_qkv.weight": rows(torch.cat(groups)),
            p + "self_attention.linear_qkv._extra_state": io.BytesIO(f"fp8 meta l{i} r{r}".encode()),
            p + "self_attention.linear_proj.weight": cols(m[f"{i}.proj"]),
            p + "mlp.linear_fc1.layer_norm_weight": m[f"{i}.mlp_norm"].clone(),
            p + "mlp.linear_fc1.weight": torch.cat([rows(m[f"{i}.gate"]), rows(m[f"{i}.up"])]),
            p + "mlp.linear_fc2.weight": cols(m[f"{i}.fc2"]),
        }
    state |= {"decoder.final_layernorm.weight": m["final_norm"].clone(), "output_layer.weight": rows(m["out"])}
    return state


def args() -> argparse.Namespace:
    return argparse.Namespace(
        num_layers=LAYERS,
        hidden_size=H,
        ffn_hidden_size=F,
        num_attention_heads=NH,
        group_query_attention=True,
        num_query_groups=NG,
        kv_channels=D,
        swiglu=True,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
        position_embedding_type="rope",
        normalization="RMSNorm",
        make_vocab_size_divisible_by=MULTIPLE,
        padded_vocab_size=VP,
        tensor_model_parallel_size=TP,
        pipeline_model_parallel_size=1,
        params_dtype=torch.float32,
        tokenizer_type="GPT2BPETokenizer",
        vocab_size=None,
    )


def main(out: Path = OUT) -> None:
    shutil.rmtree(out, ignore_errors=True)
    model = full_model()
    for r in range(TP):
        folder = out / f"iter_{ITERATION:07d}" / f"mp_rank_{r:02d}"
        folder.mkdir(parents=True)
        obj = {
            "args": args(),
            "checkpoint_version": 3.0,
            "iteration": ITERATION,
            "model": rank_state(model, r),
            "optimizer": {"param_groups": [{"lr": 1e-4}]},
        }
        torch.save(obj, folder / "model_optim_rng.pt")
    (out / "latest_checkpointed_iteration.txt").write_text(f"{ITERATION}\n")


if __name__ == "__main__":
    main()
