"""Quantized checkpoints: what ``quantization_config`` says (:mod:`.scheme`), where each stored tensor of a
quantized linear sits on the linear's axes (:mod:`.rules`, the table), and how the plan's cut of the linear
cuts them (:mod:`.plan`). Pure and torch-free: planning and ``check`` use it on headers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from reshard.config import ModelConfig
from reshard.geometry import Partition
from reshard.plans.base import Plan
from reshard.plans.recorded import RecordedPlan
from reshard.quantization.plan import QuantizedLinear, companion_partition, quantized_linears
from reshard.quantization.scheme import QuantScheme, read_scheme

Shape = tuple[int, ...]


@dataclass(frozen=True)
class QuantizedTensors:
    """A checkpoint's quantization scheme and the linears it stores quantized."""

    scheme: QuantScheme
    linears: Mapping[str, QuantizedLinear]

    def partition(self, name: str, plan: Plan, config: ModelConfig | None) -> tuple[Partition, str] | None:
        """``name``'s cut when it is a stored tensor of a quantized linear (``None`` otherwise, and for a
        name a ``reshard.json`` recorded: a checkpoint reshard wrote is read as it was written)."""
        if isinstance(plan, RecordedPlan) and name in plan.recorded:
            return None
        return companion_partition(self.scheme, name, plan, config, self.linears)


def quantized_tensors(
    config: ModelConfig | None, shapes: Mapping[str, Shape], *, ranks: int = 1
) -> QuantizedTensors | None:
    """The quantized linears of a checkpoint of ``shapes``, rank 0's of ``ranks`` (``None`` without a
    ``quantization_config``).

    Raises:
        ReshardError: a ``quantization_config`` reshard does not know (named).
    """
    scheme = read_scheme(config.raw if config is not None else None, path=config.path if config else None)
    if scheme is None:
        return None
    return QuantizedTensors(scheme, quantized_linears(scheme, shapes, ranks=ranks))


__all__ = ["QuantScheme", "QuantizedLinear", "QuantizedTensors", "quantized_tensors", "read_scheme"]
