"""The ``hf`` layout: a Hugging Face folder (safetensors or ``.bin``, single or sharded) or a single file."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from huggingface_hub.constants import SAFETENSORS_INDEX_FILE, SAFETENSORS_SINGLE_FILE

from reshard.config import CONFIG_NAME, find_config
from reshard.errors import CorruptFileError, MissingRankError, ReshardError
from reshard.formats.file_plan import FilePlan
from reshard.formats.readers import FileReader, open_tensor_file, read_safetensors_header
from reshard.formats.safetensors.writer import ShardedSafetensorsWriter, ShardPlan, plan_shards
from reshard.layouts.base import (
    ONE_RUN,
    PartsWriter,
    RankFilesWriter,
    RunFiles,
    SourceCheckpoint,
    TargetSpec,
    TensorRef,
    refs_from_readers,
)
from reshard.layouts.spec import FileProblem
from reshard.options import ReadOptions

NAME = "hf"

logger = logging.getLogger(__name__)

BIN_SINGLE_FILE = "pytorch_model.bin"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"
TENSOR_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
MANIFEST_NAME = "reshard.json"
# Optimizer state saved beside the weights, never read as weights: DeepSpeed ``*optim_states.pt``, ColossalAI
# ``pytorch_optim*``, Megatron's distributed optimizer ``distrib_optim.pt`` (not ``model_optim_rng.pt``, which
# holds the model).
OPTIMIZER = re.compile(r"optim_states|optimizer|pytorch_optim|distrib_optim", re.I)
# What HF Trainer and accelerate save beside the weights of a checkpoint-N/ folder: never weight files.
TRAINER_STATE = re.compile(
    r"^(training_args\.bin|scheduler\.pt|scaler\.pt|rng_state(_\d+)?\.pth|random_states_\d+\.pkl)$"
)


def is_hf_folder(path: Path) -> bool:
    """True for a folder with HF weight files (single, indexed, or any ``*.safetensors`` / ``*.bin``)."""
    if not path.is_dir():
        return False
    has_index = any((path / name).is_file() for name in (SAFETENSORS_INDEX_FILE, BIN_INDEX_FILE))
    return has_index or bool(weight_files(path))


def weight_files(folder: Path) -> list[Path]:
    """The weight files of one HF folder (:func:`weight_names` of the files it holds).

    An index file, when present, is authoritative: every file it names must exist inside the folder.
    """
    names = [p.name for p in folder.iterdir() if p.is_file()] if folder.is_dir() else []
    return [
        folder / n for n in weight_names(names, lambda index: list(dict.fromkeys(read_index(folder / index).values())))
    ]


def weight_names(names: Iterable[str], index_files: Callable[[str], list[str]]) -> list[str]:
    """The weight files among the file ``names`` of one folder, in the order the HF loaders look for them.

    One rule for a local folder and a Hub repo's folder, so that the Hub downloads exactly what the local reader
    then reads: the files an index names (``index_files(index_name)`` reads and checks them), else
    ``model.safetensors`` / ``pytorch_model.bin``, else every file of the first suffix of
    :data:`TENSOR_SUFFIXES` present; optimizer state (:data:`OPTIMIZER`) and a trainer's other state
    (:data:`TRAINER_STATE`) are never weight files.
    """
    present = set(names)
    for index_name in (SAFETENSORS_INDEX_FILE, BIN_INDEX_FILE):
        if index_name in present:
            return index_files(index_name)
    for single in (SAFETENSORS_SINGLE_FILE, BIN_SINGLE_FILE):
        if single in present:
            return [single]
    for suffix in TENSOR_SUFFIXES:
        found = sorted(
            n for n in present if n.endswith(suffix) and not OPTIMIZER.search(n) and not TRAINER_STATE.match(n)
        )
        if found:
            return found
    return []


def read_index(index: Path) -> dict[str, str]:
    """``weight_map`` of an index, treated as untrusted: file names must be plain names in the folder."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, RecursionError) as err:
        raise CorruptFileError(f"corrupt index: {err!r}", path=index) from err
    for tensor, filename in weight_map.items():
        pure = PurePosixPath(str(filename))
        if pure.is_absolute() or len(pure.parts) != 1 or pure.name in ("", ".", "..") or "\\" in str(filename):
            raise CorruptFileError(f"index names an unsafe file {filename!r}", path=index, tensor=tensor)
        if pure.suffix not in TENSOR_SUFFIXES:
            raise CorruptFileError(f"index names {filename!r}, not a tensor file", path=index, tensor=tensor)
        if not (index.parent / filename).is_file():
            raise MissingRankError(f"index names {filename!r}, which does not exist", path=index, tensor=tensor)
    return weight_map


def read_folder(folder: Path, rank: int, options: ReadOptions) -> tuple[dict[str, TensorRef], list[FileReader]]:
    """Open every weight file of one HF folder as one rank's state dict, checking the index against the files."""
    files = weight_files(folder)
    if not files:
        raise MissingRankError("no weight files (model.safetensors, pytorch_model.bin, ...)", path=folder)
    readers = [open_tensor_file(f, trust_pickle=options.trust_pickle) for f in files]
    seen = check_unique(folder, readers)
    for index_name in (SAFETENSORS_INDEX_FILE, BIN_INDEX_FILE):
        if (folder / index_name).is_file():
            for tensor, filename in read_index(folder / index_name).items():
                if seen.get(tensor, Path()).name != filename:
                    raise CorruptFileError(
                        f"index says {filename!r} holds this tensor, but it does not",
                        path=folder / index_name,
                        tensor=tensor,
                    )
    return refs_from_readers(readers, rank), readers


