"""The padding arithmetic of a vocab dim: how many rows a target needs, how far past the vocab rows can still be
padding, and the one place pad rows are cut off a gathered tensor.

Frameworks pad the embedding and output tables at the tail (Megatron to ``make_vocab_size_divisible_by * tp``,
ColossalAI to ``64 * tp``, reshard to tp); whatever the pad rows hold is not data. Pure: works on sizes, and on any
tensor-like with ``narrow`` and ``shape``, so no torch import.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from reshard.errors import ShapeMismatchError

# Frameworks pad the vocab to multiples of at most this many rows per rank (Megatron: 128).
MAX_VOCAB_PAD_PER_RANK = 1024


Rows = TypeVar("Rows", bound="_Narrowable")


class _Narrowable(Protocol):
    @property
    def shape(self) -> tuple[int, ...]: ...

    def narrow(self: Rows, dim: int, start: int, length: int) -> Rows: ...


def round_up(size: int, multiple: int) -> int:
    """``size`` rounded up to a multiple of ``multiple``."""
    return -(-size // multiple) * multiple


def padded_size(size: int, multiple: int, *, uneven: bool = False) -> int:
    """Rows a vocab of ``size`` is padded to: a multiple of ``multiple``, or none at all when split ``uneven``."""
    return size if uneven else round_up(size, multiple)


def is_padded_vocab(size: int, vocab_size: int | None, tp: int) -> bool:
    """``size`` is the vocab, or the vocab padded the way TP frameworks pad it."""
    return vocab_size is not None and vocab_size <= size < vocab_size + MAX_VOCAB_PAD_PER_RANK * max(tp, 1)


def cut_pad_rows(tensor: Rows, dim: int, vocab_size: int) -> Rows:
    """The first ``vocab_size`` entries of a gathered vocab tensor along ``dim`` (a view): the pad rows go."""
    if vocab_size > tensor.shape[dim]:
        raise ShapeMismatchError(f"cannot unpad dim {dim} of size {tensor.shape[dim]} up to {vocab_size}")
    return tensor.narrow(dim, 0, vocab_size)
