"""The Hugging Face Hub as a source and a destination: repo ids as CKPT, header-only reads, downloads, pushes.

``source`` parses a CKPT argument and resolves a revision to a commit; ``remote`` opens a repo from its
safetensors headers (``inspect``, ``check``); ``download`` fetches what a conversion reads into the cache;
``push`` and ``card`` publish a finished output; ``api`` holds the client, its errors and its byte count.
Only ``source`` is imported with the package (the command line parses every CKPT with it); the rest is
imported when used.
"""

from __future__ import annotations

import importlib
from typing import Any

from reshard.hub.source import HubCheckpoint, checkpoint_argument, resolve

_LAZY = {
    "download_checkpoint": "reshard.hub.download",
    "PushOptions": "reshard.hub.push",
    "PushResult": "reshard.hub.push",
    "push_output": "reshard.hub.push",
}
__all__ = ["HubCheckpoint", "checkpoint_argument", "resolve", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'reshard.hub' has no attribute {name!r}")
