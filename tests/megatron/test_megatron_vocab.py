"""``reshard.megatron.vocab``: the rows Megatron-LM pads its vocab to."""

from __future__ import annotations

from reshard.megatron.vocab import DEFAULT_MEGATRON_MULTIPLE, megatron_pad_multiple


def test_megatron_pads_to_its_multiple_times_tp() -> None:
    assert DEFAULT_MEGATRON_MULTIPLE == 128
    assert megatron_pad_multiple(None, 8) == 1024 and megatron_pad_multiple(64, 8) == 512
