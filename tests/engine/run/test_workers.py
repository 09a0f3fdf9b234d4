"""Several processes converting one checkpoint (``torchrun -m reshard convert``, ``convert --workers``): the output
and its manifest are the bytes one process writes, for 2 and 4 workers and every writable layout; a worker that
fails makes all fail with one line naming it, and one killed with SIGKILL leaves nothing behind.

The workers are real processes under ``torch.distributed.run`` (gloo, CPU), as a user starts them.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures.checks import output_tree
from safetensors.torch import load_file, save_file

from reshard.engine.run.worker_shares import assign

SAMPLE = Path(__file__).resolve().parents[3] / "sample_ckpts" / "tiny-llama-tp2"
TARGETS = {"hf": 1, "hf-ranks": 2, "megatron": 2, "sat": 2}
# Rank 1 kills itself (SIGKILL) when it has hashed its first tensor.
KILL_RANK_1 = """
import os, signal, sys
import reshard.engine.move.execute as execute
real = execute.move_unit
def move_unit(*args, **kwargs):
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)
execute.move_unit = move_unit
from reshard.cli import run
sys.argv[0] = "reshard"
run()
"""


def convert_args(layout: str, out: Path, source: Path = SAMPLE) -> list[str]:
    tp = str(TARGETS[layout])
    return ["convert", str(source), "--tp", tp, "--layout", layout, "-o", str(out), "--max-shard-size", "100KB", "-q"]


def torchrun(workers: int, *args: str) -> subprocess.CompletedProcess:
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}"]
    return subprocess.run([*run, *args], capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent)


def reshard(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reshard", *args], capture_output=True, text=True, timeout=300)


def test_files_are_shared_by_bytes_deterministically() -> None:
    files = {f"f{i}": size for i, size in enumerate([50, 40, 30, 20, 10, 10])}
    shares = assign(files, 3)
    assert shares == assign(dict(reversed(files.items())), 3)
    assert sorted(name for share in shares for name in share) == sorted(files)
    loads = [sum(files[name] for name in share) for share in shares]
    assert max(loads) - min(loads) <= max(files.values())
    assert assign(files, 1) == [frozenset(files)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("one")
    outputs = {}
    for layout in TARGETS:
        done = reshard(*convert_args(layout, root / layout))
        assert done.returncode == 0, done.stderr
        outputs[layout] = output_tree(root / layout)
    return outputs


@pytest.mark.parametrize("workers", [2, 4])
@pytest.mark.parametrize("layout", list(TARGETS))
def test_any_number_of_workers_writes_the_bytes_one_process_writes(
    tmp_path: Path, one_process: dict[str, dict[str, bytes]], layout: str, workers: int
) -> None:
    out = tmp_path / "out"
    done = torchrun(workers, "-m", "reshard", *convert_args(layout, out))
    assert done.returncode == 0, done.stderr
    assert output_tree(out) == one_process[layout]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staged folder or lock left


def test_convert_workers_starts_the_same_on_this_machine(
    tmp_path: Path, one_process: dict[str, dict[str, bytes]]
) -> None:
    out = tmp_path / "out"
    done = reshard(*convert_args("hf-ranks", out), "--workers", "3")
    assert done.returncode == 0, done.stderr
    assert output_tree(out) == one_process["hf-ranks"]


def test_a_failing_worker_fails_all_with_one_line_naming_it(tmp_path: Path) -> None:
    source = tmp_path / "src"
    subprocess.run(["cp", "-r", str(SAMPLE), str(source)], check=True)
    rank_file = source / "rank_01" / "model.safetensors"
    tensors = load_file(rank_file)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1  # replicas that differ: found while converting
    save_file(tensors, rank_file, metadata={"format": "pt"})
    out = tmp_path / "out"
    done = reshard(*convert_args("hf-ranks", out, source), "--workers", "2")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: worker ") and "model.norm.weight" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # nothing published, nothing staged


def test_a_worker_killed_mid_run_leaves_nothing_published(tmp_path: Path) -> None:
    script = tmp_path / "kill_rank_1.py"
    script.write_text(KILL_RANK_1)
    out = tmp_path / "out"
    done = torchrun(2, str(script), *convert_args("hf-ranks", out))
    assert done.returncode != 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kill_rank_1.py"], done.stderr


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def alone_in_a_group_of_two(tmp_path: Path, *extra: str, env: dict[str, str] | None = None, port: bool = False):
    """Rank 0 of two, started as torchrun starts it, whose rank 1 never comes (killed before it joined)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    group = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "reshard", *convert_args("hf-ranks", tmp_path / "out"), *extra],
        env={**os.environ, **group, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return (proc, free) if port else proc


@pytest.mark.parametrize("how", ["option", "env"])
def test_a_worker_that_never_joins_ends_the_others_after_the_worker_timeout(tmp_path: Path, how: str) -> None:
    extra, env = (["--worker-timeout", "3"], None) if how == "option" else ([], {"RESHARD_WORKER_TIMEOUT": "3"})
    start = time.monotonic()
    proc = alone_in_a_group_of_two(tmp_path, *extra, env=env)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 2 and time.monotonic() - start < 45
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: the workers did not all join within 3 s"), lines
    assert "--worker-timeout" in lines[0] and "Traceback" not in stderr
    assert [p.name for p in tmp_path.iterdir()] == []


def test_a_signal_ends_a_wait_for_workers_that_never_join(tmp_path: Path) -> None:
    proc, port = alone_in_a_group_of_two(tmp_path, port=True)  # the default wait: a minute
    deadline = time.monotonic() + 60
    while not listening(port):  # rank 0 serves the group's store: it is in the set-up now
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 143 and time.monotonic() - start < 15
    assert stderr.strip() == "Error: interrupted by SIGTERM: no partial output or temporary files were left"
    assert [p.name for p in tmp_path.iterdir()] == []


def test_a_bad_worker_timeout_is_one_line(tmp_path: Path) -> None:
    proc = alone_in_a_group_of_two(tmp_path, env={"RESHARD_WORKER_TIMEOUT": "soon"})
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert stderr.strip() == ("Error: RESHARD_WORKER_TIMEOUT='soon' is not a number of seconds between 0 and 86400"), (
        stderr
    )
