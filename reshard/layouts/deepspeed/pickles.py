"""Stand-ins for the DeepSpeed classes its checkpoint files pickle, so that they load with
``torch.load(weights_only=True)`` and without DeepSpeed installed.

Nothing reshard reads depends on their contents (the loss scale, the ZeRO stage enum, the fragment addresses
that ``param_shapes`` already gives): they only have to unpickle without running anything. Verified on the
files of deepspeed 0.19.8 (``shared/reference/deepspeed-zero-verified.md``).
"""

from __future__ import annotations

from typing import Any

from reshard.formats.safe_pickle import StandIn

PICKLED = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


class DeepSpeedObject(StandIn):
    """A pickled DeepSpeed object: its constructor arguments (an enum's value) in ``args``, its state as
    attributes."""

    def __new__(cls, *args: Any, **kwargs: Any) -> DeepSpeedObject:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args


def _stand_in(path: str) -> type[DeepSpeedObject]:
    return type(path.rsplit(".", 1)[-1], (DeepSpeedObject,), {"__module__": __name__})


# ``(stand-in, "module.Name")`` pairs, as ``torch.serialization.safe_globals`` takes them.
STAND_INS: tuple[tuple[type[DeepSpeedObject], str], ...] = tuple((_stand_in(path), path) for path in PICKLED)
