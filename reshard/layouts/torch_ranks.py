"""A base for layouts whose rank files are ``torch.save`` pickles (Megatron, SAT).

``torch.save`` needs a whole state dict in memory, but the pipeline hands over one tensor at a time
for all ranks. So slices are spooled, as they stream in, into one temporary safetensors file per
target rank; :meth:`TorchRanksWriter.close` then builds the rank files one rank at a time. Peak
memory is about one rank's state dict (never the model); the spool costs one extra copy on disk.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from reshard.io.safetensors_writer import SafetensorsFileWriter
from reshard.layouts.base import RankFilesWriter, TargetSpec

if TYPE_CHECKING:
    import torch

SPOOL_DIR = ".reshard-spool"


class TorchRanksWriter(RankFilesWriter):
    """Spools per-rank slices, then ``torch.save``s what :meth:`rank_file` builds for each rank.

    Subclasses implement :meth:`rank_file` (where rank ``r`` goes and the object to pickle around its
    state dict) and may override :meth:`finish` to write the layout's other files. ``pickle_module`` is
    what ``torch.save`` pickles with.
    """

    pickle_module: Any = pickle

    def __init__(self, out_dir: Path, spec: TargetSpec) -> None:
        self._spool = out_dir / SPOOL_DIR
        self._spool.mkdir(parents=True, exist_ok=True)
        writers = [
            # read back by close() right away: through the page cache, not O_DIRECT
            SafetensorsFileWriter(self._spool / f"rank_{rank:05d}.safetensors", headers, metadata=None, direct=False)
            for rank, headers in enumerate(spec.rank_headers)
        ]
        super().__init__(out_dir, spec, writers)

    def rank_file(self, rank: int, state_dict: dict[str, torch.Tensor]) -> tuple[Path, Any]:
        """The path (relative to the output folder) of rank ``rank``'s file and the object to save there."""
        raise NotImplementedError

    def finish(self) -> list[Path]:
        """Write the layout's files other than the rank files; return their relative paths."""
        return []

    def close(self) -> list[Path]:
        order = {name: i for i, name in enumerate(self.spec.source.names())}
        written = []
        import torch

        for rank, writer in enumerate(self.rank_writers):
            writer.close()
            with safe_open(writer.path, framework="pt") as spooled:
                names = sorted(spooled.keys(), key=lambda n: order.get(n, len(order)))
                state = {name: spooled.get_tensor(name) for name in names}
            relative, obj = self.rank_file(rank, state)
            (self.out_dir / relative).parent.mkdir(parents=True, exist_ok=True)
            torch.save(obj, self.out_dir / relative, pickle_module=self.pickle_module)
            written.append(relative)
            del state, obj
            writer.path.unlink()
        shutil.rmtree(self._spool)
        return written + self.finish()
