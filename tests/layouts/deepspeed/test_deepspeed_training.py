"""The training state ``inspect`` shows of ZeRO checkpoints DeepSpeed 0.19.8 itself wrote
(``fixtures/deepspeed_writer``: AdamW at lr 1e-2 over two groups, weight decay 0.1 and 0.0, two steps at world 3,
a frozen parameter in most variants): what DeepSpeed recorded, read from the pickles alone; and damaged records
refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from fixtures.deepspeed import VARIANTS
from fixtures.hf import load_folder

from reshard.cli.main import main
from reshard.errors import CorruptFileError
from reshard.layouts import discover
from reshard.layouts.deepspeed.pickles import Pickled
from reshard.layouts.deepspeed.training import native_state
from reshard.layouts.training import split_state_name, state_name

TAG = "global_step2"
# What fixtures/deepspeed_writer configures (it imports DeepSpeed, so it is not imported here).
NO_DECAY = ("bias", "norm")
FROZEN = {
    "zero2_bf16": None,
    "zero3_bf16": "model.layers.0.input_layernorm.weight",
    "zero2_fp32": "model.norm.weight",
    "zero1_bf16": "model.norm.weight",
    "zero1_fp32": "model.norm.weight",
    "zero3_fp32": "model.layers.1.post_attention_layernorm.weight",
    "zero2_fp16": None,
    "zero3_fp16": "model.layers.0.input_layernorm.weight",
}


def configured_groups(root: Path, variant: str) -> tuple[list[str], list[str]]:
    """The writer's two groups by name: the trainable parameters (the tied lm_head is the embedding's) with weight
    decay, and the biases and norms without."""
    frozen = FROZEN[variant]
    names = [n for n in load_folder(root / "hf_source") if n not in ("lm_head.weight", frozen)]
    decay = [n for n in names if not any(word in n for word in NO_DECAY)]
    return decay, [n for n in names if n not in decay]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_training_state_is_what_deepspeed_recorded(ds_root, variant):
    training = discover(ds_root / variant).training
    assert training is not None
    assert training.optimizer == "AdamW" and training.step == 2
    assert training.moments == ("exp_avg", "exp_avg_sq")
    assert len(training.groups) == 2
    for group, names, decay in zip(training.groups, configured_groups(ds_root, variant), (0.1, 0.0), strict=True):
        assert sorted(group.params) == sorted(names)
        assert group.hyper["lr"] == 1e-2 and group.hyper["weight_decay"] == decay
        assert group.hyper["betas"] == [0.9, 0.999] and group.hyper["eps"] == 1e-8
    frozen = FROZEN[variant]
    assert training.frozen == ((frozen,) if frozen else ())
    if variant.endswith("fp16"):  # DeepSpeed's dynamic loss scaler, pickled in the optimizer files
        assert "loss_scaler (optimizer files)" in map(str, training.not_carried), training.not_carried


def test_the_tag_folder_gives_the_same_state_as_the_root(ds_root):
    assert discover(ds_root / "zero2_fp32" / TAG).training == discover(ds_root / "zero2_fp32").training


@pytest.mark.parametrize("variant", ["zero1_bf16", "zero2_fp32", "zero3_bf16"])
def test_inspect_shows_the_training_state(ds_root, variant, cli):
    text = cli("inspect", ds_root / variant)
    assert text.exit_code == 0, text.output
    lines = text.stdout.splitlines()
    assert "training    AdamW, step 2, moments exp_avg, exp_avg_sq" in lines
    decay, rest = configured_groups(ds_root, variant)
    assert any(line.startswith(f"group 0     {len(decay)} parameters: ") for line in lines), text.stdout
    assert any(line.startswith(f"group 1     {len(rest)} parameters: ") for line in lines), text.stdout
    hyper = [line.strip() for line in lines if line.startswith(" " * 12 + "weight_decay=")]
    assert len(hyper) == 2 and "weight_decay=0.1" in hyper[0] and "weight_decay=0.0" in hyper[1], hyper
    assert f"frozen      {FROZEN[variant]} (no moments)" in lines
    report = json.loads(cli("inspect", ds_root / variant, "--json").stdout)
    assert [sorted(g["params"]) for g in report["training"]["groups"]] == [sorted(decay), sorted(rest)]
    assert report["training"]["step"] == 2 and report["training"]["frozen"] == [FROZEN[variant]]


@pytest.mark.parametrize("variant", ["zero2_bf16", "zero3_bf16"])
def test_a_universal_checkpoint_holds_the_training_state_it_was_made_from(ds_root, variant):
    """What ``ds_to_universal`` wrote: the param groups in ``zero/optimizer_state.pt``, the moments as per-parameter
    files, the step in the model states it copied."""
    native = discover(ds_root / variant).training
    universal = discover(ds_root / variant / f"{TAG}_universal").training
    assert native is not None and universal is not None
    assert universal.groups == native.groups and universal.frozen == native.frozen
    assert universal.step == 2 and universal.optimizer == "AdamW"
    assert universal.moments == ("exp_avg", "exp_avg_sq")


def test_a_universal_checkpoint_without_its_common_state_is_read_without_a_training_state(ds_copy):
    folder = ds_copy("zero2_bf16") / f"{TAG}_universal"
    (folder / "zero" / "optimizer_state.pt").unlink()
    source = discover(folder)
    assert source.training is None
    assert "no zero/optimizer_state.pt (ds_to_universal writes it): the training state is not read" in source.notes


def test_a_checkpoint_without_a_training_state_reports_none(ds_root, cli):
    """``--weights module`` reads no optimizer file; the report keeps its former keys."""
    report = json.loads(cli("inspect", ds_root / "zero2_bf16", "--weights", "module", "--json").stdout)
    assert "training" not in report
    text = cli("inspect", ds_root / "zero2_bf16", "--weights", "module").stdout
    assert "training" not in text.split("\n\n")[0]


def rewrite_states(file: Path, change) -> None:
    import torch

    states = torch.load(file, weights_only=True)
    change(states)
    torch.save(states, file)


@pytest.mark.parametrize(("key", "value"), [("global_steps", -1), ("global_steps", "2")])
def test_a_damaged_step_is_refused_naming_the_file_and_key(ds_copy, cli, key, value):
    folder = ds_copy("zero2_bf16")
    file = folder / TAG / "mp_rank_00_model_states.pt"
    rewrite_states(file, lambda states: states.__setitem__(key, value))
    result = cli("inspect", folder)
    assert result.exit_code == 2, result.output
    assert file.name in result.output and key in result.output and "not a step count" in result.output
    assert len(result.output.strip().splitlines()) == 1


# The native reader on pickled structures as DeepSpeed writes them (no file read): damaged values are refused
# naming the file and the key, and nothing is walked unbounded.
SHAPES = [{"a.weight": (2, 2), "b.weight": (2,)}, {"a.bias": (2,)}]


def pickled(groups, *, state=None, slices=None, steps=2) -> tuple[Pickled, Pickled]:
    states = Pickled(Path("mp_rank_00_model_states.pt"), {
        "module": {"a.weight": 0, "b.weight": 0, "a.bias": 0, "frozen.weight": 0},
        "global_steps": steps, "frozen_param_shapes": None, "buffer_names": [], "shared_params": {},
        "ds_config": {"optimizer": {"type": "AdamW"}},
    }, {})  # fmt: skip
    osd = {"base_optimizer_state": {"state": state or {}, "param_groups": groups}, "loss_scaler": object()}
    if slices is not None:
        osd["param_slice_mappings"] = slices
    return states, Pickled(Path("optim_states.pt"), {"optimizer_state_dict": osd}, {})


def test_the_groups_name_their_parameters_through_param_shapes():
    states, optim = pickled(
        [{"lr": 0.1, "params": [1]}, {"lr": 0.2, "params": [0]}],
        state={0: {"step": 1, "exp_avg": 0, "exp_avg_sq": 0}},
        slices=[{"a.weight": None}, {"a.bias": None}],
    )
    training = native_state(states, optim, SHAPES, beside=None)
    assert [g.params for g in training.groups] == [("a.bias",), ("a.weight", "b.weight")]
    assert [g.hyper for g in training.groups] == [{"lr": 0.1}, {"lr": 0.2}]
    assert training.moments == ("exp_avg", "exp_avg_sq") and training.frozen == ("frozen.weight",)
    assert [(i.kind, str(i)) for i in training.not_carried] == [("loss_scaler", "loss_scaler (optimizer files)")]


def test_a_hyper_parameter_is_kept_bounded():
    bomb: tuple = ()
    for _ in range(40):
        bomb = (bomb, bomb)
    states, optim = pickled([{"lr": bomb, "eps": 10**5000, "params": [0, 1]}])
    hyper = native_state(states, optim, SHAPES, beside=None).groups[0].hyper
    assert isinstance(hyper["lr"], str) and len(hyper["lr"]) <= 80
    assert hyper["eps"] == "<an integer of about 5001 digits>"


@pytest.mark.parametrize(("groups", "slices", "key", "match"), [
    ([{"params": [0, 2]}], None, "param_groups[0].params", "not a list of flat partition indices below 2"),
    ([{"params": [0]}, {"params": [0, 1]}], None, "param_groups[1].params", "another group names"),
    ([{"params": [1]}], None, "param_groups", "leave flat partition 0"),
    ([{"params": [0, 1], 3: 1}], None, "param_groups[0]", "not a short name"),
    ("groups", None, "param_groups", "not a list of at most 2"),
    ([{"params": [0, 1]}], [{"a.bias": None}, {}], "param_slice_mappings[0]", "'a.bias', which is not in"),
])  # fmt: skip
def test_damaged_groups_are_refused_naming_the_key(groups, slices, key, match):
    states, optim = pickled(groups, slices=slices)
    with pytest.raises(CorruptFileError, match=match) as err:
        native_state(states, optim, SHAPES, beside=None)
    assert err.value.tensor.endswith(key) and err.value.path == str(optim.file)


def universal_file(folder: Path, key: str):
    import torch

    name, slot = split_state_name(key)
    stored = torch.load(folder / "zero" / name / f"{slot}.pt", weights_only=True)
    return stored["param"] if isinstance(stored, dict) else stored


def test_the_moments_read_from_the_partitions_are_those_ds_to_universal_gathers(ds_root):
    """Each trainable parameter's exp_avg and exp_avg_sq, read from the three ranks' flat (padded) partitions, equal
    bit for bit DeepSpeed's own gather of them (``ds_to_universal``), and so does the universal checkpoint's read."""
    import torch

    native = discover(ds_root / "zero2_bf16").training
    universal = discover(ds_root / "zero2_bf16" / f"{TAG}_universal").training
    assert native is not None and universal is not None
    trainable = {name for group in native.groups for name in group.params}
    expected = {state_name(name, moment) for name in trainable for moment in ("exp_avg", "exp_avg_sq")}
    assert set(native.tensors[0]) == expected == set(universal.tensors[0])
    for key, ref in native.tensors[0].items():
        gathered = universal_file(ds_root / "zero2_bf16" / f"{TAG}_universal", key)
        read = ref.read()
        assert read.dtype == torch.float32 and read.shape == gathered.reshape(read.shape).shape, key
        assert torch.equal(read.reshape(-1), gathered.reshape(-1)), key
        assert torch.equal(universal.tensors[0][key].read().reshape(-1), gathered.reshape(-1)), key
        assert read.abs().sum() > 0, key  # two steps taken: no moment is all zero


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_trainable_parameter_has_its_moments_at_its_shape(ds_root, variant):
    """ZeRO-1, 2 and 3 in every precision: the moments of each trainable parameter (a rank's partition is cut to its
    fp32 partition's length: the last rank's moments keep the padding) at the weight's shape; exp_avg_sq >= 0."""
    source = discover(ds_root / variant)
    training = source.training
    assert training is not None
    for group in training.groups:
        for name in group.params:
            for moment in ("exp_avg", "exp_avg_sq"):
                ref = training.tensors[0][state_name(name, moment)]
                assert ref.shape == source.ranks[0][name].shape
            assert bool((training.tensors[0][state_name(name, "exp_avg_sq")].read() >= 0).all())
    assert not any(state_name(name, "exp_avg") in training.tensors[0] for name in training.frozen)


