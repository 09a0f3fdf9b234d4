"""``reshard.commands.verify_checks``: how two tensors' values are compared (bit-exact, or within a tolerance)."""

from __future__ import annotations

import pytest
import torch

from reshard.commands import verify_checks
from reshard.commands.verify_checks import value_difference


def test_value_difference(monkeypatch: pytest.MonkeyPatch) -> None:
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = a.clone()
    b[1, 2] += 0.5
    assert value_difference(a, a.clone()) is None
    assert value_difference(a, b) == 0.5
    assert value_difference(a, b, atol=0.6) is None
    assert value_difference(a, a.to(torch.bfloat16)) == 0.0  # same values, other dtype: not bit-exact
    nan = a.clone()
    nan[0, 0] = float("nan")
    assert value_difference(nan, nan.clone()) is None
    assert value_difference(nan, a) == float("inf")
    monkeypatch.setattr(verify_checks, "_BLOCK", 7)
    big = torch.arange(100, dtype=torch.float32)  # 15 blocks of 7
    other = big.clone()
    other[-1] += 2
    assert value_difference(big, other) == 2.0 and value_difference(big, other, atol=2.5) is None
