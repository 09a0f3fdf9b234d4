"""The ``dcp`` layout: a PyTorch Distributed Checkpoint (``torch.distributed.checkpoint.save``), read only.

    <ckpt>/.metadata                     a pickle of the global index (read with stand-ins, never run)
    <ckpt>/__{rank}_{n}.distcp           whole torch.save archives, one per chunk, back to back
    (or __{rank}.metadata per rank; or shard-*-model-*.safetensors with DCP_SHARDING_INFO)

A DCP checkpoint stores every tensor by its global shape and the chunk boxes each rank held, so it is
presented as a tp=1 checkpoint of global tensors: each tensor is assembled from the boxes over it when
it is read (:mod:`reshard.layouts.dcp.boxed_reader`), and any target tp is one slice of it away. No process
group, no torch.distributed import. The model's tensors are read by their names inside the container the
trainer nested them in (:mod:`reshard.layouts.dcp.containers`); the optimizer's state beside them is the
checkpoint's training state (:mod:`reshard.layouts.dcp.optimizer`: moments read lazily from their boxes as the
weights are); scheduler, dataloader, rng and trainer entries are reported as not carried. A folder with no model
tensors is refused (:class:`NoModelError`).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from reshard.config import CONFIG_NAME, find_config
from reshard.errors import CorruptFileError, NoModelError, PlanError, ReshardError
from reshard.formats.chunks import safetensors_entries, starts_as_zip
from reshard.formats.dcp_metadata.read import (
    HF_SHARD,
    METADATA,
    RANK_METADATA,
    DcpIndex,
    StoredChunk,
    StoredTensor,
    is_dcp_folder,
    read_index,
)
from reshard.layouts.base import SourceCheckpoint, TensorRef
from reshard.layouts.dcp.boxed_reader import BoxedReader, BoxView
from reshard.layouts.dcp.containers import model_entries
from reshard.layouts.dcp.dcp_checks import check_files, check_tensor
from reshard.layouts.dcp.optimizer import state_entries, training_state
from reshard.layouts.training import SLOTS, state_name
from reshard.options import ReadOptions
from reshard.sizes import human_bytes

NAME = "dcp"
_OWN_FILES = (METADATA, "reshard.json", CONFIG_NAME, "model.safetensors.index.json")


def detect(path: Path) -> bool:
    """True for a DCP folder (``.metadata``, ``__{r}.metadata`` or ``shard-*-model-*.safetensors``)."""
    return is_dcp_folder(path)


def discover(path: Path, options: ReadOptions) -> SourceCheckpoint:
    """Open a DCP folder as a tp=1 checkpoint of its model's global tensors, from its index alone.

    Raises:
        UnsafePickleError: the metadata pickles a class outside the DCP allow-list.
        ReshardError: the index is inconsistent (boxes outside the shape, overlapping or missing, byte ranges
            past a file's end, missing data files, compressed chunks); each problem names file and tensor.
    """
    index = read_index(path, trust_pickle=options.trust_pickle)
    entries = model_entries(index)
    groups = _groups(index, entries.skipped)
    if not entries.tensors:
        raise _no_model(path, len(index.values) - len(set(index.values) & set(entries.skipped)), groups)
    found = state_entries(index, entries)
    states = {state_name(p, slot): fqn for (p, slot), fqn in found.tensors.items() if slot in SLOTS}
    extra = {fqn: index.tensors[fqn] for fqn in [*states.values(), *found.steps.values()]}
    everything, sizes = checked({**entries.tensors, **extra})
    names = entries.names
    views = {names[fqn]: BoxView.whole(everything[fqn]) for fqn in entries.tensors}
    reader = BoxedReader(path, views | {name: BoxView.whole(everything[fqn]) for name, fqn in states.items()})
    refs = {name: TensorRef(name, 0, reader, name, reader.headers[name]) for name in views}
    state_refs = {name: TensorRef(name, 0, reader, name, reader.headers[name]) for name in states}
    model = {fqn: everything[fqn] for fqn in entries.tensors}
    source = SourceCheckpoint(path, NAME, [refs], config=find_config(path), side_files=_side_files(path))
    source.training = training_state(index, found, everything, list(refs), state_refs)
    source.notes.append(_summary(index, model, sizes))
    source.notes.extend(index.notes)
    if entries.container:
        prefix = ".".join(str(key) for key in entries.container)
        source.notes.append(f"model tensors are stored under '{prefix}.': read by their names inside it")
    values = {fqn: size for fqn, size in index.values.items() if fqn not in entries.skipped}
    source.extras.append({names.get(fqn, fqn): f"{human_bytes(size)} pickled value" for fqn, size in values.items()})
    source.top_level.append(groups)
    if groups:
        total = sum(g["bytes"] for g in groups.values())
        source.notes.append(f"skipped, not model weights: {_listed(groups)}; {human_bytes(total)} in all")
    if source.training is not None and source.training.moments:
        moments = ", ".join(source.training.moments)
        source.notes.append(f"optimizer state beside the weights: {moments} (--with-optimizer carries it)")
    return source


def checked(model: dict[str, StoredTensor]) -> tuple[dict[str, StoredTensor], dict[Path, int]]:
    """The tensors with their chunks located (torch.save archives or safetensors blobs), and the data files'
    sizes, after checking the boxes and files; every problem is raised at once, naming file and tensor."""
    problems = [problem for tensor in model.values() if (problem := check_tensor(tensor))]
    sizes: dict[Path, int] = {}
    if not problems:
        problems, sizes = check_files(list(model.values()))
    if not problems:
        model = _resolve_formats(model, sizes, problems)
    if problems:
        raise problems[0] if len(problems) == 1 else PlanError(problems)
    return model, sizes


def _resolve_formats(
    model: dict[str, StoredTensor], sizes: dict[Path, int], problems: list[ReshardError]
) -> dict[str, StoredTensor]:
    """Tell torch.save chunks from safetensors ones (by the first bytes at each file's first chunk) and
    locate the safetensors chunks' bytes in their blob's header."""
    firsts: dict[Path, int] = {}
    for tensor in model.values():
        for chunk in tensor.chunks:
            if chunk.data is None:
                firsts[chunk.file] = min(firsts.get(chunk.file, chunk.position), chunk.position)
    blobs: dict[Path, tuple[int, dict[str, Any]]] = {}
    for file, first in firsts.items():
        if not starts_as_zip(file, first):
            blobs[file] = (first, safetensors_entries(file, first, sizes[file])[0])
    if not blobs:
        return model
    resolved = {}
    for fqn, tensor in model.items():
        chunks = []
        for chunk in tensor.chunks:
            if chunk.file in blobs and chunk.data is None:
                chunk = _in_blob(tensor, chunk, *blobs[chunk.file], problems)
            chunks.append(chunk)
        resolved[fqn] = StoredTensor(fqn, tensor.shape, tensor.dtype, tuple(chunks), tensor.declared_in)
    return resolved


def _in_blob(
    tensor: StoredTensor, chunk: StoredChunk, start: int, entries: dict[str, Any], problems: list[ReshardError]
) -> StoredChunk:
    entry = entries.get(tensor.name)
    found = None if entry is None else (entry.code, entry.shape)
    if entry is None or chunk.position != start or found != (tensor.code, chunk.box.sizes):
        problems.append(
            CorruptFileError(
                f"the safetensors data holds {found or 'nothing'} for it, the metadata says a {tensor.code} chunk "
                f"{list(chunk.box.sizes)} at byte {chunk.position}",
                path=chunk.file,
                tensor=tensor.name,
            )
        )
        return chunk
    return StoredChunk(chunk.box, chunk.file, chunk.position, chunk.length, chunk.transforms, data=entry.data)


def _groups(index: DcpIndex, skipped: dict[str, str]) -> dict[str, dict[str, int]]:
    """The skipped entries by the key path they were skipped for: how many tensors and values, their bytes."""
    groups: dict[str, dict[str, int]] = {}
    for fqn, state in sorted(skipped.items()):
        group = groups.setdefault(state, {"tensors": 0, "values": 0, "bytes": 0})
        if fqn in index.tensors:
            group["tensors"] += 1
            group["bytes"] += index.tensors[fqn].stored_bytes
        else:
            group["values"] += 1
            group["bytes"] += index.values[fqn]
    return groups


def _listed(groups: dict[str, dict[str, int]]) -> str:
    return ", ".join(f"{key} ({_counts(g)}, {human_bytes(g['bytes'])})" for key, g in groups.items())


def _no_model(path: Path, values: int, groups: dict[str, dict[str, int]]) -> NoModelError:
    """The error for a folder with no model tensors (``values``: other entries), naming what it holds and the DCP
    folders beside it."""
    held = [_listed(groups)] if groups else []
    held += [_plural(values, "other pickled value")] if values else []
    beside = [p.name + "/" for p in _siblings(path) if p != path and is_dcp_folder(p)]
    return NoModelError(
        f"holds no model tensors, only {'; '.join(held)}" if held else "holds no model tensors, nor anything else",
        path=path,
        hint=f"point reshard at the folder that holds the model: {', '.join(beside)} beside it"
        if beside
        else "point reshard at the folder the model's weights were saved in",
    )


def _siblings(path: Path, limit: int = 64) -> list[Path]:
    """The first ``limit`` folders beside ``path``, by name (a parent of thousands of runs is not walked)."""
    found = []
    for entry in path.parent.iterdir():
        if entry.is_dir():
            found.append(entry)
            if len(found) >= limit:
                break
    return sorted(found)


def _counts(group: dict[str, int]) -> str:
    return ", ".join(_plural(group[kind], kind[:-1]) for kind in ("tensors", "values") if group[kind])


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


def _summary(index: DcpIndex, model: dict[str, StoredTensor], sizes: dict[Path, int]) -> str:
    per_tensor = Counter(len(t.chunks) for t in model.values())
    spread = ", ".join(f"{n} ({_plural(count, 'tensor')})" for n, count in sorted(per_tensor.items()))
    stored = sum(t.stored_bytes for t in model.values())
    return (
        f"{index.form}: {_plural(len(model), 'model tensor')} in {sum(n * c for n, c in per_tensor.items())} chunk "
        f"boxes (boxes per tensor: {spread}), {human_bytes(stored)} in {_plural(len(sizes), 'data file')}"
    )


def _side_files(folder: Path) -> list[Path]:
    """Files beside the checkpoint that belong to the model (tokenizer, generation config, ...)."""
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file()
        and p.name not in _OWN_FILES
        and p.suffix not in (".distcp", ".tmp")
        and not RANK_METADATA.match(p.name)
        and not HF_SHARD.match(p.name)
    )
