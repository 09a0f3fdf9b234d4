"""``convert --with-optimizer`` shared across processes and finished after a kill: a ZeRO-2 checkpoint DeepSpeed
itself wrote (``fixtures/deepspeed_writer``, world 3) converted to a DeepSpeed universal checkpoint and to DCP by one
process, by ``--workers 2``, by ``torchrun --nproc-per-node 2``, and by a ``--resume`` run SIGKILLed while it writes
then run again: every output is byte for byte the one-process run's (the manifest's creation time aside)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures.checks import output_tree

from reshard.io.staging import partial_folder

VARIANT = "zero2_fp32"
LAYOUTS = ("deepspeed", "dcp")
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "reshard"]
# Imported by every process started with it on the path: each tensor of a torch archive (the universal checkpoint's
# files, DCP's archives) written 40 ms late, whole or streamed as byte ranges, so that a SIGKILL lands while the
# output is being written.
SLOW = """
import time
import reshard.formats.torch_zip.writer as writer
def slowed(real):
    def slow(self, *args):
        time.sleep(0.04)
        return real(self, *args)
    return slow
writer.TorchZipWriter.write = slowed(writer.TorchZipWriter.write)
writer.TorchZipWriter.begin_parts = slowed(writer.TorchZipWriter.begin_parts)
"""


def convert(source: Path, layout: str, out: Path, *extra: str) -> list[str]:
    return ["convert", str(source), "--tp", "1", "--layout", layout, "--with-optimizer", "--drop",
            "dataloader,loss_scaler,other,scheduler,client_state", "-o", str(out), "-q", *extra]  # fmt: skip


def run(argv: list[str], env: dict[str, str] = ENV) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def one_process(ds_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("one")
    trees = {}
    for layout in LAYOUTS:
        run([sys.executable, "-m", "reshard", *convert(ds_root / VARIANT, layout, root / layout)])
        trees[layout] = output_tree(root / layout)
    return trees


@pytest.fixture(scope="module")
def slow_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("slow")
    (folder / "sitecustomize.py").write_text(SLOW)
    return {**ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), ENV.get("PYTHONPATH")]))}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_workers_write_what_one_process_writes(ds_root, one_process, tmp_path, layout):
    run([sys.executable, "-m", "reshard", *convert(ds_root / VARIANT, layout, tmp_path / "out", "--workers", "2")])
    assert output_tree(tmp_path / "out") == one_process[layout]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_torchrun_writes_what_one_process_writes(ds_root, one_process, tmp_path, layout):
    run([*TORCHRUN, *convert(ds_root / VARIANT, layout, tmp_path / "out")])
    assert output_tree(tmp_path / "out") == one_process[layout]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_resume_after_a_sigkill_writes_what_one_process_writes(ds_root, one_process, slow_env, tmp_path, layout):
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "reshard", *convert(ds_root / VARIANT, layout, out, "--resume")]
    killed = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=slow_env)
    deadline = time.monotonic() + 120
    while not partial_folder(out).is_dir() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(1.0)  # some of the state files written, not all (each tensor takes 40 ms)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    assert killed.returncode == -signal.SIGKILL, "finished before the kill"
    assert partial_folder(out).is_dir() and not out.exists()
    run(argv)
    assert output_tree(out) == one_process[layout]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
