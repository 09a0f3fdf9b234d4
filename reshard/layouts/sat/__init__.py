"""SwissArmyTransformer checkpoints (CogVLM, CogAgent): ``<iteration>/mp_rank_XX_model_states.pt``, ``latest`` and
``model_config.json``, read and written for any tp."""

from __future__ import annotations

from reshard.layouts.sat import checkpoint
from reshard.layouts.spec import LayoutSpec

SAT = LayoutSpec(
    name=checkpoint.NAME,
    looked_for="SAT mp_rank_XX_model_states.pt",
    detect=checkpoint.detect,
    open=checkpoint.discover,
    writer=checkpoint.SatWriter,
    kept=True,
    trackers=((checkpoint.LATEST, checkpoint.tracked_folder),),
)

__all__ = ["SAT"]
