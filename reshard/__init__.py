"""reshard: repair and re-slice tensor-parallel checkpoints.

The public surface is small; everything else is private and may change.
"""

from __future__ import annotations

__version__ = "0.1.0"

from reshard.check import CheckOptions, CheckReport, check  # noqa: E402
from reshard.convert import ConvertReport, convert  # noqa: E402
from reshard.errors import ReshardError  # noqa: E402
from reshard.fix import FixReport, fix  # noqa: E402
from reshard.inspect import InspectReport, inspect_checkpoint  # noqa: E402
from reshard.manifest import Manifest, read_manifest  # noqa: E402
from reshard.options import ConvertOptions  # noqa: E402
from reshard.partition import Grouped, Packed, Partition, Replicate, Shard, Vocab, gather, split  # noqa: E402
from reshard.plans import Plan, Rule  # noqa: E402
from reshard.verify import VerifyOptions, VerifyResult, verify  # noqa: E402

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
