"""A lazy reference to one rank's slice of one tensor: what every layout hands the pipeline, read only when asked."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from reshard.dtypes import TensorHeader
from reshard.formats.readers import FileReader

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TensorRef:
    """One rank's slice of one tensor, known from headers; bytes come only from :meth:`read`."""

    name: str
    rank: int
    reader: FileReader = field(repr=False, compare=False)
    key: str
    header: TensorHeader

    @property
    def file(self) -> Path:
        return self.reader.path

    @property
    def shape(self) -> tuple[int, ...]:
        return self.header.shape

    @property
    def code(self) -> str:
        """The safetensors dtype code, e.g. ``"BF16"``."""
        return self.header.code

    @property
    def dtype(self) -> torch.dtype:
        return self.header.dtype

    def read(self) -> torch.Tensor:
        return self.reader.get(self.key)

    def read_into(self, out: torch.Tensor, *, start: int = 0) -> None:
        """Fill contiguous ``out`` with this slice's bytes from byte ``start`` on (C order), without a copy
        in between where the reader can."""
        self.reader.read_into(self.key, out, start=start)

    def read_bytes(self, view: memoryview, *, start: int = 0) -> None:
        """Fill ``view`` with this slice's bytes from byte ``start`` on (C order), without torch; only for a slice
        with a :attr:`position` (read from its file directly)."""
        self.reader.read_bytes(self.key, view, start=start)

    def describe(self) -> str | None:
        """How this slice is stored, when it is not one tensor of one file (a box of a global tensor)."""
        return self.reader.describe(self.key)

    @property
    def position(self) -> int | None:
        """The file offset of this slice's first byte, when it is read from the file directly."""
        return self.reader.position(self.key)

    def prefetch(self) -> None:
        """Let the OS start reading this slice from disk in the background."""
        self.reader.prefetch(self.key)

    def evict(self) -> None:
        """Let the OS drop this slice's pages from its cache (once read, a conversion needs them no more)."""
        self.reader.evict(self.key)
