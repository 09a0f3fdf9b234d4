"""Lazy readers for the two tensor file formats: safetensors and torch pickles.

A reader is opened once per file from its header alone (names, shapes, dtypes); tensor bytes are
read only when asked (:meth:`FileReader.get`, :meth:`~FileReader.read_into`): at their file offsets for safetensors,
through a memory-mapped ``torch.load`` for torch files.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import pickle
import re
import struct
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from reshard.dtypes import TensorHeader
from reshard.errors import CorruptFileError, UnsafePickleError
from reshard.formats.safetensors.header import read_header
from reshard.formats.safetensors.writer import CHUNK_BYTES
from reshard.formats.torch_zip.checks import check_torch_file
from reshard.io.direct import Batch, DirectSource
from reshard.io.scratch import scratch
from reshard.io.vectored import file_mappings, mapped_offset, release_mapped, row_views

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

Shape = tuple[int, ...]
# Where frameworks nest the state dict inside a torch checkpoint, in the order we look.
STATE_DICT_KEYS = ("state_dict", "module", "model")
# Types that frameworks pickle next to the weights and that are safe to rebuild (layouts add their own).
SAFE_GLOBALS: tuple[Any, ...] = (io.BytesIO,)
DTENSOR_HINT = "point reshard at the folder of every rank's file (a verl actor folder), which reads them together"
# A DeviceMesh unpickled outside its run logs, on stderr, that it finds no process group: nothing reshard needs.
DEVICE_MESH_LOGGER = "torch.distributed.device_mesh"


class FileReader:
    """One open tensor file: ``headers`` maps the key inside the file to its :class:`TensorHeader`."""

    path: Path
    headers: dict[str, TensorHeader]
    extras: dict[str, Any]
    notes: list[str]

    def get(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def read_into(self, key: str, out: torch.Tensor, *, start: int = 0) -> None:
        """Fill ``out`` with bytes ``[start, start + out.nbytes)`` of tensor ``key`` (in C order).

        ``out`` is contiguous, or (with ``start`` 0) a strided view of the tensor's shape, such as its
        column block in a gathered tensor. Readers that can read from the file into ``out`` override this.
        """
        if out.numel() == 0:
            return
        source = self.get(key)
        end = start + out.numel() * out.element_size()
        if out.is_contiguous():
            _flat_bytes(out).copy_(_flat_bytes(source)[start:end])
        elif start == 0 and out.shape == source.shape:
            out.copy_(source)
        else:
            raise ValueError(f"{self.path.name}: {key}: cannot read part of a tensor into a strided buffer")
        if end == source.numel() * source.element_size():  # read to its end: let go of mapped file pages
            if getattr(self, "_mapped", None) is None:
                self._mapped = file_mappings(self.path)
            release_mapped(source, self._mapped)

    def read_bytes(self, key: str, view: memoryview, *, start: int = 0) -> None:
        """Bytes ``[start, start + len(view))`` of tensor ``key`` (in C order) into ``view``, without torch; only
        readers that give the key a :meth:`position` read it so."""
        raise NotImplementedError(f"{type(self).__name__} reads {key} only through torch")

    def describe(self, key: str) -> str | None:
        """How tensor ``key`` is stored, when it is not simply a tensor of the file (``inspect`` shows it)."""
        return None

    def position(self, key: str) -> int | None:
        """The file offset of tensor ``key``'s first byte, when it is read from the file directly."""
        return None

    def prefetch(self, key: str) -> None:
        """Ask the OS to start reading tensor ``key`` in the background (a hint; may do nothing)."""

    def evict(self, key: str) -> None:
        """Tell the OS tensor ``key``'s bytes will not be read again (a hint; may do nothing)."""


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-d uint8 view of a tensor's bytes (a contiguous copy first if it is not contiguous)."""
    import torch

    return tensor.contiguous().reshape(-1).view(torch.uint8)


