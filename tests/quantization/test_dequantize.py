"""FP8 dequantization's arithmetic against the libraries' own: transformers' ``Fp8Dequantize`` (block FP8),
DeepSeek-V3's ragged last block, compressed-tensors' ``x.to(scale.dtype) * scale`` (per tensor and per channel)."""

from __future__ import annotations

import pytest
import torch
from fixtures.fp8 import block_magnitudes, quantize_blocks
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

import reshard.quantization.dequantize as module
from reshard.quantization.dequantize import Cast, Dequantize, dequantize, float32_of

CODES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16) if tensor.element_size() == 2 else tensor.view(torch.int32)


@pytest.fixture(params=[1 << 22, 128 * 300, 1], ids=["one-strip", "strips", "one-block-row"])
def strip(request, monkeypatch):
    """The product in one strip, in strips of a few block rows, and one block row at a time: the same bytes."""
    monkeypatch.setattr(module, "STRIP", request.param)


@pytest.mark.parametrize("dtype", list(CODES), ids=lambda d: str(d).removeprefix("torch."))
def test_block_fp8_equals_transformers_dequantization_bit_for_bit(strip, dtype):
    weight = block_magnitudes(torch.randn(384, 512, generator=torch.Generator().manual_seed(0)), seed=3)
    quantized, scale_inv = quantize_blocks(weight)
    theirs = Fp8Dequantize(None)._dequantize_one(quantized, scale_inv, output_dtype=dtype)
    mine = dequantize(quantized, scale_inv, block=(128, 128), code=CODES[dtype])
    assert mine.dtype == dtype
    assert torch.equal(_bits(mine), _bits(theirs))
    # a wrong block would show: every block has its own magnitude
    assert len({round(float(b.abs().max()), 3) for b in mine.float().split(128, 0)}) == 3


@pytest.mark.parametrize("shape", [(576, 300), (130, 128), (1, 5), (200, 129)])
def test_a_ragged_last_block_is_scaled_by_its_own_scale(strip, shape):
    """DeepSeek-V3 stores kv_a_proj_with_mqa (576 rows) with a short last block: its scale covers what is left."""
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 3
    quantized, scale_inv = quantize_blocks(weight)
    rows, cols = shape
    full = scale_inv.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    expected = (quantized.double() * full).float().to(torch.bfloat16)  # exact product, rounded once
    mine = dequantize(quantized, scale_inv, block=(128, 128), code="BF16")
    assert torch.equal(_bits(mine), _bits(expected))
    assert (mine.float() - weight).abs().max() <= weight.abs().max() / 8  # it is the weight, within FP8's precision


