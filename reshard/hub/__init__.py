"""The Hugging Face Hub as a source and a destination: repo ids as CKPT, header-only reads, downloads, pushes.

``source`` parses a CKPT argument and resolves a revision to a commit; ``remote`` opens a repo from its
safetensors headers (``inspect``, ``check``); ``download`` fetches what a conversion reads into the cache;
``push`` and ``card`` publish a finished output; ``api`` holds the client, its errors and its byte count.
"""

from __future__ import annotations

from reshard.hub.download import download_checkpoint
from reshard.hub.push import PushOptions, PushResult, push_output
from reshard.hub.source import HubCheckpoint, checkpoint_argument, resolve

__all__ = [
    "HubCheckpoint",
    "PushOptions",
    "PushResult",
    "checkpoint_argument",
    "download_checkpoint",
    "push_output",
    "resolve",
]
