"""Writes a DeepSpeed universal checkpoint: what ``engine.load_checkpoint`` reads with ``{"checkpoint":
{"load_universal": true}}`` (``runtime/engine.py``, ``runtime/base_optimizer.py``
``load_hp_checkpoint_state_from_checkpoint_dir``, ``checkpoint/universal_checkpoint.py``), so that a ZeRO-1/2 run
resumes from it at any data-parallel size::

    <out>/latest_universal                          the tag folder's name
    <out>/config.json                               the model's config, where the conversion has one
    <out>/<tag>/mp_rank_00_model_states.pt          module (the weights), param_shapes, global_steps, ...
    <out>/<tag>/zero/optimizer_state.pt             param_groups (hyper-parameters; ``params`` the group's index)
    <out>/<tag>/zero/<param>/fp32.pt                {"cat_dim": 0, "param": the fp32 master}
    <out>/<tag>/zero/<param>/exp_avg.pt, exp_avg_sq.pt   Adam's moments, likewise (SGD's momentum_buffer.pt, ...)
    <out>/<tag>/zero/<param>/step.pt                the step, a float tensor (a Python int breaks torch's AdamW);
                                                    none for an optimizer without one (SGD)

``load_hp_checkpoint_state`` reads every ``<slot>.pt`` of a parameter's folder into the optimizer's state under
its file's name, whatever the optimizer (``checkpoint/universal_checkpoint.py``), so each slot the optimizer keeps
is one file named as torch names it.

Only with the training state (``--with-optimizer``): DeepSpeed resumes a universal checkpoint from its ``zero/``
files alone and never reads ``module``: weights without their optimizer state would resume with Adam started anew,
which a user who moves a run must not get silently (DeepSpeed#6691). DeepSpeed matches the param groups by
position: they are written in the source's order. A tied weight (``lm_head.weight`` of ``tie_word_embeddings``) is
one parameter: its state is its owner's, and ``shared_params`` names the alias as DeepSpeed records it. Frozen
parameters are in ``module`` only (DeepSpeed restores none from a universal checkpoint: they come from the model the
resuming run builds). The rank files are streamed tensor by tensor (:mod:`reshard.layouts.common.torch_rank_writer`);
the small files (``optimizer_state.pt``, ``step.pt``, the trackers) are written at the end with ``torch.save``.

Not for ZeRO-3, on purpose. DeepSpeed's ZeRO-3 reads a universal checkpoint otherwise (``runtime/zero/stage3.py``
``load_hp_checkpoint_state_from_checkpoint_dir_stage3``: model states named ``zero_pp_rank_0_mp_rank_00_...``, the
step and groups from ``optimizer_state_dict``), and it cannot resume one exactly but with a single param group on a
single sub-group: it gives every group the first group's hyper-parameters (the no-decay group trains with weight
decay), and it gives every sub-group one and the same step tensor, which torch's AdamW increments in place once per
sub-group, so the bias correction runs ahead (DeepSpeed 0.19.8, measured: resumed at step 4, two groups read step 10
three steps later, and the losses leave the run's by 1.6e-3). A model above ``sub_group_size`` (1e9 elements by
default) has several sub-groups in one group. Without its model-states file a ZeRO-3 engine refuses to load (no
checkpoint found) rather than train with another optimizer.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path, PurePosixPath
from typing import Any

from reshard.errors import ReshardError
from reshard.layouts.base import SourceCheckpoint, TargetSpec
from reshard.layouts.common.torch_rank_writer import RankFilePlan, TorchRanksWriter
from reshard.layouts.training import CarriedState, split_state_name, state_name

LATEST_UNIVERSAL = "latest_universal"
MODEL_STATES = "mp_rank_00_model_states.pt"
ZERO = "zero"
OPTIMIZER_STATE = "optimizer_state.pt"
CONFIG = "config.json"
# The DeepSpeed release whose ``load_universal`` reads what this writes (tests/layouts/deepspeed resume with it);
# DeepSpeed requires a version in ``optimizer_state.pt`` and checks it against ZeRO-1's format change (0.3.17).
DS_VERSION = "0.19.8"


class UniversalWriter(TorchRanksWriter):
    """The ``deepspeed`` layout's writer (see the module docstring)."""

    holds_training_state = True

    @classmethod
    def file_plan(cls, spec: TargetSpec) -> RankFilePlan:
        """The model states and every trainable parameter's state files, once the target is one DeepSpeed reads.

        Raises:
            ReshardError: no training state, tp above 1, or a master or moment that is not float32.
        """
        carried = _carried(spec)
        headers = spec.rank_headers[0]
        for group in carried.groups:
            for name in group.params:
                for held in (carried.master(name), *(state_name(name, slot) for slot in carried.kept)):
                    header = headers.get(held)
                    if header is None:
                        raise ReshardError(f"no {held} to write", path=spec.source.path, tensor=name)
                    if header.code != "F32":
                        raise ReshardError(
                            f"{held} is {header.code}: DeepSpeed's optimizer keeps float32 masters and state",
                            path=spec.source.path,
                            tensor=name,
                        )
        return super().file_plan(spec)

    @classmethod
    def check_names(cls, names: list[str], source: SourceCheckpoint) -> None:
        """A parameter's name is a folder of ``zero/``: refuse one that is not a plain folder name."""
        for name in names:
            base, _ = split_state_name(name)
            if not base or base in (".", "..", OPTIMIZER_STATE) or any(c in base for c in "/\\\0"):
                raise ReshardError(
                    "cannot be a folder name of a DeepSpeed universal checkpoint (zero/<name>/)",
                    path=source.path,
                    tensor=name,
                )

    @classmethod
    def rank_files(cls, spec: TargetSpec, rank: int, names: list[str]) -> list[tuple[PurePosixPath, set[str]]]:
        """The model states (every weight, in ``module``) and, per trainable parameter, its state files."""
        carried = _carried(spec)
        tag = PurePosixPath(_tag(carried))
        files = [(tag / MODEL_STATES, {n for n in names if split_state_name(n)[1] is None})]
        for name in _trainable(carried):
            folder = tag / ZERO / name
            files.append((folder / "fp32.pt", {carried.master(name)}))
            files += [(folder / f"{slot}.pt", {state_name(name, slot)}) for slot in carried.kept]
        return files

    def templates(self, rank: int, state_dict: dict[str, Any]) -> list[Any]:
        """The model states around the weights, then ``{"cat_dim": 0, "param": ...}`` per state file, in
        :meth:`rank_files` order (the order of the keys is ``ds_to_universal``'s)."""
        import torch

        carried = _carried(self.spec)
        module = OrderedDict((n, slot) for n, slot in state_dict.items() if split_state_name(n)[1] is None)
        shapes = [
            OrderedDict((name, torch.Size(self.spec.rank_headers[0][name].shape)) for name in group.params)
            for group in carried.groups
        ]
        objects: list[Any] = [_model_states(module, shapes, carried)]
        for name in _trainable(carried):
            held = (carried.master(name), *(state_name(name, slot) for slot in carried.kept))
            objects += [{"cat_dim": 0, "param": state_dict[key]} for key in held]
        return objects

    def finish(self) -> list[Path]:
        """The step of every parameter (of an optimizer that keeps one), the param groups, the tracker and the
        config."""
        import torch

        carried = _carried(self.spec)
        tag = Path(_tag(carried))
        written = []
        for name in _trainable(carried) if carried.stepped else ():
            step = tag / ZERO / name / "step.pt"
            torch.save(torch.tensor(float(carried.step)), self.out_dir / step)
            written.append(step)
        common = tag / ZERO / OPTIMIZER_STATE
        (self.out_dir / common).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"param_groups": _param_groups(carried), "ds_version": DS_VERSION}, self.out_dir / common)
        (self.out_dir / LATEST_UNIVERSAL).write_text(tag.name)
        written += [common, Path(LATEST_UNIVERSAL)]
        if self.spec.config is not None:
            (self.out_dir / CONFIG).write_text(json.dumps(self.spec.config, indent=2) + "\n")
            written.append(Path(CONFIG))
        return written


