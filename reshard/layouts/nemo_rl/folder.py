"""Which folder of a NeMo-RL run holds the policy's weights, and what every file of a step is: from names only.

NeMo-RL (NVIDIA-NeMo/RL 7ea279abfbeb698b092856d0dab61e7cf39bc909: ``nemo_rl/utils/checkpoint.py``
``CheckpointManager``, ``nemo_rl/algorithms/sft.py`` / ``grpo.py`` / ``dpo.py``) writes::

    <run>/step_{N}/                      renamed from tmp_step_{N} once complete (no tracker file: the latest
                                         step is the highest N, ``get_latest_checkpoint_path``)
    step_{N}/training_info.json          the trainer's counters and metrics
    step_{N}/config.yaml                 the run's config (``policy.model_name`` names the model)
    step_{N}/train_dataloader.pt         the data loader's state
    step_{N}/policy/weights/             DCP: ``{"model": state_dict}`` (DTensor worker v1,
                                         ``native_checkpoint.save_checkpoint``), or ``model/`` holding a flat
                                         state dict (worker v2, nemo_automodel's Checkpointer; PR 1881)
    step_{N}/policy/optimizer/           DCP: ``{"optim": {"optim": ..., "sched": ...}}`` (training state)
    step_{N}/policy/tokenizer/           ``tokenizer.save_pretrained`` (rank 0)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from reshard.errors import ReshardError
from reshard.formats.dcp_metadata.read import is_dcp_folder
from reshard.ranks import listed

STEP = re.compile(r"^step_(\d+)$")
POLICY, WEIGHTS, OPTIMIZER, TOKENIZER, MODEL = "policy", "weights", "optimizer", "tokenizer", "model"
RUN_CONFIG, TRAINING_INFO, DATALOADER = "config.yaml", "training_info.json", "train_dataloader.pt"
STEP_FILES = {
    RUN_CONFIG: "the run's config (policy.model_name names the model)",
    TRAINING_INFO: "training state: the trainer's counters and metrics",
    DATALOADER: "training state: the data loader's state",
}
SHOWN = 8  # steps named in the refusal of a run with several


@dataclass
class Step:
    """What a NeMo-RL step holds, each file by what it is taken for."""

    weights: Path  # the DCP folder of the model's tensors (policy/weights/ or policy/weights/model/)
    nested: bool  # version 1's {"model": ...} (weights/ itself) rather than version 2's weights/model/
    step: Path | None = None  # step_N/, when the weights sit in one
    optimizer: Path | None = None
    tokenizer: Path | None = None
    files: dict[str, str] = field(default_factory=dict)  # step_N/'s files by what they were taken for


def _weights(folder: Path) -> tuple[Path, bool] | None:
    """The DCP folder of ``policy/weights/`` and whether it is version 1's (the DCP at the top), or None."""
    if is_dcp_folder(folder):
        return folder, True
    if is_dcp_folder(folder / MODEL):
        return folder / MODEL, False
    return None


def _is_weights(path: Path) -> bool:
    return path.name == WEIGHTS and path.parent.name == POLICY and _weights(path) is not None


def _is_model(path: Path) -> bool:
    """Version 2's ``policy/weights/model/``."""
    return path.name == MODEL and _is_weights(path.parent) and _weights(path.parent) == (path, False)


def _is_step(path: Path) -> bool:
    return path.is_dir() and _is_weights(path / POLICY / WEIGHTS)


def _steps(run: Path) -> list[Path]:
    return sorted((c for c in run.iterdir() if STEP.match(c.name) and _is_step(c)), key=lambda s: int(s.name[5:]))


def detect(path: Path) -> bool:
    """A NeMo-RL run (``step_N/`` folders), a ``step_N/``, its ``policy/``, ``policy/weights/`` or version 2's
    ``policy/weights/model/``."""
    if not path.is_dir():
        return False
    if _is_model(path) or _is_weights(path) or _is_step(path) or (path.name == POLICY and _is_weights(path / WEIGHTS)):
        return True
    return bool(_steps(path))


def locate(path: Path) -> tuple[Step, list[str]]:
    """The step ``path`` names and notes saying what was chosen and why.

    Raises:
        ReshardError: a run of several steps (each named: NeMo-RL keeps no tracker), or a file NeMo-RL does not write.
    """
    notes: list[str] = []
    if _is_model(path):
        path = path.parent
    if _is_weights(path):
        path = path.parent
    if path.name == POLICY and _is_weights(path / WEIGHTS):
        path = path.parent
    if not _is_step(path):
        steps = _steps(path)
        if len(steps) > 1:
            raise ReshardError(
                f"holds {len(steps)} NeMo-RL steps ({listed([s.name for s in steps[:SHOWN]], len(steps))}), and "
                "NeMo-RL keeps no file naming one",
                path=path,
                hint=f"point reshard at the step to read (NeMo-RL resumes from the highest, {steps[-1]})",
            )
        others = sorted(c.name + ("/" if c.is_dir() else "") for c in path.iterdir() if c != steps[0])
        also = f" (also in it, not read: {', '.join(others)})" if others else ""
        notes.append(f"{path.name}/ holds one NeMo-RL step: reading {steps[0].name}/{also}")
        path = steps[0]
    return classify(path), notes


def classify(step: Path) -> Step:
    """Every file of ``step_N/`` and of its ``policy/``; anything NeMo-RL does not write there is refused by name.

    Raises:
        ReshardError: an unknown file or folder, naming it.
    """
    found = _weights(step / POLICY / WEIGHTS)
    assert found is not None  # locate reads only steps
    result = Step(weights=found[0], nested=found[1], step=step)
    for child in sorted(step.iterdir()):
        if child.name.startswith("."):
            continue
        if child.name in STEP_FILES and child.is_file():
            result.files[child.name] = STEP_FILES[child.name]
        elif child.name != POLICY:
            _refuse(child)
    for child in sorted((step / POLICY).iterdir()):
        if child.name == OPTIMIZER and is_dcp_folder(child):
            result.optimizer = child
        elif child.name == TOKENIZER and child.is_dir():
            result.tokenizer = child
        elif child.name != WEIGHTS and not child.name.startswith("."):
            _refuse(child)
    return result


def _refuse(child: Path) -> None:
    raise ReshardError(
        "a file NeMo-RL does not write in a step: not read as weights, training state or a side file",
        path=child,
        hint="move it out of the step if it does not belong to the checkpoint",
    )
