"""Which folder of an OpenRLHF checkpoint holds the actor, and what every entry around it is: from names only.

OpenRLHF (OpenRLHF/OpenRLHF 3c3be6234e0cb353e76bb8019947db9dfe99fca7: ``openrlhf/trainer/ray/ppo_actor.py`` and
``ppo_critic.py`` ``save_checkpoint``, ``openrlhf/utils/deepspeed/deepspeed.py`` ``save_ckpt`` / ``save_model``)
writes into ``--ckpt.path``::

    <ckpt>/_actor/                  DeepSpeed's save_checkpoint(tag=f"global_step{N}"): latest, global_step{N}/
                                    (model and optimizer states; OpenRLHF's metric.json), zero_to_fp32.py
    <ckpt>/_critic/                 the critic, the same way (PPO with a critic)
    <ckpt>/global_step{N}_hf/       --ckpt.save_hf: the actor's module copy (save_pretrained), config, tokenizer
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from reshard.errors import ReshardError
from reshard.layouts.deepspeed.checkpoint import detect as is_deepspeed
from reshard.layouts.deepspeed.checkpoint import tag_folder

ACTOR, CRITIC = "_actor", "_critic"
HF_SUFFIX = "_hf"
METRIC = "metric.json"  # DeepspeedStrategy.CKPT_METRIC_FILENAME, in each tag folder
SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # DeepSpeed copies its recovery scripts beside the tags


@dataclass
class Found:
    """The folder to read, the ``--ckpt.save_hf`` folder of its tag, and notes on every other entry."""

    model: Path
    side: Path | None
    notes: list[str] = field(default_factory=list)


def _is_role(path: Path) -> bool:
    return path.name in (ACTOR, CRITIC) and is_deepspeed(path)


def detect(path: Path) -> bool:
    """An OpenRLHF ``--ckpt.path`` (holding ``_actor/``), or its ``_actor/`` or ``_critic/``."""
    return path.is_dir() and (_is_role(path) or _is_role(path / ACTOR))


def locate(path: Path) -> Found:
    """The DeepSpeed folder to read for ``path`` (the actor of a ``--ckpt.path``), its tag's ``_hf`` folder (the
    actor's only: OpenRLHF saves the critic's HF copy elsewhere, at the end) and what else is there.

    Raises:
        ReshardError: an entry of ``--ckpt.path`` OpenRLHF does not write, naming it.
    """
    notes: list[str] = []
    root, model = (path.parent, path) if _is_role(path) else (path, path / ACTOR)
    if model is not path:
        others = sorted(c.name + ("/" if c.is_dir() else "") for c in root.iterdir() if c.name != ACTOR)
        also = f" (also in it, not read: {', '.join(others)})" if others else ""
        notes.append(f"{root.name}/ is an OpenRLHF checkpoint: reading its {ACTOR}/{also}")
        for child in root.iterdir():
            if child.name.startswith(".") or child.name == ACTOR or _is_role(child):
                continue
            if not (child.is_dir() and child.name.endswith(HF_SUFFIX)):
                raise ReshardError(
                    "an entry OpenRLHF does not write in a checkpoint folder (_actor/, _critic/, <tag>_hf/)",
                    path=child,
                    hint="move it out of the folder if it does not belong to the checkpoint",
                )
    tag = tag_folder(model)
    side = None
    if tag is not None:
        if model.name == ACTOR and (root / f"{tag.name}{HF_SUFFIX}").is_dir():
            side = root / f"{tag.name}{HF_SUFFIX}"
        if (tag / METRIC).is_file():
            notes.append(f"{tag.name}/{METRIC}: OpenRLHF's eval metric of the checkpoint, not read")
    scripts = [name for name in SCRIPTS if (model / name).is_file()]
    if scripts:
        notes.append(f"{model.name}/{', '.join(scripts)}: DeepSpeed's recovery scripts, not read")
    return Found(model, side, notes)
