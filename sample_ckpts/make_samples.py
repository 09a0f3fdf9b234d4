"""Regenerate the committed sample checkpoints, deterministically (fixed seeds, no transformers init).

    python sample_ckpts/make_samples.py

tiny-llama-tp2/: a tiny Llama (vocab 1001, hidden 64, 2 layers, float32) split for TP=2 in the
``hf-ranks`` layout, vocab padded to 1002 rows, as ``reshard convert --tp 2`` writes it.

tiny-cogagent-sat-tp8/: a tiny CogAgent-like SwissArmyTransformer checkpoint (LLaMA trunk with vision
expert and cross attention, an EVA tower, SAT ``lora2`` adapters of rank 2 on the attention layers;
bfloat16) at model parallel size 8 in the ``sat`` layout (``latest``, ``model_config.json``,
``1/mp_rank_XX_model_states.pt``). It is written at MP=1 and split to 8 by ``reshard convert``.

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


SAT_CONFIG = {
    "model_class": "FineTuneTestCogAgentModel",
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 8,
    "inner_hidden_size": 64,
    "vocab_size": 1024,
    "is_decoder": True,
    "cross_attn_hidden_size": 16,
    "cross_compute_hidden_size": 32,
    "image_length": 4,
    "lora_rank": 2,
    "use_lora": True,
    "eva_args": {
        "model_class": "EVA2CLIPModel",
        "num_layers": 1,
        "hidden_size": 16,
        "num_attention_heads": 8,
        "inner_hidden_size": 32,
        "vocab_size": 1,
        "max_sequence_length": 5,
    },
    "model_parallel_size": 1,
}


def _sat_lora(layer: str, rows: tuple[int, ...], cols: int, rank: int, *, bias: bool = False) -> dict:
    """lora2 shapes of one wrapped layer: the base, one (A, B) pair per packed part."""
    shapes = {f"{layer}.original.weight": (sum(rows), cols)} | (
        {f"{layer}.original.bias": (sum(rows),)} if bias else {}
    )
    for i, part in enumerate(rows):
        shapes |= {f"{layer}.matrix_A.{i}": (rank, cols), f"{layer}.matrix_B.{i}": (part, rank)}
    return shapes


def cogagent_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Full tensor shapes of the tiny CogAgent under SAT names (mixins named as CogVLM's code names them)."""
    h, i, v, r = config["hidden_size"], config["inner_hidden_size"], config["vocab_size"], config["lora_rank"]
    cross, cin = config["cross_compute_hidden_size"], config["cross_attn_hidden_size"]
    eva = config["eva_args"]
    eh, ei = eva["hidden_size"], eva["inner_hidden_size"]
    shapes = {
        "transformer.word_embeddings.weight": (v, h),
        "transformer.final_layernorm.weight": (h,),
        "mixins.lm.lm_head.weight": (v, h),
        "mixins.eva.boi": (1, 1, h),
        "mixins.eva.eoi": (1, 1, h),
        "mixins.eva.pos_embed": (config["image_length"], eh),
        "mixins.eva.linear_proj.linear_proj.weight": (h, eh),
        "mixins.eva.linear_proj.norm1.weight": (h,),
        "mixins.eva.linear_proj.norm1.bias": (h,),
        "mixins.eva.linear_proj.dense_h_to_4h.weight": (i, h),
        "mixins.eva.linear_proj.gate_proj.weight": (i, h),
        "mixins.eva.linear_proj.dense_4h_to_h.weight": (h, i),
        "mixins.eva.vit_model.transformer.word_embeddings.weight": (1, eh),
        "mixins.eva.vit_model.transformer.position_embeddings.weight": (eva["max_sequence_length"], eh),
        "mixins.eva.vit_model.mixins.patch_embedding.proj.weight": (eh, 3, 2, 2),
        "mixins.eva.vit_model.mixins.patch_embedding.proj.bias": (eh,),
        "mixins.encoder.vit.model.patch_embed.proj.weight": (cin, 3, 2, 2),
        "mixins.encoder.pos_embed": (4, cin),
    }
    for n in range(config["num_layers"]):
        p = f"transformer.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "post_cross_attention_layernorm.weight": (h,),
            p + "mlp.dense_h_to_4h.weight": (i, h),
            p + "mlp.dense_4h_to_h.weight": (h, i),
            f"mixins.mlp.gate_proj.{n}.weight": (i, h),
            f"mixins.mlp.vision_dense_h_to_4h_list.{n}.weight": (i, h),
            f"mixins.mlp.vision_gate_proj.{n}.weight": (i, h),
            f"mixins.mlp.vision_dense_4h_to_h_list.{n}.weight": (h, i),
            f"mixins.rotary.vision_query_key_value_list.{n}.weight": (3 * h, h),
            f"mixins.rotary.vision_dense_list.{n}.weight": (h, h),
        }
        shapes |= _sat_lora(p + "attention.query_key_value", (h, h, h), h, r)
        shapes |= _sat_lora(p + "attention.dense", (h,), h, r)
        shapes |= _sat_lora(p + "cross_attention.query", (cross,), h, r)
        shapes |= _sat_lora(p + "cross_attention.key_value", (cross, cross), cin, r)
        shapes |= _sat_lora(p + "cross_attention.dense", (h,), cross, r)
    e = "mixins.eva.vit_model.transformer.layers.0."
    shapes |= {
        e + "input_layernorm.weight": (eh,),
        e + "input_layernorm.bias": (eh,),
        e + "post_attention_layernorm.weight": (eh,),
        e + "post_attention_layernorm.bias": (eh,),
        e + "mlp.dense_h_to_4h.weight": (ei, eh),
        e + "mlp.dense_h_to_4h.bias": (ei,),
        e + "mlp.dense_4h_to_h.weight": (eh, ei),
        e + "mlp.dense_4h_to_h.bias": (eh,),
    }
    shapes |= _sat_lora(e + "attention.query_key_value", (eh, eh, eh), eh, r, bias=True)
    shapes |= _sat_lora(e + "attention.dense", (eh,), eh, r, bias=True)
    return shapes


