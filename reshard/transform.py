"""What the engine asks of a transform: the gathered source tensors of one unit -> its target tensors.

Two kinds implement :class:`Transform`: the mappings between namings (:mod:`reshard.mappings.transforms`, each with
an inverse) and ``convert --dtype``'s dequantize and cast (:mod:`reshard.quantization.dequantize`). It lives here,
in the domain layer, so that both (and the engine) can name it without importing each other.

The calls happen in this order: 1) :meth:`Transform.target_shapes` while planning (pure, from headers);
2) :meth:`Transform.apply` once per unit, on its canonical tensors, with ``out`` only when
:attr:`Transform.writes_into`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

Shape = tuple[int, ...]


class Transform(Protocol):
    """Source tensors (``sources`` of them, in the order of the unit's names) -> ``targets`` target tensors."""

    @property
    def sources(self) -> int:
        """How many source tensors it takes."""
        ...

    @property
    def targets(self) -> int:
        """How many target tensors it makes."""
        ...

    @property
    def writes_into(self) -> bool:
        """Whether :meth:`apply` fills target tensors it is given (``out``), so the engine may hand it pooled
        buffers instead of fresh memory."""
        ...

    def target_shapes(self, shapes: Sequence[Shape]) -> list[Shape]:
        """The targets' shapes from the sources' (pure).

        Raises:
            ShapeMismatchError: the sources' shapes do not fit the transform.
        """
        ...

    def apply(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        out: Sequence[torch.Tensor] = (),
        finite: list[bool] | None = None,
    ) -> list[torch.Tensor]:
        """The target tensors of ``tensors`` (into ``out``, one per target, when given: only if :attr:`writes_into`).
        When ``finite`` is given, one flag per target is appended to it: whether the inputs alone show every value
        of that target finite (the engine then skips looking at its bytes)."""
        ...

    def describe(self) -> str:
        """What it does, in a few words (for reports and errors)."""
        ...
