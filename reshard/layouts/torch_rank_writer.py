"""A base for layouts whose rank files are ``torch.save`` pickles (Megatron, SAT).

Each target rank's file is laid out up front from a template, the object ``torch.save`` would be given
with a :class:`~reshard.formats.torch_zip.writer.TensorSlot` for every tensor (its state dict in source order), and
every slice is written at its final offset as it arrives, from the worker threads
(:class:`~reshard.formats.torch_zip.writer.TorchZipWriter`). The files are byte for byte what ``torch.save`` writes
for the same state dicts, but no rank's state dict is ever held and nothing is spooled.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reshard.formats.torch_zip.writer import TensorSlot, TorchZipWriter
from reshard.layouts.base import RankFilesWriter, TargetSpec

if TYPE_CHECKING:
    import torch


class TorchRanksWriter(RankFilesWriter):
    """Writes, for every target rank, the ``torch.save`` file of what :meth:`rank_file` builds, tensor by tensor.

    Subclasses implement :meth:`rank_file` (where rank ``r`` goes and the object to pickle around its
    state dict) and may override :meth:`finish` to write the layout's other files. ``pickle_module`` is
    what ``torch.save`` would pickle with. :meth:`rank_file` is called from ``__init__``: set what it
    needs before calling ``super().__init__``.
    """

    pickle_module: Any = pickle

    def __init__(self, out_dir: Path, spec: TargetSpec) -> None:
        self.out_dir, self.spec = out_dir, spec  # rank_files reads them
        order = {name: i for i, name in enumerate(spec.source.names())}
        self._files: list[Path] = []
        self._tensors_of: dict[str, frozenset[str]] = {}
        hooks = spec.file_hooks(out_dir)
        writers = []
        for rank, headers in enumerate(spec.rank_headers):
            names = sorted(headers, key=lambda n: order.get(n, len(order)))
            zips = []
            for relative, template in self.rank_files(rank, {name: TensorSlot(name, headers[name]) for name in names}):
                (out_dir / relative).parent.mkdir(parents=True, exist_ok=True)
                keep, on_done = hooks(out_dir / relative)
                file = TorchZipWriter(
                    out_dir / relative, template, pickle_module=self.pickle_module, keep=keep, on_done=on_done
                )
                zips.append(file)
                self._files.append(relative)
                self._tensors_of[relative.as_posix()] = frozenset(file.keys)
            writers.append(_RankFiles(zips))
        super().__init__(out_dir, spec, writers)

    def data_files(self) -> dict[str, frozenset[str]]:
        return dict(self._tensors_of)

    def rank_files(self, rank: int, state_dict: dict[str, TensorSlot]) -> list[tuple[Path, Any]]:
        """Rank ``rank``'s files (paths relative to the output folder) and the object to save in each, with
        the slots of ``state_dict`` inside them (a slot may stand in several files: each gets the tensor)."""
        return [self.rank_file(rank, state_dict)]

    def rank_file(self, rank: int, state_dict: dict[str, TensorSlot]) -> tuple[Path, Any]:
        """The path (relative to the output folder) of rank ``rank``'s one file and the object to save there."""
        raise NotImplementedError

    def finish(self) -> list[Path]:
        """Write the layout's files other than the rank files; return their relative paths."""
        return []

    def close(self) -> list[Path]:
        for writer in self.rank_writers:
            writer.close()
        return [*self._files, *(self.finish() if self.spec.writes_shared else [])]


class _RankFiles:
    """One target rank's torch files: a tensor goes to every file whose template has a slot for it."""

    def __init__(self, files: list[TorchZipWriter]) -> None:
        self._files = files
        self._by_key: dict[str, list[TorchZipWriter]] = {}
        for file in files:
            for key in file.keys:
                self._by_key.setdefault(key, []).append(file)

    def write_unordered(self, name: str, tensor: torch.Tensor) -> None:
        for file in self._by_key[name]:
            file.write(name, tensor)

    write = write_unordered

    def close(self) -> None:
        for file in self._files:
            file.close()
