"""The output's file plan: which data file holds which tensors, worked out from a
:class:`~reshard.layouts.base.TargetSpec` alone before any byte is written.

A writer class plans its files (``CheckpointWriter.file_plan``) and is then built from that plan, so the engine's
filters of a conversion (what a resumed run still has to do, a worker's share) see exactly the files the writer
writes, without a writer having to exist first: DCP's ``SavePlan`` and huggingface_hub's ``StateDictSplit`` in
spirit. A writer that needs more of its plan (shard splits, archive places) subclasses :class:`FilePlan`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["FilePlan"]


@dataclass(frozen=True)
class FilePlan:
    """The output's data files and the tensors each holds.

    Attributes:
        files: data file (POSIX path relative to the output folder) -> the names of the target tensors written into
            it. Files that hold no tensor bytes (config, index, tracker, metadata) are not data files.

    Example:
        >>> plan = FilePlan({"rank_00/model.safetensors": frozenset({"w"}), "rank_01/model.safetensors": frozenset()})
        >>> sorted(plan.tensors_in(["rank_00/model.safetensors"]))
        ['w']
    """

    files: Mapping[str, frozenset[str]]

    def tensors_in(self, files: Iterable[str]) -> set[str]:
        """The tensors with a piece in any of ``files``."""
        return {name for file in files for name in self.files[file]}

    @property
    def tensors(self) -> set[str]:
        """The tensors with a piece in some data file."""
        return self.tensors_in(self.files)
