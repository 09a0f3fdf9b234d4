"""FP8 weights back to plain floats, and floats to another float dtype: the per-tensor steps of ``convert --dtype``.

Both are transforms of a unit of work (:class:`reshard.engine.planner.TensorPlan`): the engine gathers the
unit's source tensors (a weight and its scale) into their canonical tensors, calls :meth:`apply`, and splits what
comes out for the target tp, so a dequantized weight is cut after it is dequantized and the scale grid never has
to line up with a rank's rows. Torch is imported only when bytes move; planning builds these from headers.

The arithmetic is the libraries' own, bit for bit:

* **Block FP8** (transformers' FineGrainedFP8, DeepSeek-V3/R1): ``weight.float() * scale_inv`` with each scale
  covering a ``block`` of rows and columns, the product in float32 rounded once to the target dtype (as
  transformers' ``Fp8Dequantize``; multiplying in bf16 changes ~40% of values by one ulp). The last block row or
  column may be short (DeepSeek-V3's ``kv_a_proj_with_mqa``, 576 rows): its scale covers what is left, as in
  DeepSeek's own ``weight_dequant``.
* **compressed-tensors FP8** (per tensor, per channel, or block): ``weight.to(scale.dtype) * scale``, then the
  target dtype, as compressed-tensors' ``dequantize``: the product is rounded to the scale's dtype first.

The product is made a strip of rows at a time, so the float32 temporaries stay at :data:`STRIP` elements whatever
the weight's size; FP8 becomes float32 through float16's bit layout (:func:`float32_of`), a fifth of the CPU of
torch's own conversion, which is most of the work.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from reshard.dtypes import name_of

if TYPE_CHECKING:
    import torch

Shape = tuple[int, ...]
# Elements of the float32 product made at once (16 MB): large enough for torch's vectorised kernels, small
# beside the weight.
STRIP = 1 << 22


@dataclass(frozen=True)
class Dequantize:
    """A 2-D FP8 weight and its scale grid -> the weight in ``code``.

    Attributes:
        block: rows and columns of the weight each scale covers (a whole dim for per-tensor / per-channel scales).
        code: the target's safetensors dtype code (``"BF16"``).
        via: the dtype code the product is rounded to before ``code`` (compressed-tensors: its scale's), or None.
    """

    block: tuple[int, int]
    code: str
    via: str | None = None
    sources: int = 2
    targets: int = 1

    def target_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        return [tuple(shapes[0])]

    def apply(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        weight, scale = tensors
        return [dequantize(weight, scale, block=self.block, code=self.code, via=self.via)]

    def describe(self) -> str:
        return f"dequantize ({self.block[0]}x{self.block[1]} scales) to {name_of(self.code)}"


@dataclass(frozen=True)
class Cast:
    """A floating tensor in another float dtype (``code``), rounded once as ``Tensor.to`` does."""

    code: str
    sources: int = 1
    targets: int = 1

    def target_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        return [tuple(shapes[0])]

    def apply(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        from reshard.dtypes import dtype_from_code

        return [tensors[0].to(dtype_from_code(self.code))]

    def describe(self) -> str:
        return f"cast to {name_of(self.code)}"


def dequantize(
    weight: torch.Tensor, scale: torch.Tensor, *, block: tuple[int, int], code: str, via: str | None = None
) -> torch.Tensor:
    """``weight`` (2-D, FP8) times ``scale`` (a ``ceil(rows / block[0]) x ceil(cols / block[1])`` grid, or one value),
    in the dtype of ``code``; see the module docstring for the rounding."""
    import torch

    from reshard.dtypes import dtype_from_code

    rows, cols = weight.shape
    block_rows, block_cols = block
    grid = scale.reshape(math.ceil(rows / block_rows), math.ceil(cols / block_cols)).float()
    if len(grid) == 1:  # one scale row for every row (per tensor): as a view, so strips stay small
        grid, block_rows = grid.expand(rows, -1), 1
    out = torch.empty((rows, cols), dtype=dtype_from_code(code))
    via_dtype = dtype_from_code(via) if via is not None else None
    strip = min(rows, max(1, STRIP // max(1, cols) // block_rows) * block_rows)  # whole blocks of rows
    # one int16 and one float32 strip for every strip of the weight: fresh pages each time cost more than the work
    bits, product = torch.empty((strip, cols), dtype=torch.int16), torch.empty((strip, cols), dtype=torch.float32)
    for start in range(0, rows, strip):
        stop = min(rows, start + strip)
        values = float32_of(weight[start:stop], bits=bits[: stop - start], out=product[: stop - start])
        scales = _row_scales(grid[start // block_rows : math.ceil(stop / block_rows)], block_cols, cols)
        whole = (stop - start) // block_rows * block_rows
        if whole:  # every block row of the strip times its scales, broadcast over its rows
            values[:whole].view(whole // block_rows, block_rows, -1).mul_(scales[: whole // block_rows, None, :])
        if whole < stop - start:  # the weight's last block row, short
            values[whole:].mul_(scales[-1])
        out[start:stop].copy_(values if via_dtype is None else values.to(via_dtype))
    return out


def float32_of(
    fp8: torch.Tensor, *, bits: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The float32 values of an FP8 tensor, the same as ``fp8.float()``, NaN bits included, for a fifth of the CPU
    (into ``out``, through ``bits``, an int16 tensor of its shape, when given).

    Both FP8 kinds are exact in float16's bit layout, reached with integer shifts (vectorised) where torch converts
    element by element: float8_e5m2 is float16's high byte; float8_e4m3fn's sign goes to bit 15 and its exponent and
    mantissa to bits 7-13, where its exponent bias of 7 reads as float16's 15, so the value is that float16 times
    2^8 (exact). e4m3fn has no infinities, and its two NaN bytes come out as +-480, beyond its largest value (448):
    where the range shows one, those elements are converted by torch itself.
    """
    import torch

    bits = torch.empty(fp8.shape, dtype=torch.int16) if bits is None else bits
    out = torch.empty(fp8.shape, dtype=torch.float32) if out is None else out
    bits.copy_(fp8.view(torch.int8))  # sign-extended
    if fp8.dtype == torch.float8_e5m2:
        return out.copy_(bits.bitwise_left_shift_(8).view(torch.float16))
    out.copy_(bits.bitwise_left_shift_(7).bitwise_and_(~0x4000).view(torch.float16)).mul_(256.0)
    if out.numel() and max(-float(out.min()), float(out.max())) > 448:
        nan = fp8.view(torch.uint8).bitwise_and(0x7F).eq(0x7F)
        out[nan] = fp8[nan].float()
    return out


def _row_scales(grid: torch.Tensor, block_cols: int, cols: int) -> torch.Tensor:
    """Each block row's scale for every column (``[k, cols]``; ``[k, 1]`` when one scale spans the columns), the
    last block column cut to what is left."""
    if block_cols >= cols:
        return grid[:, :1]
    return grid.repeat_interleave(block_cols, dim=1)[:, :cols]
