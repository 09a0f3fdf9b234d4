"""``--with-optimizer`` between ``torch_dist`` checkpoints, proven by Megatron-Core 0.19.2 training on CPU
(``oracles/mcore_train.py``): its distributed optimizer trains a tiny GPT at tp 2 for 3 steps and saves it with the
optimizer in model space (``fully_reshardable``); reshard converts it (``--tp 1``, which torch_dist only records) and
Megatron-Core resumes from the output at tp 1 and tp 2 with its own load of model and optimizer.

- Right after the load, every parameter's fp32 master and moments are, bit for bit, what the optimizer held when it
  saved (tp 2: this rank's slice), and what Megatron-Core gathers when it loads its own checkpoint at tp 1; the step
  and the groups' hyper-parameters are the saved ones, though the resuming run was configured with others.
- The 3 resumed losses equal the run that went on without saving (tp 2) and Megatron-Core's own resume at tp 1.
- A weights-only conversion, whose resume starts a fresh optimizer, misses them by far more.
- Megatron-Core's non-distributed ``FP32Optimizer`` state (its weights are the masters) resumes in the distributed
  optimizer at tp 1.
- A Mixtral-like MoE (trained at tp 1: MoE trains at tp > 1 only with sequence parallelism, which the local spec's
  norms refuse) goes the same way, its experts' state included.
- Megatron-LM's default format (``dp_reshardable``, flat buffers per bucket) is shown by ``inspect`` and refused by
  name.

The vocab is unpadded (``divisible_by`` 4: 1000 rows at tp 1 and 2): Megatron-Core trains the padded rows of the
output layer (they take part in the softmax), which reshard writes as zeros, as it does for the weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from fixtures.torchrun import source_key, write_once
from fixtures.venvs import framework_python
from oracles import SCRIPT, run_jobs
from test_torch_dist_mcore19 import REQUIREMENTS

from reshard.cli import main
from reshard.layouts.dcp.torch_dist import discover
from reshard.layouts.training import state_name
from reshard.options import ReadOptions

pytestmark = pytest.mark.oracle

TRAIN = SCRIPT.with_name("mcore_train.py")
SPEC = {"variant": "llama", "overrides": {"divisible_by": "4"}}
MOE = {
    "variant": "moe",
    "tp": 1,
    "overrides": {"divisible_by": "4"},
}  # MoE trains at tp > 1 only with sequence parallelism
STEPS = 3
TOLERANCE = 1e-5  # fp32: the same state resumed at tp 1 and tp 2 differs by ~5e-7; a reset moments by ~5e-3
SLOTS = {"param": "master", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}  # Megatron's state key -> reshard's
RESUMES = (("rs-tp1", 1, "with-optimizer"), ("rs-tp2", 2, "with-optimizer"), ("reset-tp2", 2, "weights"))
SAVED_HYPER = {"betas": (0.9, 0.95), "eps": 1e-8, "step": float(STEPS)}  # the resume is configured otherwise


def spec(tp: int) -> dict:
    return SPEC | {"tp": tp}


@pytest.fixture(scope="module")
def mcore19(pytestconfig: pytest.Config) -> Path:
    return framework_python(pytestconfig, "megatron-core-0.19", REQUIREMENTS)


@pytest.fixture(scope="module")
def trained(pytestconfig: pytest.Config, mcore19: Path) -> Path:
    """Megatron-Core's run (``fully_reshardable/``, ``dp_reshardable/``) and its own resume of the first at tp 1
    (``own-tp1``), written once and cached."""
    oracles = SCRIPT.parent
    sources = [TRAIN, SCRIPT, oracles / "megatron_lm.py", oracles / "variants.py"]
    key = source_key(sources, f"{' '.join(REQUIREMENTS)} {SPEC} {MOE} {STEPS} none")
    root = Path(pytestconfig.cache.mkdir("mcore-0.19-training")) / key

    def prepare(staging: Path) -> None:
        jobs = [
            {"command": "train", "spec": spec(2), "steps": STEPS, "more": STEPS, "sharding": sharding}
            | {"out": str(staging / sharding)}
            for sharding in ("fully_reshardable", "dp_reshardable", "none")
        ]
        jobs.append({"command": "train", "spec": MOE, "steps": STEPS, "more": STEPS, "out": str(staging / "moe")})
        jobs.append(
            {"command": "resume", "spec": spec(1), "ckpt": str(staging / "fully_reshardable" / "ckpt")}
            | {"out": str(staging / "own-tp1"), "steps": STEPS, "optimizer": True}
        )
        (staging / "jobs.json").write_text(json.dumps(jobs))

    return write_once(
        root, str(TRAIN), ranks=2, args=lambda staging: ["jobs", str(staging / "jobs.json")], prepare=prepare,
        python=mcore19,
    )  # fmt: skip


@pytest.fixture(scope="module")
def resumed(trained: Path, mcore19: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """reshard's conversions of the runs (with the optimizer, and the weights alone) and Megatron-Core's resumes
    from them: ``rs-tp1``, ``rs-tp2``, ``reset-tp2`` (a fresh optimizer on the weights alone), ``rs-moe`` and
    ``rs-plain-tp1`` (the distributed optimizer resuming the non-distributed one's state)."""
    out = tmp_path_factory.mktemp("resumed")
    drop = ("--drop", "rng,scheduler,trainer")
    conversions = (
        ("with-optimizer", "fully_reshardable", ("--with-optimizer", *drop)),
        ("weights", "fully_reshardable", ()),
        ("moe-with-optimizer", "moe", ("--with-optimizer", *drop)),
        ("plain-with-optimizer", "none", ("--with-optimizer", *drop)),
    )
    for name, run, extra in conversions:
        args = ["convert", trained / run / "ckpt", "--tp", 1, "--layout", "torch_dist", *extra, "-o", out / name]
        result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
        assert result.exit_code == 0, result.output
    jobs = [
        {"command": "resume", "spec": spec(tp), "ckpt": str(out / ckpt), "out": str(out / name), "steps": STEPS}
        | {"optimizer": ckpt == "with-optimizer"}
        for name, tp, ckpt in RESUMES
    ]
    jobs.append(
        {"command": "resume", "spec": MOE, "ckpt": str(out / "moe-with-optimizer"), "out": str(out / "rs-moe")}
    )
    jobs[-1] |= {"steps": STEPS, "optimizer": True}
    jobs.append({"command": "resume", "spec": spec(1), "ckpt": str(out / "plain-with-optimizer")})
    jobs[-1] |= {"out": str(out / "rs-plain-tp1"), "steps": STEPS, "optimizer": True}
    run_jobs(jobs, nproc=2, python=mcore19, script=TRAIN)
    return out


def load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def reference(trained: Path) -> list[float]:
    return load(trained / "fully_reshardable" / "reference.pt")["losses"]


def test_reshard_reads_the_state_megatron_core_gathers(trained: Path) -> None:
    """Every parameter's master and moments as reshard reads the checkpoint equal, bit for bit, what Megatron-Core
    holds after loading its own checkpoint at tp 1 (its data-parallel shards gathered)."""
    source = discover(trained / "fully_reshardable" / "ckpt", ReadOptions())
    training = source.training
    assert training is not None and training.step == STEPS and training.moments == ("exp_avg", "exp_avg_sq")
    assert [len(g.params) for g in training.groups] == [18, 9]  # weights; norms (no weight decay)
    (refs,) = training.tensors
    held = load(trained / "own-tp1.rank0")["state"]
    assert set(held) == set(source.ranks[0])
    for name, tensors in held.items():
        for key, slot in SLOTS.items():
            ref = refs[state_name(name, slot)]
            out = torch.empty(ref.shape, dtype=torch.float32)
            ref.reader.read_into(ref.key, out)
            assert torch.equal(out, tensors[key]), (name, slot)


def test_megatron_core_resumes_from_reshards_output_at_tp1_and_tp2(trained: Path, resumed: Path) -> None:
    saved = [load(trained / "fully_reshardable" / f"saved_rank{r}.pt") for r in range(2)]
    own = [load(trained / f"own-tp1.rank{r}") for r in range(2)]
    for name, baseline in (("rs-tp2", saved), ("rs-tp1", own)):
        for rank in range(2):
            got = load(resumed / f"{name}.rank{rank}")
            state = baseline[rank]["state"]
            assert set(got["state"]) == set(state)
            for param, tensors in state.items():
                for key, tensor in tensors.items():
                    assert torch.equal(got["state"][param][key], tensor), (name, rank, param, key)
            for group in got["groups"]:
                assert {key: group[key] for key in SAVED_HYPER} == SAVED_HYPER
            assert [g["weight_decay"] for g in got["groups"]] == [0.1, 0.0]
    assert load(resumed / "rs-tp1.rank0")["losses"] == own[0]["losses"]  # the same state, the same steps
    for name in ("rs-tp1", "rs-tp2"):
        losses = load(resumed / f"{name}.rank0")["losses"]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference(trained)), rtol=0, atol=TOLERANCE)