def _carried(spec: TargetSpec) -> CarriedState:
    """The training state to write; a DeepSpeed checkpoint is not written without it, nor at tp above 1."""
    if spec.training is None:
        raise ReshardError(
            "a DeepSpeed checkpoint is written only with its optimizer state: load_universal takes every weight "
            "from zero/<param>/ beside its moments, and a resume without them restarts Adam from zero",
            path=spec.source.path,
            hint="add --with-optimizer, or write the weights alone with --layout hf",
        )
    if spec.tp != 1:
        raise ReshardError(
            f"--tp {spec.tp}: the deepspeed layout is written at tp 1 (ZeRO shards by data parallelism only; "
            "a universal checkpoint holds whole tensors, and DeepSpeed re-partitions them at any world size)",
            path=spec.source.path,
            hint="--tp 1",
        )
    return spec.training


def _tag(carried: CarriedState) -> str:
    """The tag folder, named as ``engine.save_checkpoint`` names it by default."""
    return f"global_step{carried.step}"


def _trainable(carried: CarriedState) -> list[str]:
    """The parameters with an optimizer state, group by group."""
    return [name for group in carried.groups for name in group.params]


def _model_states(module: dict[str, Any], shapes: list[Any], carried: CarriedState) -> dict[str, Any]:
    """The model-states file as ``engine.save_checkpoint`` writes it (``_common_checkpoint_state``); of it
    ``load_universal`` reads the counters only. It holds whole tensors, as one data-parallel rank of one model-parallel
    rank would; no frozen-parameter records (as ZeRO-1 writes it: ``module`` holds them); a tied weight in ``module``
    under both its names, and ``shared_params`` (alias -> owner) as DeepSpeed records a tie; no scheduler, no client
    state. The optimizer's name, where the source records one, is the only part of ``ds_config`` written: the rest
    is the resuming run's."""
    return {
        "module": module,
        "buffer_names": [],
        "optimizer": None,
        "param_shapes": shapes,
        "frozen_param_shapes": None,
        "shared_params": dict(carried.tied),
        "frozen_param_fragments": None,
        "lr_scheduler": None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": 0,
        "global_steps": carried.step,
        "dp_world_size": 1,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": {"optimizer": {"type": carried.optimizer}} if carried.optimizer else {},
        "ds_version": DS_VERSION,
    }


def _param_groups(carried: CarriedState) -> list[dict[str, Any]]:
    """The groups in the source's order (DeepSpeed overwrites its own with them by position), each naming its flat
    group by index as ZeRO-1/2 does; a list hyper-parameter is written as the tuple torch's optimizers keep
    (``betas``)."""
    return [
        {**{k: tuple(v) if isinstance(v, list) else v for k, v in group.hyper.items()}, "params": [index]}
        for index, group in enumerate(carried.groups)
    ]
