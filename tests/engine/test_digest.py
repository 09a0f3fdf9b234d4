"""``reshard.engine.digest``: the one-pass finite check agrees with ``torch.isfinite``."""

from __future__ import annotations

import pytest
import torch

from reshard.engine import digest
from reshard.engine.digest import all_finite_in_blocks


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.int32]
)
@pytest.mark.parametrize(
    "bad",
    [None, float("nan"), -float("nan"), float("inf"), float("-inf"), "largest", "-largest"],
    ids=["finite", "nan", "-nan", "inf", "-inf", "largest", "-largest"],
)
def test_finite_check_in_one_pass_agrees_with_isfinite(
    dtype: torch.dtype, bad: float | str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both ways (the exponent bits of contiguous common floats, aminmax for the rest), across blocks."""
    monkeypatch.setattr(digest, "FINITE_BLOCK", 64)
    tensor = (torch.arange(3000.0).reshape(100, 30) / 7).to(dtype)
    if isinstance(bad, str) and dtype.is_floating_point:  # the largest finite values: finite
        bad = torch.finfo(dtype).max * (-1 if bad.startswith("-") else 1)
    if bad is not None and dtype.is_floating_point:
        tensor[77, 11] = bad
    expected = bool(torch.isfinite(tensor.double()).all()) if dtype.is_floating_point else True
    assert all_finite_in_blocks(tensor) is expected
    assert all_finite_in_blocks(tensor[:, 8:14]) is expected  # a strided view holding the bad value
