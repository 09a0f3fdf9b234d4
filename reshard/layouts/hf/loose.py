"""The loose rank-files layout (read only): a folder whose weight files or sub-folders carry a rank number.

ColossalAI user scripts, hand-written ``torch.save(model.state_dict(), f"pytorch_model_rank{rank}.bin")``
loops and DeepSpeed-style ``mp_rank_00_model_states.pt`` files all put the TP rank in the file name,
in one of a few spellings: ``rank0``, ``rank_1``, ``rank-2``, ``tp3``, ``tp_rank_4``, ``mp_rank_05``.
A rank may also be a sub-folder (``tp_rank_0/pytorch_model.bin``) or several shard files
(``model_rank0-00001-of-00002.safetensors``). Files are grouped by that number; HF's
``model-00001-of-00002.safetensors`` carries no rank token and is never taken for a rank. Names with a
pipeline- or data-parallel rank (``pp_rank_1``) are refused: only tensor-parallel ranks can be gathered.
"""

from __future__ import annotations

import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

from reshard.config import find_config
from reshard.errors import CorruptFileError, MissingRankError, ReshardError
from reshard.formats.readers import open_tensor_file
from reshard.layouts.base import SourceCheckpoint, SourceFacts, refs_from_readers
from reshard.layouts.hf.folder import (
    OPTIMIZER,
    TENSOR_SUFFIXES,
    check_unique,
    collect_extras,
    is_hf_folder,
    read_folder,
    read_index,
    side_files,
)
from reshard.options import ReadOptions
from reshard.ranks import SHOWN, listed, missing_count, rank_count

NAME = "loose"

# A rank token: an optional two-letter parallel kind before "rank" (tp_rank, mp_rank, pp_rank), or "tp".
RANK_TOKEN = re.compile(r"(?<![a-z0-9])(?P<kind>(?:[a-z]{2}[_-]?)?rank|tp)[_-]?(?P<num>\d+)(?![0-9])", re.I)
TP_KINDS = {"rank", "tp", "tprank", "mprank"}
HF_SHARD = re.compile(r"-(\d{5})-of-(\d{5})")


@dataclass(frozen=True)
class RankEntry:
    """A weight file or folder and the TP rank its name carries."""

    path: Path
    rank: int
    template: str  # the name as a format string with a ``rank`` field, to name the other ranks' files


@dataclass(frozen=True, kw_only=True)
class LooseFacts(SourceFacts):
    """The name of each rank's files with ``{rank}`` for its number, so that ``fix`` can name missing ones."""

    rank_templates: tuple[str, ...] = ()


def missing_rank_files(source: SourceCheckpoint, tp: int) -> list[str] | None:
    """The files ranks ``source.tp .. tp-1`` would have, named as the ranks found are (for a single file read as
    the ``hf`` layout: as its name numbers rank 0)."""
    if isinstance(source.facts, LooseFacts):
        templates = list(source.facts.rank_templates)
    else:
        found = rank_template(source.path.name) if source.path.is_file() else None
        templates = [found[1]] if found and found[0] == 0 else []
    if not templates:
        return None
    return [t.format(rank=r) for r in range(source.tp, tp) for t in templates]


def rank_template(name: str) -> tuple[int, str] | None:
    """``(rank, template)`` for a name carrying one tensor-parallel rank number, else None.

    Example:
        >>> rank_template("mp_rank_01_model_states.pt")
        (1, 'mp_rank_{rank:02d}_model_states.pt')
    """
    tokens = [m for m in RANK_TOKEN.finditer(name) if _kind(m) in TP_KINDS]
    if len({int(m.group("num")) for m in tokens}) != 1:
        return None
    parts, last = [], 0
    for match in tokens:  # every token carries the rank (``rank0_tp0``): number each of them
        digits = match.group("num")
        start, end = match.span("num")
        parts += [
            _escape(name[last:start]),
            f"{{rank:0{len(digits)}d}}" if digits[0] == "0" and len(digits) > 1 else "{rank}",
        ]
        last = end
    return int(tokens[0].group("num")), "".join([*parts, _escape(name[last:])])


