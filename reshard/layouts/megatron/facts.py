"""What a Megatron checkpoint records beside its tensors that a Megatron output keeps: the facts of the ``torch``
format and of ``torch_dist`` (Megatron-Core's, also under NeMo 2)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from reshard.layouts.base import SourceFacts

__all__ = ["MegatronFacts"]


@dataclass(frozen=True, kw_only=True)
class MegatronFacts(SourceFacts):
    """Megatron's own record of a checkpoint (``megatron_args`` is the base class's).

    Attributes:
        iteration: the training iteration saved (None when the files do not say).
        checkpoint_version: Megatron's format version (how QKV is ordered).
        release: saved as ``release`` rather than ``iter_XXXXXXX``.
        paths: the nested state-dict path of each tensor in the legacy ``torch`` format (``language_model`` ...).
    """

    iteration: Any = None
    checkpoint_version: Any = None
    release: bool = False
    paths: dict[str, tuple[str, ...]] = field(default_factory=dict)
