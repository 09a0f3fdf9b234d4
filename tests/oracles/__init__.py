"""Oracles: real frameworks, run in subprocesses, that write the checkpoints reshard reads and read what it writes.

``mcore_gpt.py`` is Megatron-Core 0.16.1 on CPU under ``torchrun`` (its docstring says how to run it by hand). This
module runs it with a timeout and caches what it writes for the whole pytest session::

    def test_something(mcore_oracle):
        ckpt = mcore_oracle.checkpoint("llama", tp=2)          # written once per session
        ckpt.torch_dist, ckpt.torch                            # .../torch_dist (root with the tracker), .../torch
        ckpt.logits                                            # fp32 [2, 12, vocab]: the writer's, padding cut
        out = mcore_oracle.load(some_dir, "llama", tp=1, fmt="torch_dist")
        torch.testing.assert_close(out["logits"][..., : ckpt.variant.vocab], ckpt.logits, rtol=0, atol=1e-5)

Every torchrun costs about 8-10 s (imports and process start); each extra job in the same run costs well under
1 s. So ``checkpoint`` writes, on first use, every checkpoint of ``COMMON`` that runs on the same number of
processes as the one asked for, and ``load_many`` reads several checkpoints in one run. Jobs with tp * pp = 1 run
on two processes (data parallel, rank 0 writes) with the tp * pp = 2 ones: on two cores that costs nothing.

Megatron itself is never imported into the pytest process (``keep_megatron_out_of_process``, called by conftest):
tests read its pickles as reshard's users would, without Megatron. Tests that use the oracle are marked
``@pytest.mark.oracle`` (``pytest -m "not oracle"`` skips them while iterating; ``make test`` runs them).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from functools import cached_property
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from .variants import Spec, Variant

if TYPE_CHECKING:  # torch is imported when used: importing it imports tqdm, before conftest sets TQDM_DISABLE
    import torch

SCRIPT = Path(__file__).with_name("mcore_gpt.py")
MEGATRON_VERSION = "0.16.1"
INSTALL_HINT = "pip install -c constraints.txt -e '.[oracle]' (make install does it)"
TIMEOUT_BASE, TIMEOUT_PER_JOB = 240, 30  # seconds; a save of the tiny models takes about 1 s, a start about 10 s

# Written together the first time any checkpoint with the same tp * pp is asked for.
COMMON = (
    Spec("llama", tp=2),
    Spec("llama-tied", tp=2),
    Spec("moe", tp=2),
    Spec("moe-shared", tp=2),
    Spec("llama", pp=2),
    Spec("llama-tied", pp=2),
    Spec("llama", pp=2, vpp=2),  # legacy files hold model0 and model1
    Spec("llama", tp=2, overrides=(("divisible_by", "8"),)),  # 1008 rows at tp 2, 1000 at tp 1
    Spec("rope-linear", tp=2),
    Spec("moe-dense-first", tp=2),
    Spec("dsv3", tp=2),  # DeepSeek-V3-like: MLA with q_lora_rank, YaRN, grouped sigmoid router, dense first layer
    Spec("dsv3-te", tp=1),  # the same without q_lora_rank, under Transformer Engine's names
    Spec("moe-shared-gate-dense-first", tp=2),  # Qwen2-MoE-like with a dense first layer
    Spec("dsv3", tp=2, overrides=(("te_names", "true"),)),  # TE's names at tp 2: MLA's down projections whole
    Spec("dsv3", tp=2, overrides=(("expert_bias", "false"),)),  # the sigmoid router without its expert bias
    Spec("dsv3-te", tp=1, overrides=(("shared_ffn", "0"),)),  # no shared expert
)


class OracleError(RuntimeError):
    """An oracle run failed or timed out; the message holds the end of its output."""


def missing_dependencies() -> list[str]:
    """What the oracle needs and does not find: megatron-core 0.16.1, psutil (or a ``torch_dist`` save hangs)."""
    missing = []
    for name, wanted in (("megatron-core", MEGATRON_VERSION), ("psutil", None)):
        try:
            found = metadata.version(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
            continue
        if wanted and found != wanted:
            missing.append(f"{name}=={wanted} (found {found})")
    return missing


class _KeepMegatronOut(importlib.abc.MetaPathFinder):
    """Refuses to import ``megatron`` in this (the pytest) process; the oracle's subprocesses import it freely.

    ``import megatron.core`` registers torch safe globals for the whole process (``megatron/core/safe_globals.py``:
    ``ModelType``, ``AttnBackend``, ``Namespace``, numpy arrays), so every later ``torch.load(weights_only=True)``
    returns Megatron's own classes: reshard would then read and write ``args`` differently depending on which test
    ran first. Tests see the environment reshard promises to work in: Megatron not importable.
    """

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.split(".")[0] == "megatron":
            raise ModuleNotFoundError(f"No module named {name!r} (kept out of the tests' process)", name=name)
        return None


def keep_megatron_out_of_process() -> None:
    """Install the import guard (once); conftest calls it before any test module is imported."""
    if not any(isinstance(finder, _KeepMegatronOut) for finder in sys.meta_path):
        sys.meta_path.insert(0, _KeepMegatronOut())


def run_jobs(
    jobs: list[dict], *, nproc: int, timeout: float | None = None, python: Path | None = None, script: Path = SCRIPT
) -> str:
    """Run ``mcore_gpt.py jobs`` (or another oracle ``script``'s, ``mcore_train.py``) under ``torchrun --standalone``
    on ``nproc`` processes; returns its output. ``python``: another venv's interpreter with its own Megatron-Core (e.g.
    0.19.2, ``fixtures/venvs.py``).

    On timeout the launcher and all its descendants are killed: torchrun starts each worker in a session of its
    own, so killing torchrun's process group would leave them running (and a hung ``torch_dist`` writer with
    them). The output goes to a file, so a straggler holding it open cannot block the caller.
    """
    missing = missing_dependencies() if python is None else []
    if missing:
        raise OracleError(f"the Megatron-Core oracle needs {', '.join(missing)}: {INSTALL_HINT}")
    timeout = timeout or TIMEOUT_BASE + TIMEOUT_PER_JOB * len(jobs)
    with tempfile.TemporaryDirectory(prefix="mcore-jobs-") as tmp:
        jobs_file, log = Path(tmp) / "jobs.json", Path(tmp) / "output.txt"
        jobs_file.write_text(json.dumps(jobs, indent=1))
        command = [
            str(python or sys.executable),
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
        ]
        command += [str(script), "jobs", str(jobs_file)]
        env = os.environ | {"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
        with log.open("w") as sink:
            proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, text=True, env=env)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_tree(proc.pid)
                raise OracleError(f"mcore oracle timed out after {timeout:.0f} s:\n{_tail(log.read_text())}") from None
        output = log.read_text()
    if proc.returncode != 0:
        raise OracleError(f"mcore oracle failed (exit {proc.returncode}):\n{_tail(output)}")
    return output


def _kill_tree(pid: int) -> None:
    """Kill a process and every descendant (found before any is killed, while they are still its children)."""
    import psutil

    root = psutil.Process(pid)
    family = [*root.children(recursive=True), root]
    for member in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    psutil.wait_procs(family, timeout=30)


def _tail(output: str, lines: int = 40) -> str:
    """The first rank's traceback if there is one, else the last lines."""
    rank0 = [line for line in output.splitlines() if line.startswith("[rank0]")]
    return "\n".join((rank0 or output.splitlines())[-lines:])


