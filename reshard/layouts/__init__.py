"""Layouts: how checkpoints sit on disk. ``discover`` reads any of them; ``writer_class`` picks a writer."""

from __future__ import annotations

from pathlib import Path

from reshard.errors import ReshardError
from reshard.layouts import dcp, hf, hf_ranks, loose, megatron, sat, torch_dist
from reshard.layouts.base import CheckpointWriter, SourceCheckpoint, TargetSpec, TensorRef
from reshard.layouts.megatron_writer import MegatronWriter
from reshard.layouts.torch_dist_writer import TorchDistWriter
from reshard.options import Layout, ReadOptions

__all__ = ["CheckpointWriter", "SourceCheckpoint", "TargetSpec", "TensorRef", "discover", "writer_class"]

_WRITERS: dict[Layout, type[CheckpointWriter]] = {
    Layout.HF: hf.HFWriter,
    Layout.HF_RANKS: hf_ranks.HFRanksWriter,
    Layout.MEGATRON: MegatronWriter,
    Layout.SAT: sat.SatWriter,
    Layout.TORCH_DIST: TorchDistWriter,
}


def discover(path: Path, options: ReadOptions | None = None) -> SourceCheckpoint:
    """Open a checkpoint in whatever layout it is, from headers only.

    Raises:
        ReshardError: the path does not exist or holds no checkpoint reshard can read.
    """
    options = options or ReadOptions()
    if not path.exists():
        raise ReshardError("no such file or folder", path=path)
    if path.is_file():
        return hf.discover(path, options)
    if torch_dist.detect(path):  # before dcp (its data files are DCP) and megatron (the same tracker file)
        return torch_dist.discover(path, options)
    if dcp.detect(path):
        return dcp.discover(path, options)
    if megatron.detect(path):
        return megatron.discover(path, options)
    if sat.detect(path):
        return sat.discover(path, options)
    if hf_ranks.detect(path):
        return hf_ranks.discover(path, options)
    if loose.detect(path):
        return loose.discover(path, options)
    if hf.is_hf_folder(path):
        return hf.discover(path, options)
    raise ReshardError(
        "no checkpoint found (looked for Megatron-Core torch_dist metadata.json, DCP .metadata, "
        "Megatron iter_*/mp_rank_*, SAT mp_rank_XX_model_states.pt, "
        "rank_NN/ folders, *rank{r}* files, model.safetensors, "
        "pytorch_model.bin, *.safetensors)",
        path=path,
    )


def writer_class(layout: Layout) -> type[CheckpointWriter]:
    """The writer for a layout; ``ReshardError`` for a read-only one."""
    try:
        return _WRITERS[layout]
    except KeyError:
        raise ReshardError(
            f"cannot write the {str(layout)!r} layout", hint=f"choose one of {', '.join(map(str, _WRITERS))}"
        ) from None
