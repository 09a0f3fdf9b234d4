"""Folders to publish on the local Hub: a multi-GB checkpoint made of sparse files (headers only on disk)."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def sparse_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> int:
    """A valid safetensors file of ``name -> (dtype, shape)`` whose data section is a hole; returns its size."""
    itemsize = {"BF16": 2, "F16": 2, "F32": 4}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (dtype, shape) in tensors.items():
        nbytes = itemsize[dtype]
        for dim in shape:
            nbytes *= dim
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + offset)
    return 8 + len(text) + offset


def llama_9b(folder: Path, *, shards: int = 4) -> dict[str, int]:
    """A 9B Llama-shaped sharded checkpoint (bf16, 40 layers, hidden 4096, vocab 151936) of sparse shards.

    Returns the header length (the 8-byte prefix's value) of each shard. Only the headers take disk space.
    """
    hidden, inter, vocab, layers, kv = 4096, 12288, 151936, 40, 1024
    names: dict[str, tuple[str, list[int]]] = {"model.embed_tokens.weight": ("BF16", [vocab, hidden])}
    for i in range(layers):
        p = f"model.layers.{i}."
        names |= {
            p + "self_attn.q_proj.weight": ("BF16", [hidden, hidden]),
            p + "self_attn.k_proj.weight": ("BF16", [kv, hidden]),
            p + "self_attn.v_proj.weight": ("BF16", [kv, hidden]),
            p + "self_attn.o_proj.weight": ("BF16", [hidden, hidden]),
            p + "mlp.gate_proj.weight": ("BF16", [inter, hidden]),
            p + "mlp.up_proj.weight": ("BF16", [inter, hidden]),
            p + "mlp.down_proj.weight": ("BF16", [hidden, inter]),
            p + "input_layernorm.weight": ("BF16", [hidden]),
            p + "post_attention_layernorm.weight": ("BF16", [hidden]),
        }
    names |= {"model.norm.weight": ("BF16", [hidden]), "lm_head.weight": ("BF16", [vocab, hidden])}
    folder.mkdir(parents=True, exist_ok=True)
    items = list(names.items())
    per_shard = -(-len(items) // shards)
    weight_map, header_lengths, total = {}, {}, 0
    for s in range(shards):
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = dict(items[s * per_shard : (s + 1) * per_shard])
        size = sparse_safetensors(folder / shard, part)
        header_lengths[shard] = struct.unpack("<Q", (folder / shard).open("rb").read(8))[0]
        total += size - 8 - header_lengths[shard]
        weight_map |= {name: shard for name in part}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text(
        json.dumps({"model_type": "llama", "hidden_size": hidden, "vocab_size": vocab})
    )
    return header_lengths
