"""Write a synthetic tensor-parallel checkpoint with real Llama-7B tensor shapes and random bytes.

Shapes are Llama-2-7B's (hidden 4096, intermediate 11008, 32 heads, vocab 32000, bf16); only the
number of layers changes, chosen with ``--layers`` or from ``--size-gb``. The bytes are random (tiled
from a 64 MB random block at shifting offsets, so no two tensors are equal), which is all a speed and
memory benchmark needs; replicated tensors (the norms) are bit-identical on every rank, as they must be.
Every value is finite, as in a trained model, so a conversion's NaN/Inf check reads all of them (one bit of
every byte is cleared, which keeps a bf16's exponent off all ones); ``--raw-bytes`` keeps the NaN and Inf
patterns of fully random bytes, on which that check stops at the first block.

Layouts:

* ``hf-ranks``: reshard's own layout, ``rank_NN/model.safetensors`` (HF names) + top-level
  ``config.json``; written with reshard's streaming safetensors writer (byte-identical to ``save_file``)
  without ever building a tensor, so it runs at disk speed.
* ``megatron``: Megatron-LM ``torch`` format, ``iter_0000001/mp_rank_NN/model_optim_rng.pt`` holding
  ``{"model": <mcore state dict>, "args": argparse.Namespace, "checkpoint_version": 3.0, "iteration": 1}``
  and ``latest_checkpointed_iteration.txt``. The vocab is padded as Megatron pads it
  (``make_vocab_size_divisible_by`` 128 x tp), gate/up are packed per rank in ``linear_fc1`` and q/k/v
  are one ``linear_qkv`` (32 query groups, so a contiguous row split is Megatron's own split).

Examples:
    python bench/make_synthetic.py bench/out/llama-4g-tp8 --size-gb 4 --tp 8
    python bench/make_synthetic.py bench/out/llama-2l-mega --layers 2 --tp 8 --layout megatron
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the checkpoint builders of the tests

from fixtures.megatron import Sizes, megatron_args, part_shapes, rank_state  # noqa: E402
from fixtures.shapes import llama_7b_config, llama_shapes  # noqa: E402
from fixtures.trainer import rank_states  # noqa: E402

from reshard.formats.readers import TensorHeader  # noqa: E402
from reshard.formats.safetensors.writer import FORMAT_METADATA, header_bytes, ordered  # noqa: E402

LLAMA_7B = llama_7b_config(1)
HIDDEN, INTERMEDIATE = LLAMA_7B["hidden_size"], LLAMA_7B["intermediate_size"]
DTYPE = torch.bfloat16
POOL_BYTES = 64 << 20
FINITE_MASK = 0xBF
MEGATRON_DIVISIBLE_BY = 128
Shapes = dict[str, tuple[tuple[int, ...], bool]]


def _rank_shapes(rank0: dict[str, torch.Tensor]) -> Shapes:
    """Name -> (shape, replicated?) of one rank's (meta) state dict: the norms are on every rank."""
    return {name: (tuple(tensor.shape), "norm" in name) for name, tensor in rank0.items()}


