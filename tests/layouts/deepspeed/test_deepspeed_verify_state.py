"""``verify --train-state`` on ZeRO-2 checkpoints DeepSpeed 0.19.8 itself wrote (``fixtures/deepspeed_writer``:
AdamW over two groups, two steps at world 3): the checkpoint passes, and copies damaged in their bytes (the moments
where the optimizer files keep them, or ``ds_to_universal``'s per-parameter files) fail with the finding that names
the damaged tensor."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from reshard.commands.verify_state import compare_states
from reshard.commands.verify_state_plan import plan_state_check
from reshard.engine.plan.open import OpenedCheckpoint, open_checkpoint
from reshard.layouts import discover
from reshard.layouts.training import ParamGroup, state_name
from reshard.options import ReadOptions

TAG = "global_step2"
VARIANT = "zero2_bf16"
TRAINABLE = 20  # the tiny Llama's tensors but the tied lm_head (zero2_bf16 freezes none)
PARAM = "model.layers.0.mlp.up_proj.weight"


def opened(path: Path) -> OpenedCheckpoint:
    return open_checkpoint(path, ReadOptions(), target_tp=1, recorded_plan=True)


def overwrite(folder: Path, name: str, change: Callable[[np.ndarray], None]) -> None:
    """Change, in place in the optimizer files, the float32 values of ``name`` (a weight, its fp32 master, or a state
    tensor ``w::exp_avg``) where the checkpoint keeps them: the byte ranges of the flat partitions of every rank."""
    source = discover(folder)
    assert source.training is not None
    ref = source.training.tensors[0][name] if "::" in name else source.ranks[0][name]
    pieces = ref.reader.pieces[ref.key]
    values = np.frombuffer(b"".join(_read(p.file, p.position, p.length) for p in pieces), dtype=np.float32).copy()
    change(values)
    data, start = values.tobytes(), 0
    for piece in pieces:
        with open(piece.file, "r+b") as file:
            file.seek(piece.position)
            file.write(data[start : start + piece.length])
        start += piece.length


def _read(file: Path, position: int, length: int) -> bytes:
    with open(file, "rb") as handle:
        handle.seek(position)
        return handle.read(length)


def zero(values: np.ndarray) -> None:
    values[:] = 0


def flip_last_bit(values: np.ndarray) -> None:
    """The least bit of one value's mantissa: a difference no tolerance of a loss curve would see."""
    values.view(np.uint32)[5] ^= 1


def findings(result) -> list[tuple[str, str | None]]:
    report = json.loads(result.stdout)
    (state,) = [check for check in report["checks"] if check["check"] == "train-state"]
    return [(d["kind"], d["tensor"]) for d in state["differences"]]


@pytest.mark.parametrize("folder", ["", f"{TAG}_universal"], ids=["native", "universal"])
def test_a_checkpoint_deepspeed_wrote_passes(ds_root, cli, folder):
    result = cli("verify", ds_root / VARIANT / folder, "--train-state")
    assert result.exit_code == 0, result.output
    # every trainable parameter's fp32 master, exp_avg and exp_avg_sq read
    assert f"training state against its own records: ok ({3 * TRAINABLE} tensors checked)" in result.stdout


def test_moments_zeroed_for_every_parameter_at_step_2_are_a_reset_named_per_parameter(ds_copy, cli):
    """KempnerForge's silent reset: the weights kept, every moment zero."""
    folder = ds_copy(VARIANT)
    names = [n for group in discover(folder).training.groups for n in group.params]
    for name in names:
        for slot in ("exp_avg", "exp_avg_sq"):
            overwrite(folder, state_name(name, slot), zero)
    result = cli("verify", folder, "--train-state", "--json")
    assert result.exit_code == 1, result.output
    assert sorted(findings(result)) == sorted(("zero-moments", name) for name in names)
    text = cli("verify", folder, "--train-state").stdout
    assert f"all {TRAINABLE} trainable parameters' moments are zero: the optimizer state was reset" in text


def test_one_parameter_whose_moments_are_zero_is_named_alone(ds_copy, cli):
    folder = ds_copy(VARIANT)
    for slot in ("exp_avg", "exp_avg_sq"):
        overwrite(folder, state_name(PARAM, slot), zero)
    result = cli("verify", folder, "--train-state", "--json")
    assert result.exit_code == 1 and findings(result) == [("zero-moments", PARAM)]


def test_one_moment_zero_of_two_is_not_a_reset(ds_copy, cli):
    """A zero ``exp_avg`` beside a non-zero ``exp_avg_sq``: a gradient that was zero at the last step, not a reset."""
    folder = ds_copy(VARIANT)
    overwrite(folder, state_name(PARAM, "exp_avg"), zero)
    assert cli("verify", folder, "--train-state").exit_code == 0


def test_a_negative_exp_avg_sq_is_found(ds_copy, cli):
    folder = ds_copy(VARIANT)
    overwrite(folder, state_name(PARAM, "exp_avg_sq"), lambda values: values.__setitem__(77, -0.5))
    result = cli("verify", folder, "--train-state", "--json")
    assert result.exit_code == 1, result.output
    assert findings(result) == [("negative", state_name(PARAM, "exp_avg_sq"))]
    assert "1 negative values (least -0.5)" in cli("verify", folder, "--train-state").stdout


@pytest.mark.parametrize("name", [state_name(PARAM, "exp_avg"), state_name(PARAM, "exp_avg_sq"), PARAM])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_non_finite_moment_or_master_is_found(ds_copy, cli, name, value):
    folder = ds_copy(VARIANT)
    overwrite(folder, name, lambda values: values.__setitem__(slice(3, 5), value))
    result = cli("verify", folder, "--train-state", "--json")
    assert result.exit_code == 1, result.output
    assert findings(result) == [("non-finite", name)]
    assert "2 NaN/Inf values" in cli("verify", folder, "--train-state").stdout


