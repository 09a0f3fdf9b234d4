"""Which folder of a verl run holds the model, and what every file of it is: from names and small files only.

verl (``verl/trainer/ppo/ray_trainer.py`` ``_save_checkpoint``, ``verl/utils/checkpoint/fsdp_checkpoint_manager.py``)
writes::

    <run>/latest_checkpointed_iteration.txt       the last step saved ("5"), written after the step's folder
    <run>/global_step_{N}/actor/                  the actor (critic/ beside it for PPO with a critic)
    <run>/global_step_{N}/data.pt                 the data loader's state
    actor/model_world_size_{W}_rank_{r}.pt        torch.save(model.state_dict()) of each rank
    actor/optim_world_size_{W}_rank_{r}.pt        the optimizer's state of each rank
    actor/extra_state_world_size_{W}_rank_{r}.pt  the scheduler's state and the RNG of each rank
    actor/huggingface/                            config.json, tokenizer, generation config (rank 0)
    actor/fsdp_config.json                        {"FSDP_version", "world_size"} (runs since mid-2025)
    actor/lora_adapter/                           a LoRA run's adapter (PEFT: adapter_config.json and the adapter
                                                  gathered, ``fsdp_workers.save_checkpoint``), rank files PEFT-named
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from reshard.errors import CorruptFileError, ReshardError
from reshard.ranks import listed

TRACKER = "latest_checkpointed_iteration.txt"
LORA_ADAPTER = "lora_adapter"
STEP = re.compile(r"^global_step_(\d+)$")
MODEL = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
TRAINING = re.compile(r"^(optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt$")
SIDE = "huggingface"
FSDP_CONFIG = "fsdp_config.json"
ROLES = ("actor", "critic")  # the folders of a step that hold a model, the one read first
FSDP_VERSIONS = (1, 2)
SHOWN = 8  # steps named in the refusal of a run with several and no tracker


def is_model_folder(path: Path) -> bool:
    """An actor or critic folder: at least one ``model_world_size_*_rank_*.pt``."""
    return path.is_dir() and any(MODEL.match(child.name) for child in path.iterdir())


def _is_step(path: Path) -> bool:
    return path.is_dir() and any(is_model_folder(path / role) for role in ROLES)


def detect(path: Path) -> bool:
    """A verl actor / critic folder, a ``global_step_N/`` holding one, or a run holding such steps."""
    if not path.is_dir():
        return False
    if is_model_folder(path) or _is_step(path):
        return True
    return any(STEP.match(child.name) and _is_step(child) for child in path.iterdir())


def locate(path: Path) -> tuple[Path, list[str]]:
    """The actor (or critic) folder to read for ``path``, and notes saying what was chosen and why.

    Raises:
        ReshardError: a run with several steps and no tracker naming one (each named), or a tracker naming none.
    """
    if is_model_folder(path):
        return path, []
    notes: list[str] = []
    if not _is_step(path):
        step = _tracked(path)
        if step is None:
            steps = sorted((c for c in path.iterdir() if STEP.match(c.name) and _is_step(c)), key=_number)
            if len(steps) > 1:
                raise ReshardError(
                    f"holds {len(steps)} verl steps ({listed([s.name for s in steps[:SHOWN]], len(steps))}) "
                    f"and no {TRACKER} names one",
                    path=path,
                    hint=f"point reshard at the step to read, e.g. {steps[-1]}",
                )
            step = steps[0]
            notes.append(f"{path.name}/ holds one verl step: reading {step.name}/")
        else:
            notes.append(f"{path.name}/{TRACKER} names step {_number(step)}: reading {step.name}/")
        path = step
    role = next(r for r in ROLES if is_model_folder(path / r))
    others = sorted(c.name + ("/" if c.is_dir() else "") for c in path.iterdir() if c.name != role)
    also = f" (also in it, not read: {', '.join(others)})" if others else ""
    notes.append(f"{path.name}/ is a verl step: reading its {role}/{also}")
    return path / role, notes


def _tracked(run: Path) -> Path | None:
    """The step folder ``latest_checkpointed_iteration.txt`` names (verl's ``find_latest_ckpt_path``), if any."""
    tracker = run / TRACKER
    if not tracker.is_file():
        return None
    with tracker.open("rb") as handle:  # a step number; never read a damaged tracker whole
        text = handle.read(64).decode("utf-8", "replace").strip()
    if not text.isdigit():
        raise CorruptFileError(f"does not hold a step number: {text!r}", path=tracker)
    step = run / f"global_step_{int(text)}"
    if not _is_step(step):
        raise ReshardError(f"names step {int(text)}, but {step.name}/ holds no verl actor", path=tracker)
    return step


def _number(step: Path) -> int:
    match = STEP.match(step.name)
    return int(match.group(1)) if match else -1


@dataclass
class Files:
    """Every file of an actor folder by what it is taken for."""

    model: dict[int, Path] = field(default_factory=dict)  # rank -> its model file
    world_size: int = 0
    training: list[Path] = field(default_factory=list)
    side: Path | None = None
    lora_adapter: Path | None = None  # a LoRA run's adapter: its adapter_config.json records alpha and r
    fsdp_config: dict[str, int] | None = None


def classify(folder: Path) -> Files:
    """Every file of ``folder``: the rank files of one world size, ranks 0..W-1 each once; training state; the side
    folder; ``fsdp_config.json`` checked against the file names. Anything else is refused by name.

    Raises:
        ReshardError: files of two world sizes, a rank missing or outside the world, an unknown file, a LoRA
            adapter, or an ``fsdp_config.json`` that disagrees with the files.
    """
    files = Files()
    sizes: dict[int, list[str]] = {}
    for child in sorted(folder.iterdir()):
        name = child.name
        if name.startswith("."):
            continue
        if match := MODEL.match(name):
            world, rank = int(match.group(1)), int(match.group(2))
            sizes.setdefault(world, []).append(name)
            files.model[rank] = child
        elif match := TRAINING.match(name):
            sizes.setdefault(int(match.group(2)), []).append(name)
            files.training.append(child)
        elif name == SIDE and child.is_dir():
            files.side = child
        elif name == FSDP_CONFIG and child.is_file():
            files.fsdp_config = _fsdp_config(child)
        elif name == LORA_ADAPTER and child.is_dir():
            files.lora_adapter = child
        else:
            raise ReshardError(
                "a file verl does not write in an actor folder: not read as weights, training state or a side file",
                path=child,
                hint="move it out of the folder if it does not belong to the checkpoint",
            )
    if len(sizes) > 1:
        shown = "; ".join(f"world size {w}: {listed(names, len(names))}" for w, names in sorted(sizes.items()))
        raise ReshardError(f"holds files of {len(sizes)} runs ({shown})", path=folder, hint="keep one run's files")
    files.world_size = next(iter(sizes))
    extra = sorted(r for r in files.model if r >= files.world_size)
    if extra:
        raise ReshardError(f"holds rank {extra[0]} of a world of {files.world_size}", path=files.model[extra[0]])
    missing = [r for r in range(files.world_size) if r not in files.model]
    if missing:
        names = [f"model_world_size_{files.world_size}_rank_{r}.pt" for r in missing]
        raise ReshardError(
            f"missing {listed(names, len(names))} ({files.world_size} ranks wrote this checkpoint)", path=folder
        )
    recorded = files.fsdp_config["world_size"] if files.fsdp_config else files.world_size
    if recorded != files.world_size:
        raise ReshardError(
            f"records world_size {recorded}, but the rank files are model_world_size_{files.world_size}_rank_*.pt",
            path=folder / FSDP_CONFIG,
            hint="the folder mixes two runs' files: restore it as verl wrote it",
        )
    return files


def _fsdp_config(file: Path) -> dict[str, int]:
    """verl's ``FSDPConfig``: exactly ``FSDP_version`` (1 or 2) and ``world_size``."""
    try:
        value = json.loads(file.read_bytes()[: 1 << 16])
    except (OSError, ValueError) as err:
        raise CorruptFileError(f"not JSON: {err}", path=file) from err
    if not isinstance(value, dict) or set(value) != {"FSDP_version", "world_size"}:
        keys = sorted(value) if isinstance(value, dict) else type(value).__name__
        raise CorruptFileError(f"holds {keys}, not verl's FSDP_version and world_size", path=file)
    if value["FSDP_version"] not in FSDP_VERSIONS or type(value["world_size"]) is not int or value["world_size"] < 1:
        raise CorruptFileError(
            f"FSDP_version {value['FSDP_version']!r}, world_size {value['world_size']!r}", path=file
        )
    return value