def _nproc(spec: Spec) -> int:
    """The processes a job runs on: tp * pp, at least two (the extra one is a data-parallel replica)."""
    return max(2, spec.tp * spec.pp)


@dataclass(frozen=True)
class McoreCheckpoint:
    """One ``save``: both formats written by one model, and that model's logits on the fixed batch."""

    spec: Spec
    root: Path

    @property
    def torch(self) -> Path:
        """The legacy checkpoint root: ``latest_checkpointed_iteration.txt``, ``iter_0000010/mp_rank_XX[_PPP]/``."""
        return self.root / "torch"

    @property
    def torch_dist(self) -> Path:
        """The ``torch_dist`` root: ``latest_checkpointed_iteration.txt``, ``iter_0000010/{.metadata, ...}``."""
        return self.root / "torch_dist"

    @property
    def variant(self) -> Variant:
        return self.spec.model()

    @cached_property
    def reference(self) -> dict:
        """``{'input_ids', 'logits' (padded vocab), 'variant', 'spec', 'padded_vocab'}`` as the writer saved it."""
        import torch

        return torch.load(self.root / "reference.pt", weights_only=True)

    @property
    def input_ids(self) -> torch.Tensor:
        return self.reference["input_ids"]

    @property
    def logits(self) -> torch.Tensor:
        """The writer's logits over the true vocab (the padded columns cut)."""
        return self.reference["logits"][..., : self.variant.vocab]


