"""The tensors of a verl actor, put back from every rank's local pieces, each copy of a replicated piece compared.

The pieces of a global tensor are boxes of it, as DCP's chunks are: :class:`~reshard.layouts.dcp.boxed_reader.
BoxedReader` (the engine's reader of boxed tensors) copies, from each piece that overlaps what is asked, only the
overlap. Here a piece is a local tensor inside a rank file (its storage record located when the file was opened,
strided or not), and a piece that several ranks hold (a ``Replicate()`` mesh dim, a plain tensor or buffer saved by
every rank) is read from the lowest rank and compared with every other copy, bit for bit, over the same bytes:
never concatenated, never taken on trust.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from reshard.errors import DivergentReplicaError
from reshard.formats.chunks import ChunkLayout
from reshard.formats.dcp_metadata.read import StoredChunk, StoredTensor
from reshard.io.direct import Batch
from reshard.layouts.dcp.boxed_reader import BoxedReader

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Copy:
    """Another copy of a tensor: the view ``key`` of this reader (the same box, read from other ranks' pieces), the
    lowest of those ranks ``rank``."""

    key: str
    rank: int


@dataclass
class PiecesReader(BoxedReader):
    """Global tensors of located pieces (``located``: where each piece's storage lies and how it is strided, by the
    tensor's name and the piece: two tensors may be views of one storage with the same box), and
    the other ``copies`` of each (views of this reader too), compared when read; ``first_rank``: the rank the first
    copy of a tensor is read from, for the message."""

    located: Mapping[tuple[str, StoredChunk], ChunkLayout] = field(default_factory=dict)
    copies: Mapping[str, tuple[Copy, ...]] = field(default_factory=dict)
    first_rank: Mapping[str, int] = field(default_factory=dict)

    def read_into(self, key: str, out: torch.Tensor, *, start: int = 0) -> None:
        """Inside a :class:`reshard.io.direct.Batch`, the bytes of a tensor without copies may still be arriving
        when this returns; a tensor with copies is read and compared before it returns."""
        copies = self.copies.get(key, ())
        if not copies:
            super().read_into(key, out, start=start)
            return
        import torch

        from reshard.geometry.tensors import bitwise_equal

        with Batch():  # the bytes must be there to be compared
            super().read_into(key, out, start=start)
        other = torch.empty(out.shape, dtype=out.dtype)
        for copy in copies:
            with Batch():
                super().read_into(copy.key, other, start=start)
            if not bitwise_equal(out, other):
                view = self.views[copy.key]
                raise DivergentReplicaError(
                    f"a replicated tensor differs between rank {self.first_rank.get(key, 0)} (blake3 {_digest(out)}) "
                    f"and rank {copy.rank} (blake3 {_digest(other)}), which both saved it",
                    path=view.tensor.chunks[0].file,
                    tensor=key,
                    hint="the ranks drifted apart: restore the files as they were written",
                )

    def describe(self, key: str) -> str:
        copies = self.copies.get(key, ())
        if not copies:
            return super().describe(key)
        ranks = ", ".join(str(copy.rank) for copy in copies)
        whose = f"the copy of rank {ranks}" if len(copies) == 1 else f"the copies of ranks {ranks}"
        return f"{super().describe(key)}, compared with {whose}"

    def _layout(self, tensor: StoredTensor, chunk: StoredChunk) -> ChunkLayout:
        return self.located[tensor.name, chunk]


def _digest(tensor: torch.Tensor) -> str:
    """The BLAKE3 of a tensor's bytes, short (enough to tell two copies apart in a message)."""
    import blake3
    import torch

    return blake3.blake3(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