def test_a_moment_missing_from_a_universal_checkpoint_is_named(ds_copy, cli):
    folder = ds_copy(VARIANT) / f"{TAG}_universal"
    (folder / "zero" / PARAM / "exp_avg.pt").unlink()
    result = cli("verify", folder, "--train-state", "--json")
    assert result.exit_code == 1, result.output
    assert findings(result) == [("missing", state_name(PARAM, "exp_avg"))]


def test_a_truncated_moment_cannot_be_read_and_is_refused_by_name(ds_copy, cli):
    folder = ds_copy(VARIANT) / f"{TAG}_universal"
    file = folder / "zero" / PARAM / "exp_avg_sq.pt"
    stored = torch.load(file, weights_only=True)
    torch.save({**stored, "param": stored["param"].reshape(-1)[:-1].clone()}, file)
    result = cli("verify", folder, "--train-state")
    assert result.exit_code == 2, result.output
    assert str(file) in result.stderr and PARAM in result.stderr and "not the float32 [128, 64]" in result.stderr


def test_a_checkpoint_without_a_training_state_is_refused(ds_root, cli):
    result = cli("verify", ds_root / "hf_source", "--train-state")
    assert result.exit_code == 2
    assert "holds no training state reshard reads (hf layout)" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# The records: groups that do not cover the model, or cover it twice (the checkpoint's bytes, its records changed).


def records_findings(folder: Path, change) -> list[tuple[str, str | None]]:
    checkpoint = opened(folder)
    state = checkpoint.source.training
    plan = plan_state_check(change(state), checkpoint.by_name())
    return [(d.kind, d.tensor) for d in plan.findings]


def test_the_records_deepspeed_wrote_hold_together(ds_root):
    assert records_findings(ds_root / VARIANT, lambda state: state) == []
    assert records_findings(ds_root / "zero2_fp32", lambda state: state) == []  # a frozen model.norm.weight


def test_a_parameter_in_two_groups_or_in_none_is_named(ds_root):
    def regroup(state):
        first, second = state.groups
        moved = first.params[1]
        return replace(state, groups=(
            ParamGroup(first.hyper, first.params[2:]),  # first.params[0] now in no group
            ParamGroup(second.hyper, (*second.params, moved, "model.not_a_tensor")),
            ParamGroup(second.hyper, (moved,)),
        ))  # fmt: skip

    groups = discover(ds_root / VARIANT).training.groups
    found = records_findings(ds_root / VARIANT, regroup)
    assert ("ungrouped", groups[0].params[0]) in found
    assert ("group", groups[0].params[1]) in found  # in groups 1 and 2
    assert ("group", "model.not_a_tensor") in found
    # the parameter in no group keeps moments no optimizer will find; its tied lm_head is not named again
    assert ("extra", state_name(groups[0].params[0], "exp_avg")) in found
    assert ("extra", state_name(groups[0].params[0], "exp_avg_sq")) in found
    assert len(found) == 5, found


def test_a_frozen_parameter_in_a_group_is_named(ds_root):
    frozen = "model.norm.weight"
    found = records_findings(ds_root / "zero2_fp32", lambda state: replace(state, groups=(
        state.groups[0], ParamGroup(state.groups[1].hyper, (*state.groups[1].params, frozen)),
    )))  # fmt: skip
    # recorded frozen, and DeepSpeed kept no moments for it
    assert sorted(found) == [
        ("group", frozen),
        *(("missing", state_name(frozen, s)) for s in ("exp_avg", "exp_avg_sq")),
    ]


# Two checkpoints against each other.


def test_a_native_checkpoint_and_its_universal_copy_hold_the_same_state(ds_root, cli):
    result = cli("verify", ds_root / VARIANT, ds_root / VARIANT / f"{TAG}_universal", "--train-state", "--json")
    assert result.exit_code == 0, result.output
    (state,) = [c for c in json.loads(result.stdout)["checks"] if c["check"] == "train-state"]
    assert state["ok"] and state["tensors"] == 2 * TRAINABLE


def test_a_moment_changed_in_one_bit_is_found_against_the_original(ds_root, ds_copy, cli):
    folder = ds_copy(VARIANT)
    overwrite(folder, state_name(PARAM, "exp_avg"), flip_last_bit)
    result = cli("verify", ds_root / VARIANT, folder, "--train-state", "--json")
    assert result.exit_code == 1, result.output
    assert findings(result) == [("values", state_name(PARAM, "exp_avg"))]
    compare = json.loads(result.stdout)["checks"][0]
    assert compare["check"] == "compare" and compare["ok"]  # the weights are the same


def test_a_checkpoint_against_one_without_a_training_state(ds_root, cli):
    result = cli("verify", ds_root / VARIANT, ds_root / "hf_source", "--train-state", "--json")
    assert result.exit_code == 1
    assert findings(result) == [("missing", None)]


def test_the_step_and_the_groups_are_compared_by_position(ds_root):
    a, b = opened(ds_root / VARIANT), opened(ds_root / VARIANT)
    state = b.source.training
    first, second = state.groups
    b.source.training = replace(state, step=3, groups=(ParamGroup({**first.hyper, "lr": 0.02}, first.params), second))
    found = compare_states(a, b, progress=False).differences
    assert [(d.kind, d.detail) for d in found] == [("step", "step 2 vs 3"), ("hyper", "group 0 lr: 0.01 vs 0.02")]
    b.source.training = replace(state, groups=(second, first))
    kinds = [d.kind for d in compare_states(a, b, progress=False).differences]
    assert kinds == ["group", "group", "hyper", "group", "group", "hyper"]
