"""The ``sat`` layout: SwissArmyTransformer checkpoints (CogVLM, CogAgent), as ``sat/training/model_io.py`` saves them.

::

    <save>/latest                                    the iteration folder's name (a number, or ``release``)
    <save>/model_config.json                         model_class, arch args and ``model_parallel_size``
    <save>/<iteration>/mp_rank_{r:02d}_model_states.pt  ``{"module": state_dict, "iteration": ..., ...}``

SAT itself can only merge to one rank and split from one (``mp_split_model_rank0``); reshard goes from
any tp to any tp directly. The path given may be the save folder or one iteration folder inside it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from reshard.config import ModelConfig, load_config
from reshard.errors import CorruptFileError, MissingRankError, ReshardError
from reshard.formats.readers import TorchReader
from reshard.layouts.base import (
    ONE_RUN,
    RunFiles,
    SourceCheckpoint,
    SourceFacts,
    TargetSpec,
    numbered_children,
    refs_from_readers,
)
from reshard.layouts.common.torch_rank_writer import RankFilePlan, TorchRanksWriter
from reshard.layouts.hf.folder import OPTIMIZER
from reshard.layouts.hf.loose import check_archive_rank
from reshard.options import MAX_RANKS, ReadOptions
from reshard.ranks import listed, missing_count, rank_count

NAME = "sat"

LATEST = "latest"
MODEL_CONFIG = "model_config.json"
RANK_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
# Top-level keys of a rank file that stay true at another tp; optimizer, scheduler and rng state do not.
KEPT_TOP_LEVEL = ("iteration",)
DEFAULT_ITERATION = "1"  # what CogVLM's merge_model.py saves under


@dataclass(frozen=True, kw_only=True)
class SatFacts(SourceFacts):
    """The iteration folder a SAT checkpoint was read from (its ``latest`` file names it); a SAT output keeps it."""

    iteration: str = DEFAULT_ITERATION


def tracked_folder(text: str) -> str | None:
    """The iteration folder ``latest`` names: its text as written."""
    return text.strip() or None


def rank_file_name(rank: int) -> str:
    return f"mp_rank_{rank:02d}_model_states.pt"


def _rank_files(folder: Path) -> dict[int, Path]:
    return numbered_children(folder, RANK_FILE, want_dirs=False)


def detect(path: Path) -> bool:
    """A SAT save folder (``latest`` or ``model_config.json`` beside rank folders) or an iteration folder.

    DeepSpeed names its rank files as SAT does (``mp_rank_XX_model_states.pt``); such a folder with an HF
    ``config.json`` and no SAT ``model_config.json`` is left to the loose-rank-files layout.
    """
    if not path.is_dir():
        return False
    if _rank_files(path):  # an iteration folder; with an HF config.json it is a DeepSpeed-saved HF model
        return not (path / "config.json").is_file() or (path.parent / MODEL_CONFIG).is_file()
    if (path / LATEST).is_file() or (path / MODEL_CONFIG).is_file():
        return any(_rank_files(child) for child in path.iterdir() if child.is_dir())
    return False


def _locate(path: Path) -> tuple[Path, str]:
    """``(save folder, iteration)`` for ``path``."""
    if _rank_files(path):
        return path.parent, path.name
    if (path / LATEST).is_file():
        try:
            iteration = (path / LATEST).read_text().strip()
        except (OSError, UnicodeDecodeError) as err:
            raise CorruptFileError(f"cannot read it: {err}", path=path / LATEST) from err
        if not iteration or "/" in iteration or "\\" in iteration or iteration in (".", ".."):
            raise CorruptFileError(f"does not name an iteration folder: {iteration!r}", path=path / LATEST)
        return path, iteration
    candidates = sorted(child.name for child in path.iterdir() if child.is_dir() and _rank_files(child))
    if not candidates:
        raise MissingRankError("no iteration folder with mp_rank_XX_model_states.pt files", path=path)
    if len(candidates) > 1:
        raise ReshardError(
            f"several iteration folders ({', '.join(candidates)}) and no 'latest' file to choose one",
            path=path,
            hint="pass the iteration folder itself",
        )
    return path, candidates[0]


def read_model_config(path: Path) -> dict[str, Any] | None:
    """SAT's ``model_config.json`` (read like any config), or None when there is none."""
    return load_config(path).raw if path.is_file() else None


