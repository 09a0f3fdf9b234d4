"""The ``megatron`` layout: Megatron-LM's ``torch`` checkpoint format.

    <root>/latest_checkpointed_iteration.txt       "<iteration>" or "release"
    <root>/iter_{iteration:07d}/ (or release/)
        mp_rank_{tp:02d}/model_optim_rng.pt         pipeline stages: mp_rank_{tp:02d}_{pp:03d}/

    expert parallelism appends _{ep:03d}: mp_rank_{tp:02d}[_{pp:03d}]_{ep:03d}/ (which of the suffixes is
    which is read from the args: pipeline_model_parallel_size, expert_model_parallel_size)

Each file is a pickled dict: ``model`` (the state dict; ``model0``, ``model1``, ... with virtual
pipeline stages), ``args`` (an ``argparse.Namespace``), ``checkpoint_version``, ``iteration``, and
optimizer / rng state. The root or the iteration folder may be given. Pipeline stages, virtual chunks
and expert-parallel ranks are merged into one model with global layer and expert numbers
(:mod:`reshard.layouts.megatron.stages`), so every tp rank is one state dict like any other layout's.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

from reshard.config import ModelConfig
from reshard.errors import CorruptFileError, MissingRankError, ReshardError
from reshard.layouts.base import NoteScope, SourceCheckpoint
from reshard.layouts.megatron.file import MegatronFile
from reshard.layouts.megatron.merge import merge_stages
from reshard.megatron.facts import MegatronFacts
from reshard.megatron.model import (
    arg,
    config_from_args,
    count_problems,
    named_tokenizer,
    vocab_from_tokenizer_files,
)
from reshard.options import ReadOptions
from reshard.ranks import SHOWN, listed
from reshard.schema import check_int

NAME = "megatron"

TRACKER = "latest_checkpointed_iteration.txt"
FILE_NAME = "model_optim_rng.pt"
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
KEPT_KEYS = ("args", "checkpoint_version", "iteration")


# ---------------------------------------------------------------- finding the files


def _rank_dirs(folder: Path) -> dict[tuple[int, ...], Path]:
    """``{(tp, suffixes...): folder}`` for every ``mp_rank_*`` folder."""
    found = {}
    if folder.is_dir():
        for child in folder.iterdir():
            match = RANK_DIR.match(child.name)
            if match and child.is_dir():
                found[tuple(int(g) for g in match.groups() if g is not None)] = child
    return found


def read_tracker(path: Path) -> str | None:
    """What ``latest_checkpointed_iteration.txt`` in ``path`` says (``release`` or an iteration), if it is there."""
    tracker = path / TRACKER
    if not tracker.is_file():
        return None
    try:
        return tracker.read_text().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise CorruptFileError(f"cannot read the tracker: {err}", path=tracker) from err


def tracked_folder(text: str) -> str | None:
    """The folder a tracker's text names: ``iter_0000100`` for ``100``, ``release`` as it is."""
    value = text.strip()
    return f"iter_{int(value):07d}" if value.isdigit() else value or None


def iteration_folder(path: Path) -> Path | None:
    """The folder holding the ``mp_rank_*`` folders: ``path`` itself, or what the tracker file names."""
    if _rank_dirs(path):
        return path
    text = read_tracker(path)
    if text is not None:
        if text == "release":
            return path / "release"
        if not text.isdigit():
            raise CorruptFileError(f"tracker says {text!r}, not an iteration number or 'release'", path=path / TRACKER)
        return path / f"iter_{int(text):07d}"
    candidates = sorted(p for p in path.glob("iter_*") if p.is_dir() and _rank_dirs(p)) if path.is_dir() else []
    return candidates[-1] if candidates else None


def detect(path: Path) -> bool:
    return path.is_dir() and ((path / TRACKER).is_file() or iteration_folder(path) is not None)


def discover(path: Path, options: ReadOptions) -> SourceCheckpoint:
    """Read every ``mp_rank_*`` file of the iteration, merging pipeline stages, virtual chunks and
    expert-parallel ranks into one state dict per tp rank with global layer and expert numbers."""
    folder = iteration_folder(path)
    if folder is None or not folder.is_dir():
        raise MissingRankError("no Megatron iteration folder with mp_rank_* folders", path=folder or path)
    dirs = _rank_dirs(folder)
    if not dirs:
        raise MissingRankError("no mp_rank_* folders in the iteration folder", path=folder)
    if len({len(key) for key in dirs}) > 1:
        raise CorruptFileError("mixes mp_rank_XX, mp_rank_XX_YYY and mp_rank_XX_YYY_ZZZ folders", path=folder)
    first = MegatronFile(dirs[min(dirs)] / FILE_NAME, options.trust_pickle)
    grid = _grid(dirs, first, folder)
    tp, pp, ep = (max(key[i] for key in grid) + 1 for i in range(3))
    present = {key for key, child in grid.items() if (child / FILE_NAME).is_file()}
    absent = (
        _dir_name(r, p, e, pp, ep) for r in range(tp) for p in range(pp) for e in range(ep) if (r, p, e) not in present
    )  # lazily: the numbers come from folder names, up to 100 x 1000 x 1000 of them
    missing = [f"{name}/{FILE_NAME}" for name in itertools.islice(absent, SHOWN)]
    if missing:
        raise MissingRankError(
            f"missing {listed(missing, tp * pp * ep - len(present))} (tp={tp}, pp={pp}, ep={ep})",
            path=folder,
            hint="every rank file must be present to gather",
        )
    files = {
        key: first
        if grid[key] / FILE_NAME == first.path
        else MegatronFile(grid[key] / FILE_NAME, options.trust_pickle)
        for key in sorted(grid)
    }
    source = SourceCheckpoint(path, NAME, [])
    merged = merge_stages(files, tp=tp, pp=pp, ep=ep, tied=_tied(first))
    for rank in range(tp):
        refs, extras = merged.ranks[rank]
        source.ranks.append(refs)
        source.extras.append(extras)
        source.top_level.append(dict(files[(rank, pp - 1, 0)].top_level))
    for file in files.values():
        source.notes.extend(file.notes)
    source.notes.extend(merged.notes)
    _describe(source, first, folder, pp=pp, ep=ep, paths=merged.paths)
    return source


