"""FP8 weights back to plain floats, and floats to another float dtype: the per-tensor steps of ``convert --dtype``.

Both are transforms (:class:`reshard.mappings.transforms.Transform`) of a unit of work
(:class:`reshard.engine.plan.planner.TensorPlan`): the engine gathers the unit's source tensors (a weight and its
scale) into their canonical tensors, calls :meth:`apply`, and splits what comes out for the target tp, so a dequantized
weight is cut after it is dequantized and the scale grid never has to line up with a rank's rows. Torch is imported
only when bytes move; planning builds these from headers.

The arithmetic is the libraries' own, bit for bit:

* **Block FP8** (transformers' FineGrainedFP8, DeepSeek-V3/R1): ``weight.float() * scale_inv`` with each scale
  covering a ``block`` of rows and columns, the product in float32 rounded once to the target dtype (as
  transformers' ``Fp8Dequantize``; multiplying in bf16 changes ~40% of values by one ulp). The last block row or
  column may be short (DeepSeek-V3's ``kv_a_proj_with_mqa``, 576 rows): its scale covers what is left, as in
  DeepSeek's own ``weight_dequant``.
* **compressed-tensors FP8** (per tensor, per channel, or block): ``weight.to(scale.dtype) * scale``, then the
  target dtype, as compressed-tensors' ``dequantize``: the product is rounded to the scale's dtype first.

The product is made a strip of rows at a time, so the float32 temporaries stay at :data:`STRIP` elements whatever
the weight's size; FP8 becomes float32 through float16's bit layout (:func:`float32_of`), far cheaper than torch's
own conversion, which is most of the work (measured: docs/quantization-dequant.md).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from reshard.dtypes import name_of

if TYPE_CHECKING:
    import torch

Shape = tuple[int, ...]
# Elements of the float32 product made at once (4 MB; a strip is at least one row): large enough for torch's
# vectorised kernels, small enough to stay in the cache between them (measured in docs/quantization-dequant.md).
STRIP = 1 << 20


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

    writes_into = True  # the engine may hand apply() its output (a pooled buffer)
    moves_values = False  # values are computed (scaled, cast), not moved

    def apply(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        out: Sequence[torch.Tensor] = (),
        finite: list[bool] | None = None,
    ) -> list[torch.Tensor]:
        """The dequantized weight (in ``out[0]`` when given); when ``finite`` is given, whether the inputs alone show
        every value of it finite is appended to it (:func:`bounded`: the engine then skips looking at its bytes)."""
        weight, scale = tensors
        into = out[0] if out else None
        made, known = _dequantize(weight, scale, block=self.block, code=self.code, via=self.via, out=into)
        if finite is not None:
            finite.append(known)
        return [made]

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

    writes_into = True
    moves_values = False  # values are computed (scaled, cast), not moved

    def apply(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        out: Sequence[torch.Tensor] = (),
        finite: list[bool] | None = None,
    ) -> list[torch.Tensor]:
        """The cast tensor (into ``out[0]`` when given); nothing is known of its values beforehand (``finite``
        gets False: the engine looks at its bytes)."""
        from reshard.dtypes import dtype_from_code

        if finite is not None:
            finite.append(False)
        if out:
            return [out[0].copy_(tensors[0])]
        return [tensors[0].to(dtype_from_code(self.code))]

    def describe(self) -> str:
        return f"cast to {name_of(self.code)}"


def dequantize(
    weight: torch.Tensor,
    scale: torch.Tensor,
    *,
    block: tuple[int, int],
    code: str,
    via: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``weight`` (2-D, FP8) times ``scale`` (a ``ceil(rows / block[0]) x ceil(cols / block[1])`` grid, or one value),
    in the dtype of ``code`` (into ``out`` when given); see the module docstring for the rounding."""
    return _dequantize(weight, scale, block=block, code=code, via=via, out=out)[0]


