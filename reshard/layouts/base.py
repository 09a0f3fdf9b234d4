"""What every layout hands the pipeline: a :class:`SourceCheckpoint` of lazy :class:`TensorRef`s."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from reshard.config import ModelConfig, SourceFacts
from reshard.dtypes import TensorHeader
from reshard.errors import ReshardError
from reshard.formats.adapter_config import AdapterFacts
from reshard.formats.file_plan import FilePlan
from reshard.formats.readers import FileReader
from reshard.formats.safetensors.writer import FileHooks
from reshard.formats.tokenizer import NamedTokenizer
from reshard.layouts.refs import TensorRef
from reshard.layouts.training import CarriedState, TrainingState

if TYPE_CHECKING:
    import torch

    from reshard.io.joined import Joined


class NoteScope(Enum):
    """When a note about a source is true."""

    OWN_LAYOUT = "own-layout"  # only of an output in the source's own layout (how to load what it does not carry)
    VOCAB_UNKNOWN = "vocab-unknown"  # only while no true vocab size is known


@dataclass
class SourceCheckpoint:
    """A checkpoint as ``tp`` ranks, each a mapping ``name -> TensorRef``, plus what came with it.

    Attributes:
        path: what the user named.
        layout: the layout it was read as.
        ranks: one mapping per TP rank, in rank order.
        config: the model config, from ``config.json`` or the layout's own metadata.
        extras: per rank, non-tensor state-dict entries (Megatron ``_extra_state`` blobs, ...).
        top_level: per rank, other top-level keys of torch files (``args``, optimizer state, ...).
        notes: things ``inspect`` should tell the user (legacy files, dropped keys, grouping).
        scoped_notes: notes true only of some uses of it (:class:`NoteScope`); :meth:`notes_for` picks them.
        side_files: files to copy beside the output (tokenizer, generation config, ...).
        tokenizer: the tokenizer the checkpoint names (Megatron's args, NeMo's context), whose files an HF output
            carries when they are on this machine.
        facts: what the layout read for writers and mappings (its own :class:`SourceFacts` subclass).
        refusal: why a conversion of it is refused though ``inspect`` and ``check`` read it (a legacy QKV order,
            a Hub repo read from its headers only); raised as soon as a conversion is planned.
        hub: for a Hub repo, the repo, revision and commit read and what the client received.
        training: the training state beside the weights (optimizer, step, groups), where the layout reads it.
        adapter: the LoRA adapter it was narrowed to for a PEFT adapter folder (:mod:`reshard.layouts.peft`).
    """

    path: Path
    layout: str
    ranks: list[dict[str, TensorRef]]
    config: ModelConfig | None = None
    extras: list[dict[str, Any]] = field(default_factory=list)
    top_level: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    scoped_notes: list[tuple[NoteScope, str]] = field(default_factory=list)
    side_files: list[Path] = field(default_factory=list)
    tokenizer: NamedTokenizer | None = None
    facts: SourceFacts = field(default_factory=SourceFacts)
    refusal: ReshardError | None = None
    hub: dict[str, Any] | None = None
    training: TrainingState | None = None
    adapter: AdapterFacts | None = None

    @property
    def tp(self) -> int:
        return len(self.ranks)

    @property
    def files(self) -> list[Path]:
        seen: dict[Path, None] = {}
        for rank in self.ranks:
            for ref in rank.values():
                seen.setdefault(ref.file)
        return list(seen)

    def notes_for(self, *, layout: str | None, vocab_known: bool) -> list[str]:
        """The notes true of what is done with it: every plain note; those of :attr:`NoteScope.OWN_LAYOUT` when
        ``layout`` (the output's) is its own or None (``inspect``, which reports on the source itself); those of
        :attr:`NoteScope.VOCAB_UNKNOWN` while no true vocab size is known (no ``--vocab``, manifest or config)."""
        wanted = {NoteScope.OWN_LAYOUT} if layout in (None, self.layout) else set()
        wanted |= set() if vocab_known else {NoteScope.VOCAB_UNKNOWN}
        return [*self.notes, *(text for scope, text in self.scoped_notes if scope in wanted)]

    def names(self) -> list[str]:
        """Every tensor name, in the order the ranks first list them."""
        seen: dict[str, None] = {}
        for rank in self.ranks:
            for name in rank:
                seen.setdefault(name)
        return list(seen)


def numbered_children(folder: Path, pattern: re.Pattern[str], *, want_dirs: bool) -> dict[int, Path]:
    """``{number: path}`` for every folder (``want_dirs``) or file directly in ``folder`` whose name matches
    ``pattern``; its first group is the number (a rank)."""
    if not folder.is_dir():
        return {}
    found: dict[int, Path] = {}
    for child in sorted(folder.iterdir()):
        match = pattern.match(child.name)
        if match and (child.is_dir() if want_dirs else child.is_file()):
            number = int(match.group(1))
            if number in found:
                raise ReshardError(
                    f"{found[number].name} and {child.name} both carry rank {number}",
                    path=folder,
                    hint="keep one of them",
                )
            found[number] = child
    return found


def refs_from_readers(readers: Iterable[FileReader], rank: int) -> dict[str, TensorRef]:
    """Merge the tensors of several files of one rank (shards of one state dict)."""
    refs: dict[str, TensorRef] = {}
    for reader in readers:
        for key, header in reader.headers.items():
            refs[key] = TensorRef(key, rank, reader, key, header)
    return refs


@dataclass(frozen=True)
class RunFiles:
    """What the run tells its writer of the files, beside the plan (:class:`TargetSpec`), once it knows them: a resumed
    or shared run's are known only after the file plan is made and the output staged.

    Attributes:
        done_files: data files (paths relative to the output folder) that a resumed run found complete: the
            writer leaves them as they are and drops what would go into them.
        on_file_done: told the relative path of every other data file once its last byte is written.
        writes_shared: write the files that are not data files (config, index, tracker, metadata); one of several
            processes writing one output (:mod:`reshard.engine.run.workers`) leaves them to rank 0.
    """

    done_files: frozenset[str] = frozenset()
    on_file_done: Callable[[str], None] | None = None
    writes_shared: bool = True

    def hooks(self, out_dir: Path) -> FileHooks:
        """For a data file inside ``out_dir``: whether it is done (:attr:`done_files`), and what tells
        :attr:`on_file_done` once it is complete."""

        def hooks(path: Path) -> tuple[bool, Callable[[], None] | None]:
            relative, callback = path.relative_to(out_dir).as_posix(), self.on_file_done
            return relative in self.done_files, (None if callback is None else lambda: callback(relative))

        return hooks


# A run of one process that resumes nothing: every file to write, the shared ones too.
ONE_RUN = RunFiles()


@dataclass(frozen=True)
class TargetSpec:
    """Everything a writer needs to know before the first tensor arrives.

    Attributes:
        tp: number of target ranks.
        rank_headers: per target rank, ``name -> TensorHeader`` in write order.
        config: the ``config.json`` content to write (vocab size already corrected), if any.
        vocab_size: the true vocab size, if known.
        padded_vocab_size: the vocab size the vocab tensors are padded to at the target tp.
        max_shard_size: for safetensors outputs, the largest file before a new shard starts.
        source: the checkpoint being converted (layout writers read its ``facts``, ``extras``, ``top_level``).
        layout_facts: the facts a mapping made for the target (its layout's :class:`SourceFacts` subclass), which
            its writer reads before the source's: a Megatron target's args when the source has none.
        requested_tp: the tp asked for (``--tp``); a layout of global tensors records it and writes ``tp`` 1.
        pp: pipeline stages to write (layouts without stages refuse more than one).
        training: the training state carried (``--with-optimizer``; only to a writer that
            :attr:`~CheckpointWriter.holds_training_state`); its state tensors are among ``rank_headers``.
    """

    tp: int
    rank_headers: list[dict[str, TensorHeader]]
    config: dict[str, Any] | None
    vocab_size: int | None
    padded_vocab_size: int | None
    max_shard_size: int | str
    source: SourceCheckpoint
    layout_facts: SourceFacts | None = None
    requested_tp: int = 1
    pp: int = 1
    training: CarriedState | None = None


@runtime_checkable
class PartsWriter(Protocol):
    """One rank's file writer that knows where each tensor lands before its bytes arrive, and takes them as byte
    ranges (the safetensors writers of :mod:`reshard.formats.safetensors.writer`, and the torch zip writer of
    :mod:`reshard.formats.torch_zip.writer`, which joins its ranges' CRC-32s). A :class:`RankFilesWriter` whose every
    rank writer is one :attr:`takes_parts`.

    The calls for one tensor happen in this order: 1) :meth:`position` (any time); 2) :meth:`begin_parts`;
    3) :meth:`write_part`, any number of times, ranges in any order, from the thread that began it;
    4) :meth:`end_parts`. Other tensors may be written meanwhile, from other threads.
    """

    def position(self, name: str) -> int | None:
        """Where ``name``'s bytes start in its file (None when it is not this writer's)."""
        ...

    def begin_parts(self, name: str, shape: tuple[int, ...], code: str) -> None:
        """Announce that tensor ``name``'s bytes (of ``shape`` and dtype ``code``) come in parts."""
        ...

    def write_part(self, name: str, views: Sequence[memoryview], start: int) -> None:
        """Write bytes ``[start, start + len)`` of tensor ``name``; the views may be reused once this returns."""
        ...

    def end_parts(self, name: str) -> None:
        """Every byte of ``name`` is written."""
        ...