def test_with_optimizer_needs_a_layout_that_holds_it(ds_root, cli, tmp_path):
    result = CliRunner().invoke(
        main,
        [
            "convert",
            str(ds_root / "zero2_bf16"),
            "--tp",
            "1",
            "--layout",
            "hf",
            "--with-optimizer",
            "-o",
            str(tmp_path / "out"),
        ],  # fmt: skip
    )
    assert result.exit_code == 2, result.output
    assert "the hf layout holds no optimizer state (--with-optimizer)" in result.output
    assert not (tmp_path / "out").exists()


def test_drop_needs_with_optimizer_and_known_kinds(ds_root, tmp_path):
    base = ["convert", str(ds_root / "zero2_bf16"), "--tp", "1", "-o", str(tmp_path / "out")]
    alone = CliRunner().invoke(main, [*base, "--drop", "rng"])
    assert alone.exit_code == 2 and "--drop only applies with --with-optimizer" in alone.output
    unknown = CliRunner().invoke(main, [*base, "--with-optimizer", "--drop", "rng,dice"])
    assert unknown.exit_code == 2 and "dice: not one of rng, scheduler" in unknown.output


def test_a_universal_output_verifies_against_its_manifest_state_included(ds_root, tmp_path):
    """``--with-optimizer`` to ``--layout deepspeed``: the manifest holds every moment's digest, and ``verify`` of the
    output reads the moments back (not 'missing'); the output read again holds the source's state and nothing left
    over (the model states it writes record no skipped step)."""
    out = tmp_path / "universal"
    drop = "dataloader,loss_scaler,other"
    done = CliRunner().invoke(main, ["convert", str(ds_root / "zero2_bf16"), "--tp", "1", "--layout", "deepspeed",
                                     "--with-optimizer", "--drop", drop, "-o", str(out), "-q"])  # fmt: skip
    assert done.exit_code == 0, done.output
    manifest = json.loads((out / "reshard.json").read_text())
    moments = [name for name in manifest["tensors"] if split_state_name(name)[1] is not None]
    assert len(moments) == 40
    verified = CliRunner().invoke(main, ["verify", str(out), "--json"])
    assert verified.exit_code == 0, verified.output
    assert json.loads(verified.output)["checks"][0]["tensors"] == len(manifest["tensors"])
    source, written = discover(ds_root / "zero2_bf16"), discover(out)
    again = written.training
    assert again is not None and again.not_carried == ()
    assert again.groups == source.training.groups
    # The tie as DeepSpeed records it (shared_params): lm_head.weight is the embedding, neither frozen nor grouped.
    tie = "tied weights (shared_params): lm_head.weight = model.embed_tokens.weight"
    assert tie in source.notes and tie in written.notes
    assert again.frozen == source.training.frozen
    import torch

    tag = (out / "latest_universal").read_text()
    states = torch.load(out / tag / "mp_rank_00_model_states.pt", weights_only=True)
    assert states["shared_params"] == {"lm_head.weight": "model.embed_tokens.weight"}