def _dequantize(
    weight: torch.Tensor,
    scale: torch.Tensor,
    *,
    block: tuple[int, int],
    code: str,
    via: str | None,
    out: torch.Tensor | None,
) -> tuple[torch.Tensor, bool]:
    """:func:`dequantize`, and whether its inputs bound every value of it finite (:func:`bounded`)."""
    import torch

    from reshard.dtypes import dtype_from_code

    rows, cols = weight.shape
    block_rows, block_cols = block
    grid = scale.reshape(math.ceil(rows / block_rows), math.ceil(cols / block_cols)).float()
    if len(grid) == 1:  # one scale row for every row (per tensor or per column block): any rows at once
        block_rows = rows
    out = torch.empty((rows, cols), dtype=dtype_from_code(code)) if out is None else out
    if not out.numel():
        return out, False
    via_dtype = dtype_from_code(via) if via is not None and via != code else None
    known = bounded(grid, weight.dtype, via=via_dtype, dtype=out.dtype)  # before _has_nan: it needs no NaN
    grid, factor = _folded(grid, weight.dtype)
    row_scales = _row_scales(grid, block_cols, cols)  # [block rows, cols] or [block rows, 1]
    with _one_thread():
        nan = weight.dtype == torch.float8_e4m3fn and _has_nan(weight)
        _product(weight, row_scales, factor, out, block_rows=block_rows, via=via_dtype, nan=nan)
    return out, known and not nan


# The largest magnitude of a float8_e4m3fn value that is not NaN (it has no infinities).
E4M3_MAX = 448.0


def bounded(grid: torch.Tensor, fp8: torch.dtype, *, via: torch.dtype | None, dtype: torch.dtype) -> bool:
    """Whether every product of a float8_e4m3fn weight with no NaN and the float32 scale ``grid`` is finite in
    ``dtype`` (through ``via``), as the inputs alone show: no value of the weight exceeds 448 in magnitude, and
    rounding to nearest is monotonic, so no product rounds past the largest scale times 448 rounded the same way
    (float32, then ``via``, then ``dtype``). A finite bound makes every value finite; otherwise (an infinite or NaN
    scale, or a product near the dtype's limit) the caller looks at the values. float8_e5m2 (it has infinities)
    is never bounded here. The caller still has to rule out the weight's NaN bytes."""
    import torch

    if fp8 != torch.float8_e4m3fn or not grid.numel():
        return False
    bound = grid.abs().max() * E4M3_MAX  # float32, rounded as each product is
    for step in (via, dtype):
        if step is not None:
            bound = bound.to(step)
    return bool(torch.isfinite(bound))


