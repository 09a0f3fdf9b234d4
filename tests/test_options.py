"""``reshard.options``: a command's options are composed from their parts, the reading part one ``ReadOptions``."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from reshard.commands.check import CheckOptions
from reshard.commands.verify import VerifyOptions
from reshard.errors import ReshardError
from reshard.options import ConvertOptions, ReadOptions, composed


def test_flat_parameters_are_composed_into_their_parts() -> None:
    options = composed(ConvertOptions, tp=2, vocab=65535, uneven=True, config=Path("c.json"), jobs=3)
    assert options.read == ReadOptions(vocab=65535, uneven=True, config=Path("c.json"))
    assert (options.tp, options.jobs) == (2, 3)
    check = composed(CheckOptions, tp=4, plan="transformers", pad_multiple=8)
    assert check.read == ReadOptions(plan="transformers") and check.pad_multiple == 8
    verify = composed(VerifyOptions, roundtrip=(2,), trust_pickle=True, progress=False)
    assert verify.read == ReadOptions(trust_pickle=True) and verify.reading(own_config=False).config is None


def test_no_option_is_held_twice() -> None:
    """A reading option lives in ``ReadOptions`` only: a command's own fields never copy one."""
    reading = {f.name for f in fields(ReadOptions)}
    for kind in (ConvertOptions, CheckOptions, VerifyOptions):
        assert reading.isdisjoint(f.name for f in fields(kind) if f.name != "read"), kind.__name__


def test_an_unknown_parameter_is_refused_as_the_class_refuses_it() -> None:
    with pytest.raises(TypeError):
        composed(ConvertOptions, tp=2, vocabulary=3)
    with pytest.raises(ReshardError, match="--tp 0"):
        composed(ConvertOptions, tp=0)