def write_sat_mp1(folder: Path, config: dict, seed: int = 0) -> None:
    """A SAT save folder at model parallel size 1: random bf16 weights from a fixed seed."""
    gen = torch.Generator().manual_seed(seed)
    state = {
        name: (torch.randn(*shape, generator=gen) * 0.05).to(torch.bfloat16)
        for name, shape in cogagent_shapes(config).items()
    }
    (folder / "1").mkdir(parents=True)
    torch.save({"module": state, "iteration": 1}, folder / "1" / "mp_rank_00_model_states.pt")
    (folder / "latest").write_text("1")
    (folder / "model_config.json").write_text(json.dumps(config, indent=4))


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


def fix_manifest(target: Path, source_name: str) -> None:
    manifest = json.loads((target / "reshard.json").read_text())
    manifest["source"]["path"] = f"{source_name} (generated by make_samples.py)"
    manifest["created"] = "2026-01-01T00:00:00+00:00"  # fixed, so regenerating changes no byte
    (target / "reshard.json").write_text(json.dumps(manifest, indent=2) + "\n")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        sat_mp1 = Path(tmp) / "cogagent-mp1"
        write_sat_mp1(sat_mp1, SAT_CONFIG)
        sat_target = HERE / "tiny-cogagent-sat-tp8"
        shutil.rmtree(sat_target, ignore_errors=True)
        convert(sat_mp1, sat_target, ConvertOptions(tp=8, layout="sat", progress=False))
    fix_manifest(sat_target, "tiny-cogagent")
    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp) / "full"
        write_hf(full, CONFIG, llama_state_dict(CONFIG))
        target = HERE / "tiny-llama-tp2"
        shutil.rmtree(target, ignore_errors=True)
        convert(full, target, ConvertOptions(tp=2, progress=False))
    fix_manifest(target, "tiny-llama")
    padded = HERE / "tiny-llama-65535-tp2"
    shutil.rmtree(padded, ignore_errors=True)
    write_padded_ranks(padded, PADDED_CONFIG)


if __name__ == "__main__":
    main()
