"""The parts of ``verify`` that need no pipeline: the :class:`Difference` record, the file checks, and
the comparison of two tensors' values.

Files are checked before any tensor is gathered, so a deleted rank file is reported as a difference
naming the file, not as a failure to read the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reshard.layouts import find_layout
from reshard.manifest import Manifest

if TYPE_CHECKING:
    import torch

    from reshard.engine.plan.planner import SourceTensor

# Elements widened to float64 at a time when comparing values (128 MB per side).
_BLOCK = 1 << 24


@dataclass(frozen=True)
class Difference:
    """One thing ``verify`` found: its kind, the tensor (if any), what differs, the file(s) concerned.

    Kinds: ``missing-file``, ``duplicate``, ``missing``, ``extra``, ``inconsistent`` (the ranks do not
    gather), ``dtype``, ``shape``/``reshaped``, ``sha256``, ``non-finite``, ``values``, ``plan`` (a round trip
    the model cannot make), ``not-run``; of a training state (``--train-state``): ``group`` (a parameter in two
    groups, or one the model does not hold; groups that differ from OTHER's), ``ungrouped``, ``negative`` (an
    ``exp_avg_sq`` below 0), ``zero-moments``, ``step``, ``hyper``, and ``missing``, ``shape``, ``extra`` of its state
    tensors.
    """

    kind: str
    tensor: str | None
    detail: str
    file: str | None = None
    max_abs_diff: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def files_of(tensor: SourceTensor) -> str:
    """The files a tensor's slices are read from, each once, for a difference's ``file``."""
    return ", ".join(dict.fromkeys(str(ref.file) for ref in tensor.refs))


def check_files(ckpt: Path, manifest: Manifest) -> list[Difference]:
    """Missing rank folders, files an index names that are absent, folders without weights, duplicates, for a
    layout whose folders can be checked file by file (others are checked by reading them)."""
    spec = find_layout(manifest.target.get("layout"))
    if not ckpt.is_dir() or spec is None or spec.check_files is None:
        return []
    return [Difference(p.kind, p.tensor, p.detail, p.file) for p in spec.check_files(ckpt, manifest.target.get("tp"))]


def value_difference(a: torch.Tensor, b: torch.Tensor, *, atol: float = 0.0, rtol: float = 0.0) -> float | None:
    """None when ``a`` and ``b`` agree (bit for bit when both tolerances are 0), else their max abs difference.

    NaN equals NaN here (a NaN on one side only counts as an infinite difference). Values are widened to
    float64 (complex128) a block at a time, so the extra memory stays bounded whatever the tensor's size.
    """
    import torch

    from reshard.geometry.tensors import bitwise_equal

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
