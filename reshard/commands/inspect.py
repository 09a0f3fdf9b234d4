"""``inspect``: what a checkpoint is, and how reshard would read every tensor, from headers only."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reshard.dtypes import name_of
from reshard.engine.plan.open import open_checkpoint
from reshard.engine.plan.target import preview_mapping
from reshard.geometry import at_tp, partition_to_dict
from reshard.hub.source import HubCheckpoint
from reshard.layouts import SourceCheckpoint
from reshard.options import ReadOptions
from reshard.vocab import source_padded_rows


@dataclass
class TensorReport:
    name: str
    rank_shapes: list[list[int]]
    dtype: str
    bytes: int
    partition: dict[str, Any] | None
    reason: str
    shape: list[int] | None
    problem: str | None
    targets: list[str] | None = None  # its names under the mapping to transformers, when there is one
    stored: str | None = None  # how it is stored, when not as a tensor of its own (a box of a global tensor)


@dataclass
class InspectReport:
    """Layout, tp, files, per-tensor decisions, vocab padding found, the training state, and notes."""

    path: str
    layout: str
    tp: int
    files: list[str]
    config: str | None
    model_type: str | None
    plan: str
    vocab: dict[str, Any]
    mapping: str | None = None
    tensors: list[TensorReport] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    extras: list[str] = field(default_factory=list)
    hub: dict[str, Any] | None = None  # a Hub repo: repo, revision, commit, bytes_transferred, requests
    training: dict[str, Any] | None = None  # the training state (TrainingState.to_dict), where the layout reads it

    @property
    def problems(self) -> list[str]:
        return [t.problem for t in self.tensors if t.problem]

    def to_dict(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        if data["hub"] is None:  # a local checkpoint's report stays as it was
            del data["hub"]
        if data["training"] is None:  # nor does that of a checkpoint without a training state read
            del data["training"]
        data["tensors"] = [t.__dict__ for t in self.tensors]
        data["problems"] = self.problems
        return data


def _ranks_text(ranks: list[int], tp: int) -> str:
    if len(ranks) == tp and tp > 1:
        return "all ranks"
    return "rank " + ", ".join(str(r) for r in ranks) if len(ranks) < 4 else f"ranks {ranks[0]}-{ranks[-1]}"


def _not_tensors(source: SourceCheckpoint) -> list[str]:
    """Top-level keys and non-tensor state-dict entries, each listed once with the ranks that hold it."""
    found: dict[str, list[int]] = {}
    for rank, (top, extras) in enumerate(zip(source.top_level, source.extras, strict=False)):
        for key in top:
            found.setdefault(f"{key} (top level)", []).append(rank)
        for key in extras:
            found.setdefault(f"{key} (in the state dict)", []).append(rank)
    return [f"{key}, {_ranks_text(ranks, source.tp)}" for key, ranks in sorted(found.items())]


def inspect_checkpoint(ckpt: Path | HubCheckpoint, options: ReadOptions | None = None) -> InspectReport:
    """Describe ``ckpt``: layout, tp, files, and for every tensor its rank shapes, partition and why.

    A tensor that cannot be gathered is reported with its problem rather than raised, so one bad
    tensor does not hide the rest. A Hub repo is described from its safetensors headers alone.
    """
    opened = open_checkpoint(ckpt if isinstance(ckpt, HubCheckpoint) else Path(ckpt), options or ReadOptions())
    source, vocab, tensors = opened.source, opened.vocab, opened.tensors
    padded = source_padded_rows(tensors)
    mapping, targets, why_not = preview_mapping(opened)
    report = InspectReport(
        path=str(opened.path),
        layout=source.layout,
        tp=source.tp,
        files=[str(f) for f in source.files],
        config=str(source.config.path) if source.config and source.config.path else None,
        model_type=source.config.model_type if source.config else None,
        plan=opened.plan.name,
        vocab={
            "original": vocab.original,
            "origin": vocab.origin,
            "padded_in_source": padded,
            "padding_rows": None if padded is None or vocab.original is None else padded - vocab.original,
        },
        mapping=mapping,
        notes=source.notes_for(layout=None, vocab_known=vocab.original is not None) + ([why_not] if why_not else []),
        extras=_not_tensors(source),
        hub=source.hub,
        training=source.training.to_dict() if source.training else None,
    )
    for t in tensors:
        report.tensors.append(
            TensorReport(
                name=t.name,
                rank_shapes=[list(r.shape) for r in t.refs],
                dtype=name_of(t.code),
                bytes=sum(r.header.nbytes for r in t.refs),
                partition=partition_to_dict(at_tp(t.partition, t.shape or (), source.tp)) if t.partition else None,
                reason=t.reason,
                shape=list(t.shape) if t.shape else None,
                problem=t.problem.one_line() if t.problem else None,
                targets=targets.get(t.name) if mapping else None,
                stored=t.refs[0].describe(),
            )
        )
    return report
