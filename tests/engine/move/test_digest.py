"""``reshard.engine.move.digest``: the one-pass finite check agrees with ``torch.isfinite``."""

from __future__ import annotations

import pytest
import torch

from reshard.engine.move import digest
from reshard.engine.move.digest import all_finite_in_blocks


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.int32]
)
@pytest.mark.parametrize(
    "bad",
    [None, float("nan"), -float("nan"), float("inf"), float("-inf"), "largest", "-largest"],
    ids=["finite", "nan", "-nan", "inf", "-inf", "largest", "-largest"],
)
def test_finite_check_in_one_pass_agrees_with_isfinite(dtype: torch.dtype, bad: float | str | None) -> None:
    """Both ways (the exponent bits of contiguous common floats, aminmax for the rest)."""
    tensor = (torch.arange(3000.0).reshape(100, 30) / 7).to(dtype)
    if isinstance(bad, str) and dtype.is_floating_point:  # the largest finite values: finite
        bad = torch.finfo(dtype).max * (-1 if bad.startswith("-") else 1)
    if bad is not None and dtype.is_floating_point:
        tensor[77, 11] = bad
    expected = bool(torch.isfinite(tensor.double()).all()) if dtype.is_floating_point else True
    assert all_finite_in_blocks(tensor) is expected
    assert all_finite_in_blocks(tensor[:, 8:14]) is expected  # a strided view holding the bad value


@pytest.mark.parametrize(
    ("dtype", "code"),
    [
        (torch.bfloat16, "BF16"),
        (torch.float16, "F16"),
        (torch.float8_e4m3fn, "F8_E4M3"),
        (torch.float8_e5m2, "F8_E5M2"),
        (torch.int16, "I16"),
    ],
)
def test_every_bit_pattern_is_judged_as_isfinite_judges_it(dtype: torch.dtype, code: str) -> None:
    """The torch-free check of a stream (:class:`~reshard.engine.move.digest.RunningDigest`, on the bits) and the check
    of a gathered tensor, on every value the dtype has, one value at a time."""
    bits = torch.int8 if dtype.itemsize == 1 else torch.int16
    low, high = torch.iinfo(bits).min, torch.iinfo(bits).max
    values = torch.arange(low, high + 1, dtype=torch.int32).to(bits).view(dtype)
    expected = (
        torch.isfinite(values.double()) if dtype.is_floating_point else torch.ones(len(values), dtype=torch.bool)
    )
    streamed, gathered = [], []
    for value in values:
        running = digest.RunningDigest(code, finite=True)
        running.update(memoryview(value.reshape(1).view(torch.uint8).numpy()))
        streamed.append(running.result()[1])
        gathered.append(all_finite_in_blocks(value.reshape(1)))
    assert torch.tensor(streamed).equal(expected) and torch.tensor(gathered).equal(expected)
    assert digest.checked_without_torch(code)
