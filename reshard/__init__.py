"""reshard: repair and re-slice tensor-parallel checkpoints.

The public surface is small; everything else is private and may change.
"""

from __future__ import annotations

__version__ = "0.1.0"

from reshard.check import CheckOptions, CheckReport, check
from reshard.convert import ConvertReport, convert
from reshard.errors import ReshardError
from reshard.fix import FixReport, fix
from reshard.inspect import InspectReport, inspect_checkpoint
from reshard.manifest import Manifest, read_manifest
from reshard.options import ConvertOptions
from reshard.partition import Grouped, Packed, Partition, Replicate, Shard, Vocab
from reshard.plans import Plan, Rule
from reshard.slicing import gather, split
from reshard.verify import VerifyOptions, VerifyResult, verify

__all__ = [
    "CheckOptions",
    "CheckReport",
    "ConvertOptions",
    "ConvertReport",
    "FixReport",
    "Grouped",
    "InspectReport",
    "Manifest",
    "Packed",
    "Partition",
    "Plan",
    "Replicate",
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
