"""The ``verl`` layout: a verl FSDP / FSDP2 actor or critic (``global_step_N/actor/``), read without running its
pickles and without a process group.

Each ``model_world_size_{W}_rank_{r}.pt`` is ``torch.save(model.state_dict())`` of one rank: under FSDP2 (and
FSDP1's sharded state dict) a dict of DTensors, each a local tensor with its placements on the mesh, under one GPU
plain tensors. The files are read by the structure-only unpickler (a tensor is where its bytes lie, a DTensor its
local tensor and spec: :mod:`reshard.formats.safe_pickle`); each global tensor is the local pieces put back by their
placements and the ranks' mesh coordinates (:mod:`reshard.layouts.verl.placements`), read by the engine's reader of
boxed tensors, and a piece several ranks hold is compared between them (:mod:`reshard.layouts.verl.reader`). The
config, tokenizer and generation config come from ``huggingface/``; optimizer and extra-state files are training
state, skipped with a note.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.config import find_config
from reshard.dtypes import code_from_name
from reshard.errors import CorruptFileError, ReshardError, UnsafePickleError
from reshard.formats.boxes import Box, tiling_problem
from reshard.formats.chunks import ChunkLayout
from reshard.formats.dcp_metadata.read import StoredChunk, StoredTensor
from reshard.formats.safe_pickle import DeviceMesh, DTensorSpec
from reshard.formats.torch_zip.archive import read_archive
from reshard.formats.torch_zip.structure import DTensorRecord, Inert, TensorRecord
from reshard.layouts.base import SourceCheckpoint, TensorRef
from reshard.layouts.dcp.boxed_reader import BoxView
from reshard.layouts.hf.folder import TENSOR_SUFFIXES, side_files
from reshard.layouts.verl.folder import FSDP_CONFIG, Files, classify, locate
from reshard.layouts.verl.placements import PlacementError, local_box
from reshard.layouts.verl.reader import Copy, PiecesReader
from reshard.options import ReadOptions
from reshard.ranks import listed

NAME = "verl"
MAX_PICKLE = 64 << 20  # a state dict's data.pkl: names, shapes and specs, far below this for any model


@dataclass(frozen=True)
class _Piece:
    """One rank's piece of one tensor: where it lies in the global tensor and in its file."""

    rank: int
    box: Box
    chunk: StoredChunk
    layout: ChunkLayout


def discover(path: Path, options: ReadOptions) -> SourceCheckpoint:
    """Open a verl actor (or the step or run holding one) as one rank of global tensors, from the pickles alone.

    Raises:
        UnsafePickleError: a rank file pickles a class neither a tensor's nor a DTensor's (without ``--trust-pickle``).
        ReshardError: files that do not make one model (see :func:`reshard.layouts.verl.folder.classify`), pieces
            that do not fit their placements or do not tile their tensor; each names the file and the tensor.
    """
    folder, notes = locate(path)
    files = classify(folder)
    ranks = [_read_rank(files.model[r], options) for r in range(files.world_size)]
    names = list(ranks[0])
    for rank, entries in enumerate(ranks[1:], start=1):
        if set(entries) != set(names):
            other = sorted(set(entries) ^ set(names))[0]
            raise CorruptFileError(
                f"rank {rank} and rank 0 hold different tensors ({other} in one only)", path=files.model[rank]
            )
    views: dict[str, BoxView] = {}
    copies: dict[str, tuple[Copy, ...]] = {}
    first_rank: dict[str, int] = {}
    located: dict[tuple[str, StoredChunk], ChunkLayout] = {}
    kinds: dict[str, int] = {}
    for name in names:
        pieces, shape, dtype, kind = _pieces(name, [entries[name] for entries in ranks], files)
        kinds[kind] = kinds.get(kind, 0) + 1
        sets = _copies(name, pieces, shape, files)
        located.update({(name, piece.chunk): piece.layout for piece in pieces})
        for number, members in enumerate(sets):
            stored = StoredTensor(name, shape, dtype, tuple(p.chunk for p in members), files.model[members[0].rank])
            key = name if number == 0 else f"{name}#copy{number}"
            views[key] = BoxView.whole(stored)
        first_rank[name] = sets[0][0].rank
        copies[name] = tuple(Copy(f"{name}#copy{n}", s[0].rank) for n, s in enumerate(sets) if n)
    reader = PiecesReader(folder, views, located=located, copies=copies, first_rank=first_rank)
    refs = {name: TensorRef(name, 0, reader, name, reader.headers[name]) for name in names}
    side = files.side
    config = find_config(side, options.config) if side is not None else find_config(folder, options.config)
    # the actor folder is the checkpoint: a LoRA run's adapter_config.json is looked for in its lora_adapter/
    source = SourceCheckpoint(folder, NAME, [refs], config=config, side_files=side_files(side) if side else [])
    source.notes.extend([*notes, *_file_notes(folder, files, kinds)])
    return source