class CheckpointWriter:
    """Receives, tensor by tensor, the target rank slices and lays them out on disk.

    The calls happen in this order: 0) :meth:`file_plan` (pure: the data files and their tensors, from the spec
    alone); 1) ``__init__`` with that plan (the writer lays out exactly those files, never another plan);
    2) :meth:`write` or :meth:`write_unordered` per tensor; 3) :meth:`close`. Subclasses write into ``out_dir``
    (a temporary folder the caller renames into place when :meth:`close` returns) and return the paths they
    wrote, relative to it.
    """

    def __init__(self, out_dir: Path, spec: TargetSpec, plan: FilePlan, run: RunFiles = ONE_RUN) -> None:
        self.out_dir = out_dir
        self.spec = spec
        self.plan = plan
        self.run = run

    @classmethod
    def file_plan(cls, spec: TargetSpec) -> FilePlan:
        """Every data file the writer will write for ``spec`` and the tensors each holds; reads and writes nothing.

        Raises:
            ReshardError: the layout cannot hold the target (found here, before any output exists).
        """
        raise NotImplementedError

    @classmethod
    def pad_multiple(cls, tp: int, source: SourceCheckpoint, layout_facts: SourceFacts | None) -> int | None:
        """The multiple the vocab is padded to for ``tp`` ranks when the user does not say (None: tp);
        ``layout_facts`` are those a mapping made for the target, if any (:attr:`TargetSpec.layout_facts`)."""
        return None

    @classmethod
    def check_names(cls, names: list[str], source: SourceCheckpoint) -> None:
        """Refuse, before any output exists, target names the layout's framework cannot hold."""

    @classmethod
    def vocab_problems(
        cls, source: SourceCheckpoint, *, padded_rows: int | None, pad_multiple: int
    ) -> list[ReshardError]:
        """Problems of an output whose true vocab size is unknown (``padded_rows`` rows in the source), when the
        layout's framework would pad it differently at load time."""
        return []

    # Why the layout's runtime cannot load copies of a KV head on several ranks (``replicated_heads`` at a tp
    # above the head count); None when it can.
    replicated_heads_refusal: str | None = None

    # True when the layout holds an optimizer's state beside the weights: the writer receives each parameter's state
    # tensors (:func:`reshard.layouts.training.state_name`) and :attr:`TargetSpec.training` (``--with-optimizer``).
    holds_training_state: bool = False

    # The :attr:`~reshard.layouts.training.Leftover.key` of what the writer takes over from a source of its own
    # framework as it is (Megatron's LR scheduler, which does not depend on the parallelism): not left behind.
    carries: frozenset[str] = frozenset()

    # True when :meth:`write_unordered` may be called from several threads at once, in any order
    # (the writer knows every tensor's place up front), so the callers' threads write in parallel.
    concurrent: bool = False

    def write(self, name: str, slices: list[torch.Tensor | Joined]) -> None:
        raise NotImplementedError

    def write_unordered(self, name: str, slices: list[torch.Tensor | Joined]) -> None:
        """Like :meth:`write`, in any order and from any thread; only when :attr:`concurrent`."""
        raise NotImplementedError

    def position(self, name: str, rank: int = 0) -> int | None:
        """Where rank ``rank``'s slice of ``name`` will start in its file, when the layout fixes it before the slice
        arrives (None otherwise). The engine puts memory it fills for the target (a transform's output, a streamed
        block) on that offset's 4 KB phase, so it goes to the disk without a staging copy
        (:func:`reshard.io.direct.in_phase`)."""
        return None

    @property
    def takes_parts(self) -> bool:
        """Whether a tensor's slices may be written in byte ranges instead (:meth:`begin_parts`, :meth:`write_part`,
        :meth:`end_parts`, the calls of a :class:`PartsWriter` with a rank), as they stream through a small buffer:
        only writers that need no whole slice."""
        return False

    def begin_parts(self, name: str, shapes: Sequence[tuple[int, ...]], code: str) -> None:
        """Announce that tensor ``name``'s slices (one shape per target rank, of dtype ``code``) come as byte ranges;
        only when :attr:`takes_parts`. Any thread; the parts of one tensor from one thread."""
        raise NotImplementedError

    def write_part(self, name: str, rank: int, views: Sequence[memoryview], start: int) -> None:
        """Write bytes ``[start, start + len)`` of rank ``rank``'s slice of ``name``; the views may be reused once
        this returns."""
        raise NotImplementedError

    def end_parts(self, name: str) -> None:
        """Every byte of every slice of ``name`` is written."""
        raise NotImplementedError

    def close(self) -> list[Path]:
        raise NotImplementedError