@dataclass
class McoreOracle:
    """Writes Megatron-Core checkpoints on demand into ``base`` (once each) and loads checkpoints back."""

    base: Path
    _written: dict[Spec, McoreCheckpoint] = field(default_factory=dict)

    def checkpoint(self, variant: str = "llama", *, tp: int = 1, pp: int = 1, vpp: int = 1, **overrides):
        """The checkpoint of ``variant`` saved at tp/pp(/vpp) with ``overrides`` (``Variant`` fields)."""
        spec = Spec(variant, tp, pp, tuple(sorted((k, str(v)) for k, v in overrides.items())), vpp)
        return self.checkpoints(spec)[0]

    def checkpoints(self, *specs: Spec) -> list[McoreCheckpoint]:
        """Several checkpoints, the missing ones written in one run per process count (with ``COMMON``'s)."""
        for spec in specs:
            spec.model()  # an unknown variant or field fails here, not inside torchrun
        worlds = {_nproc(spec) for spec in specs if spec not in self._written}
        todo = list(dict.fromkeys(s for s in (*specs, *COMMON) if s not in self._written and _nproc(s) in worlds))
        for world in sorted(worlds):
            batch = [s for s in todo if _nproc(s) == world]
            jobs = [{"command": "save", "spec": s.to_json(), "out": str(self.base / s.slug)} for s in batch]
            run_jobs(jobs, nproc=world)
            self._written |= {s: McoreCheckpoint(s, self.base / s.slug) for s in batch}
        return [self._written[spec] for spec in specs]

    def load(
        self,
        ckpt: Path,
        variant: str = "llama",
        *,
        fmt: str = "torch_dist",
        tp: int = 1,
        pp: int = 1,
        vpp: int = 1,
        strict: str = "assume_ok_unexpected",
        **overrides,
    ) -> dict:
        """Build ``variant`` at tp/pp, load ``ckpt`` (``fmt``: ``torch_dist`` or legacy ``torch``), run the batch.

        Returns ``{'input_ids', 'logits' (padded vocab of this tp), 'args', 'iteration', 'checkpoint_version'}``;
        ``args`` holds the plain values of the checkpoint's ``args`` (None if it has none). Raises ``OracleError``
        with Megatron's traceback when the load fails.
        """
        spec = Spec(variant, tp, pp, tuple(sorted((k, str(v)) for k, v in overrides.items())), vpp)
        return self.load_many([(Path(ckpt), fmt, spec, strict)])[0]

    def load_many(self, requests: list[tuple[Path, str, Spec, str]]) -> list[dict]:
        """Several loads ``(ckpt, fmt, spec, strict)``, one torchrun per process count, results in order."""
        import torch

        results: list[dict | None] = [None] * len(requests)
        with tempfile.TemporaryDirectory(prefix="mcore-load-", dir=self.base) as tmp:
            jobs = [
                {"command": "load", "spec": spec.to_json(), "ckpt": str(ckpt), "format": fmt, "strict": strict}
                | {"out": str(Path(tmp) / f"{i}.pt")}
                for i, (ckpt, fmt, spec, strict) in enumerate(requests)
            ]
            worlds = [_nproc(spec) for _, _, spec, _ in requests]
            for world in sorted(set(worlds)):
                run_jobs([job for job, w in zip(jobs, worlds, strict=True) if w == world], nproc=world)
            for i, job in enumerate(jobs):
                results[i] = torch.load(job["out"], weights_only=True)
        return results


@pytest.fixture(scope="session")
def mcore_oracle(tmp_path_factory: pytest.TempPathFactory) -> McoreOracle:
    """The session's Megatron-Core oracle (tests using it should be marked ``@pytest.mark.oracle``)."""
    missing = missing_dependencies()
    if missing:
        pytest.fail(f"the Megatron-Core oracle needs {', '.join(missing)}: {INSTALL_HINT}", pytrace=False)
    return McoreOracle(tmp_path_factory.mktemp("mcore"))
