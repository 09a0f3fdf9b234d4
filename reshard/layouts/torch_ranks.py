"""A base for layouts whose rank files are ``torch.save`` pickles (Megatron, SAT).

Each target rank's file is laid out up front from a template, the object ``torch.save`` would be given
with a :class:`~reshard.io.torch_zip.TensorSlot` for every tensor (its state dict in source order), and
every slice is written at its final offset as it arrives, from the worker threads
(:class:`~reshard.io.torch_zip.TorchZipWriter`). The files are byte for byte what ``torch.save`` writes
for the same state dicts, but no rank's state dict is ever held and nothing is spooled.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from reshard.io.torch_zip import TensorSlot, TorchZipWriter
from reshard.layouts.base import RankFilesWriter, TargetSpec


class TorchRanksWriter(RankFilesWriter):
    """Writes, for every target rank, the ``torch.save`` file of what :meth:`rank_file` builds, tensor by tensor.

    Subclasses implement :meth:`rank_file` (where rank ``r`` goes and the object to pickle around its
    state dict) and may override :meth:`finish` to write the layout's other files. ``pickle_module`` is
    what ``torch.save`` would pickle with. :meth:`rank_file` is called from ``__init__``: set what it
    needs before calling ``super().__init__``.
    """

    pickle_module: Any = pickle

    def __init__(self, out_dir: Path, spec: TargetSpec) -> None:
        self.out_dir, self.spec = out_dir, spec  # rank_file reads them
        order = {name: i for i, name in enumerate(spec.source.names())}
        self._files: list[Path] = []
        writers = []
        for rank, headers in enumerate(spec.rank_headers):
            names = sorted(headers, key=lambda n: order.get(n, len(order)))
            relative, template = self.rank_file(rank, {name: TensorSlot(name, headers[name]) for name in names})
            (out_dir / relative).parent.mkdir(parents=True, exist_ok=True)
            writers.append(TorchZipWriter(out_dir / relative, template, pickle_module=self.pickle_module))
            self._files.append(relative)
        super().__init__(out_dir, spec, writers)

    def rank_file(self, rank: int, state_dict: dict[str, TensorSlot]) -> tuple[Path, Any]:
        """The path (relative to the output folder) of rank ``rank``'s file and the object to save there,
        with ``state_dict`` (slots standing for the tensors) inside it."""
        raise NotImplementedError

    def finish(self) -> list[Path]:
        """Write the layout's files other than the rank files; return their relative paths."""
        return []

    def close(self) -> list[Path]:
        for writer in self.rank_writers:
            writer.close()
        return [*self._files, *self.finish()]
