"""The ``dcp`` layout: a PyTorch Distributed Checkpoint (``torch.distributed.checkpoint.save``), read only.

    <ckpt>/.metadata                     a pickle of the global index (read with stand-ins, never run)
    <ckpt>/__{rank}_{n}.distcp           whole torch.save archives, one per chunk, back to back
    (or __{rank}.metadata per rank; or shard-*-model-*.safetensors with DCP_SHARDING_INFO)

A DCP checkpoint stores every tensor by its global shape and the chunk boxes each rank held, so it is
presented as a tp=1 checkpoint of global tensors: each tensor is assembled from the boxes over it when
it is read (:mod:`reshard.layouts.dcp.boxed_reader`), and any target tp is one slice of it away. No process
group, no torch.distributed import. Only the model's tensors are read: optimizer, scheduler,
dataloader, rng and training-state entries are skipped and reported (torchtitan saves the model at the
top level next to ``optimizer.*``, ``lr_scheduler.*``, ``dataloader.*`` and ``train_state.*``; the DCP
tutorials nest it as ``model.*`` next to ``optim.*``, and then the ``model.`` prefix is dropped).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from reshard.config import CONFIG_NAME, find_config
from reshard.errors import CorruptFileError, PlanError, ReshardError
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
from reshard.layouts.dcp.dcp_checks import check_files, check_tensor
from reshard.options import ReadOptions
from reshard.sizes import human_bytes

# State-dict keys that hold training state, not the model (any container of an entry's key path).
NOT_MODEL = frozenset(
    "optimizer optimizers optim optim_state optimizer_state lr_scheduler lr_schedulers scheduler schedulers "
    "dataloader dataloaders data_loader train_state trainer_state training_state rng rng_state rng_states "
    "rng_tracker_states grad_scaler scaler".split()
)

NAME = "dcp"
# Keys that a trainer nests the model under: dropped from the names when every model tensor sits under one.
MODEL_KEYS = ("model", "module", "state_dict")
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
    model, skipped = _split(index)
    model, sizes = checked(model)
    names, prefix = _names(index, list(model))
    reader = BoxedReader(path, {names[fqn]: BoxView.whole(tensor) for fqn, tensor in model.items()})
    refs = {name: TensorRef(name, 0, reader, name, reader.headers[name]) for name in reader.headers}
    source = SourceCheckpoint(path, NAME, [refs], config=find_config(path), side_files=_side_files(path))
    source.notes.append(_summary(index, model, sizes))
    source.notes.extend(index.notes)
    if prefix:
        source.notes.append(f"model tensors are stored under '{prefix}.': read by their names inside it")
    values = {fqn: size for fqn, size in index.values.items() if fqn not in skipped}
    source.extras.append({names.get(fqn, fqn): f"{human_bytes(size)} pickled value" for fqn, size in values.items()})
    groups = _groups(index, skipped)
    source.top_level.append(groups)
    if groups:
        total = sum(g["bytes"] for g in groups.values())
        listed = ", ".join(f"{key} ({_counts(g)}, {human_bytes(g['bytes'])})" for key, g in groups.items())
        source.notes.append(f"skipped, not model weights: {listed}; {human_bytes(total)} in all")
    return source


def _key_path(index: DcpIndex, fqn: str) -> tuple[Any, ...]:
    return index.paths.get(fqn) or tuple(fqn.split(".", 1))


def _split(index: DcpIndex) -> tuple[dict[str, StoredTensor], set[str]]:
    """The model's tensors, and the fqns (tensors and values) that are training state."""
    skipped = {
        fqn
        for fqn in [*index.tensors, *index.values]
        if any(isinstance(k, str) and k in NOT_MODEL for k in _key_path(index, fqn)[:-1])
    }
    return {fqn: t for fqn, t in index.tensors.items() if fqn not in skipped}, skipped


def _names(index: DcpIndex, fqns: list[str]) -> tuple[dict[str, str], str | None]:
    """Names for the model's tensors: the fqns, or the keys inside ``model`` when every tensor is under it."""
    paths = [index.paths.get(fqn) for fqn in fqns]
    if fqns and all(p and len(p) == 2 and isinstance(p[1], str) and p[0] == paths[0][0] for p in paths):
        if paths[0][0] in MODEL_KEYS:
            names = {fqn: p[1] for fqn, p in zip(fqns, paths, strict=True)}
            extra = {
                fqn: key_path[1]
                for fqn in index.values
                if (key_path := index.paths.get(fqn)) and len(key_path) == 2 and key_path[0] == paths[0][0]
            }
            return {**names, **extra}, paths[0][0]
    return {fqn: fqn for fqn in fqns}, None


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
    if chunk.position != start or found != (tensor.code, chunk.box.sizes):
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


def _groups(index: DcpIndex, skipped: set[str]) -> dict[str, dict[str, int]]:
    """The skipped entries by their top-level key: how many tensors and values, and their bytes on disk."""
    groups: dict[str, dict[str, int]] = {}
    for fqn in sorted(skipped):
        top = str(_key_path(index, fqn)[0])
        group = groups.setdefault(top, {"tensors": 0, "values": 0, "bytes": 0})
        if fqn in index.tensors:
            group["tensors"] += 1
            group["bytes"] += index.tensors[fqn].stored_bytes
        else:
            group["values"] += 1
            group["bytes"] += index.values[fqn]
    return groups


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
