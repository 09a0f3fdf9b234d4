"""Write a synthetic block-FP8 checkpoint (DeepSeek-V3's storage) with Llama-2-7B tensor shapes, for the
``convert --dtype bfloat16`` benchmark.

Every linear weight is float8_e4m3fn with its ``weight_scale_inv`` (float32, one per 128x128 block; Llama-7B's
11008 is not a multiple of 128, so the MLP weights have a short last block, as DeepSeek-V3's
``kv_a_proj_with_mqa``); embeddings and norms stay bf16. ``config.json`` carries the ``quantization_config``
transformers' FineGrainedFP8 writes. Sharded as transformers saves (``model-0000i-of-0000n.safetensors`` and the
index), each shard written straight from a random pool without building a tensor (FP8 NaN bytes removed from the
pool, so every value is finite). Only the number of layers changes, from ``--size-gb`` (FP8 bytes).

Example:
    python bench/make_fp8.py bench/out/fp8-2g --size-gb 2
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the checkpoint builders of the tests

from fixtures.shapes import llama_7b_config, llama_shapes  # noqa: E402

from reshard.dtypes import TensorHeader  # noqa: E402
from reshard.formats.safetensors.writer import FORMAT_METADATA, header_bytes, ordered  # noqa: E402

BLOCK = 128
POOL_BYTES = 64 << 20
SHARD_BYTES = 1 << 30
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def fp8_headers(layers: int) -> dict[str, TensorHeader]:
    """Every tensor of the FP8 checkpoint: linear weights FP8 with their scale grid, the rest bf16."""
    headers = {}
    for name, shape in llama_shapes(llama_7b_config(layers)).items():
        if name.endswith(tuple(f"{p}.weight" for p in QUANTIZED)):
            headers[name] = TensorHeader(tuple(shape), "F8_E4M3")
            grid = tuple(math.ceil(size / BLOCK) for size in shape)
            headers[name.removesuffix("weight") + "weight_scale_inv"] = TensorHeader(grid, "F32")
        else:
            headers[name] = TensorHeader(tuple(shape), "BF16")
    return headers


def layers_for_size(size_gb: float) -> int:
    per_layer = sum(h.nbytes for n, h in fp8_headers(1).items() if ".layers." in n)
    return max(1, round(size_gb * 1e9 / per_layer))


class Pool:
    """Random bytes tiled from a 64 MB pool at shifting offsets; bf16 and FP8 values both finite."""

    def __init__(self, seed: int) -> None:
        pool = torch.randint(0, 256, (POOL_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
        pool[(pool & 0x7F) == 0x7F] ^= 1  # no float8_e4m3fn NaN, and so no bf16 high byte of an all-ones exponent
        self._pool = memoryview(pool.numpy()).cast("B")
        self._offset = 0

    def chunks(self, n: int):
        start = self._offset
        self._offset = (self._offset + 4098) % POOL_BYTES
        while n:
            take = min(n, POOL_BYTES - start)
            yield self._pool[start : start + take]
            n -= take
            start = 0


def scale_bytes(header: TensorHeader, generator: torch.Generator) -> bytes:
    """A scale grid of distinct magnitudes (2^-12 to 2^-4)."""
    values = 2.0 ** torch.randint(-12, -4, header.shape, generator=generator).float()
    return values.numpy().tobytes()


def write(out: Path, layers: int, seed: int = 0) -> None:
    headers = fp8_headers(layers)
    shards: list[list[str]] = [[]]
    size = 0
    for name in ordered(headers):
        if shards[-1] and size + headers[name].nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += headers[name].nbytes
    pool, generator = Pool(seed), torch.Generator().manual_seed(seed)
    out.mkdir(parents=True)
    weight_map = {}
    for index, names in enumerate(shards, start=1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        mine = {name: headers[name] for name in names}
        with (out / file).open("wb") as handle:
            handle.write(header_bytes(mine, FORMAT_METADATA))
            for name in ordered(mine):
                if name.endswith("weight_scale_inv"):
                    handle.write(scale_bytes(mine[name], generator))
                    continue
                for chunk in pool.chunks(mine[name].nbytes):
                    handle.write(chunk)
        weight_map |= dict.fromkeys(names, file)
    total = sum(h.nbytes for h in headers.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = llama_7b_config(layers) | {"quantization_config": QUANTIZATION}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to create (must not exist)")
    parser.add_argument("--size-gb", type=float, default=2.0, help="FP8 bytes of the layers, about (1e9 bytes)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write(args.out, layers_for_size(args.size_gb), args.seed)
    total = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"{args.out}: {total / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