def _meta(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Tensors of these shapes that hold no memory: the builders cut them, only the shapes are kept."""
    return {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}


def hf_rank_shapes(layers: int, tp: int) -> Shapes:
    """HF Llama names -> (per-rank shape, replicated?) for ``tp`` ranks (vocab padded to a multiple of tp)."""
    state = _meta(llama_shapes(llama_7b_config(layers)))
    return _rank_shapes(rank_states(state, tp, pad_multiple=1, junk_seed=None)[0])


def megatron_sizes(layers: int) -> Sizes:
    c = LLAMA_7B
    return Sizes(
        hidden=HIDDEN,
        heads=c["num_attention_heads"],
        groups=c["num_key_value_heads"],
        head_dim=c["head_dim"],
        ffn=INTERMEDIATE,
        layers=layers,
        vocab=c["vocab_size"],
        multiple=MEGATRON_DIVISIBLE_BY,
    )


def megatron_rank_shapes(layers: int, tp: int) -> Shapes:
    """mcore GPTModel (TE spec) names -> (per-rank shape, replicated?)."""
    sizes = megatron_sizes(layers)
    return _rank_shapes(rank_state(_meta(part_shapes(sizes)), sizes, tp, 0, pad_fill=0.0))


def layers_for_size(size_gb: float) -> int:
    """The number of layers whose checkpoint is closest to ``size_gb`` (10^9 bytes), at least 1."""
    ranked = hf_rank_shapes(1, 1)
    fixed = sum(_nbytes(s) for n, (s, _) in ranked.items() if "layers." not in n)
    layer = sum(_nbytes(s) for n, (s, _) in ranked.items() if "layers." in n)
    return max(1, round((size_gb * 1e9 - fixed) / layer))


def _nbytes(shape: tuple[int, ...]) -> int:
    return TensorHeader.of(shape, DTYPE).nbytes


class RandomBytes:
    """Hands out ``n`` random-looking bytes, tiling a fixed random pool from an offset that moves on."""

    def __init__(self, seed: int, *, finite: bool = True) -> None:
        generator = torch.Generator().manual_seed(seed)
        pool = torch.randint(0, 256, (POOL_BYTES,), dtype=torch.uint8, generator=generator)
        if finite:  # bit 6 of a bf16's high byte is its exponent's top bit: never all ones, never NaN or Inf
            pool &= FINITE_MASK
        self._pool = memoryview(pool.numpy()).cast("B")
        self._offset = 0

    def chunks(self, n: int):
        """Yield memoryviews adding up to ``n`` bytes."""
        start = self._offset
        self._offset = (self._offset + 4099) % POOL_BYTES  # the next tensor starts elsewhere
        while n:
            take = min(n, POOL_BYTES - start)
            yield self._pool[start : start + take]
            n -= take
            start = 0

    def tensor(self, shape: tuple[int, ...]) -> torch.Tensor:
        out = torch.empty(shape, dtype=DTYPE)
        flat = memoryview(out.view(torch.uint8).numpy()).cast("B") if out.numel() else memoryview(b"")
        done = 0
        for chunk in self.chunks(out.numel() * DTYPE.itemsize):
            flat[done : done + len(chunk)] = chunk
            done += len(chunk)
        return out


def write_hf_ranks(out: Path, layers: int, tp: int, seed: int, *, finite: bool) -> None:
    shapes = hf_rank_shapes(layers, tp)
    headers = {name: TensorHeader.of(shape, DTYPE) for name, (shape, _) in shapes.items()}
    shared = RandomBytes(seed + 1000, finite=finite)
    replicated = {name: b"".join(shared.chunks(_nbytes(shape))) for name, (shape, rep) in shapes.items() if rep}
    for rank in range(tp):
        source = RandomBytes(seed + rank, finite=finite)
        folder = out / f"rank_{rank:02d}"
        folder.mkdir(parents=True)
        with (folder / "model.safetensors").open("wb") as handle:
            handle.write(header_bytes(headers, FORMAT_METADATA))
            for name in ordered(headers):
                shape, is_replicated = shapes[name]
                if is_replicated:
                    handle.write(replicated[name])
                else:
                    for chunk in source.chunks(_nbytes(shape)):
                        handle.write(chunk)
    (out / "config.json").write_text(json.dumps(llama_7b_config(layers), indent=2) + "\n")


def write_megatron(out: Path, layers: int, tp: int, seed: int, *, finite: bool) -> None:
    """One rank's state dict in memory at a time (torch.save needs it whole)."""
    shapes = megatron_rank_shapes(layers, tp)
    replicated = RandomBytes(seed + 1000, finite=finite)
    norms = {name: replicated.tensor(shape) for name, (shape, rep) in shapes.items() if rep}
    args = megatron_args(
        megatron_sizes(layers),
        tp,
        dtype=DTYPE,
        record_vocab=True,
        seq_length=4096,
        max_position_embeddings=4096,
        bf16=True,
        transformer_impl="transformer_engine",
        iteration=1,
    )
    for rank in range(tp):
        source = RandomBytes(seed + rank, finite=finite)
        model = {name: norms[name].clone() if rep else source.tensor(shape) for name, (shape, rep) in shapes.items()}
        folder = out / "iter_0000001" / f"mp_rank_{rank:02d}"
        folder.mkdir(parents=True)
        checkpoint = {"args": args, "checkpoint_version": 3.0, "iteration": 1, "model": model}
        torch.save(checkpoint, folder / "model_optim_rng.pt")
        del model, checkpoint
    (out / "latest_checkpointed_iteration.txt").write_text("1")


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder to create (must not exist)")
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--layers", type=int, help="number of transformer layers")
    size.add_argument("--size-gb", type=float, help="pick the number of layers for about this many GB (1e9 bytes)")
    parser.add_argument("--tp", type=int, default=8, help="tensor-parallel ranks (default 8)")
    parser.add_argument("--layout", choices=("hf-ranks", "megatron"), default="hf-ranks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--raw-bytes", action="store_true", help="fully random bytes, NaN and Inf patterns included (default: finite)"
    )
    args = parser.parse_args(argv)
    if args.out.exists():
        parser.error(f"{args.out} exists")
    if HIDDEN % args.tp or INTERMEDIATE % args.tp:
        parser.error(f"tp={args.tp} does not divide hidden {HIDDEN} and intermediate {INTERMEDIATE}")
    layers = args.layers if args.layers is not None else layers_for_size(args.size_gb)
    args.out.mkdir(parents=True)
    with torch.inference_mode():
        if args.layout == "hf-ranks":
            write_hf_ranks(args.out, layers, args.tp, args.seed, finite=not args.raw_bytes)
        else:
            write_megatron(args.out, layers, args.tp, args.seed, finite=not args.raw_bytes)
    os.sync()
    total = folder_bytes(args.out)
    sys.stdout.write(f"{args.out}: {args.layout}, tp={args.tp}, {layers} layers, {total / 1e9:.2f} GB\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