def test_verify_reads_the_state_back_against_the_source(cli, trained: Path, resumed: Path) -> None:
    source = trained / "fully_reshardable" / "ckpt"
    result = cli("verify", resumed / "with-optimizer", source, "--train-state")
    assert result.exit_code == 0, result.output
    assert f"training state against {source}: ok (81 tensors checked)" in result.output


def test_an_moe_resumes_with_its_experts_state(trained: Path, resumed: Path) -> None:
    """Four routed experts stacked ``[L, E, ...]`` and the router, the distributed optimizer sharded over two
    data-parallel ranks: the resume holds the saved state and takes the reference steps."""
    for rank in range(2):
        saved = load(trained / "moe" / f"saved_rank{rank}.pt")["state"]
        got = load(resumed / f"rs-moe.rank{rank}")["state"]
        assert any(".local_experts.3." in name for name in saved) and set(got) == set(saved)
        for param, tensors in saved.items():
            for key, tensor in tensors.items():
                assert torch.equal(got[param][key], tensor), (rank, param, key)
    assert load(resumed / "rs-moe.rank0")["losses"] == load(trained / "moe" / "reference.pt")["losses"]


def test_the_distributed_optimizer_resumes_the_non_distributed_ones_state(trained: Path, resumed: Path) -> None:
    """Megatron-Core's ``FP32Optimizer`` (no ``--use-distributed-optimizer``) keeps no master apart: its fp32 weights
    are written as the distributed optimizer's ``param``, which resumes from them at tp 1 with the reference steps."""
    got = load(resumed / "rs-plain-tp1.rank0")
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(load(trained / "none" / "reference.pt")["losses"]), rtol=0,
        atol=TOLERANCE,
    )  # fmt: skip
    assert [g["weight_decay"] for g in got["groups"]] == [0.1, 0.0] and got["groups"][0]["step"] == STEPS


def test_a_weights_only_conversion_misses_the_resumed_losses(trained: Path, resumed: Path) -> None:
    losses = torch.tensor(load(resumed / "reset-tp2.rank0")["losses"])
    deviation = (losses - torch.tensor(reference(trained))).abs().max().item()
    assert deviation > 100 * TOLERANCE, deviation


def test_dp_reshardable_is_shown_and_refused_by_name(cli, trained: Path, tmp_path: Path) -> None:
    source = trained / "dp_reshardable" / "ckpt"
    report = json.loads(cli("inspect", source, "--json").stdout)["training"]
    assert report["moments"] == ["exp_avg", "exp_avg_sq"] and "'dp_reshardable'" in report["unread"]
    assert "not read    the distributed optimizer's state is 'dp_reshardable'" in cli("inspect", source).stdout
    drop = ("--drop", "rng,scheduler,trainer")
    result = cli(
        "convert", source, "--tp", 1, "--layout", "torch_dist", "--with-optimizer", *drop, "-o", tmp_path / "o"
    )
    assert result.exit_code == 2
    assert "'dp_reshardable': per-bucket flat buffers" in result.output
    assert "--dist-ckpt-optim-fully-reshardable" in result.output and not (tmp_path / "o").exists()