def _grid(dirs: dict[tuple[int, ...], Path], first: MegatronFile, folder: Path) -> dict[tuple[int, int, int], Path]:
    """``{(tp, pp, ep): folder}``: which suffix is a stage and which an expert rank, from the args."""
    args = first.top_level.get("args")
    pp, ep = (
        check_int(arg(args, key, 1), path=first.path, key=f"args.{key}")
        for key in ("pipeline_model_parallel_size", "expert_model_parallel_size")
    )
    grid = {}
    for key, child in dirs.items():
        if len(key) == 3:
            grid[(key[0], key[1], key[2])] = child
        elif len(key) == 2 and ep > 1 and pp == 1:
            grid[(key[0], 0, key[1])] = child
        elif len(key) == 2:
            grid[(key[0], key[1], 0)] = child
        else:
            grid[(key[0], 0, 0)] = child
    return grid


def _tied(first: MegatronFile) -> bool:
    return not arg(first.top_level.get("args"), "untie_embeddings_and_output_weights", False)


def _dir_name(rank: int, stage: int, expert: int, pp: int, ep: int) -> str:
    """Megatron-LM's ``get_checkpoint_name``: the stage suffix with pipelines, the expert suffix with experts."""
    return f"mp_rank_{rank:02d}" + (f"_{stage:03d}" if pp > 1 else "") + (f"_{expert:03d}" if ep > 1 else "")


def _describe(
    source: SourceCheckpoint, first: MegatronFile, folder: Path, *, pp: int, ep: int, paths: dict[str, tuple]
) -> None:
    """Config from the args, the facts the writer needs, notes, and why a conversion would be refused."""
    top = first.top_level
    args = top.get("args")
    for key, found in (
        ("tensor_model_parallel_size", source.tp),
        ("pipeline_model_parallel_size", pp),
        ("expert_model_parallel_size", ep),
    ):
        expected = arg(args, key)
        if isinstance(expected, int) and expected > found:
            raise MissingRankError(
                f"the args say {key}={expected}, but only {found} are here",
                path=folder,
                hint="every rank file must be present to gather",
            )
        tp_arg = key == "tensor_model_parallel_size"  # a _YYY suffix may be an expert rank, not a stage
        if tp_arg and isinstance(expected, int) and not isinstance(expected, bool) and 0 < expected < found:
            raise ReshardError(
                f"the args say {key}={expected}, but {found} are here: an extra rank, a copy or a leftover?",
                path=folder,
                hint="remove the extra mp_rank_* folders, or correct the args",
            )
    config = source.config = config_from_args(args, first.path) if args is not None else None
    from_tokenizer = vocab_from_tokenizer_files(args) if config and config.vocab_size is None else None
    if from_tokenizer is not None and config is not None:  # looked for only with a config
        size, vocab_file = from_tokenizer
        source.config = ModelConfig({**config.raw, "vocab_size": size}, config.path)
        source.notes.append(f"the true vocab size {size} comes from the tokenizer's vocab file {vocab_file}")
    source.tokenizer = named_tokenizer(args) if args is not None else None
    version = top.get("checkpoint_version")
    source.facts = MegatronFacts(
        args=args,
        iteration=top.get("iteration"),
        checkpoint_version=version,
        release=folder.name == "release",
        paths=paths,
    )
    if source.config is None:
        source.notes.append("no usable Megatron args in the files: model sizes must come from --config")
    elif source.config.vocab_size is None:
        source.scoped_notes.append(
            (
                NoteScope.VOCAB_UNKNOWN,
                "the args do not record the true vocab size: without --vocab (or a manifest) the padded vocab "
                "table is kept as is, pad rows included",
            )
        )
    dropped = sorted({k for t in source.top_level for k in t} - set(KEPT_KEYS))
    if dropped:
        source.scoped_notes.append(
            (
                NoteScope.OWN_LAYOUT,
                f"not carried over by convert: {', '.join(dropped)} "
                "(load the output with --no-load-optim --no-load-rng, or --finetune)",
            )
        )
    if pp > 1 or ep > 1 or first.chunks > 1:
        source.notes.append(
            f"merged {pp} pipeline stage(s), {first.chunks} virtual chunk(s) per stage and {ep} expert-parallel "
            "rank(s) into global layer and expert numbers"
        )
    problems = []
    if isinstance(version, (int, float)) and version < 2.0:
        problems.append(f"checkpoint_version {version} stores QKV in an older order: load and re-save it in Megatron")
    if args is not None:
        problems += count_problems(source.names(), args)
    for problem in problems:
        source.notes.append(problem)
    if problems:
        source.refusal = ReshardError("; ".join(problems), path=folder)
