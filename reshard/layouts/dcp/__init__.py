"""Checkpoints in PyTorch DCP's storage, global tensors stored as chunk boxes: DCP itself (torchtitan, FSDP2,
accelerate; read and written, the optimizer's state with it) and Megatron-Core's ``torch_dist`` (also NeMo 2's
``weights/``; read and written). The package is not called ``dist``: pytest does not collect test folders of that
name, nor do many ``.gitignore`` files keep them."""

from __future__ import annotations

from reshard.layouts.dcp import dcp, dcp_writer, torch_dist, torch_dist_writer
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
    loaded_at_any_size="torch_dist holds global tensors that Megatron-Core loads at any tp/pp; its args record "
    "tensor_model_parallel_size={tp}, pipeline_model_parallel_size={pp}",
    pipeline_stages=True,
    trackers=((TRACKER, tracked_folder),),
)
DCP = LayoutSpec(
    name=dcp.NAME,
    looked_for="DCP .metadata",
    detect=dcp.detect,
    open=dcp.discover,
    writer=dcp_writer.DcpWriter,
    global_tensors=True,
    loaded_at_any_size="dcp holds global tensors that FSDP2 and torchtitan load at any world size (DCP reshards "
    "at load); --tp is not recorded",
)

__all__ = ["DCP", "TORCH_DIST"]