def _ranks(folder: Path, declared: Any, config_path: Path) -> list[Path]:
    """The rank files in rank order, checked against ``model_parallel_size``."""
    files = _rank_files(folder)
    if not files:
        raise MissingRankError("no mp_rank_XX_model_states.pt files", path=folder)
    if declared is not None and (type(declared) is not int or not 1 <= declared <= MAX_RANKS):
        raise CorruptFileError(
            f"model_parallel_size is {declared!r}, not a number of ranks from 1 to {MAX_RANKS}",
            path=config_path,
            tensor="model_parallel_size",
        )
    found = max(files) + 1
    if declared is not None and found > declared:
        raise ReshardError(
            f"model_parallel_size is {declared} but rank files up to {files[found - 1].name} "
            f"({len(files)} files) are in {folder}",
            path=config_path,
            hint="fix model_parallel_size or remove the stale rank files",
        )
    tp, missing = rank_count(files, path=folder, name=lambda r: files[r].name, declared=declared)
    if missing:
        said = f"model_parallel_size is {declared}" if declared else f"ranks up to {found - 1} exist"
        names = listed([rank_file_name(r) for r in missing], missing_count(files, tp))
        raise MissingRankError(
            f"missing {names} ({said}, {len(files)} rank files found)",
            path=folder / rank_file_name(missing[0]),
            hint="every rank file must be present to gather",
        )
    for rank in range(tp):
        check_archive_rank(files[rank], rank)
    return [files[r] for r in range(tp)]


def discover(path: Path, options: ReadOptions) -> SourceCheckpoint:
    """Read a SAT checkpoint from headers; a missing rank file is a :class:`MissingRankError` naming it."""
    root, iteration = _locate(path)
    folder = root / iteration
    if not folder.is_dir():
        raise MissingRankError(f"names iteration {iteration!r} but {folder} does not exist", path=root / LATEST)
    config_path = root / MODEL_CONFIG
    model_config = read_model_config(config_path)
    files = _ranks(folder, (model_config or {}).get("model_parallel_size"), config_path)
    source = SourceCheckpoint(
        path,
        NAME,
        [],
        config=ModelConfig(model_config, config_path) if model_config is not None else None,
        facts=SatFacts(iteration=iteration),
    )
    for rank, file in enumerate(files):
        reader = TorchReader(file, trust_pickle=options.trust_pickle)
        source.ranks.append(refs_from_readers([reader], rank))
        source.extras.append(reader.extras)
        source.top_level.append(reader.top_level)
        source.notes.extend(reader.notes)
        if reader.state_dict_key != "module":
            source.notes.append(f"{file.name}: no 'module' state dict; read the tensors found at its top level")
    dropped = sorted({k for top in source.top_level for k in top} - set(KEPT_TOP_LEVEL))
    if dropped:
        source.notes.append(f"top-level keys not carried over (optimizer, scheduler, rng state): {', '.join(dropped)}")
    if any(source.extras):
        extras = ", ".join(sorted({k for extras in source.extras for k in extras}))
        source.notes.append(f"non-tensor state-dict entries are not carried over: {extras}")
    skipped = sorted(p.name for p in folder.iterdir() if p.is_file() and p not in files and OPTIMIZER.search(p.name))
    if skipped:
        source.notes.append(f"skipped optimizer state: {', '.join(skipped)}")
    if model_config is None:
        source.notes.append(f"no {MODEL_CONFIG} beside {folder.name}/: packed tensors cannot be sized")
    return source


class SatWriter(TorchRanksWriter):
    """Writes ``<iteration>/mp_rank_XX_model_states.pt`` (``{"module": ...}``), ``latest`` and
    ``model_config.json`` with ``model_parallel_size`` set to the target tp."""

    replicated_heads_refusal = "SAT splits every head count exactly (mpu divide) and cannot load copies of a KV head"

    def __init__(self, out_dir: Path, spec: TargetSpec, plan: RankFilePlan, run: RunFiles = ONE_RUN) -> None:
        self.iteration = _iteration(spec.source)
        first = spec.source.top_level[0] if spec.source.top_level else {}
        self._top = {k: first[k] for k in KEPT_TOP_LEVEL if k in first}
        super().__init__(out_dir, spec, plan, run)  # lays out every rank file (templates needs the above)

    @classmethod
    def rank_files(cls, spec: TargetSpec, rank: int, names: list[str]) -> list[tuple[PurePosixPath, set[str]]]:
        """One file per rank, ``<iteration>/mp_rank_XX_model_states.pt``, holding all its tensors."""
        return [(PurePosixPath(_iteration(spec.source), rank_file_name(rank)), set(names))]

    def templates(self, rank: int, state_dict: dict[str, Any]) -> list[Any]:
        return [{"module": state_dict, **self._top}]

    def finish(self) -> list[Path]:
        (self.out_dir / LATEST).write_text(self.iteration)
        config = dict(self.spec.config or {})
        config["model_parallel_size"] = self.spec.tp
        (self.out_dir / MODEL_CONFIG).write_text(json.dumps(config, indent=4) + "\n")
        return [Path(LATEST), Path(MODEL_CONFIG)]


def _iteration(source: SourceCheckpoint) -> str:
    """The iteration folder to write: the source's, else ``1``."""
    return source.facts.iteration if isinstance(source.facts, SatFacts) else "1"
