"""The naive baseline: what a simple resharding script does, for comparison with ``reshard convert``.

It loads every rank fully, concatenates each tensor along its Llama split dim (names hard-coded, as
such scripts do), cuts the padded vocab back, splits for the target tp and saves every target rank
with ``safetensors.torch.save_file`` (or ``torch.save`` for Megatron). It is kinder than most scripts
(it frees a source tensor as soon as it is concatenated), so its peak memory is about the model plus
one target rank, not twice the model. It writes no manifest and checks nothing.

Examples:
    python bench/naive.py bench/out/llama-4g-tp8 bench/out/naive-tp4 --tp 4
    python bench/naive.py bench/out/mega-4g-tp8 bench/out/naive-mega-tp1 --tp 1 --layout megatron
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

HF_DIM = [
    (r"(embed_tokens|lm_head)\.weight$", 0),
    (r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$", 0),
    (r"\.(o_proj|down_proj)\.weight$", 1),
    (r"norm\.weight$", None),
]
MEGATRON_DIM = [
    (r"(word_embeddings|output_layer)\.weight$", 0),
    (r"linear_qkv\.weight$", 0),
    (r"linear_fc1\.weight$", "packed"),
    (r"(linear_proj|linear_fc2)\.weight$", 1),
    (r"(layer_norm_weight|layernorm\.weight)$", None),
]
VOCAB = re.compile(r"(embed_tokens|lm_head|word_embeddings|output_layer)\.weight$")


def split_dim(name: str, rules: list) -> int | str | None:
    for pattern, dim in rules:
        if re.search(pattern, name):
            return dim
    raise SystemExit(f"naive: no rule for {name}")


def merge(ranks: list[dict[str, torch.Tensor]], rules: list, vocab: int) -> dict[str, torch.Tensor]:
    full = {}
    for name in list(ranks[0]):
        parts = [rank.pop(name) for rank in ranks]
        dim = split_dim(name, rules)
        if dim is None:
            full[name] = parts[0]
        elif dim == "packed":  # each rank holds [gate_r; up_r]
            halves = [p.chunk(2, dim=0) for p in parts]
            full[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        else:
            full[name] = torch.cat(parts, dim=dim)
        if VOCAB.search(name):
            full[name] = full[name][:vocab]
        del parts
    return full


def rank_slice(full: dict[str, torch.Tensor], rules: list, tp: int, rank: int, multiple: int) -> dict:
    out = {}
    for name, tensor in full.items():
        dim = split_dim(name, rules)
        if VOCAB.search(name) and tensor.shape[0] % multiple:
            pad = tensor.new_zeros((multiple - tensor.shape[0] % multiple, *tensor.shape[1:]))
            tensor = torch.cat([tensor, pad])
        if dim is None:
            out[name] = tensor
        elif dim == "packed":
            gate, up = tensor.chunk(2, dim=0)
            out[name] = torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]]).contiguous()
        else:
            out[name] = tensor.chunk(tp, dim=dim)[rank].contiguous()
    return out


def hf_ranks(src: Path, out: Path, tp: int) -> None:
    config = json.loads((src / "config.json").read_text())
    folders = sorted(src.glob("rank_*"))
    ranks = [load_file(folder / "model.safetensors") for folder in folders]
    full = merge(ranks, HF_DIM, config["vocab_size"])
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for rank in range(tp):
        folder = out if tp == 1 else out / f"rank_{rank:02d}"
        folder.mkdir(exist_ok=True)
        save_file(rank_slice(full, HF_DIM, tp, rank, tp), folder / "model.safetensors", metadata={"format": "pt"})


def megatron(src: Path, out: Path, tp: int) -> None:
    iteration = (src / "latest_checkpointed_iteration.txt").read_text().strip()
    folders = sorted((src / f"iter_{int(iteration):07d}").glob("mp_rank_*"))
    loaded = [torch.load(f / "model_optim_rng.pt", map_location="cpu", weights_only=False) for f in folders]
    args = loaded[0]["args"]
    full = merge([c["model"] for c in loaded], MEGATRON_DIM, args.vocab_size)
    multiple = args.make_vocab_size_divisible_by * tp
    for rank in range(tp):
        folder = out / f"iter_{int(iteration):07d}" / f"mp_rank_{rank:02d}"
        folder.mkdir(parents=True)
        args.tensor_model_parallel_size = tp
        checkpoint = dict(loaded[0], model=rank_slice(full, MEGATRON_DIM, tp, rank, multiple), args=args)
        torch.save(checkpoint, folder / "model_optim_rng.pt")
    (out / "latest_checkpointed_iteration.txt").write_text(iteration)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--layout", choices=("hf-ranks", "megatron"), default="hf-ranks")
    args = parser.parse_args(argv)
    with torch.inference_mode():
        (hf_ranks if args.layout == "hf-ranks" else megatron)(args.src, args.out, args.tp)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
