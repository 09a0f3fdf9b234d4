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
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the TP cuts of the tests' builders

from fixtures.tp import Kind, gather_pieces, pad_rows, padded_rows, rank_piece  # noqa: E402

HF_CUT = [
    (r"(embed_tokens|lm_head)\.weight$", "col"),
    (r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$", "col"),
    (r"\.(o_proj|down_proj)\.weight$", "row"),
    (r"norm\.weight$", "rep"),
]
MEGATRON_CUT = [
    (r"(word_embeddings|output_layer)\.weight$", "col"),
    (r"linear_qkv\.weight$", "col"),
    (r"linear_fc1\.weight$", "glu"),  # each rank holds [gate_r; up_r]
    (r"(linear_proj|linear_fc2)\.weight$", "row"),
    (r"(layer_norm_weight|layernorm\.weight)$", "rep"),
]
VOCAB = re.compile(r"(embed_tokens|lm_head|word_embeddings|output_layer)\.weight$")


def cut(name: str, rules: list, rows: int) -> Kind:
    """How ``name`` is split; ``rows``: its full row count (a GLU's gate and up halves)."""
    for pattern, kind in rules:
        if re.search(pattern, name):
            return ("packed", (rows // 2, rows // 2)) if kind == "glu" else kind
    raise SystemExit(f"naive: no rule for {name}")


def merge(ranks: list[dict[str, torch.Tensor]], rules: list, vocab: int) -> dict[str, torch.Tensor]:
    full = {}
    for name in list(ranks[0]):
        parts = [rank.pop(name) for rank in ranks]
        full[name] = gather_pieces(parts, cut(name, rules, parts[0].shape[0] * len(parts)))
        if VOCAB.search(name):
            full[name] = full[name][:vocab]
        del parts
    return full


def rank_slice(full: dict[str, torch.Tensor], rules: list, tp: int, rank: int, multiple: int) -> dict:
    out = {}
    for name, tensor in full.items():
        if VOCAB.search(name):
            tensor = pad_rows(tensor, padded_rows(tensor.shape[0], multiple))
        out[name] = rank_piece(tensor, cut(name, rules, tensor.shape[0]), tp, rank).contiguous()
    return out


def hf_ranks(src: Path, out: Path, tp: int) -> None:
    config = json.loads((src / "config.json").read_text())
    folders = sorted(src.glob("rank_*"))
    ranks = [load_file(folder / "model.safetensors") for folder in folders]
    full = merge(ranks, HF_CUT, config["vocab_size"])
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for rank in range(tp):
        folder = out if tp == 1 else out / f"rank_{rank:02d}"
        folder.mkdir(exist_ok=True)
        save_file(rank_slice(full, HF_CUT, tp, rank, tp), folder / "model.safetensors", metadata={"format": "pt"})


def megatron(src: Path, out: Path, tp: int) -> None:
    iteration = (src / "latest_checkpointed_iteration.txt").read_text().strip()
    folders = sorted((src / f"iter_{int(iteration):07d}").glob("mp_rank_*"))
    loaded = [torch.load(f / "model_optim_rng.pt", map_location="cpu", weights_only=False) for f in folders]
    args = loaded[0]["args"]
    full = merge([c["model"] for c in loaded], MEGATRON_CUT, args.vocab_size)
    multiple = args.make_vocab_size_divisible_by * tp
    for rank in range(tp):
        folder = out / f"iter_{int(iteration):07d}" / f"mp_rank_{rank:02d}"
        folder.mkdir(parents=True)
        args.tensor_model_parallel_size = tp
        checkpoint = dict(loaded[0], model=rank_slice(full, MEGATRON_CUT, tp, rank, multiple), args=args)
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
