"""verl's FSDP / FSDP2 actors and critics (``global_step_N/actor/``: ``model_world_size_{W}_rank_{r}.pt`` of
DTensors or plain tensors, ``huggingface/`` beside them), read only: their global tensors put back from the ranks'
local pieces without running a pickle or starting a process group."""

from __future__ import annotations

from reshard.layouts.spec import LayoutSpec
from reshard.layouts.verl import actor, folder

VERL = LayoutSpec(
    name=actor.NAME,
    looked_for="verl model_world_size_{W}_rank_{r}.pt",
    detect=folder.detect,
    open=actor.discover,
    naming="hf",  # verl trains transformers models: their state dicts carry transformers' names
)

__all__ = ["VERL"]
