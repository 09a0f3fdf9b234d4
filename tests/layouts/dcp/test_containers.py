"""Where a DCP index keeps its model (:mod:`reshard.layouts.dcp.containers`), on key paths as DCP's planner records
them: pure, no file read (the real writers' folders are in ``test_trainer_folders.py``)."""

from __future__ import annotations

from pathlib import Path

from reshard.formats.dcp_metadata.read import DcpIndex, StoredTensor
from reshard.layouts.dcp.containers import model_entries


def index(entries: dict[tuple, tuple[int, ...]], values: tuple[tuple, ...] = ()) -> DcpIndex:
    """An index whose tensors have these key paths and shapes (and values these key paths)."""
    found = DcpIndex(Path("ckpt"), "dcp")
    for path, shape in entries.items():
        fqn = ".".join(map(str, path))
        found.tensors[fqn] = StoredTensor(fqn, shape, "torch.float32", (), Path("ckpt/.metadata"))
        found.paths[fqn] = path
    for path in values:
        fqn = ".".join(map(str, path))
        found.values[fqn], found.paths[fqn] = 8, path
    return found


def test_a_container_at_any_depth_is_dropped_from_the_names():
    got = model_entries(
        index(
            {
                ("app", "model", "embed.weight"): (10, 4),
                ("app", "model", "norm.weight"): (4,),
                ("app", "optim", "state", "embed.weight", "exp_avg"): (10, 4),
            },
            values=(("app", "optim", "param_groups", 0, "lr"),),
        )
    )
    assert got.container == ("app", "model")
    assert got.names == {"app.model.embed.weight": "embed.weight", "app.model.norm.weight": "norm.weight"}
    assert set(got.skipped.values()) == {"app.optim"}


def test_flat_optimizer_keys_are_training_state():
    got = model_entries(
        index({("embed.weight",): (10, 4), ("optimizer.state.embed.weight.exp_avg",): (10, 4)}),
    )
    assert list(got.tensors) == ["embed.weight"] and got.container == ()
    assert got.skipped == {"optimizer.state.embed.weight.exp_avg": "optimizer"}


def test_a_counter_beside_the_container_is_not_a_weight():
    got = model_entries(index({("model", "embed.weight"): (10, 4), ("model", "scale"): (), ("step",): ()}))
    assert got.container == ("model",)
    assert got.names == {"model.embed.weight": "embed.weight", "model.scale": "scale"}
    assert got.skipped == {"step": "step"}


def test_weights_in_two_containers_keep_their_full_names():
    got = model_entries(index({("student", "w"): (2, 2), ("teacher", "w"): (2, 2)}))
    assert got.container == () and got.names == {"student.w": "student.w", "teacher.w": "teacher.w"}
