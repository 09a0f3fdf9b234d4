"""Layouts: how checkpoints sit on disk, one package each, and the registry that the engine, the commands, the Hub
code and the mappings ask instead of naming a layout.

Adding a layout is a package with its :class:`~reshard.layouts.spec.LayoutSpec` and one line in :data:`LAYOUTS`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

from reshard.errors import CorruptFileError, NoModelError, ReshardError
from reshard.layouts.base import CheckpointWriter, SourceCheckpoint, SourceFacts, TargetSpec, TensorRef
from reshard.layouts.dcp import DCP, TORCH_DIST
from reshard.layouts.deepspeed import DEEPSPEED
from reshard.layouts.hf import HF, HF_RANKS, LOOSE
from reshard.layouts.hf.folder import TENSOR_SUFFIXES, weight_names  # the weight-file rule every folder follows
from reshard.layouts.megatron import MEGATRON
from reshard.layouts.nemo_rl import NEMO_RL
from reshard.layouts.openrlhf import OPENRLHF
from reshard.layouts.peft import PEFT
from reshard.layouts.sat import SAT
from reshard.layouts.spec import FileProblem, LayoutSpec
from reshard.layouts.verl import VERL
from reshard.manifest import MANIFEST_NAME, Manifest
from reshard.options import ReadOptions

__all__ = [
    "LAYOUTS",
    "TENSOR_SUFFIXES",
    "CheckpointWriter",
    "FileProblem",
    "LayoutSpec",
    "SourceCheckpoint",
    "SourceFacts",
    "TargetSpec",
    "TensorRef",
    "check_manifest",
    "discover",
    "find_layout",
    "layout",
    "rank_folder_patterns",
    "target_layout",
    "tracker_files",
    "weight_names",
    "writable_layouts",
]

logger = logging.getLogger(__name__)

# Every layout, in the order a folder is tried: verl first (a verl run's root holds Megatron's tracker file name,
# latest_checkpointed_iteration.txt, and its rank files carry rank numbers); torch_dist before dcp (its data files
# are DCP) and megatron (the same tracker file); deepspeed before sat (DeepSpeed names its model-states files as SAT
# does); nemo-rl before dcp (its policy/weights/ is DCP, read with the step's side files), openrlhf before deepspeed
# (its _actor/ is DeepSpeed's, read with the <tag>_hf/ beside it); an HF folder last (a folder of rank files holds
# weight files too). A single file is read as hf. PEFT's adapter folder is written only (an adapter file reads as hf).
LAYOUTS: tuple[LayoutSpec, ...] = (
    VERL,
    NEMO_RL,
    OPENRLHF,
    TORCH_DIST,
    DCP,
    MEGATRON,
    DEEPSPEED,
    SAT,
    HF_RANKS,
    LOOSE,
    HF,
    PEFT,
)


def discover(path: Path, options: ReadOptions | None = None) -> SourceCheckpoint:
    """Open a checkpoint in whatever layout it is, from headers only.

    Raises:
        ReshardError: the path does not exist or holds no checkpoint reshard can read.
    """
    options = options or ReadOptions()
    if not path.exists():
        raise ReshardError("no such file or folder", path=path)
    if path.is_file():
        return HF.open(path, options)
    spec = _detected(path)
    if spec is not None:
        return spec.open(path, options)
    return _inside(path, options)


def _detected(folder: Path) -> LayoutSpec | None:
    return next((spec for spec in LAYOUTS if spec.detect(folder)), None)


def _inside(path: Path, options: ReadOptions) -> SourceCheckpoint:
    """The one checkpoint with model tensors in the folders of ``path``, a folder no layout reads itself: trainers
    save one of those beside others that hold training state (HF Trainer's ``checkpoint-N/`` holds accelerate's
    ``pytorch_model_fsdp_0/`` and ``optimizer_0/``, or DeepSpeed's ``global_stepN/``). What was picked is said
    on stderr and in the notes; several candidates, or none, are refused naming each."""
    models: list[SourceCheckpoint] = []
    others: list[str] = []
    for sub in _subfolders(path):
        spec = _detected(sub)
        if spec is None:
            continue
        try:
            models.append(spec.open(sub, options))
        except NoModelError as err:
            others.append(f"{sub.name}/ ({spec.name}: {err.detail})")
        except ReshardError as err:
            others.append(f"{sub.name}/ ({spec.name}, which cannot be read: {err.detail})")
    if len(models) == 1:
        source = models[0]
        also = f"; also inside: {'; '.join(others)}" if others else ""
        note = f"{path.name}/ is not a checkpoint itself: reading {source.path.name}/ ({source.layout}) in it{also}"
        logger.warning(note)
        source.notes.insert(0, note)
        return source
    looked = f"looked for {', '.join(s.looked_for for s in LAYOUTS)}"
    if models:
        held = ", ".join(f"{m.path.name}/ ({m.layout})" for m in models)
        raise ReshardError(
            f"holds {len(models)} checkpoints: {held}", path=path, hint="point reshard at the one to read"
        )
    if others:
        raise ReshardError(f"no checkpoint found ({looked}); inside: {'; '.join(others)}", path=path)
    raise ReshardError(f"no checkpoint found ({looked})", path=path)


def _subfolders(path: Path, limit: int = 256) -> list[Path]:
    """The folders in ``path`` by name, the first ``limit`` found (a folder of thousands of runs is not walked)."""
    found: list[Path] = []
    for entry in path.iterdir():
        if entry.is_dir() and not entry.name.startswith("."):
            found.append(entry)
            if len(found) >= limit:
                break
    return sorted(found)


def check_manifest(source: SourceCheckpoint, manifest: Manifest | None) -> None:
    """Refuse a ``reshard.json`` beside ``source`` that names a layout reshard does not know, or records another tp
    for this very layout (a rank missing or extra)."""
    if manifest is None:
        return
    folder = source.path if source.path.is_dir() else source.path.parent
    for side in ("source", "target"):
        name = getattr(manifest, side).get("layout")
        if name is not None and find_layout(name) is None:
            known = ", ".join(sorted(spec.name for spec in LAYOUTS))
            raise CorruptFileError(
                f"{name!r} is not a layout ({known})", path=folder / MANIFEST_NAME, tensor=f"{side}.layout"
            )
    recorded = manifest.target.get("tp")
    if manifest.target.get("layout") == source.layout and recorded is not None and recorded != source.tp:
        raise ReshardError(
            f"holds {source.tp} ranks, but {MANIFEST_NAME} records tp={recorded} for this {source.layout} checkpoint",
            path=folder / MANIFEST_NAME,
            hint="a rank is missing or extra: restore the checkpoint as it was written",
        )


def find_layout(name: object) -> LayoutSpec | None:
    """The layout called ``name``, or None."""
    return next((spec for spec in LAYOUTS if spec.name == name), None)


def layout(name: str) -> LayoutSpec:
    """The layout called ``name``; a one-line error naming the known ones otherwise."""
    spec = find_layout(name)
    if spec is None:
        raise ReshardError(f"unknown layout {name!r}", hint=f"choose one of {', '.join(writable_layouts())}")
    return spec


def writable_layouts() -> list[str]:
    """The names of the layouts reshard writes, sorted (as ``--layout`` lists them)."""
    return sorted(spec.name for spec in LAYOUTS if spec.writer is not None)


def canonical_layout() -> LayoutSpec:
    """Transformers' one folder: what ``fix`` writes at tp 1 from any source, and the form it leaves as it is."""
    return HF


def target_layout(name: str | None, source: SourceCheckpoint, tp: int) -> LayoutSpec:
    """The layout a conversion writes: the one named, else the source's own when it is ``kept`` (Megatron, SAT),
    else transformers' folders (``hf`` at tp 1, ``hf-ranks`` above).

    Raises:
        ReshardError: an unknown layout, or one reshard only reads.
    """
    if name is None:
        own = find_layout(source.layout)
        return own if own is not None and own.kept else HF if tp == 1 else HF_RANKS
    spec = layout(name)
    if spec.writer is None:
        raise ReshardError(f"cannot write the {name!r} layout", hint=f"choose one of {', '.join(writable_layouts())}")
    return spec


def tracker_files() -> dict[str, Callable[[str], str | None]]:
    """Small files, in any layout, that name the folder to read (a Hub download fetches them to plan), each with what
    gives the folder's name from its text."""
    found: dict[str, Callable[[str], str | None]] = {}
    for spec in LAYOUTS:
        for name, folder in spec.trackers:
            found.setdefault(name, folder)
    return found


def rank_folder_patterns() -> tuple[re.Pattern[str], ...]:
    """Patterns of the names of folders that hold one rank's files, in any layout."""
    return tuple(spec.rank_folder for spec in LAYOUTS if spec.rank_folder is not None)