def _read_rank(file: Path, options: ReadOptions) -> dict[str, tuple[Any, ChunkLayout, StoredChunk]]:
    """Every tensor of one rank file: its record (plain or DTensor) and where its local bytes lie."""

    def refuse(module: str, name: str) -> UnsafePickleError | None:
        if options.trust_pickle:
            return None
        return UnsafePickleError(
            f"pickles {module}.{name}, neither a tensor nor a DTensor's part: refused without running it",
            path=file,
            hint="pass --trust-pickle to read it as an inert object (nothing in it runs), only if you trust the file",
        )

    obj, starts = read_archive(file, refuse=refuse, max_pickle=MAX_PICKLE)
    if not isinstance(obj, Mapping) or not all(isinstance(k, str) for k in obj):
        raise CorruptFileError(f"holds a {type(obj).__name__}, not a model's state dict", path=file)
    found = {}
    for key, value in obj.items():
        local = value.local if isinstance(value, DTensorRecord) else value
        if not isinstance(local, TensorRecord):
            what = (
                "a DTensor without a local tensor"
                if isinstance(value, DTensorRecord)
                else "an object of a class read as inert (--trust-pickle)"
                if isinstance(value, Inert)
                else f"a {type(value).__name__}"
            )
            raise CorruptFileError(f"holds {what}, not a tensor", path=file, tensor=key)
        start = starts.get(local.storage.key)
        if start is None:
            raise CorruptFileError(f"no storage record data/{local.storage.key}", path=file, tensor=key)
        extent = (
            0
            if 0 in local.sizes
            else local.offset + 1 + sum((s - 1) * t for s, t in zip(local.sizes, local.strides, strict=True))
        )
        if local.offset < 0 or min(local.strides, default=0) < 0 or extent > local.storage.numel:
            raise CorruptFileError("its bytes run past its storage record: truncated?", path=file, tensor=key)
        chunk = StoredChunk(Box.whole(local.sizes), file, start, local.storage.nbytes)
        found[key] = (value, ChunkLayout(start, local.offset, local.strides), chunk)
    return found


def _pieces(
    name: str, held: list[tuple[Any, ChunkLayout, StoredChunk]], files: Files
) -> tuple[list[_Piece], tuple[int, ...], str, str]:
    """Each rank's piece of ``name`` placed in the global tensor; the global shape, dtype and what it was stored as."""
    records = [value for value, _, _ in held]
    if all(isinstance(r, TensorRecord) for r in records):
        shape, dtype = records[0].sizes, records[0].dtype
        boxes = [Box.whole(shape)] * len(records)
        kind = "plain tensors"
        for rank, record in enumerate(records):
            if (record.sizes, record.dtype) != (shape, dtype):
                why = (
                    f"torch.{record.dtype} {list(record.sizes)} on rank {rank}, torch.{dtype} {list(shape)} on rank 0"
                )
                raise CorruptFileError(
                    f"a plain tensor saved by every rank, as {why}", path=files.model[rank], tensor=name
                )
    elif all(isinstance(r, DTensorRecord) for r in records):
        shape, dtype, boxes, kind = _placed(name, records, files)
    else:
        raise CorruptFileError("a DTensor on some ranks, a plain tensor on others", path=files.model[0], tensor=name)
    if code_from_name(dtype) is None:
        raise CorruptFileError(f"dtype torch.{dtype} has no safetensors code", path=files.model[0], tensor=name)
    pieces = []
    for rank, (box, (record, layout, chunk)) in enumerate(zip(boxes, held, strict=True)):
        local = record.local if isinstance(record, DTensorRecord) else record
        if local.sizes != box.sizes or local.dtype != dtype:
            raise CorruptFileError(
                f"local tensor torch.{local.dtype} {list(local.sizes)}, but its placements give rank {rank} "
                f"torch.{dtype} {list(box.sizes)} of {list(shape)}",
                path=files.model[rank],
                tensor=name,
            )
        pieces.append(_Piece(rank, box, StoredChunk(box, chunk.file, chunk.position, chunk.length), layout))
    return pieces, shape, dtype, kind


