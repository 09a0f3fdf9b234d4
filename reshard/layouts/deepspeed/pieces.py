"""A reader of tensors stored as byte ranges spread over several files: a parameter that ZeRO cut into the flat
fp32 partitions of every data-parallel rank, read back as one tensor without loading any partition whole.

A key is an ordered list of :class:`Piece` (file, byte position, length); the tensor's bytes are their
concatenation in C order. Reading copies, from each piece that overlaps the asked range, only the overlap,
straight into the caller's buffer (:class:`~reshard.io.direct.DirectSource`), so memory stays the output tensor.
A key listed in ``widened`` is stored in a narrower float (a bf16 frozen parameter beside fp32 masters) and read
as its header's dtype: the stored elements of the asked range go through one temporary of their own size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reshard.dtypes import dtype_from_code, itemsize_of
from reshard.errors import CorruptFileError
from reshard.formats.readers import ReadIntoReader, TensorHeader
from reshard.io.direct import Batch, OpenSources

if TYPE_CHECKING:
    import torch

OPEN_FILES = 64  # partition files kept open at once


@dataclass(frozen=True)
class Piece:
    """``length`` bytes of ``file`` from ``position`` on."""

    file: Path
    position: int
    length: int


@dataclass
class PiecesReader(ReadIntoReader):
    """Tensors each the concatenation of its pieces' bytes; ``path`` is the checkpoint folder."""

    path: Path
    pieces: Mapping[str, tuple[Piece, ...]]
    headers: dict[str, TensorHeader]
    described: Mapping[str, str] = field(default_factory=dict)
    widened: Mapping[str, str] = field(default_factory=dict)  # key -> the code it is stored in
    extras: dict[str, Any] = field(init=False, default_factory=dict)
    notes: list[str] = field(init=False, default_factory=list)
    _files: OpenSources = field(init=False, default_factory=lambda: OpenSources(OPEN_FILES), repr=False)

    def __post_init__(self) -> None:
        for key, header in self.headers.items():
            stored = sum(piece.length for piece in self.pieces[key])
            wanted = header.nbytes // itemsize_of(header.code) * itemsize_of(self.widened.get(key, header.code))
            if stored != wanted:
                raise ValueError(f"{key}: pieces of {stored} bytes for a tensor stored in {wanted}")

    def read_into(self, key: str, out: torch.Tensor, *, start: int = 0) -> None:
        """Inside a :class:`reshard.io.direct.Batch`, the bytes may still be arriving when this returns."""
        import torch

        if out.numel() == 0:
            return
        if not out.is_contiguous():
            if start or tuple(out.shape) != self.headers[key].shape:
                raise ValueError(f"{self.path.name}: {key}: cannot read part of a tensor into a strided buffer")
            out.copy_(self.get(key))
            return
        wanted = out.numel() * out.element_size()
        if start + wanted > self.headers[key].nbytes:
            raise ValueError(f"{self.path.name}: {key}: read_into past the end of the tensor")
        code = self.widened.get(key)
        if code is None:
            self.read_bytes(key, out.reshape(-1).view(torch.uint8).numpy().data, start=start)
            return
        if start % out.element_size():
            raise ValueError(f"{self.path.name}: {key}: read_into at byte {start} of a widened tensor")
        narrow = torch.empty(out.numel(), dtype=dtype_from_code(code))
        with Batch():
            first = start // out.element_size() * narrow.element_size()
            self._read_stored(key, narrow.view(torch.uint8).numpy().data, first)
        out.reshape(-1).copy_(narrow)

    def read_bytes(self, key: str, view: memoryview, *, start: int = 0) -> None:
        """Bytes ``[start, start + len(view))`` of ``key`` into ``view``, without torch: for a key stored as it is
        read (one with a :meth:`position`, not a widened one)."""
        if key in self.widened:
            raise ValueError(f"{self.path.name}: {key}: a widened tensor is read through torch")
        if start + len(view) > self.headers[key].nbytes:
            raise ValueError(f"{self.path.name}: {key}: read past the end of the tensor")
        self._read_stored(key, view, start)

    def _read_stored(self, key: str, buffer: memoryview, start: int) -> None:
        """Stored bytes ``[start, start + len(buffer))`` of ``key`` into ``buffer``."""
        begin = 0  # the stored byte the current piece starts at
        for piece in self.pieces[key]:
            low, high = max(start, begin), min(start + len(buffer), begin + piece.length)
            if low < high:

                def error(why: str, piece: Piece = piece) -> CorruptFileError:
                    return CorruptFileError(f"cannot read its partition: {why}", path=piece.file, tensor=key)

                view = buffer[low - start : high - start]
                try:
                    self._files.get(piece.file).read([view], piece.position + low - begin, error=error)
                except OSError as err:
                    raise error(str(err)) from err
            begin += piece.length

    def position(self, key: str) -> int | None:
        """Where the first piece starts: the engine puts its buffer on that byte's 4 KB phase, so that piece (the
        whole tensor under ZeRO-1/2, unless it straddles two ranks) is read straight into it, not through staging
        and a copy. None for a widened key (read through a temporary)."""
        pieces = self.pieces[key]
        return pieces[0].position if pieces and key not in self.widened else None

    def describe(self, key: str) -> str | None:
        return self.described.get(key)
