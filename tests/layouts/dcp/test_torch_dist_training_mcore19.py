"""``--with-optimizer`` between ``torch_dist`` checkpoints, proven by Megatron-Core 0.19.2 training on CPU
(``oracles/mcore_train.py``): its distributed optimizer trains a tiny GPT at tp 2 for 3 steps (fp32, and bf16 with
fp32 masters apart) and saves it with the optimizer in model space (``fully_reshardable``); reshard converts it
(``--tp 1``, which torch_dist only records) and Megatron-Core resumes from the output at tp 1 and tp 2 with its own
load of model, optimizer and LR scheduler.

- Right after the load, every parameter's fp32 master and moments are, bit for bit, what the optimizer held when it
  saved (tp 2: this rank's slice), and what Megatron-Core gathers when it loads its own checkpoint at tp 1; the step
  and the groups' hyper-parameters are the saved ones, though the resuming run was configured with others.
- The 3 resumed losses equal the run that went on without saving (tp 2) and Megatron-Core's own resume at tp 1.
- A weights-only conversion, whose resume starts a fresh optimizer, misses them by far more.
- Megatron-Core's non-distributed ``FP32Optimizer`` state (its weights are the masters) resumes in the distributed
  optimizer at tp 1.
- A Mixtral-like MoE (trained at tp 1: MoE trains at tp > 1 only with sequence parallelism, which the local spec's
  norms refuse) goes the same way, its experts' state included.
- Megatron-LM's default format (``dp_reshardable``, flat buffers per bucket) is read, at tp 2 (one bucket) and at
  data-parallel 2 with ``--overlap-grad-reduce`` and small buckets (four, parameters cut across the data-parallel
  shares): every master and moment equals what Megatron-Core gathers, Megatron-Core resumes from the conversion
  at tp 1 and tp 2 with the reference losses, and ``--layout dcp`` and ``deepspeed`` carry the same state. A layout
  reshard computes that the checkpoint's records contradict is refused, with both numbers. Pipeline stages
  (tp 1 x pp 2, stepped with synthetic gradients: no pipeline schedule runs here) are read as Megatron-Core gathers
  them, and Megatron-Core at pp 1 loads their conversion.

The vocab is unpadded (``divisible_by`` 4: 1000 rows at tp 1 and 2): Megatron-Core trains the padded rows of the
output layer (they take part in the softmax), which reshard writes as zeros, as it does for the weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from fixtures.mcore19 import REQUIREMENTS
from fixtures.torchrun import source_key, write_once
from fixtures.venvs import framework_python
from oracles import SCRIPT, run_jobs

from reshard.cli import main
from reshard.layouts.dcp import torch_dist_dp
from reshard.layouts.dcp.dcp import discover as discover_dcp
from reshard.layouts.dcp.torch_dist import discover
from reshard.layouts.training import state_name
from reshard.options import ReadOptions

pytestmark = pytest.mark.oracle

TRAIN = SCRIPT.with_name("mcore_train.py")
SPEC = {"variant": "llama", "overrides": {"divisible_by": "4"}}
MOE = {"variant": "moe", "tp": 1, "overrides": {"divisible_by": "4"}}  # at tp > 1 MoE trains only with sequence par.
STEPS = 3
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-3}  # one state resumed at tp 1 and tp 2 differs by ~5e-7 (fp32), ~6e-4 (bf16)
SLOTS = {"param": "master", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}  # Megatron's state key -> reshard's
BUCKET = 40_000  # --ddp-bucket-size: the tiny model's 121,920 parameters in 4 buckets
SAVED_HYPER = {"betas": (0.9, 0.95), "eps": 1e-8, "step": float(STEPS)}  # the resume is configured otherwise


def spec(tp: int) -> dict:
    return SPEC | {"tp": tp}


# Megatron-Core's runs, trained 3 steps and saved: folder -> what the train job adds.
RUNS = {
    "fp32": {"spec": spec(2)},
    "bf16": {"spec": spec(2), "bf16": True},  # bf16 weights, fp32 masters apart
    "dp_reshardable": {"spec": spec(2), "sharding": "dp_reshardable"},  # Megatron-LM's default format
    "dp2": {"spec": spec(1), "sharding": "dp_reshardable", "bucket_size": BUCKET},  # 4 buckets over dp 2
    "dp_bf16": {"spec": spec(2), "bf16": True, "sharding": "dp_reshardable"},  # bf16 buffers, fp32 masters
    "pp2": {"spec": SPEC | {"tp": 1, "pp": 2}, "sharding": "dp_reshardable", "bucket_size": BUCKET},  # synthetic
    "plain": {"spec": spec(2), "sharding": "none"},  # FP32Optimizer: no distributed optimizer
    "moe": {"spec": MOE},
}
OWN = ("fp32", "bf16")  # resumed by Megatron-Core from its own checkpoint at tp 1: RUN/own-tp1
# reshard's conversions: output -> (run, --with-optimizer); Megatron-Core's resumes: name -> (output, job).
CONVERSIONS = {"fp32": ("fp32", True), "weights": ("fp32", False), "bf16": ("bf16", True)}
CONVERSIONS |= {"moe": ("moe", True), "plain": ("plain", True)}
CONVERSIONS |= {"dp_reshardable": ("dp_reshardable", True), "dp2": ("dp2", True), "pp2": ("pp2", True)}
RESUMES = {
    "fp32-tp1": ("fp32", {"spec": spec(1)}),
    "fp32-tp2": ("fp32", {"spec": spec(2)}),
    "reset-tp2": ("weights", {"spec": spec(2), "optimizer": False}),
    "bf16-tp1": ("bf16", {"spec": spec(1), "bf16": True}),
    "bf16-tp2": ("bf16", {"spec": spec(2), "bf16": True}),
    "moe-tp1": ("moe", {"spec": MOE}),
    "plain-tp1": ("plain", {"spec": spec(1)}),
    "dp_reshardable-tp1": ("dp_reshardable", {"spec": spec(1)}),
    "dp_reshardable-tp2": ("dp_reshardable", {"spec": spec(2)}),
    "dp2-tp1": ("dp2", {"spec": spec(1)}),
    "dp2-tp2": ("dp2", {"spec": spec(2)}),
    "pp2-tp1": ("pp2", {"spec": spec(1)}),
}


@pytest.fixture(scope="module")
def mcore19(pytestconfig: pytest.Config) -> Path:
    return framework_python(pytestconfig, "megatron-core-0.19", REQUIREMENTS)


@pytest.fixture(scope="module")
def trained(pytestconfig: pytest.Config, mcore19: Path) -> Path:
    """Megatron-Core's ``RUNS`` (``RUN/ckpt``, ``RUN/reference.pt``, ``RUN/saved_rank{r}.pt``) and its own resumes
    of ``OWN`` at tp 1 (``RUN/own-tp1.rank{r}``), written once and cached."""
    oracles = SCRIPT.parent
    sources = [TRAIN, SCRIPT, oracles / "megatron_lm.py", oracles / "variants.py"]
    key = source_key(sources, f"{' '.join(REQUIREMENTS)} {RUNS} {OWN} {STEPS}")
    root = Path(pytestconfig.cache.mkdir("mcore-0.19-training")) / key

    def prepare(staging: Path) -> None:
        jobs = [
            {"command": "train", "steps": STEPS, "more": STEPS, "out": str(staging / run)} | extra
            for run, extra in RUNS.items()
        ]
        jobs += [
            {"command": "resume", "spec": spec(1), "ckpt": str(staging / run / "ckpt"), "steps": STEPS}
            | {"out": str(staging / run / "own-tp1"), "optimizer": True, "bf16": RUNS[run].get("bf16", False)}
            for run in OWN
        ]
        (staging / "jobs.json").write_text(json.dumps(jobs))

    return write_once(
        root, str(TRAIN), ranks=2, args=lambda staging: ["jobs", str(staging / "jobs.json")], prepare=prepare,
        python=mcore19,
    )  # fmt: skip


@pytest.fixture(scope="module")
def resumed(trained: Path, mcore19: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """reshard's ``CONVERSIONS`` of the runs (``OUT/<output>``) and Megatron-Core's ``RESUMES`` from them
    (``OUT/<name>.rank{r}``), in one torchrun."""
    out = tmp_path_factory.mktemp("resumed")
    for name, (run, with_optimizer) in CONVERSIONS.items():
        extra = ("--with-optimizer", "--drop", "rng,trainer") if with_optimizer else ()  # the scheduler goes along
        args = ["convert", trained / run / "ckpt", "--tp", 1, "--layout", "torch_dist", *extra, "-o", out / name]
        result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
        assert result.exit_code == 0, result.output
    jobs = [
        {"command": "resume", "ckpt": str(out / output), "out": str(out / name), "steps": STEPS, "optimizer": True}
        | job
        for name, (output, job) in RESUMES.items()
    ]
    run_jobs(jobs, nproc=2, python=mcore19, script=TRAIN)
    return out


def load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def reference(trained: Path, run: str = "fp32") -> list[float]:
    return load(trained / run / "reference.pt")["losses"]


def assert_same_state(got: dict, held: dict, what: str) -> None:
    assert set(got) == set(held), what
    for param, tensors in held.items():
        for key, tensor in tensors.items():
            assert torch.equal(got[param][key], tensor), (what, param, key)


@pytest.mark.parametrize("run", OWN)
def test_reshard_reads_the_state_megatron_core_gathers(trained: Path, run: str) -> None:
    """Every parameter's master and moments as reshard reads the checkpoint equal, bit for bit, what Megatron-Core
    holds after loading its own checkpoint at tp 1 (its data-parallel shards gathered)."""
    source = discover(trained / run / "ckpt", ReadOptions())
    training = source.training
    assert training is not None and training.step == STEPS and training.moments == ("exp_avg", "exp_avg_sq")
    assert [len(g.params) for g in training.groups] == [18, 9]  # weights; norms (no weight decay)
    (refs,) = training.tensors
    held = load(trained / run / "own-tp1.rank0")["state"]
    assert set(held) == set(source.ranks[0])
    for name, tensors in held.items():
        for key, slot in SLOTS.items():
            ref = refs[state_name(name, slot)]
            out = torch.empty(ref.shape, dtype=torch.float32)
            ref.reader.read_into(ref.key, out)
            assert torch.equal(out, tensors[key]), (name, slot)


@pytest.mark.parametrize("run", OWN)
def test_megatron_core_resumes_from_reshards_output_at_tp1_and_tp2(trained: Path, resumed: Path, run: str) -> None:
    """Right after the load: at tp 2 each rank's state is the one it saved, at tp 1 the one Megatron-Core gathers from
    its own checkpoint, the step and hyper-parameters the saved ones; then the reference losses (at tp 1 exactly
    those of Megatron-Core's own resume)."""
    for rank in range(2):
        baseline = {"tp2": trained / run / f"saved_rank{rank}.pt", "tp1": trained / run / f"own-tp1.rank{rank}"}
        for tp, held in baseline.items():
            got = load(resumed / f"{run}-{tp}.rank{rank}")
            assert_same_state(got["state"], load(held)["state"], f"{run}-{tp} rank {rank}")
            for group in got["groups"]:
                assert {key: group[key] for key in SAVED_HYPER} == SAVED_HYPER
            assert [g["weight_decay"] for g in got["groups"]] == [0.1, 0.0]
    assert load(resumed / f"{run}-tp1.rank0")["losses"] == load(trained / run / "own-tp1.rank0")["losses"]
    for tp in ("tp1", "tp2"):
        losses = torch.tensor(load(resumed / f"{run}-{tp}.rank0")["losses"])
        torch.testing.assert_close(losses, torch.tensor(reference(trained, run)), rtol=0, atol=TOLERANCE[run])


def test_bf16_masters_travel_as_fp32_apart_from_the_weights(resumed: Path) -> None:
    """A bf16 copy passed off as the master would pass the losses' bf16 tolerance: the bits show it is not one."""
    state = load(resumed / "bf16-tp1.rank0")["state"]
    masters = torch.cat([tensors["param"].flatten() for tensors in state.values()])
    assert masters.dtype == torch.float32 and not torch.equal(masters, masters.bfloat16().float())


def test_verify_reads_the_state_back_against_the_source(cli, trained: Path, resumed: Path) -> None:
    source = trained / "fp32" / "ckpt"
    result = cli("verify", resumed / "fp32", source, "--train-state")
    assert result.exit_code == 0, result.output
    assert f"training state against {source}: ok (81 tensors checked)" in result.output


def test_an_moe_resumes_with_its_experts_state(trained: Path, resumed: Path) -> None:
    """Four routed experts stacked ``[L, E, ...]`` and the router, the distributed optimizer sharded over two
    data-parallel ranks: the resume holds the saved state and takes the reference steps."""
    for rank in range(2):
        saved = load(trained / "moe" / f"saved_rank{rank}.pt")["state"]
        assert any(".local_experts.3." in name for name in saved)
        assert_same_state(load(resumed / f"moe-tp1.rank{rank}")["state"], saved, f"moe rank {rank}")
    assert load(resumed / "moe-tp1.rank0")["losses"] == reference(trained, "moe")


def test_the_distributed_optimizer_resumes_the_non_distributed_ones_state(trained: Path, resumed: Path) -> None:
    """Megatron-Core's ``FP32Optimizer`` (no ``--use-distributed-optimizer``) keeps no master apart: its fp32 weights
    are written as the distributed optimizer's ``param``, which resumes from them at tp 1 with the reference steps."""
    got = load(resumed / "plain-tp1.rank0")
    losses = torch.tensor(got["losses"])
    torch.testing.assert_close(losses, torch.tensor(reference(trained, "plain")), rtol=0, atol=TOLERANCE["fp32"])
    assert [g["weight_decay"] for g in got["groups"]] == [0.1, 0.0] and got["groups"][0]["step"] == STEPS


def test_a_weights_only_conversion_misses_the_resumed_losses(trained: Path, resumed: Path) -> None:
    losses = torch.tensor(load(resumed / "reset-tp2.rank0")["losses"])
    deviation = (losses - torch.tensor(reference(trained))).abs().max().item()
    assert deviation > 100 * TOLERANCE["fp32"], deviation


def test_dp_reshardable_is_read_as_megatron_core_gathers_it(trained: Path) -> None:
    """Megatron-LM's default format, one bucket per tp rank (tp 2, fp32 and bf16 with fp32 masters) or four buckets
    cut across two data-parallel shares (tp 1): every parameter's master and moments equal, bit for bit, what
    Megatron-Core gathers of the same run (tp 2: its own load at tp 1 of the same training saved
    ``fully_reshardable``, whose states are the same bit for bit)."""
    same = {"dp_reshardable": "fp32", "dp_bf16": "bf16"}  # the same training, saved fully_reshardable
    for run, twin in same.items():
        for rank in range(2):
            assert_same_state(
                load(trained / run / f"saved_rank{rank}.pt")["state"],
                load(trained / twin / f"saved_rank{rank}.pt")["state"],
                f"{run}: the same training saved in both formats",
            )
    held = {run: trained / twin / "own-tp1.rank0" for run, twin in same.items()}
    held["dp2"] = trained / "dp2" / "saved_rank0.pt"
    for run, held_by in held.items():
        training = discover(trained / run / "ckpt", ReadOptions()).training
        assert training is not None and training.unread is None and training.step == STEPS
        assert [len(g.params) for g in training.groups] == [18, 9]
        (refs,) = training.tensors
        state = load(held_by)["state"]
        assert len(state) == 27
        for name, tensors in state.items():
            for key, slot in SLOTS.items():
                ref = refs[state_name(name, slot)]
                assert ref.dtype == torch.float32 and torch.equal(ref.read(), tensors[key]), (run, name, slot)


@pytest.mark.parametrize("run", ["dp_reshardable", "dp2"])
def test_megatron_core_resumes_from_dp_reshardable_converted(trained: Path, resumed: Path, run: str) -> None:
    """Converted to ``fully_reshardable`` at tp 1, resumed at tp 1 and tp 2: right after the load each rank holds the
    state Megatron-Core held at the save (at the saving tp) or gathers (tp 1 from tp 2), the saved step and
    hyper-parameters; then the reference losses."""
    saved_tp = RUNS[run]["spec"]["tp"]
    for rank in range(2):
        held = {f"tp{saved_tp}": trained / run / f"saved_rank{rank}.pt"}
        if run == "dp_reshardable":
            held["tp1"] = trained / "fp32" / f"own-tp1.rank{rank}"
        for tp, baseline in held.items():
            got = load(resumed / f"{run}-{tp}.rank{rank}")
            assert_same_state(got["state"], load(baseline)["state"], f"{run}-{tp} rank {rank}")
            for group in got["groups"]:
                assert {key: group[key] for key in SAVED_HYPER} == SAVED_HYPER
    for tp in ("tp1", "tp2"):
        losses = torch.tensor(load(resumed / f"{run}-{tp}.rank0")["losses"])
        torch.testing.assert_close(losses, torch.tensor(reference(trained, run)), rtol=0, atol=TOLERANCE["fp32"])


def test_dp_reshardable_pipeline_stages_are_read_and_resumed_in_one(trained: Path, resumed: Path) -> None:
    """tp 1 x pp 2, stage 0 in four buckets and stage 1 in one (Megatron-Core buckets the first stage alone), stepped
    with synthetic gradients (no pipeline schedule runs here): every master and moment is read as each stage's
    Megatron-Core gathers it, and Megatron-Core at pp 1 loads the conversion holding all of them."""
    saved = load(trained / "pp2" / "saved_rank0.pt")["state"] | load(trained / "pp2" / "saved_rank1.pt")["state"]
    assert len(saved) == 27 and "decoder.layers.3.mlp.linear_fc2.weight" in saved
    training = discover(trained / "pp2" / "ckpt", ReadOptions()).training
    assert training is not None and training.unread is None and training.step == STEPS
    (refs,) = training.tensors
    for name, tensors in saved.items():
        for key, slot in SLOTS.items():
            assert torch.equal(refs[state_name(name, slot)].read(), tensors[key]), (name, slot)
    for rank in range(2):
        assert_same_state(load(resumed / f"pp2-tp1.rank{rank}")["state"], saved, f"pp2-tp1 rank {rank}")


def test_dp_reshardable_goes_to_dcp_and_deepspeed_with_its_state(cli, trained: Path, tmp_path: Path) -> None:
    """The same training state in the other targets: DCP's model tensors are the masters and its optimizer holds
    the moments (Megatron's names); DeepSpeed's universal files hold them under transformers' names (the tp-2
    ``linear_fc2`` put back together on dim 1, ``linear_fc1``'s gate half as ``gate_proj``)."""
    source = trained / "dp_reshardable" / "ckpt"
    (refs,) = discover(source, ReadOptions()).training.tensors

    def state(name: str, slot: str) -> torch.Tensor:
        return refs[state_name(name, slot)].read()

    drop = ("--drop", "rng,scheduler,trainer")
    for layout in ("dcp", "deepspeed"):
        result = cli(
            "convert", source, "--tp", 1, "--layout", layout, "--with-optimizer", *drop, "-o", tmp_path / layout
        )
        assert result.exit_code == 0, result.output
    dcp = discover_dcp(tmp_path / "dcp", ReadOptions())
    (dcp_refs,) = dcp.training.tensors
    for name in ("decoder.layers.1.mlp.linear_fc2.weight", "output_layer.weight", "decoder.final_layernorm.weight"):
        assert torch.equal(dcp.ranks[0][name].read(), state(name, "master")), name
        for slot in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(dcp_refs[state_name(name, slot)].read(), state(name, slot)), (name, slot)
    zero = tmp_path / "deepspeed" / f"global_step{STEPS}" / "zero"
    for hf, name, rows in (
        ("model.layers.1.mlp.down_proj.weight", "decoder.layers.1.mlp.linear_fc2.weight", None),
        ("model.layers.1.mlp.gate_proj.weight", "decoder.layers.1.mlp.linear_fc1.weight", slice(0, 96)),
        ("model.norm.weight", "decoder.final_layernorm.weight", None),
    ):
        for file, slot in (("fp32", "master"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            written = load(zero / hf / f"{file}.pt")["param"]
            expected = state(name, slot) if rows is None else state(name, slot)[rows]
            assert torch.equal(written, expected), (hf, slot)


def test_a_layout_the_checkpoint_contradicts_is_refused_with_both_numbers(
    cli, trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Buckets computed another size than Megatron-Core made them (here: one, where it made four) are refused,
    named with what the checkpoint records and what reshard computes; inspect shows why the state is not read."""
    monkeypatch.setattr(torch_dist_dp, "bucket_size_of", lambda args, dp: (None, False, None))
    source = trained / "dp2" / "ckpt"
    report = json.loads(cli("inspect", source, "--json").stdout)["training"]
    assert report["unread"].startswith(
        "the distributed optimizer's state is 'dp_reshardable', but optimizer.distributed.dp_group_idx_0."
        "per_bucket_numel: the checkpoint records [64000, 47360, 45312, 86656], reshard computes [243328] from"
    )
    drop = ("--drop", "rng,trainer")
    result = cli(
        "convert", source, "--layout", "torch_dist", "--tp", 1, "--with-optimizer", *drop, "-o", tmp_path / "o"
    )
    assert result.exit_code == 2 and "reshard computes [243328]" in result.output and not (tmp_path / "o").exists()


def test_the_lr_scheduler_goes_along_to_torch_dist_and_is_left_behind_elsewhere_only_by_leave(
    cli, trained: Path, tmp_path: Path
) -> None:
    """Megatron-LM loads the optimizer with its LR scheduler (a KeyError without it), which does not depend on the
    parallelism: a torch_dist target takes it over as it is and says so; another framework's target leaves it behind,
    only with ``--drop scheduler``."""
    source = trained / "fp32" / "ckpt"
    drop = ("--with-optimizer", "--drop", "rng,trainer")
    result = cli("convert", source, "--tp", 1, "--layout", "torch_dist", *drop, "-o", tmp_path / "td", "--json")
    assert result.exit_code == 0, result.output
    (note,) = [n for n in json.loads(result.stdout)["notes"] if n.startswith("training state carried")]
    assert "carried as it is: Megatron's opt_param_scheduler (common state)" in note
    assert "opt_param_scheduler" not in note.partition("left behind")[2]
    written = discover(tmp_path / "td", ReadOptions()).top_level[0]["opt_param_scheduler"]
    assert written and written == discover(source, ReadOptions()).top_level[0]["opt_param_scheduler"]
    result = cli("convert", source, "--tp", 1, "--layout", "dcp", *drop, "-o", tmp_path / "dcp")
    assert result.exit_code == 2 and "Megatron's opt_param_scheduler (common state)" in result.output
    assert "--drop rng,scheduler" not in result.output and "--drop scheduler" in result.output
    assert not (tmp_path / "dcp").exists()