def _escape(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


def _kind(match: re.Match[str]) -> str:
    return re.sub(r"[_-]", "", match.group("kind").lower())


def _candidates(folder: Path) -> list[Path]:
    """Weight files directly in ``folder`` and sub-folders holding weight files."""
    out = []
    for child in sorted(folder.iterdir()):
        if child.is_file() and child.suffix in TENSOR_SUFFIXES:
            out.append(child)
        elif is_hf_folder(child):
            out.append(child)
    return out


def detect(path: Path) -> bool:
    """True for a folder with at least one weight file or weight sub-folder whose name carries a rank token."""
    return path.is_dir() and any(RANK_TOKEN.search(p.name) and not OPTIMIZER.search(p.name) for p in _candidates(path))


def group(folder: Path) -> tuple[dict[int, list[RankEntry]], list[str]]:
    """``{rank: entries}`` for every rank-named weight file or sub-folder, plus notes on what was skipped.

    Raises:
        ReshardError: a name carries a non-TP rank (``pp_rank``) or two different rank numbers, or the
            folder mixes rank files with rank sub-folders.
    """
    ranks: dict[int, list[RankEntry]] = {}
    skipped: list[str] = []
    for path in _candidates(folder):
        tokens = list(RANK_TOKEN.finditer(path.name))
        if not tokens:
            continue
        if OPTIMIZER.search(path.name):
            skipped.append(path.name)
            continue
        other = [m.group(0) for m in tokens if _kind(m) not in TP_KINDS]
        if other:
            raise ReshardError(
                f"the name carries a {other[0]!r} number, not a tensor-parallel rank",
                path=path,
                hint="reshard gathers tensor-parallel ranks only; merge pipeline or data-parallel parts first",
            )
        found = rank_template(path.name)
        if found is None:
            raise ReshardError("the name carries two different rank numbers", path=path, hint="rename the rank files")
        rank, template = found
        ranks.setdefault(rank, []).append(RankEntry(path, rank, template))
    kinds = {e.path.is_dir() for entries in ranks.values() for e in entries}
    if len(kinds) > 1:
        raise ReshardError(
            "the folder holds both rank files and rank sub-folders", path=folder, hint="keep one of them"
        )
    notes = [f"skipped optimizer state: {', '.join(skipped)}"] if skipped else []
    return ranks, notes


def discover(path: Path, options: ReadOptions) -> SourceCheckpoint:
    """Read the rank files of ``path``; a gap in the rank numbers is a :class:`MissingRankError`."""
    ranks, notes = group(path)
    tp, missing = rank_count(ranks, path=path, name=lambda r: ranks[r][0].path.name)
    templates = sorted({e.template for e in ranks[min(ranks)]})
    if missing:
        names = listed(
            [t.format(rank=r) for r in missing for t in templates], missing_count(ranks, tp) * len(templates)
        )
        found = listed([str(r) for r in sorted(ranks)[:SHOWN]], len(ranks))
        raise MissingRankError(
            f"rank files {names} are missing (found rank(s) {found} of {tp})",
            path=path,
            hint="every rank must be present to gather; a single full file can be named directly",
        )
    source = SourceCheckpoint(path, NAME, [], config=find_config(path), side_files=_side_files(path))
    source.facts = LooseFacts(rank_templates=tuple(templates))
    for rank in range(tp):
        entries = ranks[rank]
        if entries[0].path.is_dir():
            if len(entries) > 1:
                raise CorruptFileError(
                    f"several folders for rank {rank}: {', '.join(e.path.name for e in entries)}", path=path
                )
            refs, readers = read_folder(entries[0].path, rank, options)
        else:
            files = _rank_files(path, rank, [e.path for e in entries], notes)
            for file in files:
                check_archive_rank(file, rank)
            readers = [open_tensor_file(f, trust_pickle=options.trust_pickle) for f in files]
            refs = refs_from_readers(readers, rank)
            check_unique(path, readers)
        source.ranks.append(refs)
        collect_extras(source, readers)
    source.notes[:0] = [_grouping_note(ranks, tp), *notes]
    return source


def _rank_files(folder: Path, rank: int, files: list[Path], notes: list[str]) -> list[Path]:
    """One rank's files: its index if it has one (authoritative, as in HF), safetensors preferred over torch
    copies (as transformers does), and every ``-0000i-of-0000n`` shard present."""
    indexes = sorted(
        (p for p in folder.glob("*.index.json") if (found := rank_template(p.name)) and found[0] == rank),
        key=lambda p: ".safetensors" not in p.name,
    )
    if indexes:
        files = [folder / name for name in dict.fromkeys(read_index(indexes[0]).values())]
    safetensors = [f for f in files if f.suffix == ".safetensors"]
    if safetensors and len(safetensors) < len(files):
        ignored = ", ".join(f.name for f in files if f not in safetensors)
        notes.append(f"rank {rank}: read the .safetensors files, ignored {ignored}")
        files = safetensors
    for f in files:
        match = HF_SHARD.search(f.name)
        if match:
            total = int(match.group(2))
            present = {int(m.group(1)) for g in files if (m := HF_SHARD.search(g.name))}
            absent = [i for i in range(1, total + 1) if i not in present]
            if absent:
                width = len(match.group(1))
                names = [f.name.replace(match.group(0), f"-{i:0{width}d}-of-{match.group(2)}") for i in absent]
                raise MissingRankError(f"shard files {', '.join(names)} of rank {rank} are missing", path=folder)
            break
    return files


def _side_files(folder: Path) -> list[Path]:
    """Side files to copy, without per-rank indexes or anything else named for a rank."""
    return [p for p in side_files(folder) if not RANK_TOKEN.search(p.name) and not p.name.endswith(".index.json")]


def _grouping_note(ranks: dict[int, list[RankEntry]], tp: int) -> str:
    shown = [
        f"rank {r}: {', '.join(e.path.name + ('/' if e.path.is_dir() else '') for e in ranks[r])}" for r in range(tp)
    ]
    if len(shown) > 4:
        shown = [*shown[:3], "...", shown[-1]]
    count = sum(len(v) for v in ranks.values())
    return (
        f"loose rank files: grouped {count} file(s)/folder(s) into tp={tp} by the rank number in their names "
        f"({'; '.join(shown)})"
    )


def check_archive_rank(path: Path, rank: int) -> None:
    """Refuse a torch file whose zip archive is named for another rank than its file name.

    ``torch.save(sd, "pytorch_model_rank1.bin")`` names the folder inside the archive ``pytorch_model_rank1/``:
    a ``pytorch_model_rank2.bin`` whose archive says rank 1 is a copy of rank 1's file, not rank 2's slices.
    """
    if path.suffix == ".safetensors":
        return
    try:
        with zipfile.ZipFile(path) as archive:
            root = archive.namelist()[0].split("/", 1)[0] if archive.namelist() else ""
    except (OSError, zipfile.BadZipFile, ValueError):
        return  # not an archive (legacy pickle) or unreadable: the reader says what is wrong
    found = rank_template(root)
    if found is not None and found[0] != rank:
        raise CorruptFileError(
            f"named for rank {rank}, but the archive inside is {root}/ (rank {found[0]}): a copy of another rank?",
            path=path,
            hint="restore the rank's own file",
        )
