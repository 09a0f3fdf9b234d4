"""The ``hf-ranks`` layout: reshard's own per-rank folders ``rank_00/ ... rank_{tp-1:02d}/``.

Each rank folder is an HF weights folder holding that rank's slices under the original names; the
top level holds ``config.json`` (of the full model) and the ``reshard.json`` manifest.
"""

from __future__ import annotations

import re
from pathlib import Path

from reshard.config import CONFIG_NAME, find_config
from reshard.errors import MissingRankError
from reshard.formats.safetensors.writer import ShardedSafetensorsWriter
from reshard.layouts.base import (
    ONE_RUN,
    PartsWriter,
    RankFilesWriter,
    RunFiles,
    SourceCheckpoint,
    TargetSpec,
    numbered_children,
)
from reshard.layouts.hf.folder import (
    SafetensorsFilePlan,
    check_folder,
    collect_extras,
    read_folder,
    safetensors_plan,
    side_files,
    write_config,
)
from reshard.layouts.spec import FileProblem
from reshard.manifest import MANIFEST_NAME, find_manifest
from reshard.options import ReadOptions
from reshard.ranks import listed, missing_count, rank_count

NAME = "hf-ranks"

RANK_DIR = re.compile(r"^rank_(\d+)$")


def rank_dir(rank: int) -> str:
    return f"rank_{rank:02d}"


def rank_folders(path: Path) -> dict[int, Path]:
    """``{rank: folder}`` for every ``rank_NN`` folder directly inside ``path``."""
    return numbered_children(path, RANK_DIR, want_dirs=True)


def missing_rank_files(source: SourceCheckpoint, tp: int) -> list[str] | None:
    """The folders ranks ``source.tp .. tp-1`` would have."""
    return [f"{rank_dir(r)}/" for r in range(source.tp, tp)]


def detect(path: Path) -> bool:
    return bool(rank_folders(path))


def discover(path: Path, options: ReadOptions) -> SourceCheckpoint:
    """Read every rank folder; a gap in the rank numbers is a :class:`MissingRankError`."""
    folders = rank_folders(path)
    manifest = find_manifest(path)
    declared = None
    if manifest is not None and manifest.target.get("layout") == NAME:
        declared = manifest.target.get("tp")
    tp, missing = rank_count(
        folders, path=path, name=lambda r: f"{folders[r].name}/", declared=declared, declared_by=MANIFEST_NAME
    )
    if missing:
        shown = listed([rank_dir(r) for r in missing], missing_count(folders, tp))
        raise MissingRankError(
            f"rank folder(s) {shown} missing (found {len(folders)} of {tp})",
            path=path,
            hint="every rank must be present to gather",
        )
    source = SourceCheckpoint(path, NAME, [], config=find_config(path), side_files=side_files(path))
    for rank in range(tp):
        refs, readers = read_folder(folders[rank], rank, options)
        source.ranks.append(refs)
        collect_extras(source, readers)
    return source


class HFRanksWriter(RankFilesWriter):
    """Writes ``rank_NN/`` safetensors folders plus the top-level ``config.json``; takes byte parts."""

    def __init__(self, out_dir: Path, spec: TargetSpec, plan: SafetensorsFilePlan, run: RunFiles = ONE_RUN) -> None:
        writers: list[PartsWriter] = []
        for (folder, shards), headers in zip(plan.folders, spec.rank_headers, strict=True):
            (out_dir / folder).mkdir(parents=True, exist_ok=True)
            writers.append(ShardedSafetensorsWriter(out_dir / folder, headers, shards, hooks=run.hooks(out_dir)))
        super().__init__(out_dir, spec, plan, run, writers)

    @classmethod
    def file_plan(cls, spec: TargetSpec) -> SafetensorsFilePlan:
        """A folder of shards per rank, ``rank_00/`` ... ``rank_{tp-1:02d}/``."""
        return safetensors_plan(spec, [rank_dir(rank) for rank in range(spec.tp)])

    def close(self) -> list[Path]:
        written: list[Path] = []
        for rank, writer in enumerate(self.rank_writers):
            writer.close(index=self.run.writes_shared)
            written.extend(Path(rank_dir(rank)) / f for f in writer.filenames)
        if self.spec.config is not None and self.run.writes_shared:
            write_config(self.out_dir, self.spec.config)
            written.append(Path(CONFIG_NAME))
        return written


def check_rank_folders(ckpt: Path, tp: int | None) -> list[FileProblem]:
    """Rank folders missing for the ``tp`` a manifest records, and each rank folder's own files."""
    found = rank_folders(ckpt)
    if found:
        rank_count(found, path=ckpt, name=lambda r: f"{found[r].name}/")  # refuses an absurd rank number
    expected = max(int(tp or 0), max(found, default=-1) + 1)
    problems = [
        FileProblem("missing-file", None, f"rank folder missing (reshard.json says tp={tp})", str(ckpt / rank_dir(r)))
        for r in range(expected)
        if r not in found
    ]
    for rank in sorted(found):
        problems += check_folder(found[rank])
    return problems
