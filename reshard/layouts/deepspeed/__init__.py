"""DeepSpeed ZeRO checkpoints (``latest`` + ``global_stepN/`` with ZeRO's model-states and optimizer files), read
for any ZeRO stage: the fp32 master weights rebuilt from the optimizer partitions, streamed."""

from __future__ import annotations

from reshard.layouts.deepspeed import checkpoint
from reshard.layouts.spec import LayoutSpec

DEEPSPEED = LayoutSpec(
    name=checkpoint.NAME,
    looked_for="DeepSpeed ZeRO latest / *_optim_states.pt",
    detect=checkpoint.detect,
    open=checkpoint.discover,
)

__all__ = ["DEEPSPEED"]