def check_unique(folder: Path, readers: list[FileReader]) -> dict[str, Path]:
    """``{tensor: file}`` over the shard files of one state dict; a tensor in two files is an error."""
    seen: dict[str, Path] = {}
    for reader in readers:
        for key in reader.headers:
            if key in seen:
                raise CorruptFileError(
                    f"tensor is in both {seen[key].name} and {reader.path.name}", path=folder, tensor=key
                )
            seen[key] = reader.path
    return seen


def side_files(folder: Path) -> list[Path]:
    """Files beside the weights that belong to the model (tokenizer, generation config, ...)."""
    skip = {SAFETENSORS_INDEX_FILE, BIN_INDEX_FILE, MANIFEST_NAME, CONFIG_NAME}
    return sorted(
        p for p in folder.iterdir() if p.is_file() and p.name not in skip and p.suffix not in TENSOR_SUFFIXES
    )


def discover(path: Path, options: ReadOptions) -> SourceCheckpoint:
    """Read an HF folder or a single tensor file as a tp=1 checkpoint."""
    if path.is_file():
        reader = open_tensor_file(path, trust_pickle=options.trust_pickle)
        readers = [reader]
        refs = refs_from_readers(readers, 0)
        folder = path.parent
        sides: list[Path] = []
    else:
        refs, readers = read_folder(path, 0, options)
        folder = path
        sides = side_files(path)
    source = SourceCheckpoint(path, NAME, [refs], config=find_config(folder), side_files=sides)
    collect_extras(source, readers)
    return source


def collect_extras(source: SourceCheckpoint, readers: list[FileReader]) -> None:
    extras: dict = {}
    top: dict = {}
    for reader in readers:
        extras.update(reader.extras)
        top.update(getattr(reader, "top_level", {}))
        source.notes.extend(reader.notes)
    source.extras.append(extras)
    source.top_level.append(top)


def check_writable(tp: int) -> None:
    if tp != 1:
        raise ReshardError(
            f"the hf layout holds one full checkpoint, not {tp} ranks",
            hint="use --layout hf-ranks (or megatron / sat) for tp > 1",
        )


@dataclass(frozen=True)
class SafetensorsFilePlan(FilePlan):
    """The files of one or more folders of safetensors shards.

    Attributes:
        folders: each folder (POSIX, relative to the output; ``""`` for the output itself) with its shard split.
    """

    folders: tuple[tuple[str, ShardPlan], ...] = ()


def safetensors_plan(spec: TargetSpec, folders: list[str]) -> SafetensorsFilePlan:
    """Rank ``r``'s tensors (``spec.rank_headers[r]``) in shards of ``spec.max_shard_size`` in ``folders[r]``."""
    splits = tuple(
        (folder, plan_shards(headers, max_shard_size=spec.max_shard_size))
        for folder, headers in zip(folders, spec.rank_headers, strict=True)
    )
    files = {
        f"{folder}/{filename}" if folder else filename: frozenset(names)
        for folder, split in splits
        for filename, names in split.files.items()
    }
    return SafetensorsFilePlan(files, splits)


class HFWriter(RankFilesWriter):
    """Writes a canonical HF folder: ``config.json`` and safetensors shards with their index; takes byte parts."""

    def __init__(self, out_dir: Path, spec: TargetSpec, plan: SafetensorsFilePlan, run: RunFiles = ONE_RUN) -> None:
        ((_, shards),) = plan.folders
        writer: PartsWriter = ShardedSafetensorsWriter(out_dir, spec.rank_headers[0], shards, hooks=run.hooks(out_dir))
        super().__init__(out_dir, spec, plan, run, [writer])

    @classmethod
    def file_plan(cls, spec: TargetSpec) -> SafetensorsFilePlan:
        """One folder of shards (refused for more than one rank: ``hf`` holds one full checkpoint)."""
        check_writable(spec.tp)
        return safetensors_plan(spec, [""])

    def close(self) -> list[Path]:
        (writer,) = self.rank_writers
        writer.close(index=self.run.writes_shared)
        written = [Path(f) for f in writer.filenames]
        if self.spec.config is not None and self.run.writes_shared:
            write_config(self.out_dir, self.spec.config)
            written.append(Path(CONFIG_NAME))
        return written


def write_config(folder: Path, config: dict) -> None:
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def check_folder(folder: Path, tp: int | None = None) -> list[FileProblem]:
    """Files an index names that are absent, no weight files at all, a tensor in two safetensors files."""
    problems = []
    for index_name in (SAFETENSORS_INDEX_FILE, BIN_INDEX_FILE):
        index = folder / index_name
        if not index.is_file():
            continue
        named: dict[str, str] = {}
        try:
            for tensor, filename in json.loads(index.read_text())["weight_map"].items():
                named.setdefault(str(filename), tensor)
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
            continue  # a corrupt index is reported when the checkpoint is read
        for filename, tensor in named.items():
            plain = len(PurePosixPath(filename).parts) == 1 and filename not in (".", "..")
            if plain and not (folder / filename).is_file():
                problems.append(
                    FileProblem(
                        "missing-file", tensor, f"{index_name} names it, it does not exist", str(folder / filename)
                    )
                )
    if problems:
        return problems
    files = weight_files(folder)  # files an index names are all there (checked above)
    if not files:
        return [FileProblem("missing-file", None, "no weight files in the folder", str(folder))]
    seen: dict[str, Path] = {}
    for path in (f for f in files if f.suffix == ".safetensors"):
        for key in read_safetensors_header(path)[0]:
            if key in seen:
                problems.append(FileProblem("duplicate", key, f"also in {seen[key].name}", str(path)))
            seen.setdefault(key, path)
    return problems
