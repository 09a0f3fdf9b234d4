"""DeepSpeed ZeRO checkpoints (``latest`` + ``global_stepN/`` with ZeRO's model-states and optimizer files), read
for any ZeRO stage: the fp32 master weights rebuilt from the optimizer partitions, streamed; written as a universal
checkpoint with the training state (``--with-optimizer``), which DeepSpeed resumes at any data-parallel size."""

from __future__ import annotations

from reshard.layouts.deepspeed import checkpoint
from reshard.layouts.deepspeed.universal_writer import UniversalWriter
from reshard.layouts.spec import LayoutSpec

DEEPSPEED = LayoutSpec(
    name=checkpoint.NAME,
    looked_for="DeepSpeed ZeRO latest / *_optim_states.pt",
    detect=checkpoint.detect,
    open=checkpoint.discover,
    writer=UniversalWriter,
    naming="hf",  # the names of a transformers model, which DeepSpeed's users (the HF Trainer) train
)

__all__ = ["DEEPSPEED"]
