"""What a conversion does while torch imports: plan, and have the disk read the first tensors.

Importing torch takes 1-2 s of a 2-core machine, longer than reading and planning the headers of a
whole 70B checkpoint, and neither needs it: only moving bytes does (gather buffers, the finite check).
So the import starts first, on a thread, and planning runs meanwhile. Then, until the import is done,
the disk need not idle either: the source slices of the first tensors to convert are read into the
page cache (:meth:`~reshard.layouts.base.TensorRef.warm`), in the order the engine gathers them, and
the engine takes them from there. The page cache holds them, not this process. A checkpoint that only
torch can open (Megatron, SAT: their structure is a pickle) cannot be planned before the import is
done, so its rank files are read from their start instead, in turns (:func:`warm_files`): torch saves
the model's storages first, and the engine reads most of them soon. The threads only import
and read ahead; a failing import is raised again, with its traceback, by the first real ``import torch``,
and a failing read ahead changes nothing (the engine's own read reports the error).
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from reshard.io.direct import warm

if TYPE_CHECKING:
    from reshard.engine.planner import ConversionPlan

logger = logging.getLogger(__name__)

# At most this many source bytes are read ahead: about what a disk reads while torch imports (1-2 s at
# 1-1.5 GB/s), and little enough that the page cache keeps them until the engine comes for them.
WARM_BYTES = 2 << 30

# One read ahead: its size in bytes, the call that makes it, what it reads (for the debug log).
Read = tuple[int, Callable[[], None], str]

# Bytes of each rank file read in its turn by warm_files: the engine gathers a tensor from every rank at once.
FILE_TURN = 64 << 20

_started = threading.Event()
_importing: threading.Thread | None = None


def import_torch_in_background() -> None:
    """Start importing torch, once per process, unless it is already imported."""
    global _importing
    if "torch" in sys.modules or _started.is_set():
        return
    _started.set()
    _importing = threading.Thread(target=_import_torch, name="reshard-import-torch", daemon=True)
    _importing.start()


def warm_first_reads(conversion: ConversionPlan) -> threading.Thread | None:
    """While torch is still importing, read the source slices of the first tensors of ``conversion`` into the
    page cache, in the order the engine gathers them, until the import is done or :data:`WARM_BYTES` are read.
    The thread doing it (None when torch is imported already)."""

    def reads() -> Iterator[Read]:
        for ref in (ref for plan in conversion.tensors for source in plan.sources for ref in source.refs):
            yield ref.header.nbytes, ref.warm, f"{ref.file}: {ref.name}"

    return _reading_ahead(reads)


def warm_files(files: list[Path]) -> threading.Thread | None:
    """While torch is still importing, read ``files`` into the page cache from their start, :data:`FILE_TURN`
    bytes of each in turn, until the import is done or :data:`WARM_BYTES` are read. The thread doing it (None
    when torch is imported already or there are no files)."""

    def reads() -> Iterator[Read]:
        sizes = {file: _size(file) for file in files}
        for start in range(0, max(sizes.values(), default=0), FILE_TURN):
            for file, size in sizes.items():
                if (length := min(FILE_TURN, size - start)) > 0:
                    yield length, functools.partial(warm, file, start, length), str(file)

    return _reading_ahead(reads) if files else None


def _import_torch() -> None:
    try:
        importlib.import_module("torch")
    except ImportError:  # raised again where torch is needed, in the main thread
        pass


def _reading_ahead(reads: Callable[[], Iterable[Read]]) -> threading.Thread | None:
    """Start a thread making the reads ``reads()`` lists, in order, while torch imports and within
    :data:`WARM_BYTES`; None when torch is imported already."""
    importing = _importing
    if importing is None or not importing.is_alive():
        return None
    thread = threading.Thread(target=_read_ahead, args=(reads, importing), name="reshard-warm", daemon=True)
    thread.start()
    return thread


def _read_ahead(reads: Callable[[], Iterable[Read]], importing: threading.Thread) -> None:
    total = 0
    for nbytes, read, what in reads():
        total += nbytes
        if total > WARM_BYTES or not importing.is_alive():
            return
        try:
            read()
        except Exception as err:  # noqa: BLE001 - reading ahead is a hint: the engine's read reports real errors
            logger.debug("%s: not read ahead: %s", what, err)


def _size(file: Path) -> int:
    try:
        return file.stat().st_size
    except OSError:
        return 0
