"""NeMo-RL's checkpoints (``step_N/policy/weights/`` DCP, ``policy/optimizer/``, ``policy/tokenizer/``, the run's
``config.yaml``), read only: the weights by the DCP reader, every other file of the step named."""

from __future__ import annotations

from reshard.layouts.nemo_rl import checkpoint, folder
from reshard.layouts.spec import LayoutSpec

NEMO_RL = LayoutSpec(
    name=checkpoint.NAME,
    looked_for="NeMo-RL step_N/policy/weights",
    detect=folder.detect,
    open=checkpoint.discover,
    naming="hf",  # NeMo-RL trains transformers models (through nemo_automodel): their names
)

__all__ = ["NEMO_RL"]