@pytest.mark.parametrize("strategy", ["tensor", "channel"])
@pytest.mark.parametrize("dtype", list(CODES), ids=lambda d: str(d).removeprefix("torch."))
def test_compressed_tensors_fp8_multiplies_in_the_scales_dtype(strip, strategy, dtype):
    """compressed-tensors' dequantize: ``x_q.to(scale.dtype) * scale``, then the target dtype (float16 from a bf16
    product is rounded twice, as the library does)."""
    weight = torch.randn(300, 70, generator=torch.Generator().manual_seed(2))
    absmax = weight.abs().amax(1, keepdim=True) if strategy == "channel" else weight.abs().amax().reshape(1)
    scale = (absmax / 448).to(torch.bfloat16)
    quantized = (weight / scale.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
    block = (1, 70) if strategy == "channel" else (300, 70)
    mine = dequantize(quantized, scale, block=block, code=CODES[dtype], via="BF16")
    assert torch.equal(_bits(mine), _bits((quantized.to(scale.dtype) * scale).to(dtype)))


def test_the_transforms_state_their_shapes_and_cast_once():
    dequant = Dequantize((128, 128), "BF16")
    assert dequant.target_shapes([(256, 384), (2, 3)]) == [(256, 384)]
    assert dequant.describe() == "dequantize (128x128 scales) to bfloat16"
    values = torch.randn(4, 4, dtype=torch.float32)
    (cast,) = Cast("BF16").apply([values])
    assert torch.equal(cast, values.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3fn", "e5m2"])
def test_fp8_to_float32_is_torchs_conversion_for_every_byte(dtype):
    every = torch.arange(256, dtype=torch.uint8).repeat(3, 1).view(dtype)  # NaNs (and e5m2's infinities) included
    assert torch.equal(float32_of(every).view(torch.int32), every.float().view(torch.int32))


@pytest.mark.parametrize("dtype", list(CODES), ids=lambda d: str(d).removeprefix("torch."))
def test_every_fp8_byte_times_every_kind_of_scale_is_transformers_bit_for_bit(dtype):
    """All 256 bytes (NaN, subnormals, negative zero) in every block, scales from subnormal to 2^120 (where folding
    float8_e4m3fn's 2^8 into the scale would overflow), infinite and NaN; into a given (pooled) output too."""
    every = torch.arange(256, dtype=torch.uint8)
    codes = torch.stack([every.roll(r) for r in range(256)]).repeat(2, 2).view(torch.float8_e4m3fn)  # 512 x 512
    scales = torch.tensor(
        [[1e-45, 2.0**-12], [0.0123, 2.0**120], [1.5 * 2.0**119, -0.75], [float("inf"), float("nan")]]
    )
    scale_inv = scales.reshape(4, 2)
    weight = codes.repeat(2, 1)[:, :256]  # 1024 x 256: a 8 x 2 grid
    grid = torch.cat([scale_inv, scale_inv]).reshape(8, 2)
    theirs = Fp8Dequantize(None)._dequantize_one(weight, grid, output_dtype=dtype)
    mine = dequantize(weight, grid, block=(128, 128), code=CODES[dtype])
    assert torch.equal(_bits(mine), _bits(theirs))
    into = torch.full_like(theirs, 7)
    (out,) = Dequantize((128, 128), CODES[dtype]).apply([weight, grid], out=[into])
    assert out is into and torch.equal(_bits(into), _bits(theirs))


def _near_the_limits() -> list[float]:
    """Scales whose products with 448 (float8_e4m3fn's largest value) fall on either side of each float dtype's
    largest finite value, its rounding boundary included; ordinary, zero, infinite and NaN scales."""
    scales = [0.0, 1.0, 0.0123, -(2.0**-12), float("inf"), float("nan")]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        limit = torch.tensor(torch.finfo(dtype).max / 448, dtype=torch.float32)
        for factor in (1 - 2.0**-8, 1 - 2.0**-9, 1.0, 1 + 2.0**-9, 1 + 2.0**-8):
            near = (limit.double() * factor).float()
            for _ in range(3):
                scales.append(float(near))
                near = torch.nextafter(near, torch.tensor(float("inf")))
    return scales


@pytest.mark.parametrize("via", [None, "F16", "BF16"], ids=["float32-product", "via-float16", "via-bfloat16"])
@pytest.mark.parametrize("dtype", list(CODES), ids=lambda d: str(d).removeprefix("torch."))
def test_a_weight_is_known_finite_exactly_when_its_values_are(dtype, via):
    """The inputs' bound (no NaN byte; the largest scale times 448 rounded as every product is) is claimed for a
    weight holding every other byte exactly when its dequantized values have no NaN or Inf, for scales up to each
    dtype's limit; never for a weight with a NaN byte; and the engine skips its own look only then."""
    every = torch.arange(256, dtype=torch.uint8)
    plain = every[(every & 0x7F) != 0x7F].repeat(4).reshape(8, -1).view(torch.float8_e4m3fn)
    claimed = 0
    for value in _near_the_limits():
        for sign in (1.0, -1.0):
            grid = torch.tensor([[sign * value]])
            finite: list[bool] = []
            (out,) = Dequantize(tuple(plain.shape), CODES[dtype], via).apply([plain, grid], finite=finite)
            actual = bool(torch.isfinite(out.float()).all())
            assert finite == [actual], (value, sign)
            claimed += actual
            with_nan = plain.clone()
            with_nan.view(torch.uint8)[3, 5] = 0xFF
            finite = []
            Dequantize(tuple(plain.shape), CODES[dtype], via).apply([with_nan, grid], finite=finite)
            assert finite == [False]
    assert claimed > 4
    finite = []
    Cast(CODES[dtype]).apply([torch.ones(3)], finite=finite)
    assert finite == [False]