def _placed(name: str, records: list[DTensorRecord], files: Files) -> tuple[tuple[int, ...], str, list[Box], str]:
    """The global shape and dtype of a DTensor saved by every rank, and each rank's box of it."""
    boxes: list[Box] = []
    first: tuple[Any, ...] | None = None
    for rank, record in enumerate(records):
        file = files.model[rank]
        spec = record.spec
        mesh = spec.mesh if isinstance(spec, DTensorSpec) else None
        if not isinstance(mesh, DeviceMesh):
            raise CorruptFileError("a DTensor without its spec and device mesh", path=file, tensor=name)
        sizes, coordinate = mesh.sizes(), mesh._coordinate_on_dim
        meta = spec.tensor_meta
        shape = meta[0] if isinstance(meta, tuple) and meta else record.shape
        if not (isinstance(shape, tuple) and all(type(s) is int and s >= 0 for s in shape)) or shape != record.shape:
            raise CorruptFileError(f"global shape {shape!r} and {record.shape!r} in its spec", path=file, tensor=name)
        if sizes is None or not isinstance(coordinate, tuple) or not isinstance(spec.placements, tuple):
            raise CorruptFileError("a device mesh without its shape or this rank's coordinate", path=file, tensor=name)
        if math.prod(sizes) != files.world_size:
            raise ReshardError(
                f"on a mesh of {list(sizes)} ({math.prod(sizes)} ranks), saved by {files.world_size} rank files",
                path=file,
                tensor=name,
                hint="every rank of the mesh must have saved its file",
            )
        if mesh._rank is not None and mesh._rank != rank:
            raise CorruptFileError(
                f"holds rank {mesh._rank}'s DTensor: a copy of another rank's file?", path=file, tensor=name
            )
        same = (shape, str(record.dtype), sizes, tuple(repr(p) for p in spec.placements))
        if first is not None and same != first:
            raise CorruptFileError(f"saved as {same}, on rank 0 as {first}", path=file, tensor=name)
        first = same
        try:
            boxes.append(local_box(shape, sizes, coordinate, spec.placements))
        except PlacementError as err:
            raise ReshardError(str(err), path=file, tensor=name) from err
    assert first is not None
    placements = ", ".join(
        f"{type(p).__name__}({'' if p.dim is None else p.dim})" if hasattr(p, "dim") else f"{type(p).__name__}()"
        for p in records[0].spec.placements
    )
    return first[0], first[1], boxes, f"DTensors ({placements}) on a mesh of {list(first[2])}"


def _copies(name: str, pieces: list[_Piece], shape: tuple[int, ...], files: Files) -> list[list[_Piece]]:
    """The pieces as whole copies of the tensor: the k-th rank holding a box gives its piece to copy k. Each copy
    must tile the tensor; copy 0 is read, the others are compared with it."""
    sets: list[list[_Piece]] = []
    seen: dict[Box, int] = {}
    for piece in [p for p in pieces if p.box.numel] or pieces[:1]:  # the empty pieces of an uneven cut hold nothing
        number = seen.get(piece.box, 0)
        seen[piece.box] = number + 1
        if number == len(sets):
            sets.append([])
        sets[number].append(piece)
    for members in sets:
        problem = tiling_problem(shape, [p.box for p in members])
        if problem is not None:
            ranks = listed([str(p.rank) for p in members], len(members))
            raise CorruptFileError(
                f"the pieces of ranks {ranks} do not make it: {problem}",
                path=files.model[members[0].rank],
                tensor=name,
            )
    return sets


def _file_notes(folder: Path, files: Files, kinds: dict[str, int]) -> list[str]:
    """What every file of the folder was taken for (``inspect`` shows these notes)."""
    model = [p.name for p in files.model.values()]
    stored = "; ".join(f"{count} as {kind}" for kind, count in kinds.items())
    notes = [f"model weights: {listed(model[:4], len(model))} (world size {files.world_size}; {stored})"]
    if files.training:
        names = [p.name for p in files.training]
        notes.append(f"training state, skipped (not carried yet): {listed(names[:6], len(names))}")
    if files.side is not None:
        side = sorted(p.name for p in files.side.iterdir())
        notes.append(f"{files.side.name}/: config, tokenizer and generation config ({', '.join(side)})")
        weights = [name for name in side if Path(name).suffix in TENSOR_SUFFIXES]
        if weights:  # checkpoint.contents with hf_model: a full copy, saved by verl in bfloat16
            notes.append(
                f"{files.side.name}/ holds full weights too ({listed(weights[:3], len(weights))}): not read, the rank "
                "files are (in the dtype the run trained in)"
            )
    else:
        notes.append("no huggingface/ folder: no config.json, tokenizer or generation config beside the weights")
    if files.lora_adapter is not None:
        held = sorted(p.name for p in files.lora_adapter.iterdir())
        notes.append(
            f"{files.lora_adapter.name}/: a LoRA run's adapter ({', '.join(held) or 'empty'}): its "
            "adapter_config.json gives alpha and r to --merge-lora and --layout peft; the LoRA weights are read from "
            "the rank files"
        )
    if files.fsdp_config is not None:
        recorded = files.fsdp_config
        notes.append(f"{FSDP_CONFIG}: FSDP_version {recorded['FSDP_version']}, world_size {recorded['world_size']}")
    else:
        notes.append(f"no {FSDP_CONFIG} (runs before mid-2025 wrote none): the world size is the rank files'")
    return notes
