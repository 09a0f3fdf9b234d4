"""A parameter's optimizer state in its global shape, read from Megatron-Core's flat buckets (``dp_reshardable``,
:mod:`reshard.layouts.dcp.torch_dist_dp`): each tp rank's local shard lies flattened in its bucket, and is that
rank's boxes of the global tensor. Memory: the output tensor plus one tp rank's shard at a time."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reshard.dtypes import TensorHeader
from reshard.formats.boxes import Box, Shape
from reshard.formats.readers import FileReader, ReadIntoReader
from reshard.io.direct import Batch
from reshard.layouts.dcp.boxed_reader import BoxedReader, BoxView

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Shard:
    """One tp rank's local shard of a parameter: ``boxes`` of the global parameter, one after the other along dim 0
    of the local tensor, which lies flattened at ``flat`` of the rank's stored bucket."""

    boxes: tuple[Box, ...]
    flat: BoxView


@dataclass
class BucketReader(ReadIntoReader):
    """Each parameter's state tensor in its global shape, from its tp ranks' shards in the stored buckets
    (``shards[key]``: one per tp rank, one alone for a parameter every rank holds whole)."""

    path: Path
    shards: Mapping[str, tuple[Shard, ...]]
    shapes: Mapping[str, Shape]
    buckets: BoxedReader
    headers: dict[str, TensorHeader] = field(init=False)
    extras: dict[str, Any] = field(init=False, default_factory=dict)
    notes: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.headers = {
            key: TensorHeader(self.shapes[key], self.buckets.headers[shards[0].flat.tensor.name].code)
            for key, shards in self.shards.items()
        }

    def read_into(self, key: str, out: torch.Tensor, *, start: int = 0) -> None:
        """The whole tensor into ``out`` (contiguous or strided); a part of it through a whole copy."""
        if start or tuple(out.shape) != self.shapes[key]:
            FileReader.read_into(self, key, out, start=start)
            return
        import torch

        for shard in self.shards[key]:
            local = torch.empty(shard.flat.box.numel, dtype=self.headers[key].dtype)  # as stored; out may differ
            with Batch():
                self.buckets.read_into_view(shard.flat, local)
            done = 0
            for box in shard.boxes:
                place = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))
                out[place].copy_(local[done : done + box.numel].view(box.sizes))
                done += box.numel

    def describe(self, key: str) -> str:
        shard = self.shards[key][0]
        return f"{len(self.shards[key])} tp shard(s) in {shard.flat.tensor.name} from {shard.flat.box.offsets[0]}"
