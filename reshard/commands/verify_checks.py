"""The parts of ``verify`` that need no pipeline: the :class:`Difference` record, the file checks, and
the comparison of two tensors' values.

Files are checked before any tensor is gathered, so a deleted rank file is reported as a difference
naming the file, not as a failure to read the checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from huggingface_hub.constants import SAFETENSORS_INDEX_FILE

from reshard.layouts.hf import BIN_INDEX_FILE, weight_files
from reshard.layouts.hf_ranks import rank_dir, rank_folders
from reshard.layouts.readers import read_safetensors_header
from reshard.manifest import Manifest
from reshard.options import Layout
from reshard.slicing import bitwise_equal

# Layouts whose folders reshard can check file by file; others are checked by reading them.
_FOLDER_LAYOUTS = (Layout.HF, Layout.HF_RANKS)
# Elements widened to float64 at a time when comparing values (128 MB per side).
_BLOCK = 1 << 24


@dataclass(frozen=True)
class Difference:
    """One thing ``verify`` found: its kind, the tensor (if any), what differs, the file(s) concerned.

    Kinds: ``missing-file``, ``duplicate``, ``missing``, ``extra``, ``inconsistent`` (the ranks do not
    gather), ``dtype``, ``shape``/``reshaped``, ``sha256``, ``non-finite``, ``values``, ``plan`` (a round trip
    the model cannot make), ``not-run``.
    """

    kind: str
    tensor: str | None
    detail: str
    file: str | None = None
    max_abs_diff: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def check_files(ckpt: Path, manifest: Manifest) -> list[Difference]:
    """Missing rank folders, files an index names that are absent, folders without weights, duplicates."""
    layout, tp = manifest.target.get("layout"), manifest.target.get("tp")
    if not ckpt.is_dir() or layout not in _FOLDER_LAYOUTS:
        return []
    if layout == Layout.HF:
        return _check_folder(ckpt)
    found = rank_folders(ckpt)
    expected = max(int(tp or 0), max(found, default=-1) + 1)
    diffs = [
        Difference("missing-file", None, f"rank folder missing (reshard.json says tp={tp})", str(ckpt / rank_dir(r)))
        for r in range(expected)
        if r not in found
    ]
    for rank in sorted(found):
        diffs += _check_folder(found[rank])
    return diffs


def _check_folder(folder: Path) -> list[Difference]:
    diffs = []
    for index_name in (SAFETENSORS_INDEX_FILE, BIN_INDEX_FILE):
        index = folder / index_name
        if not index.is_file():
            continue
        named: dict[str, str] = {}
        try:
            for tensor, filename in json.loads(index.read_text())["weight_map"].items():
                named.setdefault(str(filename), tensor)
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
            continue  # a corrupt index is reported when the checkpoint is read
        for filename, tensor in named.items():
            plain = len(PurePosixPath(filename).parts) == 1 and filename not in (".", "..")
            if plain and not (folder / filename).is_file():
                diffs.append(
                    Difference(
                        "missing-file", tensor, f"{index_name} names it, it does not exist", str(folder / filename)
                    )
                )
    if diffs:
        return diffs
    files = weight_files(folder)  # files an index names are all there (checked above)
    if not files:
        return [Difference("missing-file", None, "no weight files in the folder", str(folder))]
    seen: dict[str, Path] = {}
    for path in (f for f in files if f.suffix == ".safetensors"):
        for key in read_safetensors_header(path)[0]:
            if key in seen:
                diffs.append(Difference("duplicate", key, f"also in {seen[key].name}", str(path)))
            seen.setdefault(key, path)
    return diffs


def value_difference(a: torch.Tensor, b: torch.Tensor, *, atol: float = 0.0, rtol: float = 0.0) -> float | None:
    """None when ``a`` and ``b`` agree (bit for bit when both tolerances are 0), else their max abs difference.

    NaN equals NaN here (a NaN on one side only counts as an infinite difference). Values are widened to
    float64 (complex128) a block at a time, so the extra memory stays bounded whatever the tensor's size.
    """
    if atol == 0 and rtol == 0 and a.dtype == b.dtype and bitwise_equal(a, b):
        return None
    wide = torch.complex128 if a.is_complex() or b.is_complex() else torch.float64
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    close, gap = True, 0.0
    for start in range(0, flat_a.numel(), _BLOCK):
        x, y = flat_a[start : start + _BLOCK].to(wide), flat_b[start : start + _BLOCK].to(wide)
        if atol or rtol:
            close = close and bool(torch.isclose(x, y, rtol=rtol, atol=atol, equal_nan=True).all())
        distance = (x - y).abs().nan_to_num(nan=float("inf"))
        distance[torch.isnan(x) & torch.isnan(y)] = 0.0
        gap = max(gap, float(distance.max()))
    return None if (atol or rtol) and close else gap
