"""The universal writer on a spec made by hand (no DeepSpeed, no source read): the files ``load_universal`` reads,
holding what it was handed, and what it refuses before any file exists. That DeepSpeed resumes from them is
``test_deepspeed_resume.py``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from reshard.dtypes import TensorHeader
from reshard.errors import ReshardError
from reshard.layouts.base import SourceCheckpoint, TargetSpec
from reshard.layouts.deepspeed.universal_writer import UniversalWriter
from reshard.layouts.training import CarriedState, ParamGroup, state_name

SHAPES = {"w": (3, 4), "n": (4,), "frozen": (2, 2), "head": (3, 4)}
HYPER = (
    {"lr": 0.1, "betas": [0.9, 0.99], "weight_decay": 0.1},
    {"lr": 0.1, "betas": [0.9, 0.99], "weight_decay": 0.0},
)


def spec(**changes) -> TargetSpec:
    carried = CarriedState(
        optimizer="AdamW",
        step=7,
        groups=(ParamGroup(HYPER[0], ("w",)), ParamGroup(HYPER[1], ("n",))),
        slots=("exp_avg", "exp_avg_sq"),
        kind="Adam",
        frozen=("frozen",),
        tied=(("head", "w"),),
    )
    headers = {name: TensorHeader(shape, "F32") for name, shape in SHAPES.items()}
    headers |= {state_name(n, s): headers[n] for n in ("w", "n") for s in carried.slots}
    made = TargetSpec(
        tp=1,
        rank_headers=[headers],
        config={"model_type": "llama"},
        vocab_size=None,
        padded_vocab_size=None,
        max_shard_size="5GB",
        source=SourceCheckpoint(Path("src"), "deepspeed", [{}]),
        training=carried,
    )
    return replace(made, **changes)


def values() -> dict[str, torch.Tensor]:
    """A distinct arange per tensor, so that a misplaced one cannot pass."""
    names = spec().rank_headers[0]
    start = 0
    made = {}
    for name, header in names.items():
        count = int(torch.tensor(header.shape).prod())
        made[name] = torch.arange(start, start + count, dtype=torch.float32).view(header.shape)
        start += count
    return made


def test_the_files_hold_what_load_universal_reads(tmp_path):
    target = spec()
    plan = UniversalWriter.file_plan(target)
    tag = "global_step7"
    assert sorted(plan.files) == sorted(
        [f"{tag}/mp_rank_00_model_states.pt"]
        + [f"{tag}/zero/{n}/{f}.pt" for n in ("w", "n") for f in ("fp32", "exp_avg", "exp_avg_sq")]
    )
    writer = UniversalWriter(tmp_path, target, plan)
    tensors = values()
    for name, tensor in tensors.items():
        writer.write(name, [tensor])
    written = writer.close()
    assert {p.as_posix() for p in written} >= set(plan.files) | {"latest_universal", f"{tag}/zero/optimizer_state.pt"}
    assert (tmp_path / "latest_universal").read_text() == tag
    states = torch.load(tmp_path / tag / "mp_rank_00_model_states.pt", weights_only=True)
    assert list(states["module"]) == list(SHAPES) and all(torch.equal(states["module"][n], tensors[n]) for n in SHAPES)
    assert [dict(g) for g in states["param_shapes"]] == [{"w": torch.Size([3, 4])}, {"n": torch.Size([4])}]
    assert (states["global_steps"], states["skipped_steps"], states["mp_world_size"]) == (7, 0, 1)
    assert states["shared_params"] == {"head": "w"}  # as DeepSpeed records a tie: alias -> owner
    for name in ("w", "n"):
        folder = tmp_path / tag / "zero" / name
        master = torch.load(folder / "fp32.pt", weights_only=True)
        assert master["cat_dim"] == 0 and torch.equal(master["param"], tensors[name])
        for slot in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(
                torch.load(folder / f"{slot}.pt", weights_only=True)["param"], tensors[f"{name}::{slot}"]
            )
        step = torch.load(folder / "step.pt", weights_only=True)
        assert step.dtype == torch.float32 and step.item() == 7.0
    assert not (tmp_path / tag / "zero" / "frozen").exists() and not (tmp_path / tag / "zero" / "head").exists()
    common = torch.load(tmp_path / tag / "zero" / "optimizer_state.pt", weights_only=True)
    assert common["ds_version"] and common["param_groups"] == [
        {"lr": 0.1, "betas": (0.9, 0.99), "weight_decay": 0.1, "params": [0]},
        {"lr": 0.1, "betas": (0.9, 0.99), "weight_decay": 0.0, "params": [1]},
    ]


def test_a_master_that_is_not_float32_is_refused():
    target = spec()
    headers = dict(target.rank_headers[0], w=TensorHeader((3, 4), "BF16"))
    with pytest.raises(ReshardError, match="w is BF16: DeepSpeed's optimizer keeps float32 masters"):
        UniversalWriter.file_plan(replace(target, rank_headers=[headers]))


@pytest.mark.parametrize("name", ["../w", "a/b", "..", "optimizer_state.pt"])
def test_a_name_that_is_no_folder_name_is_refused(name):
    with pytest.raises(ReshardError, match="cannot be a folder name") as err:
        UniversalWriter.check_names(["w", state_name(name, "exp_avg")], spec().source)
    assert err.value.tensor == state_name(name, "exp_avg")
