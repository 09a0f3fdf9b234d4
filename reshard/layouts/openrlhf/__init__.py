"""OpenRLHF's checkpoints (``--ckpt.path`` with ``_actor/`` and ``_critic/`` of DeepSpeed ZeRO, ``<tag>_hf/`` side
folders), read only: the weights by the DeepSpeed reader, the config and tokenizer from the side folder."""

from __future__ import annotations

from reshard.layouts.openrlhf import checkpoint, folder
from reshard.layouts.spec import LayoutSpec

OPENRLHF = LayoutSpec(
    name=checkpoint.NAME,
    looked_for="OpenRLHF _actor/ (DeepSpeed)",
    detect=folder.detect,
    open=checkpoint.discover,
    naming="hf",  # OpenRLHF hands DeepSpeed the transformers model inside its Actor: transformers' names
)

__all__ = ["OPENRLHF"]
