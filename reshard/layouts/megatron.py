"""The ``megatron`` layout: Megatron-LM's ``torch`` checkpoint format.

    <root>/latest_checkpointed_iteration.txt       "<iteration>" or "release"
    <root>/iter_{iteration:07d}/ (or release/)
        mp_rank_{tp:02d}/model_optim_rng.pt         pipeline stages: mp_rank_{tp:02d}_{pp:03d}/

Each file is a pickled dict: ``model`` (the state dict; ``model0``, ``model1``, ... with virtual
pipeline stages), ``args`` (an ``argparse.Namespace``), ``checkpoint_version``, ``iteration``, and
optimizer / rng state. The root or the iteration folder may be given. Pipeline stages and virtual
stages are read and reported (names prefixed ``stage{p}.`` / ``model{i}.``), but converting them
is refused: their layer numbers are stage-local, and merging stages is not implemented.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reshard.errors import CorruptFileError, MissingRankError, ReshardError
from reshard.layouts.base import SourceCheckpoint, TargetSpec, TensorRef
from reshard.layouts.megatron_args import (
    PICKLE_MODULE,
    SAFE_GLOBALS,
    arg,
    config_from_args,
    retarget_args,
)
from reshard.layouts.readers import FileReader, TensorHeader, load_torch_file, torch_header
from reshard.layouts.torch_ranks import TorchRanksWriter
from reshard.options import Layout, ReadOptions
from reshard.vocab import megatron_pad_multiple

if TYPE_CHECKING:
    import torch

TRACKER = "latest_checkpointed_iteration.txt"
FILE_NAME = "model_optim_rng.pt"
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
CHUNK_KEY = re.compile(r"^model(\d+)$")
KEPT_KEYS = ("args", "checkpoint_version", "iteration")


@dataclass
class MegatronFile(FileReader):
    """One ``model_optim_rng.pt``: its model chunk(s) flattened to dotted names, the rest kept aside.

    ``_extra_state`` entries (Transformer Engine's per-rank FP8 metadata: BytesIO, None, or a byte
    tensor that may differ between ranks) are never resharded, only carried: they go to ``extras``
    with the other non-tensor entries. ``paths`` maps every flat name (tensor or not) to its key path
    in the nested dict, so the writer can rebuild the legacy ``language_model -> embedding -> ...``
    nesting exactly.
    """

    path: Path
    trust_pickle: bool = False
    prefix: str = ""
    headers: dict[str, TensorHeader] = field(init=False, default_factory=dict)
    extras: dict[str, Any] = field(init=False, default_factory=dict)
    top_level: dict[str, Any] = field(init=False, default_factory=dict)
    paths: dict[str, tuple[str, ...]] = field(init=False, default_factory=dict)
    chunks: int = field(init=False, default=1)
    notes: list[str] = field(init=False, default_factory=list)
    _tensors: dict[str, torch.Tensor] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        import torch

        obj = load_torch_file(self.path, trust_pickle=self.trust_pickle, notes=self.notes, allowed=SAFE_GLOBALS)
        if not isinstance(obj, Mapping):
            raise CorruptFileError(f"holds a {type(obj).__name__}, not a Megatron checkpoint dict", path=self.path)
        if isinstance(obj.get("model"), Mapping):
            keys = ["model"]
        else:
            keys = sorted((k for k in obj if CHUNK_KEY.match(str(k))), key=lambda k: int(k[5:]))
        if not keys:
            raise CorruptFileError("no 'model' state dict in this Megatron file", path=self.path)
        self.chunks = len(keys)
        self.top_level = {k: v for k, v in obj.items() if k not in keys}
        for key in keys:
            chunk_prefix = f"{key}." if len(keys) > 1 else ""
            for path, value in _walk(obj[key]):
                name = self.prefix + chunk_prefix + ".".join(path)
                self.paths[name] = path
                if isinstance(value, torch.Tensor) and not name.endswith("_extra_state"):
                    self._tensors[name] = value
                    self.headers[name] = torch_header(value, path=self.path, key=name)
                else:
                    self.extras[name] = value

    def get(self, key: str) -> torch.Tensor:
        return self._tensors[key]


def _walk(state: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    for key, value in state.items():
        if isinstance(value, Mapping):
            yield from _walk(value, (*prefix, str(key)))
        else:
            yield (*prefix, str(key)), value


# ---------------------------------------------------------------- finding the files


def _rank_dirs(folder: Path) -> dict[tuple[int, int | None], Path]:
    found = {}
    if folder.is_dir():
        for child in folder.iterdir():
            match = RANK_DIR.match(child.name)
            if match and child.is_dir():
                stage = None if match.group(2) is None else int(match.group(2))
                found[(int(match.group(1)), stage)] = child
    return found


def iteration_folder(path: Path) -> Path | None:
    """The folder holding the ``mp_rank_*`` folders: ``path`` itself, or what the tracker file names."""
    if _rank_dirs(path):
        return path
    tracker = path / TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text == "release":
            return path / "release"
        if not text.isdigit():
            raise CorruptFileError(f"tracker says {text!r}, not an iteration number or 'release'", path=tracker)
        return path / f"iter_{int(text):07d}"
    candidates = sorted(p for p in path.glob("iter_*") if p.is_dir() and _rank_dirs(p)) if path.is_dir() else []
    return candidates[-1] if candidates else None


def detect(path: Path) -> bool:
    return path.is_dir() and ((path / TRACKER).is_file() or iteration_folder(path) is not None)


def discover(path: Path, options: ReadOptions) -> SourceCheckpoint:
    """Read every ``mp_rank_*`` file of the iteration (all tp ranks and pipeline stages)."""
    folder = iteration_folder(path)
    if folder is None or not folder.is_dir():
        raise MissingRankError("no Megatron iteration folder with mp_rank_* folders", path=folder or path)
    dirs = _rank_dirs(folder)
    if not dirs:
        raise MissingRankError("no mp_rank_* folders in the iteration folder", path=folder)
    tp = max(r for r, _ in dirs) + 1
    stages = sorted({p for _, p in dirs}, key=lambda p: -1 if p is None else p)
    if None in stages and len(stages) > 1:
        raise CorruptFileError("mixes mp_rank_XX and mp_rank_XX_YYY folders", path=folder)
    pp = 1 if stages == [None] else max(stages) + 1
    wanted = [(r, p) for r in range(tp) for p in ([None] if pp == 1 and None in stages else range(pp))]
    missing = [_dir_name(r, p) for r, p in wanted if (r, p) not in dirs or not (dirs[(r, p)] / FILE_NAME).is_file()]
    if missing:
        raise MissingRankError(
            f"missing {', '.join(f'{m}/{FILE_NAME}' for m in missing)} (tp={tp}, pp={pp})",
            path=folder,
            hint="every rank file must be present to gather",
        )
    source = SourceCheckpoint(path, Layout.MEGATRON, [])
    first: MegatronFile | None = None
    for rank in range(tp):
        refs: dict[str, TensorRef] = {}
        extras: dict[str, Any] = {}
        for _, stage in (w for w in wanted if w[0] == rank):
            prefix = f"stage{stage}." if pp > 1 else ""
            reader = MegatronFile(dirs[(rank, stage)] / FILE_NAME, options.trust_pickle, prefix)
            first = first or reader
            refs.update({n: TensorRef(n, rank, reader, n, h) for n, h in reader.headers.items()})
            extras.update(reader.extras)
            source.notes.extend(reader.notes)
        source.ranks.append(refs)
        source.extras.append(extras)
        source.top_level.append(dict(reader.top_level))
    _describe(source, first, folder, pp)
    return source


def _dir_name(rank: int, stage: int | None) -> str:
    return f"mp_rank_{rank:02d}" + ("" if stage is None else f"_{stage:03d}")


def _describe(source: SourceCheckpoint, first: MegatronFile, folder: Path, pp: int) -> None:
    """Config from the args, the facts the writer needs, notes, and why a conversion would be refused."""
    top = first.top_level
    args = top.get("args")
    for key, found in (("tensor_model_parallel_size", source.tp), ("pipeline_model_parallel_size", pp)):
        expected = arg(args, key)
        if isinstance(expected, int) and expected > found:
            raise MissingRankError(
                f"the args say {key}={expected}, but only {found} are here",
                path=folder,
                hint="every rank file must be present to gather",
            )
    source.config = config_from_args(args, first.path) if args is not None else None
    version = top.get("checkpoint_version")
    source.meta.update(
        megatron=True,
        args=args,
        checkpoint_version=version,
        iteration=top.get("iteration"),
        release=folder.name == "release",
        paths=first.paths,
        pp=pp,
        chunks=first.chunks,
    )
    if source.config is None:
        source.notes.append("no usable Megatron args in the files: model sizes must come from --config")
    elif source.config.vocab_size is None:
        source.notes.append(
            "the args do not record the true vocab size: without --vocab (or a manifest) the padded vocab "
            "table is kept as is, pad rows included"
        )
    dropped = sorted({k for t in source.top_level for k in t} - set(KEPT_KEYS))
    if dropped:
        source.notes.append(
            f"not carried over by convert: {', '.join(dropped)} "
            "(load the output with --no-load-optim --no-load-rng, or --finetune)"
        )
    problems = []
    if pp > 1:
        problems.append(f"{pp} pipeline stages (mp_rank_XX_YYY): merging stages is not supported yet")
    if int(arg(args, "expert_model_parallel_size", 1) or 1) > 1:
        problems.append("expert-parallel ranks (an extra _YYY in mp_rank_*): not supported yet")
    if first.chunks > 1:
        problems.append(f"{first.chunks} virtual pipeline chunks (model0..): not supported yet")
    if isinstance(version, (int, float)) and version < 2.0:
        problems.append(f"checkpoint_version {version} stores QKV in an older order: load and re-save it in Megatron")
    for problem in problems:
        source.notes.append(problem)
    if problems:
        source.meta["cannot_convert"] = ReshardError("; ".join(problems), path=folder)


# ---------------------------------------------------------------- writing


class MegatronWriter(TorchRanksWriter):
    """Writes ``iter_XXXXXXX/mp_rank_XX/model_optim_rng.pt`` (model, args, version, iteration) and the tracker.

    ``args`` is the source's, with the new ``tensor_model_parallel_size`` and ``padded_vocab_size``;
    non-tensor entries (``_extra_state``) come from the source rank whose rows the target rank starts with.
    """

    pickle_module = PICKLE_MODULE
    replicated_heads_refusal = "Megatron stores KV heads as query groups and cannot load copies of a KV head"

    def __init__(self, out_dir: Path, spec: TargetSpec) -> None:
        _require_megatron_source(spec.source)
        uneven = sorted(
            {n for h in spec.rank_headers for n, t in h.items() if t.shape != spec.rank_headers[0][n].shape}
        )
        if uneven:
            raise ReshardError(
                f"Megatron needs every rank to hold equal shapes, but {uneven[0]} would differ between ranks",
                hint="drop --uneven: the megatron layout pads the vocab the Megatron way",
            )
        super().__init__(out_dir, spec)
        meta = spec.source.meta
        self._folder = "release" if meta.get("release") else f"iter_{int(meta.get('iteration') or 0):07d}"

    @classmethod
    def pad_multiple(cls, tp: int, source: SourceCheckpoint) -> int | None:
        """Megatron pads the vocab to ``make_vocab_size_divisible_by * tp`` (128 * tp by default)."""
        _require_megatron_source(source)
        return megatron_pad_multiple(arg(source.meta.get("args"), "make_vocab_size_divisible_by"), tp)

    def rank_file(self, rank: int, state_dict: dict[str, torch.Tensor]) -> tuple[Path, Any]:
        source, meta = self.spec.source, self.spec.source.meta
        extras = source.extras[rank * source.tp // self.spec.tp]
        model: dict[str, Any] = {}
        for name, path in meta["paths"].items():
            if name in state_dict or name in extras:
                _put(model, path, state_dict[name] if name in state_dict else extras[name])
        for name in state_dict.keys() - meta["paths"].keys():
            _put(model, (name,), state_dict[name])
        obj = {
            "args": retarget_args(meta["args"], self.spec.tp, self.spec.padded_vocab_size),
            "checkpoint_version": meta.get("checkpoint_version"),
            "iteration": meta.get("iteration"),
            "model": model,
        }
        return Path(self._folder) / _dir_name(rank, None) / FILE_NAME, obj

    def finish(self) -> list[Path]:
        meta = self.spec.source.meta
        tracker = "release" if meta.get("release") else str(int(meta.get("iteration") or 0))
        (self.out_dir / TRACKER).write_text(tracker + "\n")
        return [Path(TRACKER)]


def _put(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _require_megatron_source(source: SourceCheckpoint) -> None:
    if not source.meta.get("megatron") or source.meta.get("args") is None:
        raise ReshardError(
            "the megatron layout is written from a Megatron source (its args give the model and training setup)",
            path=source.path,
            hint="convert a Megatron checkpoint, or choose --layout hf / hf-ranks",
        )