class RankFilesWriter(CheckpointWriter):
    """A writer that keeps one file writer per target rank and hands each rank its slice.

    ``rank_writers`` are anything with ``write(name, tensor)`` and ``write_unordered(name, tensor)``
    (safetensors writers whose offsets are known up front), so callers may write from several threads.
    """

    concurrent = True

    def __init__(
        self, out_dir: Path, spec: TargetSpec, plan: FilePlan, run: RunFiles, rank_writers: list[Any]
    ) -> None:
        super().__init__(out_dir, spec, plan, run)
        self.rank_writers = rank_writers

    def write(self, name: str, slices: list[torch.Tensor | Joined]) -> None:
        for writer, piece in zip(self.rank_writers, slices, strict=True):
            writer.write(name, piece)

    def write_unordered(self, name: str, slices: list[torch.Tensor | Joined]) -> None:
        for writer, piece in zip(self.rank_writers, slices, strict=True):
            writer.write_unordered(name, piece)

    def position(self, name: str, rank: int = 0) -> int | None:
        """Rank ``rank``'s file writer's offset of ``name``, for writers that know it up front (safetensors)."""
        writer = self.rank_writers[rank] if rank < len(self.rank_writers) else None
        return writer.position(name) if isinstance(writer, PartsWriter) else None

    @property
    def takes_parts(self) -> bool:
        """Whether every rank's writer is a :class:`PartsWriter`."""
        return all(isinstance(writer, PartsWriter) for writer in self.rank_writers)

    def begin_parts(self, name: str, shapes: Sequence[tuple[int, ...]], code: str) -> None:
        for writer, shape in zip(self.rank_writers, shapes, strict=True):
            writer.begin_parts(name, tuple(shape), code)

    def write_part(self, name: str, rank: int, views: Sequence[memoryview], start: int) -> None:
        self.rank_writers[rank].write_part(name, views, start)

    def end_parts(self, name: str) -> None:
        for writer in self.rank_writers:
            writer.end_parts(name)
