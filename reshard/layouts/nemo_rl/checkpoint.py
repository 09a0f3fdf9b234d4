"""The ``nemo-rl`` layout: a NeMo-RL step (``step_N/policy/weights/``, DCP), read as the ``dcp`` layout reads DCP,
with the step's other files each taken for what NeMo-RL wrote them for.

The weights are DCP whether NeMo-RL nested them (``{"model": ...}``, version 1) or not (version 2's
``weights/model/``): :func:`reshard.layouts.dcp.dcp.discover` reads both by their key paths. NeMo-RL saves no
``config.json``: ``config.yaml`` names the model (``policy.model_name``), whose config must be given with
``--config``; reshard never fetches or guesses it. The tokenizer comes from ``policy/tokenizer/``.
"""

from __future__ import annotations

from pathlib import Path

from reshard.config import find_config
from reshard.errors import ReshardError
from reshard.layouts.base import SourceCheckpoint
from reshard.layouts.dcp import dcp
from reshard.layouts.hf.folder import side_files
from reshard.layouts.nemo_rl.folder import RUN_CONFIG, Step, locate
from reshard.options import ReadOptions

NAME = "nemo-rl"
MAX_CONFIG = 1 << 20  # a run's config.yaml: far below this


def discover(path: Path, options: ReadOptions) -> SourceCheckpoint:
    """Open a NeMo-RL run, step, ``policy/`` or ``policy/weights/`` as the policy's model.

    Raises:
        ReshardError: a run of several steps, an unknown file in a step, or what the DCP reader refuses.
    """
    step, notes = locate(path)
    source = dcp.discover(step.weights, options)
    source.path, source.layout = path, NAME
    source.notes[:0] = [*notes, *_file_notes(step)]
    source.side_files = side_files(step.tokenizer) if step.tokenizer is not None else []
    source.config = find_config(step.weights, options.config)
    if source.config is None:
        named = _model_name(step)
        source.refusal = ReshardError(
            "NeMo-RL saves no config.json"
            + (f"; {RUN_CONFIG} names the model: policy.model_name {named!r}" if named else ""),
            path=step.weights,
            hint="pass --config with that model's config.json",
        )
    return source


def _model_name(step: Step) -> str | None:
    """``policy.model_name`` of the step's ``config.yaml``, to name in the refusal, or None."""
    import yaml

    file = step.step / RUN_CONFIG if step.step is not None else None
    if file is None or not file.is_file():
        return None
    try:
        config = yaml.safe_load(file.read_bytes()[:MAX_CONFIG])
    except yaml.YAMLError:
        return None
    policy = config.get("policy") if isinstance(config, dict) else None
    name = policy.get("model_name") if isinstance(policy, dict) else None
    return name if isinstance(name, str) else None


def _file_notes(step: Step) -> list[str]:
    """What every file of the step was taken for (``inspect`` shows these notes)."""
    version = "version 1: {'model': ...}" if step.nested else "version 2: a flat state dict in weights/model/"
    notes = [f"policy/weights/: model weights, DCP ({version})"]
    if step.optimizer is not None:
        notes.append("policy/optimizer/: training state (the optimizer and the LR scheduler, DCP), skipped")
    if step.tokenizer is not None:
        held = ", ".join(sorted(p.name for p in step.tokenizer.iterdir()))
        notes.append(f"policy/tokenizer/: the tokenizer, copied beside the output ({held})")
    notes.extend(f"{name}: {what}" + ("" if name == RUN_CONFIG else ", skipped") for name, what in step.files.items())
    return notes
