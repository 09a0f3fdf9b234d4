"""A layout's one entry in the registry: everything the engine, the commands, the Hub code and the mappings may
ask of it, so that none of them names a layout.

A layout package (``layouts/hf/``, ``layouts/megatron/``, ...) builds one :class:`LayoutSpec` per layout it
reads and lists it in :data:`reshard.layouts.LAYOUTS`. The calls happen in this order:

0. ``detect(path)``: the registry tries the specs in their order; the first that says yes reads the folder;
1. ``open(path, options)``: headers only, a :class:`~reshard.layouts.base.SourceCheckpoint` whose ``facts`` are
   the layout's own :class:`~reshard.config.SourceFacts` subclass;
2. for a conversion into it: ``writer`` (its class methods while planning: ``pad_multiple``, ``check_names``,
   ``vocab_problems``, ``replicated_heads_refusal``, then ``file_plan``; then an instance built from that file
   plan that receives the tensors);
3. ``fix``: ``missing_rank_files`` names what a partial checkpoint lacks; ``verify``: ``check_files`` lists the
   files a written folder of the layout lacks.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from reshard.errors import ReshardError
from reshard.layouts.base import CheckpointWriter, SourceCheckpoint
from reshard.options import ReadOptions

__all__ = ["FileProblem", "LayoutSpec"]


@dataclass(frozen=True)
class FileProblem:
    """A file a written checkpoint lacks or holds twice: ``kind`` is ``missing-file`` or ``duplicate``."""

    kind: str
    tensor: str | None
    detail: str
    file: str


def _no_names(source: SourceCheckpoint, tp: int) -> list[str] | None:
    return None


@dataclass(frozen=True)
class LayoutSpec:
    """One layout: how it is found, read and written, and what the rest of reshard needs to know of it.

    Attributes:
        name: the name users give (``--layout``) and manifests record.
        looked_for: what :attr:`detect` looks for, for the error when no layout reads a path.
        detect: whether a folder is of this layout (cheap: names and small files only).
        open: read a file or folder of this layout from headers.
        writer: the writer of the layout; None for a layout reshard only reads.
        library: the library that loads a folder of this layout as it is (the model card's ``library_name``).
        carries_tokenizer: an output of this layout is read by transformers and runtimes (vLLM), which need a
            tokenizer and ``generation_config.json`` at its top (a chosen tokenizer is copied there).
        naming: whose tensor names its files hold (``"hf"``: transformers', ``"megatron"``: Megatron's); None keeps
            the source's names.
        kept: a conversion without ``--layout`` writes the source's layout again (else transformers' folders).
        global_tensors: holds global tensors that any tp loads: planned at tp 1, the tp asked only recorded.
        loaded_at_any_size: for a layout of global tensors, the note a conversion into it ends with: who loads it at
            any parallel size and what it records of the sizes asked (``{tp}`` and ``{pp}`` stand for them).
        pipeline_stages: can write ``--pp`` stages.
        trackers: small files naming the folder to read (Megatron's ``latest_checkpointed_iteration.txt``), each with
            what gives the folder's name from the file's text.
        rank_folder: names of the folders that hold one rank's files.
        missing_rank_files: the files or folders ranks ``source.tp .. tp-1`` would have, when names tell them.
        check_files: the files a folder written in this layout for ``tp`` ranks lacks or holds twice; None: the
            folder is checked by reading it.
        lora_adapter: holds a LoRA adapter alone (PEFT's folder): a conversion into it opens the source with its
            chosen adapter's tensors only, under PEFT's saved names.
    """

    name: str
    looked_for: str
    detect: Callable[[Path], bool]
    open: Callable[[Path, ReadOptions], SourceCheckpoint]
    writer: type[CheckpointWriter] | None = None
    library: str | None = None
    carries_tokenizer: bool = False
    naming: str | None = None
    kept: bool = False
    global_tensors: bool = False
    loaded_at_any_size: str = ""
    pipeline_stages: bool = False
    trackers: tuple[tuple[str, Callable[[str], str | None]], ...] = ()
    rank_folder: re.Pattern[str] | None = None
    missing_rank_files: Callable[[SourceCheckpoint, int], list[str] | None] = _no_names
    check_files: Callable[[Path, int | None], list[FileProblem]] | None = None
    lora_adapter: bool = False

    @property
    def target_writer(self) -> type[CheckpointWriter]:
        """The writer of a layout a conversion writes (:func:`reshard.layouts.target_layout` refuses the others).

        Raises:
            ReshardError: the layout is one reshard only reads.
        """
        if self.writer is None:
            raise ReshardError(f"cannot write the {self.name!r} layout")
        return self.writer

    def planned_tp(self, tp: int) -> int:
        """The tp a conversion into this layout is planned at: 1 for global tensors, else ``tp``."""
        return 1 if self.global_tensors else tp

    def __str__(self) -> str:
        return self.name
