"""What a Megatron checkpoint records beside its tensors that a Megatron output keeps: the facts of the ``torch``
format and of ``torch_dist`` (Megatron-Core's, also under NeMo 2). Here, not in a layout package, since the
mappings and the engine read them (and a mapping makes a Megatron target's: ``TargetSpec.layout_facts``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from reshard.config import SourceFacts

__all__ = ["MegatronFacts", "args_of"]


@dataclass(frozen=True, kw_only=True)
class MegatronFacts(SourceFacts):
    """Megatron's own record of a checkpoint.

    Attributes:
        args: Megatron-LM's ``args`` namespace (or the dict ``--trust-pickle`` may give) when the checkpoint records
            one: the model's shape and the arguments a Megatron target keeps.
        iteration: the training iteration saved (None when the files do not say).
        checkpoint_version: Megatron's format version (how QKV is ordered).
        release: saved as ``release`` rather than ``iter_XXXXXXX``.
        paths: the nested state-dict path of each tensor in the legacy ``torch`` format (``language_model`` ...).
    """

    args: Any = None
    iteration: Any = None
    checkpoint_version: Any = None
    release: bool = False
    paths: dict[str, tuple[str, ...]] = field(default_factory=dict)


def args_of(facts: SourceFacts | None) -> Any:
    """The Megatron args ``facts`` hold: None for another layout's facts, or for Megatron's without args."""
    return facts.args if isinstance(facts, MegatronFacts) else None
