"""Checks of a DCP index before any tensor byte is read: each problem is one line naming the file and the tensor.

Stricter than torch, which trusts its metadata: boxes inside the global shape and tiling it exactly (no gap, no
overlap), data files present and long enough for every chunk, dtypes reshard can hold, no compressed chunks.
"""

from __future__ import annotations

import math
from pathlib import Path

from reshard.dtypes import itemsize_of
from reshard.errors import CorruptFileError, MissingRankError, ReshardError
from reshard.formats.boxes import tiling_problem
from reshard.formats.dcp_metadata.read import StoredChunk, StoredTensor

MAX_ELEMENTS = 1 << 48  # far beyond any tensor; a global shape past it is damage, and its boxes are not checked


def check_tensor(tensor: StoredTensor) -> ReshardError | None:
    """What is wrong with one tensor's declaration (dtype, boxes, compression), naming the file and the tensor."""
    name, declared = tensor.name, tensor.declared_in
    if tensor.code is None:
        return ReshardError(
            f"dtype {tensor.dtype} is not supported (safetensors has no code for it)", path=declared, tensor=name
        )
    if any(size < 0 for size in tensor.shape) or math.prod(tensor.shape) > MAX_ELEMENTS:
        return CorruptFileError(
            f"global shape {list(tensor.shape)} is not a tensor's shape", path=declared, tensor=name
        )
    outside = [chunk.box for chunk in tensor.chunks if not chunk.box.fits(tensor.shape)]
    if outside:
        return CorruptFileError(
            f"chunk box {outside[0]} lies outside the global shape {list(tensor.shape)}", path=declared, tensor=name
        )
    tiling = tiling_problem(tensor.shape, [chunk.box for chunk in tensor.chunks])
    if tiling:
        return CorruptFileError(
            f"{tiling} of the global shape {list(tensor.shape)}{_hint(tensor)}", path=declared, tensor=name
        )
    compressed = next((chunk for chunk in tensor.chunks if chunk.transforms), None)
    if compressed is not None:
        return ReshardError(
            f"chunk {compressed.box} is stored compressed ({', '.join(compressed.transforms)}): not supported",
            path=compressed.file,
            tensor=name,
            hint="load it with torch.distributed.checkpoint and save it again without the extension",
        )
    short = next((c for c in tensor.chunks if c.length < c.box.numel * itemsize_of(tensor.code)), None)
    if short is not None:
        return CorruptFileError(
            f"chunk {short.box} is stored in {short.length} bytes, fewer than its "
            f"{short.box.numel * itemsize_of(tensor.code)} bytes of elements",
            path=short.file,
            tensor=name,
        )
    return None


def _hint(tensor: StoredTensor) -> str:
    return " (a shard file missing?)" if tensor.declared_in.is_dir() else ""


def check_files(tensors: list[StoredTensor]) -> tuple[list[ReshardError], dict[Path, int]]:
    """One problem per data file that is missing or ends before a chunk's bytes (naming the file and the
    first tensor concerned), and the size of every file."""
    by_file: dict[Path, list[tuple[StoredChunk, str]]] = {}
    for tensor in tensors:
        for chunk in tensor.chunks:
            by_file.setdefault(chunk.file, []).append((chunk, tensor.name))
    problems: list[ReshardError] = []
    sizes: dict[Path, int] = {}
    for file, chunks in by_file.items():
        names = list(dict.fromkeys(name for _, name in chunks))
        others = f" and chunks of {len(names) - 1} other tensors" if len(names) > 1 else ""
        if not file.is_file():
            problems.append(
                MissingRankError(
                    f"data file missing (it holds a chunk of this tensor{others})", path=file, tensor=names[0]
                )
            )
            continue
        sizes[file] = size = file.stat().st_size
        past = sorted((c.position, c, name) for c, name in chunks if c.position + c.length > size)
        if past:
            _, chunk, name = past[0]
            more = f" (and {len(past) - 1} more chunks after it)" if len(past) > 1 else ""
            problems.append(
                CorruptFileError(
                    f"the file ends at byte {size}, inside chunk {chunk.box} at bytes [{chunk.position}, "
                    f"{chunk.position + chunk.length}){more}: truncated?",
                    path=file,
                    tensor=name,
                )
            )
    return problems, sizes
