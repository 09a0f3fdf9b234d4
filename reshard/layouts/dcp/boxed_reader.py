"""A reader of "boxed" tensors: global tensors stored as chunk boxes, read one box of the global tensor at a time.

A key of a :class:`BoxedReader` stands for a box of a global tensor: the whole tensor (DCP), or one layer
of a stacked ``[L, ...]`` tensor (Megatron-Core ``torch_dist``), with the unit dims it drops. Reading
it copies, from every stored chunk that overlaps it, only the overlap, and only that overlap's bytes
are read from disk: straight into the caller's buffer where the overlap is one run of the chunk and
the buffer takes it as rows of at least 1 KB, else through a temporary no larger than the chunk.
So memory stays about the output tensor plus one chunk, whatever the size of the checkpoint.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reshard.dtypes import itemsize_of
from reshard.errors import CorruptFileError
from reshard.formats.boxes import Box, Shape, c_strides, contiguous_pieces, runs
from reshard.formats.chunks import ChunkLayout, torch_archive_layout
from reshard.formats.dcp_metadata.read import StoredChunk, StoredTensor
from reshard.formats.readers import ReadIntoReader, TensorHeader
from reshard.io.direct import Batch, OpenSources
from reshard.io.vectored import row_views

if TYPE_CHECKING:
    import torch

# Data files kept open at once (a checkpoint of thousands of ranks has more files than descriptors).
OPEN_FILES = 64


@dataclass(frozen=True)
class BoxView:
    """The box ``box`` of the global ``tensor``, seen with ``shape`` (the box's sizes, unit dims dropped or not)."""

    tensor: StoredTensor
    box: Box
    shape: Shape

    @classmethod
    def whole(cls, tensor: StoredTensor) -> BoxView:
        return cls(tensor, Box.whole(tensor.shape), tensor.shape)


@dataclass(frozen=True)
class StackedView:
    """Views of equal trailing shape seen as one tensor, one after the other along dim 0 (Megatron-Core's
    ``_w`` / ``_v`` halves of a SwiGLU fc1 seen as the fused ``[gate; up]``)."""

    parts: tuple[BoxView, ...]

    @property
    def tensor(self) -> StoredTensor:
        return self.parts[0].tensor

    @property
    def shape(self) -> Shape:
        first = self.parts[0].shape
        return (sum(p.shape[0] for p in self.parts), *first[1:])


def _code(tensor: StoredTensor) -> str:
    """The dtype code of a tensor a :class:`BoxedReader` holds (it refuses the others when it is made)."""
    code = tensor.code
    if code is None:
        raise ValueError(f"{tensor.name}: dtype {tensor.dtype} has no safetensors code")
    return code


@dataclass
class BoxedReader(ReadIntoReader):
    """Boxes of global tensors stored as chunks (see the module docstring); ``path`` is the checkpoint folder."""

    path: Path
    views: Mapping[str, BoxView | StackedView]
    headers: dict[str, TensorHeader] = field(init=False)
    extras: dict[str, Any] = field(init=False, default_factory=dict)
    notes: list[str] = field(init=False, default_factory=list)
    _layouts: dict[StoredChunk, ChunkLayout] = field(init=False, default_factory=dict, repr=False)
    _files: OpenSources = field(init=False, default_factory=lambda: OpenSources(OPEN_FILES), repr=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.headers = {}
        for key, view in self.views.items():
            parts = view.parts if isinstance(view, StackedView) else (view,)
            for part in parts:
                if part.tensor.code is None or part.box.numel != TensorHeader(part.shape, "U8").nbytes:
                    raise ValueError(f"{key}: a view of {part.box.sizes} cannot be seen as {part.shape}")
            if len({(p.tensor.code, p.shape[1:]) for p in parts}) > 1:
                raise ValueError(f"{key}: parts of different dtypes or trailing shapes cannot be stacked")
            self.headers[key] = TensorHeader(view.shape, _code(view.tensor))

    def read_into(self, key: str, out: torch.Tensor, *, start: int = 0) -> None:
        """Inside a :class:`reshard.io.direct.Batch`, the bytes may still be arriving when this returns."""
        view = self.views[key]
        if out.numel() == 0:
            return
        if isinstance(view, StackedView):
            self._read_stacked(key, view, out, start)
            return
        itemsize = out.element_size()
        if itemsize != itemsize_of(_code(view.tensor)) or start % itemsize:
            raise ValueError(f"{self.path.name}: {key}: read_into a {out.dtype} buffer at byte {start}")
        if out.is_contiguous():
            if start // itemsize + out.numel() > view.box.numel:
                raise ValueError(f"{self.path.name}: {key}: read_into past the end of the tensor")
            self.read_into_view(view, out, start=start)
        elif start == 0 and tuple(out.shape) == view.shape:
            self._fill(view.tensor, view.box, out.view(view.box.sizes))
        else:
            raise ValueError(f"{self.path.name}: {key}: cannot read part of a tensor into a strided buffer")

    def _read_stacked(self, key: str, view: StackedView, out: torch.Tensor, start: int) -> None:
        """The parts' bytes in order: each part's share of ``[start, start + out.nbytes)``."""
        if not out.is_contiguous():
            if start or tuple(out.shape) != view.shape:
                raise ValueError(f"{self.path.name}: {key}: cannot read part of a tensor into a strided buffer")
            offset = 0
            for part in view.parts:
                self._fill(part.tensor, part.box, out.narrow(0, offset, part.shape[0]).view(part.box.sizes))
                offset += part.shape[0]
            return
        flat, itemsize = out.reshape(-1), out.element_size()
        first, last, begin = start // itemsize, start // itemsize + out.numel(), 0
        for part in view.parts:
            low, high = max(first, begin), min(last, begin + part.box.numel)
            if low < high:
                piece = flat[low - first : high - first]
                self.read_into_view(part, piece, start=(low - begin) * itemsize)
            begin += part.box.numel

    def read_into_view(self, view: BoxView, out: torch.Tensor, *, start: int = 0) -> None:
        """:meth:`read_into` of one box view (contiguous ``out`` from byte ``start`` of the view)."""
        itemsize = out.element_size()
        first = start // itemsize
        flat, done = out.reshape(-1), 0
        for piece in contiguous_pieces(view.box.sizes, first, first + out.numel()):
            region = Box(tuple(a + b for a, b in zip(view.box.offsets, piece.offsets, strict=True)), piece.sizes)
            self._fill(view.tensor, region, flat[done : done + piece.numel].view(piece.sizes))
            done += piece.numel

    def describe(self, key: str) -> str:
        """The stored tensor(s) and the box: ``decoder.layers.linear_qkv.weight[3] of [4, 96, 64], 2 chunks``."""
        view = self.views[key]
        parts = view.parts if isinstance(view, StackedView) else (view,)
        return " + ".join(_describe(part) for part in parts)

    def prefetch(self, key: str) -> None:
        self._advise(key, "POSIX_FADV_WILLNEED")

    def evict(self, key: str) -> None:
        self._advise(key, "POSIX_FADV_DONTNEED")

    def _advise(self, key: str, advice: str) -> None:
        """A page-cache hint over the chunks of a whole-tensor view (a sub-box shares its chunks with others)."""
        view = self.views[key]
        parts = view.parts if isinstance(view, StackedView) else (view,)
        if any(part.box != Box.whole(part.tensor.shape) for part in parts):
            return
        for chunk in (chunk for part in parts for chunk in part.tensor.chunks):
            try:
                self._files.get(chunk.file).advise(chunk.position, chunk.length, advice)
            except OSError:
                return

    def _fill(self, tensor: StoredTensor, region: Box, dest: torch.Tensor) -> None:
        """Copy ``region`` of the global tensor into ``dest`` (shaped like the region) from the chunks over it."""
        for chunk in tensor.chunks:
            common = chunk.box.intersect(region)
            if common is None:
                continue
            place = common.within(region)
            part = dest[tuple(slice(o, o + s) for o, s in zip(place.offsets, place.sizes, strict=True))]
            self._copy(tensor, chunk, common.within(chunk.box), part)

    def _copy(self, tensor: StoredTensor, chunk: StoredChunk, inner: Box, dest: torch.Tensor) -> None:
        """Copy ``inner`` (in the chunk's coordinates) of one chunk into ``dest``."""
        import torch

        layout = self._layout(tensor, chunk)
        source = self._files.get(chunk.file)
        itemsize = dest.element_size()

        def error(why: str) -> CorruptFileError:
            return CorruptFileError(f"cannot read chunk {chunk.box}: {why}", path=chunk.file, tensor=tensor.name)

        def at(element: int) -> int:
            return layout.data + (layout.storage_offset + element) * itemsize

        sizes = chunk.box.sizes
        if _c_ordered(sizes, layout.strides):
            spans = list(runs(sizes, inner))
            views = row_views(dest) if len(spans) == 1 else None
            if views is not None:  # one run of the chunk, taken by the buffer's rows as they are
                source.read(views, at(spans[0][0]), error=error)
                return
            low, high = spans[0][0], spans[-1][0] + spans[-1][1]
            strides, origin = (
                c_strides(sizes),
                sum(o * s for o, s in zip(inner.offsets, c_strides(sizes), strict=True)),
            )
        else:  # strided on disk: read the chunk's whole storage span
            low = 0
            high = 1 + sum((s - 1) * st for s, st in zip(sizes, layout.strides, strict=True))
            strides = layout.strides
            origin = sum(o * s for o, s in zip(inner.offsets, strides, strict=True))
        temporary = torch.empty(high - low, dtype=dest.dtype)
        with Batch():
            source.read([temporary.view(torch.uint8).numpy().data], at(low), error=error)
        dest.copy_(temporary.as_strided(inner.sizes, strides, origin - low))

    def _layout(self, tensor: StoredTensor, chunk: StoredChunk) -> ChunkLayout:
        with self._lock:
            layout = self._layouts.get(chunk)
        if layout is not None:
            return layout
        if chunk.data is not None:  # a safetensors blob: C order from its data position
            layout = ChunkLayout(chunk.data, 0, c_strides(chunk.box.sizes))
        else:
            layout = torch_archive_layout(
                chunk.file, chunk.position, chunk.length, code=_code(tensor), shape=chunk.box.sizes, tensor=tensor.name
            )
        with self._lock:
            self._layouts[chunk] = layout
        return layout


def _describe(view: BoxView) -> str:
    tensor, box = view.tensor, view.box
    fixed = len(tensor.shape) - len(view.shape)  # leading stacked axes (layers, experts) fixed by the view
    index = f"[{', '.join(str(o) for o in box.offsets[:fixed])}]" if fixed else ""
    chunks = sum(1 for chunk in tensor.chunks if chunk.box.intersect(box) is not None)
    return f"{tensor.name}{index} of {list(tensor.shape)}, {chunks} chunk{'s' if chunks != 1 else ''}"


def _c_ordered(sizes: Shape, strides: Shape) -> bool:
    """True when a tensor of ``sizes`` and ``strides`` lies in C order (strides of unit dims do not matter)."""
    return all(size == 1 or stride == c for size, stride, c in zip(sizes, strides, c_strides(sizes), strict=True))