KILL_AFTER_FILES = """
import os, signal, sys
import reshard.io.journal as journal
real, count = journal.Journal.file_done, [0]
def file_done(self, relative):
    real(self, relative)
    count[0] += 1
    if count[0] == 25:
        os.kill(os.getpid(), signal.SIGKILL)
journal.Journal.file_done = file_done
from reshard.cli.main import main
sys.argv[0] = "reshard"
main()
"""


def test_a_training_state_conversion_is_shared_by_workers_and_resumed_after_a_kill(ds_root, tmp_path):
    """The state tensors are units of work like the weights: ``--workers 2`` writes the bytes one process writes, and
    a run killed after 25 files finishes with ``--resume`` into them too."""
    import subprocess
    import sys

    from fixtures.checks import output_tree

    def convert(out: Path, *extra: str, code: str | None = None) -> subprocess.CompletedProcess:
        argv = ["convert", str(ds_root / "zero2_bf16"), "--tp", "1", "--layout", "deepspeed", "--with-optimizer",
                "--drop", "dataloader,loss_scaler,other", "-o", str(out), "-q", *extra]  # fmt: skip
        command = [sys.executable, "-c", code, *argv] if code else [sys.executable, "-m", "reshard", *argv]
        return subprocess.run(command, capture_output=True, text=True, timeout=600)

    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    assert convert(one).returncode == 0
    shared = convert(two, "--workers", "2")
    assert shared.returncode == 0, shared.stderr
    assert output_tree(two) == output_tree(one)
    killed = convert(resumed, "--resume", code=KILL_AFTER_FILES)
    assert killed.returncode == -9 and not resumed.exists()
    finished = convert(resumed, "--resume")
    assert finished.returncode == 0, finished.stderr
    assert output_tree(resumed) == output_tree(one)
