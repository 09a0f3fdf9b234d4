"""reshard: repair and re-slice tensor-parallel checkpoints.

The public surface is small; everything else is private and may change.
"""

from __future__ import annotations

__version__ = "0.1.0"

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

# Where each public name lives. They are imported on first use (PEP 562), so that ``reshard check``,
# which reads only headers, starts without importing torch.
_EXPORTS = {
    "CheckOptions": "reshard.check",
    "CheckReport": "reshard.check",
    "ConvertOptions": "reshard.options",
    "ConvertReport": "reshard.convert",
    "FixReport": "reshard.fix",
    "Grouped": "reshard.partition",
    "InspectReport": "reshard.inspect",
    "Manifest": "reshard.manifest",
    "Packed": "reshard.partition",
    "Partition": "reshard.partition",
    "Plan": "reshard.plans",
    "Replicate": "reshard.partition",
    "ReshardError": "reshard.errors",
    "Rule": "reshard.plans",
    "Shard": "reshard.partition",
    "VerifyOptions": "reshard.verify",
    "VerifyResult": "reshard.verify",
    "Vocab": "reshard.partition",
    "check": "reshard.check",
    "convert": "reshard.convert",
    "fix": "reshard.fix",
    "gather": "reshard.slicing",
    "inspect_checkpoint": "reshard.inspect",
    "read_manifest": "reshard.manifest",
    "split": "reshard.slicing",
    "verify": "reshard.verify",
}

if TYPE_CHECKING:
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


class _Package(types.ModuleType):
    """The ``reshard`` module object: keeps ``reshard.check`` & co. the functions, not their modules.

    Importing a submodule binds it on its package (``reshard.convert = <module>``). Four submodules
    share their name with the function they export, and the function is the public name: the binding
    is dropped, so the name resolves through :func:`__getattr__` to the function.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == value.__name__:
            self.__dict__.pop(name, None)
            return
        super().__setattr__(name, value)


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


sys.modules[__name__].__class__ = _Package
