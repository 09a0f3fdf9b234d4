"""Import torch on a background thread while the checkpoint is opened and planned.

Importing torch takes longer than reading and planning the headers of a whole 70B checkpoint, and
neither of those needs it: only moving bytes does (gather buffers, the
finite check). Starting the import first and planning meanwhile takes the larger of the two off
every run instead of their sum. The thread only imports; a failing import is raised again, with its
traceback, by the first real ``import torch``.

The disk is not given the first tensors to read meanwhile: a cold import reads some 1,250 files of torch's,
and a bulk read beside it delays each of them, and the conversion with it (docs/performance.md; ``git log``
of this file for the code).
"""

from __future__ import annotations

import importlib
import sys
import threading

_started = threading.Event()
_thread: threading.Thread | None = None


def import_torch_in_background() -> None:
    """Start importing torch, once per process, unless it is already imported."""
    if "torch" in sys.modules or _started.is_set():
        return
    global _thread
    _started.set()
    _thread = threading.Thread(target=_import_torch, name="reshard-import-torch", daemon=True)
    _thread.start()


def wait_for_torch() -> None:
    """Wait for the background import to end. Called where the next step needs torch anyway and needs this process
    to run one thread: the config-family check forks its child only then (``plans/built_family.py``); on a thread,
    it held the interpreter lock against the import and the bytes (seconds of pure-Python import)."""
    if _thread is not None:
        _thread.join()


def _import_torch() -> None:
    try:
        importlib.import_module("torch")
    except ImportError:  # raised again where torch is needed, in the main thread
        pass
