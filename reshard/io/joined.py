"""A tensor that is its parts one after the other along dim 0, handed to the writers without a copy.

Why: a packed tensor's slice for one target rank (``[gate_r; up_r]`` of Megatron's ``linear_fc1``) is two
ranges of the gathered ``[gate; up]``, not one, and ``torch.cat`` would copy them into fresh memory (page
faults for a large share of a Megatron checkpoint). The writers only need the bytes in C order, which are the
parts' bytes one after the other (:func:`reshard.io.vectored.row_views`,
:func:`reshard.formats.safetensors.writer.byte_chunks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Joined:
    """``torch.cat(parts)`` along dim 0, as far as a writer is concerned: shape, dtype and bytes."""

    parts: tuple[torch.Tensor, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.parts[0]
        return (sum(part.shape[0] for part in self.parts), *first.shape[1:])

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype
