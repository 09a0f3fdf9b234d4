"""The rows Megatron-LM pads its vocab tables to: ``make_vocab_size_divisible_by * tp`` (its
``_vocab_size_with_padding``). Where the true size comes from and how pad rows are cut is :mod:`reshard.vocab`."""

from __future__ import annotations

__all__ = ["DEFAULT_MEGATRON_MULTIPLE", "megatron_pad_multiple"]

DEFAULT_MEGATRON_MULTIPLE = 128  # Megatron's --make-vocab-size-divisible-by default


def megatron_pad_multiple(divisible_by: int | None, tp: int) -> int:
    """Megatron pads the vocab to ``make_vocab_size_divisible_by * tp`` rows (128 * tp by default)."""
    return int(divisible_by or DEFAULT_MEGATRON_MULTIPLE) * tp
