"""Writing the ``dcp`` layout: a PyTorch Distributed Checkpoint laid out as ``dcp.save`` lays out
``{"model": model_sd, "optimizer": optim_sd}`` of ``get_state_dict(model, optimizer)`` (torch 2.13)::

    <out>/.metadata          DCP's Metadata pickle, with the key paths DCP's planner records
    <out>/__0_{n}.distcp     torch.save archives back to back (split at --max-shard-size)
    <out>/config.json        when the conversion has a config

The tensors are global, one chunk each, so FSDP2 and torchtitan load the output at any world size (DCP reshards at
load): the conversion is planned at tp 1. Without ``--with-optimizer`` only the model is written; with it the
optimizer beside it, in ``get_state_dict``'s default (nested) form: ``optimizer.state.<fqn>.<slot>`` as they arrive
(Adam's ``exp_avg`` and ``exp_avg_sq``, SGD's ``momentum_buffer``, ...), ``.step`` (a float32 scalar, as torch's
optimizers keep it) for each trainable parameter of an optimizer that keeps one, and each param group's keys
(:mod:`reshard.layouts.dcp.param_groups`) with its parameters' fqns in ``optimizer.param_groups.<i>.params``.
``set_state_dict`` matches the groups by fqn: each parameter lands in the group it had in the source, in the
source's order. Where the source keeps fp32 masters apart from its weights, the masters are the model's tensors
(FSDP2 trains fp32 parameters) and the weights are not written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reshard.config import CONFIG_NAME
from reshard.formats.dcp_metadata import write as dcp
from reshard.formats.file_plan import FilePlan
from reshard.io.joined import Joined
from reshard.layouts.base import ONE_RUN, CheckpointWriter, RunFiles, TargetSpec
from reshard.layouts.dcp.distcp_files import (
    METADATA,
    ArchiveFiles,
    Archives,
    Chunk,
    GlobalTensor,
    metadata,
    one_slice,
    place_archives,
)
from reshard.layouts.dcp.param_groups import torch_groups
from reshard.layouts.optimizers import CARRIED
from reshard.layouts.training import split_state_name, state_name

if TYPE_CHECKING:
    import torch

MODEL, OPTIMIZER = "model", "optimizer"
STEP_CODE = "F32"  # torch's Adam and Adagrad keep their step as a float32 scalar tensor (``_get_scalar_dtype``)


@dataclass(frozen=True)
class DcpFilePlan(FilePlan):
    """Where every archive of a ``dcp`` output sits.

    Attributes:
        entries: the output's tensors (key, dtype, global shape, its one chunk), in the order ``.metadata`` lists
            them.
        objects: the pickled values (the param groups' keys), by key.
        paths: each key's path in the nested state dict (``DefaultSavePlanner``'s ``planner_data``).
        steps: the step tensors' keys, with the step; the writer fills them itself.
        skipped: incoming tensors not written (weights whose fp32 masters are written in their place).
        archives: the data files and where each archive sits in them.
    """

    entries: tuple[GlobalTensor, ...] = ()
    objects: dict[str, Any] = field(default_factory=dict)
    paths: dict[str, tuple[str | int, ...]] = field(default_factory=dict)
    steps: dict[str, float] = field(default_factory=dict)
    skipped: frozenset[str] = frozenset()
    archives: Archives = field(default_factory=Archives)


class DcpWriter(CheckpointWriter):
    """Writes the ``dcp`` layout (see the module docstring) from tp-1 target tensors named by their model fqns."""

    concurrent = True
    holds_training_state = True

    @classmethod
    def file_plan(cls, spec: TargetSpec) -> DcpFilePlan:
        """Lay out the model, the optimizer's state and its param groups, and place every archive.

        Raises:
            PlanError: a param group's key torch's optimizer needs that the source does not give.
        """
        if spec.tp != 1:
            raise ValueError(f"dcp holds global tensors: plan the conversion at tp 1, not {spec.tp}")
        headers, training = spec.rank_headers[0], spec.training
        skipped = {  # weights whose masters are written in their place (the masters themselves are not skipped)
            name
            for name in headers
            if training is not None and split_state_name(name)[1] is None and training.master(name) != name
        }
        tensors: list[GlobalTensor] = []
        paths: dict[str, tuple[str | int, ...]] = {}

        def add(key: str, path: tuple[str | int, ...], incoming: str, code: str, shape: tuple[int, ...]) -> None:
            tensors.append(GlobalTensor(key, code, shape, chunks=[Chunk(incoming, (0,) * len(shape), shape)]))
            paths[key] = path

        for name, header in headers.items():
            base, slot = split_state_name(name)
            if slot is None and name not in skipped:
                add(f"{MODEL}.{name}", (MODEL, name), name, header.code, header.shape)
            elif slot == "master":
                add(f"{MODEL}.{base}", (MODEL, base), name, header.code, header.shape)
        objects: dict[str, Any] = {}
        steps: dict[str, float] = {}
        if training is not None:
            for group in training.groups:
                for name in group.params:
                    key = f"{OPTIMIZER}.state.{name}.step"
                    if training.stepped:
                        add(key, (OPTIMIZER, "state", name, "step"), key, STEP_CODE, ())
                        steps[key] = float(training.step)
                    for slot in training.kept:
                        incoming = state_name(name, slot)
                        header = headers[incoming]
                        state = f"{OPTIMIZER}.state.{name}.{slot}"
                        add(state, (OPTIMIZER, "state", name, slot), incoming, header.code, header.shape)
            optimizer = CARRIED[training.kind]
            amsgrad = "max_exp_avg_sq" in training.slots
            written = torch_groups(training.groups, optimizer, training.optimizer, spec.source.path, amsgrad=amsgrad)
            for index, group_dict in enumerate(written):
                for key, value in group_dict.items():
                    flat = f"{OPTIMIZER}.param_groups.{index}.{key}"
                    objects[flat], paths[flat] = value, (OPTIMIZER, "param_groups", index, key)
        archives = place_archives(tensors, objects, spec.max_shard_size)
        files = archives.files("", written_by_writer=frozenset(steps))
        return DcpFilePlan(files, tuple(tensors), objects, paths, steps, frozenset(skipped), archives)

    def __init__(self, out_dir: Path, spec: TargetSpec, plan: DcpFilePlan, run: RunFiles = ONE_RUN) -> None:
        super().__init__(out_dir, spec, plan, run)
        import torch

        self._plan = plan
        self._files = ArchiveFiles(out_dir, plan.archives, plan.objects, run.hooks(out_dir))
        for key, step in plan.steps.items():  # known already: written now
            self._files.write(key, torch.tensor(step, dtype=torch.float32))

    def write_unordered(self, name: str, slices: list[torch.Tensor | Joined]) -> None:
        """Write tensor ``name`` (one slice: the plan is at tp 1) as its archive; safe from several threads."""
        if name in self._plan.skipped:
            return
        tensor = one_slice(name, slices)
        self._files.write(name, tensor)

    write = write_unordered

    def close(self) -> list[Path]:
        missing = self._files.missing()
        if missing:
            raise ValueError(f"dcp: closed before {missing[0]} (and {len(missing) - 1} more) was written")
        self._files.close()
        written = [Path(name) for name in self._plan.archives.names]
        if self.run.writes_shared:
            data = metadata(self._plan.entries, self._plan.objects, self._plan.archives, planner_data=self._plan.paths)
            (self.out_dir / METADATA).write_bytes(dcp.dumps(data))
            written.append(Path(METADATA))
            if self.spec.config is not None:
                (self.out_dir / CONFIG_NAME).write_text(json.dumps(self.spec.config, indent=2, sort_keys=True) + "\n")
                written.append(Path(CONFIG_NAME))
        return written