class ReadIntoReader(FileReader):
    """A reader whose :meth:`read_into` is the real read (byte ranges into the caller's buffer): :meth:`get` is that
    read into a fresh tensor, so the two paths cannot disagree."""

    def get(self, key: str) -> torch.Tensor:
        import torch

        header = self.headers[key]
        out = torch.empty(header.shape, dtype=header.dtype)
        with Batch():
            self.read_into(key, out)
        return out


@dataclass
class DirectReader(FileReader):
    """A reader of tensors stored whole and in C order at known file offsets (``_offsets``).

    :meth:`read_into` reads into the caller's buffer with ``O_DIRECT`` through small staging blocks
    (:class:`~reshard.io.direct.DirectSource`; ``preadv`` through the page cache where the file system
    refuses it), and never maps the file: pages of a memory-mapped file count as resident for as long
    as the mapping lives, and each first touch of one is a synchronous 4 KB fault, while direct reads
    keep 8 MB blocks in flight. A key without an offset is read by :meth:`FileReader.read_into`.
    """

    _offsets: dict[str, int] = field(init=False, repr=False, default_factory=dict)
    _source: DirectSource | None = field(init=False, default=None, repr=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock, repr=False)  # the first open

    def position(self, key: str) -> int | None:
        return self._offsets.get(key)

    def read_into(self, key: str, out: torch.Tensor, *, start: int = 0) -> None:
        """Inside a :class:`reshard.io.direct.Batch`, the bytes may still be arriving when this returns."""
        if key not in self._offsets:
            super().read_into(key, out, start=start)
            return
        if out.numel() == 0:
            return
        if start + out.numel() * out.element_size() > self.headers[key].nbytes:
            raise ValueError(f"{self.path.name}: {key}: read_into past the end of the tensor")
        views = row_views(out)
        if views is None:
            self._read_in_blocks(key, out, start)
            return
        self._read_views(key, views, start)

    def read_bytes(self, key: str, view: memoryview, *, start: int = 0) -> None:
        """Bytes ``[start, start + len(view))`` of tensor ``key`` into ``view``, straight from the file; for a key
        with a :meth:`position`. Torch-free: the byte stream reads with it (:mod:`reshard.engine.move.stream`)."""
        if start + len(view) > self.headers[key].nbytes:
            raise ValueError(f"{self.path.name}: {key}: read past the end of the tensor")
        self._read_views(key, [view], start)

    def _read_views(self, key: str, views: list[memoryview], start: int) -> None:
        def error(why: str) -> CorruptFileError:
            return CorruptFileError(f"cannot read tensor: {why}", path=self.path, tensor=key)

        try:
            self._file().read(views, self._offsets[key] + start, error=error)
        except OSError as err:
            raise error(str(err)) from err

    def _read_in_blocks(self, key: str, out: torch.Tensor, start: int) -> None:
        """Short strided rows (a column block of a gathered tensor): blocks of rows are read contiguously into
        this thread's scratch buffer and copied into place by torch, one copy per block of at most
        ``CHUNK_BYTES`` rather than one Python call per row (row-parallel weights have hundreds of thousands of
        rows, and the threads queue for the GIL between the calls)."""
        row = out[0].numel() * out.element_size()
        step = max(1, CHUNK_BYTES // row)
        for first in range(0, len(out), step):
            part = out.narrow(0, first, min(step, len(out) - first))
            at = start + first * row
            with scratch(part, phase=self._offsets[key] + at) as block:  # on the file's phase: read in place
                with Batch():
                    self.read_into(key, block, start=at)
                part.copy_(block)

    def prefetch(self, key: str) -> None:
        self._advise(key, "POSIX_FADV_WILLNEED", "no read-ahead")

    def evict(self, key: str) -> None:
        self._advise(key, "POSIX_FADV_DONTNEED", "cannot drop cached pages")

    def _advise(self, key: str, advice: str, failure: str) -> None:
        """A page-cache hint over one tensor's bytes (direct reads bypass the cache and skip it); only a
        hint, so a failure is logged, not raised."""
        if key not in self._offsets:
            return
        try:
            self._file().advise(self._offsets[key], self.headers[key].nbytes, advice)
        except OSError as err:
            logger.debug("%s: %s for %s: %s", self.path, failure, key, err)

    def _file(self) -> DirectSource:
        with self._lock:
            if self._source is None:
                self._source = DirectSource(self.path)
            return self._source


@dataclass
class SafetensorsReader(ReadIntoReader, DirectReader):
    """A ``.safetensors`` file; the header is parsed and checked against the file size up front, and tensors
    are read around the page cache (:class:`DirectReader`), :meth:`get` too: through ``safe_open`` the file would
    be mapped, and every page read stays resident for as long as the handle lives (``verify``'s rank check then
    peaked at the files' size; measured: docs/performance.md)."""

    path: Path
    headers: dict[str, TensorHeader] = field(init=False)
    metadata: dict[str, str] = field(init=False)
    extras: dict[str, Any] = field(init=False, default_factory=dict)
    notes: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.headers, self.metadata, self._offsets = _parse_safetensors_header(self.path)


def read_safetensors_header(path: Path) -> tuple[dict[str, TensorHeader], dict[str, str]]:
    """Parse a safetensors header, checked as the library checks it (:mod:`reshard.formats.safetensors.header`).

    Raises:
        CorruptFileError: truncated file, unreadable header, or offsets that do not fit.
    """
    headers, metadata, _ = _parse_safetensors_header(path)
    return headers, metadata


def _parse_safetensors_header(path: Path) -> tuple[dict[str, TensorHeader], dict[str, str], dict[str, int]]:
    """:func:`read_safetensors_header` plus, per tensor, the file offset where its bytes start."""
    entries, metadata = read_header(path)
    headers = {name: TensorHeader(entry.shape, entry.code) for name, entry in entries.items()}
    return headers, metadata, {name: entry.start for name, entry in entries.items()}


@dataclass
class TorchReader(DirectReader):
    """A ``torch.save`` file, opened with ``torch.load(mmap=True, weights_only=True)``.

    The load only unpickles the structure; a contiguous tensor's bytes are then read from its place in the
    file around the page cache (:class:`DirectReader`: the mapping tells where its storage's record lies),
    others (strided views, a legacy file read whole) are copied from the loaded tensor.

    The state dict is found at the top level or under ``state_dict`` / ``module`` / ``model``; nested
    dicts are flattened with dots (Megatron's legacy ``language_model.embedding...`` nesting). Non-tensor
    entries of the state dict (``_extra_state`` blobs) land in ``extras``; other top-level keys
    (``args``, ``iteration``, optimizer state) in ``top_level``.
    """

    path: Path
    trust_pickle: bool = False
    headers: dict[str, TensorHeader] = field(init=False)
    extras: dict[str, Any] = field(init=False, default_factory=dict)
    top_level: dict[str, Any] = field(init=False, default_factory=dict)
    state_dict_key: str | None = field(init=False, default=None)
    notes: list[str] = field(init=False, default_factory=list)
    _tensors: dict[str, torch.Tensor] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        import torch

        obj = load_torch_file(self.path, trust_pickle=self.trust_pickle, notes=self.notes)
        state = obj
        if isinstance(obj, Mapping):
            for key in STATE_DICT_KEYS:
                if isinstance(obj.get(key), Mapping):
                    self.state_dict_key = key
                    state = obj[key]
                    self.top_level = {k: v for k, v in obj.items() if k != key}
                    break
        if not isinstance(state, Mapping):
            raise CorruptFileError(f"holds a {type(obj).__name__}, not a state dict", path=self.path)
        for name, value in _flatten(state):
            if isinstance(value, torch.Tensor):
                _refuse_subclass(value, path=self.path, key=name)
                self._tensors[name] = value
            else:
                self.extras[name] = value
        self.headers = {k: torch_header(t, path=self.path, key=k) for k, t in self._tensors.items()}
        self._offsets = offsets_in_file(self.path, self._tensors)

    def get(self, key: str) -> torch.Tensor:
        return self._tensors[key]


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Logger ``name`` silenced for the block."""
    logger = logging.getLogger(name)
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled


def _refuse_subclass(tensor: torch.Tensor, *, path: Path, key: str) -> None:
    """A tensor subclass (a DTensor, a quantized wrapper), which ``--trust-pickle`` unpickles, is not one tensor
    of bytes: refused by name. A DTensor is one rank's piece, read with every rank's by the layout of its folder."""
    import torch

    kind = type(tensor)
    if kind in (torch.Tensor, torch.nn.Parameter):
        return
    name = f"{kind.__module__}.{kind.__qualname__}"
    dtensor = name.startswith("torch.distributed.tensor") or kind.__qualname__ == "DTensor"
    raise CorruptFileError(
        f"holds a {name} (a tensor subclass), not a plain tensor",
        path=path,
        tensor=key,
        hint=DTENSOR_HINT if dtensor else "save its plain tensors (or a safetensors file) to read it",
    )


def offsets_in_file(path: Path, tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Where the bytes of each contiguous tensor memory-mapped from ``path`` start in the file (a tensor that is
    strided, or not mapped from it, has none)."""
    mappings = file_mappings(path)
    offsets = {}
    for key, tensor in tensors.items():
        offset = mapped_offset(tensor, mappings) if tensor.is_contiguous() else None
        if offset is not None:
            offsets[key] = offset
    return offsets


def torch_header(tensor: torch.Tensor, *, path: Path, key: str) -> TensorHeader:
    """The header of a tensor loaded from a torch file; an error for dtypes safetensors cannot hold."""
    try:
        return TensorHeader.of(tensor.shape, tensor.dtype)
    except KeyError:
        raise CorruptFileError(
            f"dtype {tensor.dtype} is not supported (safetensors has no code for it)", path=path, tensor=key
        ) from None


def _flatten(state: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    import torch

    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and not isinstance(value, torch.Tensor):
            yield from _flatten(value, f"{name}.")
        else:
            yield name, value


def load_torch_file(
    path: Path, *, trust_pickle: bool, notes: list[str], allowed: Sequence[Any] = (), data: bytes | None = None
) -> Any:
    """``torch.load`` as safely and lazily as the file allows.

    Zip-format files are memory-mapped with ``weights_only=True`` and the :data:`SAFE_GLOBALS`
    allow-list (plus numpy's RNG-state arrays and a layout's own ``allowed`` types); legacy (non-zip)
    files are read whole, with a note that they cannot be streamed. With ``trust_pickle`` the file is
    unpickled fully; stand-ins given in ``allowed`` as ``(callable, "module.Name")`` still serve when
    that module is not installed. ``data``: the archive is these bytes (an entry stored inside ``path``, which
    errors name), loaded from memory under the same rules.

    Raises:
        UnsafePickleError: the file pickles a type outside the allow-list and ``trust_pickle`` is off.
        CorruptFileError: the file is not a readable torch file.
    """
    import torch

    streamable = data is None and check_torch_file(path) is not None
    if data is None and not streamable:
        notes.append(f"{path.name}: legacy (non-zip) torch file, read whole into memory: cannot be streamed")
    source = path if data is None else io.BytesIO(data)
    try:
        with warnings.catch_warnings():  # torch warns on stderr about protocols it may not read: the error says it
            warnings.simplefilter("ignore", UserWarning)
            if trust_pickle:
                with _quiet(DEVICE_MESH_LOGGER):
                    return torch.load(
                        source,
                        map_location="cpu",
                        mmap=streamable,
                        weights_only=False,
                        pickle_module=_trusting(allowed),
                    )
            with torch.serialization.safe_globals([*SAFE_GLOBALS, *_rng_state_globals(), *allowed]):
                return torch.load(source, map_location="cpu", mmap=streamable, weights_only=True)
    except pickle.UnpicklingError as err:
        message = str(err)
        if "to load DTensors" in message:  # torch's refusal of a DTensor when torch.distributed.tensor is not loaded
            raise UnsafePickleError(
                "holds DTensors: one rank's pieces of its tensors, not tensors of their own",
                path=path,
                hint=DTENSOR_HINT,
            ) from err
        if "Unsupported global" in message or "weights_only" in message.lower():
            raise UnsafePickleError(
                _refusal(message),
                path=path,
                hint="pass --trust-pickle to unpickle it fully, only if you trust the file",
            ) from err
        raise CorruptFileError(f"not a readable torch file: {message.splitlines()[0]}", path=path) from err
    except (RecursionError, MemoryError, OverflowError) as err:
        raise CorruptFileError(f"not a readable torch file: {type(err).__name__}", path=path) from err
    except (ImportError, AttributeError) as err:  # --trust-pickle, and the pickled class is not importable here
        raise CorruptFileError(
            f"cannot unpickle: {err}", path=path, hint="install the package that defines it to load this file"
        ) from err
    except (OSError, RuntimeError, EOFError, ValueError, KeyError, IndexError, TypeError, struct.error) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CorruptFileError(f"not a readable torch file: {first}", path=path) from err


@functools.cache
def _rng_state_globals() -> tuple[Any, ...]:
    """The numpy types in ``np.random.get_state()`` (a uint32 array), which DeepSpeed (SAT's trainer) pickles
    as ``np_rng_state`` next to the weights: plain arrays, safe to rebuild under ``weights_only``."""
    try:
        import numpy as np

        try:
            from numpy._core.multiarray import _reconstruct
        except ImportError:  # numpy < 2
            # The same function under numpy 1's module name (numpy 2's stubs declare it once).
            from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    except ImportError:
        return ()
    uint32 = getattr(getattr(np, "dtypes", None), "UInt32DType", None)
    return (np.ndarray, np.dtype, _reconstruct) + ((uint32,) if uint32 is not None else ())


def _trusting(allowed: Sequence[Any]) -> ModuleType:
    """A pickle module for full unpickling whose classes fall back to the stand-ins in ``allowed``."""
    stand_ins = {name: obj for obj, name in (a for a in allowed if isinstance(a, tuple))}

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            try:
                return super().find_class(module, name)
            except (ImportError, AttributeError):
                if f"{module}.{name}" in stand_ins:
                    return stand_ins[f"{module}.{name}"]
                raise

    trusting = ModuleType("reshard_trusting_pickle")
    trusting.__dict__.update({k: v for k, v in vars(pickle).items() if not k.startswith("__")})
    trusting.__dict__["Unpickler"] = Unpickler
    return trusting


def _refusal(message: str) -> str:
    """What torch's weights-only unpickler refused: a global, from either of its messages ("Unsupported global:
    GLOBAL x was not an allowed global", "Trying to load unsupported GLOBAL x whose module y is blocked"), or
    the instruction it stopped at."""
    found = re.search(r"GLOBAL (\S+) (?:was not|whose module)", message)
    if found:
        return f"pickles {found.group(1)}, which is not on reshard's allow-list"
    reason = re.search(r"WeightsUnpickler error:\s*(.+)", message)
    return f"refused by the weights-only unpickler ({reason.group(1).strip() if reason else 'not a plain state dict'})"


def open_tensor_file(path: Path, *, trust_pickle: bool = False) -> FileReader:
    """A reader for ``path`` chosen by its extension (``.safetensors``, else a torch file)."""
    if path.suffix == ".safetensors":
        return SafetensorsReader(path)
    return TorchReader(path, trust_pickle=trust_pickle)
