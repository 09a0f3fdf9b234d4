"""Merging the files of one tensor-parallel rank (pipeline stages x virtual chunks x expert ranks) into one
state dict with global layer and expert numbers (the numbering rules are in :mod:`megatron_stages`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from reshard.errors import CorruptFileError
from reshard.layouts.base import TensorRef
from reshard.layouts.megatron.file import MegatronFile
from reshard.layouts.megatron.stages import (
    EXPERT,
    LAYER,
    expert_of,
    layer_counts,
    layer_of,
    layer_offsets,
    with_expert,
    with_layer,
)

# The last stage's copy of tied embeddings: a duplicate of the first stage's table, not a separate weight.
TIED_HEAD = ("output_layer.weight", "word_embeddings_for_head.weight", "language_model.output_layer.weight")


@dataclass
class Merged:
    """Per tp rank its tensors and non-tensor entries by global name; the key path of every global name."""

    ranks: list[tuple[dict[str, TensorRef], dict[str, Any]]] = field(default_factory=list)
    paths: dict[str, tuple[str, ...]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def merge_stages(files: dict[tuple[int, int, int], MegatronFile], *, tp: int, pp: int, ep: int, tied: bool) -> Merged:
    """One state dict per tp rank from the files of every ``(tp, pp, ep)``; see the module docstring.

    Raises:
        CorruptFileError: two files give the same global name (the stages or experts overlap).
    """
    merged = Merged()
    dropped_heads: set[str] = set()
    for rank in range(tp):
        counts = {
            (chunk, stage): layer_counts(n for n, c in files[(rank, stage, 0)].chunk_of.items() if c == chunk)
            for stage in range(pp)
            for chunk in range(files[(rank, stage, 0)].chunks)
        }
        offsets = layer_offsets(counts)
        local_experts = max((expert_of(n) or 0) + 1 for n in files[(rank, 0, 0)].paths) if ep > 1 else 0
        refs: dict[str, TensorRef] = {}
        extras: dict[str, Any] = {}
        for (r, stage, expert_rank), file in sorted(files.items()):
            if r != rank:
                continue
            for name, chunk in file.chunk_of.items():
                local = name.split(".", 1)[1] if file.chunks > 1 else name
                if expert_rank > 0 and expert_of(local) is None:
                    continue  # every expert rank holds the same non-expert tensors: rank 0's are read
                renumber = _renumbering(offsets[(chunk, stage)], expert_rank * local_experts)
                glob = renumber(local)
                if tied and pp > 1 and stage == pp - 1 and glob in TIED_HEAD:
                    dropped_heads.add(glob)
                    continue
                if glob in refs or glob in extras:
                    raise CorruptFileError(f"{glob} is also in another stage or expert rank", path=file.path)
                if name in file.headers:
                    refs[glob] = TensorRef(glob, rank, file, name, file.headers[name])
                else:
                    extras[glob] = file.extras[name]
                merged.paths.setdefault(glob, tuple(renumber(part) for part in file.paths[name]))
        merged.ranks.append((refs, extras))
    if dropped_heads:
        merged.notes.append(
            f"the last pipeline stage's copy of the tied embeddings ({', '.join(sorted(dropped_heads))}) is the "
            "first stage's table: read once"
        )
    return merged


def _renumbering(layer_offset: int, expert_offset: int):
    """A function giving a file-local name (or key-path part) its global layer and expert numbers."""

    def renumber(text: str) -> str:
        layer = layer_of(text) if LAYER.search(text) else None
        if layer is not None:
            text = with_layer(text, layer + layer_offset)
        expert = expert_of(text) if EXPERT.search(text) else None
        if expert is not None:
            text = with_expert(text, expert + expert_offset)
        return text

    return renumber
