"""A base for layouts whose rank files are ``torch.save`` pickles (Megatron, SAT).

Each target rank's file is laid out up front from a template, the object ``torch.save`` would be given
with a :class:`~reshard.formats.torch_zip.writer.TensorSlot` for every tensor (its state dict in source order), and
every slice is written at its final offset as it arrives, from the worker threads, whole or as the byte ranges of
a stream (:class:`~reshard.formats.torch_zip.writer.TorchZipWriter`). The files are byte for byte what ``torch.save``
writes for the same state dicts, but no rank's state dict is ever held and nothing is spooled.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from reshard.formats.file_plan import FilePlan
from reshard.formats.torch_zip.writer import TensorSlot, TorchZipWriter
from reshard.layouts.base import ONE_RUN, RankFilesWriter, RunFiles, TargetSpec

if TYPE_CHECKING:
    import torch

    from reshard.io.joined import Joined


@dataclass(frozen=True)
class RankFilePlan(FilePlan):
    """The ``torch.save`` files of every target rank.

    Attributes:
        ranks: per target rank, its files (POSIX paths relative to the output) with the tensors each holds, in the
            order :meth:`TorchRanksWriter.templates` gives their objects.
    """

    ranks: tuple[tuple[tuple[str, frozenset[str]], ...], ...] = ()


class TorchRanksWriter(RankFilesWriter):
    """Writes, for every target rank, the ``torch.save`` files :meth:`rank_files` plans, each holding the object
    :meth:`templates` builds around the rank's state dict, tensor by tensor.

    Subclasses implement :meth:`rank_files` (pure: where rank ``r``'s tensors go) and :meth:`templates` (the
    objects to pickle around its state dict) and may override :meth:`finish` to write the layout's other files.
    ``pickle_module`` is what ``torch.save`` would pickle with. :meth:`templates` is called from ``__init__``:
    set what it needs before calling ``super().__init__``.
    """

    pickle_module: Any = pickle

    @classmethod
    def file_plan(cls, spec: TargetSpec) -> RankFilePlan:
        """Every rank's files, as :meth:`rank_files` places the rank's tensors."""
        ranks = tuple(
            tuple((path.as_posix(), frozenset(names)) for path, names in cls.rank_files(spec, rank, list(headers)))
            for rank, headers in enumerate(spec.rank_headers)
        )
        return RankFilePlan({path: names for files in ranks for path, names in files}, ranks)

    @classmethod
    def rank_files(cls, spec: TargetSpec, rank: int, names: list[str]) -> list[tuple[PurePosixPath, set[str]]]:
        """Rank ``rank``'s files (paths relative to the output folder) and the tensors of ``names`` each holds (a
        tensor may be in several files: each gets it)."""
        raise NotImplementedError

    def __init__(self, out_dir: Path, spec: TargetSpec, plan: RankFilePlan, run: RunFiles = ONE_RUN) -> None:
        self.out_dir, self.spec = out_dir, spec  # templates reads them
        order = {name: i for i, name in enumerate(spec.source.names())}
        hooks = run.hooks(out_dir)
        writers = []
        for rank, (files, headers) in enumerate(zip(plan.ranks, spec.rank_headers, strict=True)):
            names = sorted(headers, key=lambda n: order.get(n, len(order)))
            templates = self.templates(rank, {name: TensorSlot(name, headers[name]) for name in names})
            zips = []
            for (relative, held), template in zip(files, templates, strict=True):
                (out_dir / relative).parent.mkdir(parents=True, exist_ok=True)
                keep, on_done = hooks(out_dir / relative)
                file = TorchZipWriter(
                    out_dir / relative, template, pickle_module=self.pickle_module, keep=keep, on_done=on_done
                )
                if frozenset(file.keys) != held:
                    raise ValueError(f"{relative}: the template holds other tensors than the file plan says")
                zips.append(file)
            writers.append(_RankFiles(zips))
        super().__init__(out_dir, spec, plan, run, writers)

    def templates(self, rank: int, state_dict: dict[str, TensorSlot]) -> list[Any]:
        """The object to save in each of rank ``rank``'s files (in :meth:`rank_files` order), with the slots of
        ``state_dict`` (in the source's order) inside them."""
        raise NotImplementedError

    def finish(self) -> list[Path]:
        """Write the layout's files other than the rank files; return their relative paths."""
        return []

    def close(self) -> list[Path]:
        for writer in self.rank_writers:
            writer.close()
        files = [Path(path) for path in self.plan.files]
        return [*files, *(self.finish() if self.run.writes_shared else [])]


class _RankFiles:
    """One target rank's torch files: a tensor goes to every file whose template has a slot for it."""

    def __init__(self, files: list[TorchZipWriter]) -> None:
        self._files = files
        self._by_key: dict[str, list[TorchZipWriter]] = {}
        for file in files:
            for key in file.keys:
                self._by_key.setdefault(key, []).append(file)

    def write_unordered(self, name: str, tensor: torch.Tensor | Joined) -> None:
        for file in self._by_key[name]:
            file.write(name, tensor)

    write = write_unordered

    def position(self, name: str) -> int | None:
        """Where ``name``'s bytes start in the first of its files (the phase the engine fills its blocks on)."""
        files = self._by_key.get(name)
        return files[0].position(name) if files else None

    @property
    def takes_parts(self) -> bool:
        return True

    def begin_parts(self, name: str, shape: tuple[int, ...], code: str) -> None:
        for file in self._by_key[name]:
            file.begin_parts(name, shape, code)

    def write_part(self, name: str, views: Sequence[memoryview], start: int) -> None:
        for file in self._by_key[name]:
            file.write_part(name, views, start)

    def end_parts(self, name: str) -> None:
        for file in self._by_key[name]:
            file.end_parts(name)

    def close(self) -> None:
        for file in self._files:
            file.close()
