"""Regenerate the committed sample checkpoints, deterministically (fixed seeds, no transformers init).

    python sample_ckpts/make_samples.py

tiny-llama-tp2/: a tiny Llama (vocab 1001, hidden 64, 2 layers, float32) split for TP=2 in the
``hf-ranks`` layout, vocab padded to 1002 rows, as ``reshard convert --tp 2`` writes it.

tiny-llama-65535-tp2/: the ``reshard fix`` field case. A tiny Llama (vocab 65535, hidden 8, 1 layer,
bfloat16) as a TP=2 trainer with vocab padding saves it: ``pytorch_model_rank0.bin`` and
``pytorch_model_rank1.bin`` (``torch.save`` of each rank's state dict), the vocab padded to 65536 (a
multiple of 64 x tp, ColossalAI's default) so each rank holds 32768 rows, the pad row filled with junk;
q/k/v/gate/up split on dim 0, o/down on dim 1, norms on every rank; ``config.json`` says 65535.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from reshard import ConvertOptions, convert

HERE = Path(__file__).resolve().parent
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1001,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 8,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "hidden_act": "silu",
}


def llama_state_dict(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under transformers' Llama names, from a fixed seed."""
    gen = torch.Generator().manual_seed(seed)
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.05).contiguous()

    state = {"model.embed_tokens.weight": rand(v, h), "lm_head.weight": rand(v, h), "model.norm.weight": 1 + rand(h)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        state |= {
            p + "input_layernorm.weight": 1 + rand(h),
            p + "post_attention_layernorm.weight": 1 + rand(h),
            p + "self_attn.q_proj.weight": rand(q, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(i, h),
            p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
        }
    return state


def write_hf(folder: Path, config: dict, state: dict[str, torch.Tensor]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


PADDED_CONFIG = CONFIG | {
    "vocab_size": 65535,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 4,
    "torch_dtype": "bfloat16",
}


def write_padded_ranks(folder: Path, config: dict, tp: int = 2, multiple: int = 64) -> None:
    """Per-rank ``pytorch_model_rank{r}.bin`` files as a TP trainer that pads the vocab saves them."""
    state = {k: v.to(torch.bfloat16) for k, v in llama_state_dict(config, seed=1).items()}
    junk = torch.Generator().manual_seed(2)
    ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for name, tensor in state.items():
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            rows = -(-tensor.shape[0] // (multiple * tp)) * multiple * tp
            pad = (3 + torch.rand(rows - tensor.shape[0], tensor.shape[1], generator=junk)).to(tensor.dtype)
            pieces = torch.cat([tensor, pad]).chunk(tp)
        elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")):
            pieces = tensor.chunk(tp, dim=0)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            pieces = tensor.chunk(tp, dim=1)
        else:
            pieces = (tensor,) * tp
        for rank, piece in enumerate(pieces):
            ranks[rank][name] = piece.clone()
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for rank, rank_state in enumerate(ranks):
        torch.save(rank_state, folder / f"pytorch_model_rank{rank}.bin")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp) / "full"
        write_hf(full, CONFIG, llama_state_dict(CONFIG))
        target = HERE / "tiny-llama-tp2"
        shutil.rmtree(target, ignore_errors=True)
        convert(full, target, ConvertOptions(tp=2, progress=False))
    manifest = json.loads((target / "reshard.json").read_text())
    manifest["source"]["path"] = "tiny-llama (generated by make_samples.py)"
    manifest["created"] = "2026-01-01T00:00:00+00:00"  # fixed, so regenerating changes no byte
    (target / "reshard.json").write_text(json.dumps(manifest, indent=2) + "\n")
    padded = HERE / "tiny-llama-65535-tp2"
    shutil.rmtree(padded, ignore_errors=True)
    write_padded_ranks(padded, PADDED_CONFIG)


if __name__ == "__main__":
    main()
