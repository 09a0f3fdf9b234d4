"""reshard: repair and re-slice tensor-parallel checkpoints.

The public surface is small; everything else is private and may change.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from reshard.version import __version__

# Where each public name lives. They are imported on first use (PEP 562), so that ``reshard check``,
# which reads only headers, starts without importing torch.
_EXPORTS = {
    "CheckOptions": "reshard.commands.check",
    "CheckReport": "reshard.commands.check",
    "ConvertOptions": "reshard.options",
    "ConvertReport": "reshard.commands.convert",
    "FixReport": "reshard.commands.fix",
    "Grouped": "reshard.geometry",
    "Heads": "reshard.geometry",
    "InspectReport": "reshard.commands.inspect",
    "Manifest": "reshard.manifest",
    "Packed": "reshard.geometry",
    "Partition": "reshard.geometry",
    "Plan": "reshard.plans",
    "ReadOptions": "reshard.options",
    "Replicate": "reshard.geometry",
    "ReplicatedHeads": "reshard.geometry",
    "ReshardError": "reshard.errors",
    "Rule": "reshard.plans",
    "Shard": "reshard.geometry",
    "VerifyOptions": "reshard.commands.verify",
    "VerifyResult": "reshard.commands.verify",
    "Vocab": "reshard.geometry",
    "check": "reshard.commands.check",
    "convert": "reshard.commands.convert",
    "fix": "reshard.commands.fix",
    "gather": "reshard.geometry.tensors",
    "inspect_checkpoint": "reshard.commands.inspect",
    "read_manifest": "reshard.manifest",
    "split": "reshard.geometry.tensors",
    "verify": "reshard.commands.verify",
}

if TYPE_CHECKING:
    from reshard.commands.check import CheckOptions, CheckReport, check
    from reshard.commands.convert import ConvertReport, convert
    from reshard.commands.fix import FixReport, fix
    from reshard.commands.inspect import InspectReport, inspect_checkpoint
    from reshard.commands.verify import VerifyOptions, VerifyResult, verify
    from reshard.errors import ReshardError
    from reshard.geometry import Grouped, Heads, Packed, Partition, Replicate, ReplicatedHeads, Shard, Vocab
    from reshard.geometry.tensors import gather, split
    from reshard.manifest import Manifest, read_manifest
    from reshard.options import ConvertOptions, ReadOptions
    from reshard.plans import Plan, Rule


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'reshard' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "CheckOptions",
    "CheckReport",
    "ConvertOptions",
    "ConvertReport",
    "FixReport",
    "Grouped",
    "Heads",
    "InspectReport",
    "Manifest",
    "Packed",
    "Partition",
    "Plan",
    "ReadOptions",
    "Replicate",
    "ReplicatedHeads",
    "ReshardError",
    "Rule",
    "Shard",
    "VerifyOptions",
    "VerifyResult",
    "Vocab",
    "__version__",
    "check",
    "convert",
    "fix",
    "gather",
    "inspect_checkpoint",
    "read_manifest",
    "split",
    "verify",
]
