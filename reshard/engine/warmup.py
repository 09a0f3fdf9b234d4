"""What a conversion does while torch imports: plan, and have the disk read the first tensors.

Importing torch takes 1-2 s of a 2-core machine, longer than reading and planning the headers of a
whole 70B checkpoint, and neither needs it: only moving bytes does (gather buffers, the finite check).
So the import starts first, on a thread, and planning runs meanwhile. Then, until the import is done,
the disk need not idle either: the source bytes of the first tensors to convert are asked into the page
cache (``warm``), up to about what the disk reads in that time, and the engine reads them from there.
The threads only import and hint; a failing import is raised again, with its traceback, by the first
real ``import torch``, and a failing hint changes nothing.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from reshard.engine.planner import ConversionPlan

logger = logging.getLogger(__name__)

# About what a disk reads while torch imports (1-2 s at ~1 GB/s); it waits in the page cache, not in this process.
WARM_BYTES = 1 << 30

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


def warm_first_reads(conversion: ConversionPlan) -> None:
    """While torch is still importing, have the OS read the source slices of the first tensors the engine
    will gather (in plan order, up to :data:`WARM_BYTES`) into the page cache."""
    if _importing is None or not _importing.is_alive():
        return
    refs, total = [], 0
    for ref in (ref for plan in conversion.tensors for source in plan.sources for ref in source.refs):
        total += ref.header.nbytes
        if total > WARM_BYTES:
            break
        refs.append(ref)
    threading.Thread(target=_warm, args=(refs,), name="reshard-warm", daemon=True).start()


def _import_torch() -> None:
    try:
        importlib.import_module("torch")
    except ImportError:  # raised again where torch is needed, in the main thread
        pass


def _warm(refs: list) -> None:
    for ref in refs:
        try:
            ref.warm()
        except Exception as err:  # noqa: BLE001 - a hint: the read itself reports real errors
            logger.debug("%s: %s not warmed: %s", ref.file, ref.name, err)
