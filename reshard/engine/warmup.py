"""Import torch on a background thread while the checkpoint is opened and planned.

Importing torch takes 1-2 s of a 2-core machine, longer than reading and planning the headers of a
whole 70B checkpoint, and neither of those needs it: only moving bytes does (gather buffers, the
finite check). Starting the import first and planning meanwhile takes the larger of the two off
every run instead of their sum. The thread only imports; a failing import is raised again, with its
traceback, by the first real ``import torch``.

The disk is not given the first tensors to read meanwhile: a cold import reads some 1,250 files of torch's,
and a bulk read beside it delays each of them. On the 2-core Intel bench VM a 2 GB read ahead made the
import end 2.9-3.4 s after the start instead of 1.5-1.6 s, and 4 GB conversions 0.8-2.5 s slower end to end
(docs/performance.md; ``git log`` of this file for the code).
"""

from __future__ import annotations

import importlib
import sys
import threading

_started = threading.Event()


def import_torch_in_background() -> None:
    """Start importing torch, once per process, unless it is already imported."""
    if "torch" in sys.modules or _started.is_set():
        return
    _started.set()
    threading.Thread(target=_import_torch, name="reshard-import-torch", daemon=True).start()


def _import_torch() -> None:
    try:
        importlib.import_module("torch")
    except ImportError:  # raised again where torch is needed, in the main thread
        pass
