"""Checkpoints in PyTorch DCP's storage, global tensors stored as chunk boxes: DCP itself (torchtitan, FSDP2,
accelerate; read) and Megatron-Core's ``torch_dist`` (also NeMo 2's ``weights/``; read and written). The package is
not called ``dist``: pytest does not collect test folders of that name, nor do many ``.gitignore`` files keep them."""

from __future__ import annotations

from reshard.layouts.dcp import dcp, torch_dist, torch_dist_writer
from reshard.layouts.megatron.reader import TRACKER, tracked_folder
from reshard.layouts.spec import LayoutSpec

TORCH_DIST = LayoutSpec(
    name=torch_dist.NAME,
    looked_for="Megatron-Core torch_dist metadata.json",
    detect=torch_dist.detect,
    open=torch_dist.discover,
    writer=torch_dist_writer.TorchDistWriter,
    naming="megatron",
    global_tensors=True,
    pipeline_stages=True,
    trackers=((TRACKER, tracked_folder),),
)
DCP = LayoutSpec(name=dcp.NAME, looked_for="DCP .metadata", detect=dcp.detect, open=dcp.discover)

__all__ = ["DCP", "TORCH_DIST"]