def _product(
    weight: torch.Tensor,
    row_scales: torch.Tensor,
    factor: float,
    out: torch.Tensor,
    *,
    block_rows: int,
    via: torch.dtype | None,
    nan: bool,
) -> None:
    """``out`` = ``weight`` times each block row's scales, a strip of rows at a time (a strip holds whole block rows,
    or is part of one)."""
    rows, cols = weight.shape
    per_strip = max(1, STRIP // cols)
    temps = _Strips(per_strip if per_strip < block_rows else per_strip // block_rows * block_rows, cols)
    start = 0
    while start < rows:
        first = start // block_rows
        if temps.rows < block_rows:  # part of one block row
            stop = min(rows, start + temps.rows, (first + 1) * block_rows)
        else:  # whole block rows (the weight's last one may be short)
            stop = min(rows, start + temps.rows)
        strip = stop - start
        values = _float32_into(weight[start:stop], temps.bits(strip), temps.values(strip), nan=nan)
        if factor != 1.0:
            values.mul_(factor)
        whole = (stop - start) // block_rows if start % block_rows == 0 else 0
        if whole:  # every whole block row of the strip times its scales, broadcast over its rows
            values[: whole * block_rows].view(whole, block_rows, -1).mul_(row_scales[first : first + whole, None])
        if whole * block_rows < stop - start:  # within one block row (the strip's end, or a part of one)
            values[whole * block_rows :].mul_(row_scales[(stop - 1) // block_rows])
        if via is not None:
            values = temps.via(via, strip).copy_(values)
        out[start:stop].copy_(values)
        start = stop


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """torch's operations on this thread run on it alone while the block lasts.

    The engine already runs one unit per worker thread (``--jobs``); each of them starting a team of OpenMP
    threads for every strip's operations oversubscribes the cores, and the teams' waiting costs more CPU than the
    work on a loaded machine (measured: docs/performance.md). OpenMP's
    thread count is a per-thread setting, so other threads keep theirs."""
    import torch

    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def float32_of(fp8: torch.Tensor) -> torch.Tensor:
    """The float32 values of an FP8 tensor, the same as ``fp8.float()``, NaN bits included, for less CPU."""
    import torch

    bits, values = torch.empty(fp8.shape, dtype=torch.int16), torch.empty(fp8.shape, dtype=torch.float32)
    e4m3 = fp8.dtype == torch.float8_e4m3fn
    values = _float32_into(fp8, bits, values, nan=e4m3 and _has_nan(fp8))
    return values.mul_(E4M3_FACTOR) if e4m3 else values


_Kept = tuple["torch.Tensor", "torch.Tensor", dict["torch.dtype", "torch.Tensor"]]  # a thread's bits, values, via


class _Strips:
    """This thread's reusable temporaries for ``rows`` rows of ``cols`` columns at a time: the FP8 bits widened to
    int16, their float32 values, and the product rounded to the scale's dtype. Fresh pages for every strip cost
    more than the arithmetic (page faults and zeroing), so each thread keeps its own and grows them when needed."""

    def __init__(self, rows: int, cols: int) -> None:
        import torch

        self.rows, self.cols = rows, cols
        kept: tuple[torch.Tensor, torch.Tensor, dict[torch.dtype, torch.Tensor]] | None = getattr(
            _local, "strips", None
        )
        elements = rows * cols
        if kept is None or kept[0].numel() < elements:
            kept = _local.strips = (
                torch.empty(elements, dtype=torch.int16),
                torch.empty(elements, dtype=torch.float32),
                {},
            )
        self._bits, self._values, self._via = kept

    def bits(self, rows: int) -> torch.Tensor:
        return self._bits[: rows * self.cols].view(rows, self.cols)

    def values(self, rows: int) -> torch.Tensor:
        return self._values[: rows * self.cols].view(rows, self.cols)

    def via(self, dtype: torch.dtype, rows: int) -> torch.Tensor:
        import torch

        kept = self._via.get(dtype)
        if kept is None or kept.numel() < self._values.numel():
            kept = self._via[dtype] = torch.empty(self._values.numel(), dtype=dtype)
        return kept[: rows * self.cols].view(rows, self.cols)


_local = threading.local()
# float8_e4m3fn read in float16's bit layout is its value times 2^-8 (see :func:`_float32_into`).
E4M3_FACTOR = 256.0


def _float32_into(fp8: torch.Tensor, bits: torch.Tensor, values: torch.Tensor, *, nan: bool) -> torch.Tensor:
    """The float32 values of FP8 in ``values`` through ``bits`` (int16, of its shape; float8_e4m3fn: the values
    times 2^-8, exact), with integer
    shifts (vectorised) where torch converts FP8 element by element (docs/quantization-dequant.md).

    Both FP8 kinds are exact in float16's bit layout: float8_e5m2 is float16's high byte; float8_e4m3fn's sign goes
    to bit 15 and its exponent and mantissa to bits 7-13, where its exponent bias of 7 reads as float16's 15, so
    the float16 is the value times 2^-8 (exact, subnormals included). e4m3fn has no infinities, and its two NaN
    bytes would read as +-480: when the weight has any (``nan``), those elements are converted by torch itself.
    """
    import torch

    bits.copy_(fp8.view(torch.int8))  # sign-extended
    if fp8.dtype == torch.float8_e5m2:
        return values.copy_(bits.bitwise_left_shift_(8).view(torch.float16))
    values.copy_(bits.bitwise_left_shift_(7).bitwise_and_(~0x4000).view(torch.float16))
    if nan:
        where = fp8.view(torch.uint8).bitwise_and(0x7F).eq(0x7F)
        values[where] = fp8[where].float()
    return values


def _has_nan(fp8: torch.Tensor) -> bool:
    """Whether a float8_e4m3fn tensor holds a NaN (bytes 0x7F and 0xFF: the largest as int8 and as uint8)."""
    import torch

    return bool(fp8.numel()) and (int(fp8.view(torch.int8).max()) == 127 or int(fp8.view(torch.uint8).max()) == 255)


def _folded(grid: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """The scale grid with float8_e4m3fn's 2^8 (:func:`_float32_into`) folded in, and the factor left to apply (1
    unless a scale would overflow): ``(v * 2^-8) * (s * 2^8)`` is ``v * s`` rounded once, since both factors are
    exact."""
    import torch

    if dtype != torch.float8_e4m3fn:
        return grid, 1.0
    folded = grid * E4M3_FACTOR
    if bool((folded.isinf() & grid.isfinite()).any()):
        return grid, E4M3_FACTOR
    return folded, 1.0


def _row_scales(grid: torch.Tensor, block_cols: int, cols: int) -> torch.Tensor:
    """Each block row's scale for every column (``[k, cols]``; ``[k, 1]`` when one scale spans the columns), the
    last block column cut to what is left."""
    if block_cols >= cols:
        return grid[:, :1]
    return grid.repeat_interleave(block_cols, dim=1)[:, :cols]
