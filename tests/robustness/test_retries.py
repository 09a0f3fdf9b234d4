"""Retries and hang-ups, with real processes: a scheduler's retry of a finished ``--resume`` run succeeds without
rewriting a byte; a retry of another conversion names what differs; SIGHUP, SIGQUIT and SIGTERM sent at many instants
of a run (before staging, while writing, while publishing) leave either the complete output or nothing (a
``--resume`` run: its partial output, which the next ``--resume`` finishes); what a SIGKILL left is found and said by
the next run; and a retry loop killed at random ends with the output an uninterrupted run writes, byte for byte, and
nothing else beside it."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures.checks import output_tree

from reshard.io.staging import partial_folder

SAMPLE = Path(__file__).resolve().parents[2] / "sample_ckpts" / "tiny-llama-tp2"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def args(out: Path, *extra: str, tp: int = 2) -> list[str]:
    return [
        "convert",
        str(SAMPLE),
        "--tp",
        str(tp),
        "-o",
        str(out),
        "--max-shard-size",
        "100KB",
        "--jobs",
        "1",
        *extra,
    ]


def reshard(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "reshard", *argv], capture_output=True, text=True, env=ENV, timeout=300, **kwargs
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("uninterrupted") / "out"
    done = reshard(args(out, "-q"))
    assert done.returncode == 0, done.stderr
    return output_tree(out)


def beside(out: Path) -> list[str]:
    """Everything in the output's folder: the output alone, or nothing, is what a run may leave."""
    return sorted(p.name for p in out.parent.iterdir())


def stamps(folder: Path) -> dict[str, int]:
    return {p.relative_to(folder).as_posix(): p.stat().st_mtime_ns for p in folder.rglob("*")}


def test_a_retry_of_a_finished_resume_run_succeeds_and_rewrites_nothing(tmp_path, uninterrupted):
    out = tmp_path / "out"
    assert reshard(args(out, "--resume", "-q")).returncode == 0
    before = stamps(out)
    again = reshard(args(out, "--resume"))
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == (
        f"{out} is already complete (hf-ranks, tp=2, from {SAMPLE}): its reshard.json matches this conversion; "
        "nothing was rewritten"
    )
    assert again.stderr == ""
    assert stamps(out) == before and output_tree(out) == uninterrupted
    assert json.loads(reshard([*args(out, "--resume"), "--json"]).stdout)["already_complete"] is True
    assert beside(out) == ["out"]


@pytest.mark.parametrize(
    ("extra", "tp", "said"),
    [
        (["--vocab", "1002"], 2, "--vocab unset then, 1002 now"),
        ([], 4, "--tp 2 then, 4 now"),
        (["--layout", "hf"], 1, "target layout hf-ranks then, hf now"),
    ],
)
def test_a_retry_of_another_conversion_names_what_differs(tmp_path, extra, tp, said):
    out = tmp_path / "out"
    assert reshard(args(out, "--resume", "-q")).returncode == 0
    before = stamps(out)
    other = reshard(args(out, "--resume", *extra, tp=tp))
    assert other.returncode == 2
    assert other.stderr.strip().startswith(f"Error: {out}: output is complete, but of another conversion: ")
    assert said in other.stderr and "(pass --overwrite to replace it, or choose another -o)" in other.stderr
    assert stamps(out) == before


def test_an_output_without_the_conversion_record_is_not_taken_for_this_one(tmp_path):
    out = tmp_path / "out"
    assert reshard(args(out, "-q")).returncode == 0
    manifest = json.loads((out / "reshard.json").read_text())
    manifest["reshard_version"] = "0.0.1"
    (out / "reshard.json").write_text(json.dumps(manifest))
    older = reshard(args(out, "--resume"))
    assert older.returncode == 2 and "written by reshard 0.0.1, this is" in older.stderr
    del manifest["conversion"]
    (out / "reshard.json").write_text(json.dumps(manifest))
    oldest = reshard(args(out, "--resume"))
    assert oldest.returncode == 2 and "records no conversion (an older reshard wrote it)" in oldest.stderr


# Imported by every Python process started with it on the path (the workers too): a tensor written every 40 ms or
# slower, so that a signal lands while the output is being written.
SLOW = """
import time
import reshard.formats.safetensors.writer as writer
for method in ("write", "write_unordered", "end_parts"):
    def slow(self, *args, real=getattr(writer.SafetensorsFileWriter, method)):
        time.sleep(0.04)
        return real(self, *args)
    setattr(writer.SafetensorsFileWriter, method, slow)
"""


@pytest.fixture(scope="module")
def slow_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("slow")
    (folder / "sitecustomize.py").write_text(SLOW)
    return {**ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), ENV.get("PYTHONPATH")]))}


def slowed(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    """``reshard ARGV`` with :data:`SLOW` in every process."""
    return subprocess.Popen(
        [sys.executable, "-m", "reshard", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def staged(out: Path) -> bool:
    return any(p.name.endswith((".reshard-tmp", ".reshard-partial")) for p in out.parent.iterdir())


def wait_for(condition, run: subprocess.Popen, limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while not condition() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)


# When the signal is sent: after the start (importing, planning), once the staged folder exists (writing), or once
# the output is published (the process ending).
INSTANTS = (("start", 0.0), ("start", 0.4), ("staged", 0.0), ("staged", 0.3), ("staged", 0.7), ("published", 0.0))


@pytest.mark.parametrize(
    ("signum", "workers"),
    [(signal.SIGHUP, 1), (signal.SIGQUIT, 1), (signal.SIGTERM, 1), (signal.SIGHUP, 2)],
    ids=["SIGHUP", "SIGQUIT", "SIGTERM", "SIGHUP-workers"],
)
@pytest.mark.parametrize("resume", [False, True], ids=["plain", "resume"])
def test_a_stopping_signal_at_any_instant_leaves_the_output_or_nothing(
    tmp_path, uninterrupted, slow_env, signum, workers, resume
):
    seen: set[str] = set()
    for index, (after, delay) in enumerate(INSTANTS):
        out = tmp_path / f"run{index}" / "out"
        out.parent.mkdir()
        argv = args(out, "--workers", str(workers), *(["--resume"] if resume else []))
        run = slowed(argv, slow_env)
        if after == "staged":
            wait_for(lambda out=out: staged(out), run)
        elif after == "published":
            wait_for(out.exists, run)
        time.sleep(delay)
        run.send_signal(signum)
        _, stderr = run.communicate(timeout=120)
        code, left, when = run.returncode, beside(out), (after, delay)
        if code == 0 or (code in (128 + signum, -signum) and left == ["out"]):  # done, or stopped once published
            seen.add("finished")
            assert output_tree(out) == uninterrupted and left == ["out"], when
        elif code == -signum:  # before the command installed its handler (or after it ended): nothing made yet
            seen.add("default action")
            assert left == [], when
        else:
            assert code == 128 + signum, (when, code, stderr)
            assert stderr.strip().splitlines()[-1].startswith(f"Error: interrupted by {signum.name}: "), stderr
            if resume and left:  # the work done is kept for the next --resume, and said so
                seen.add("kept")
                assert left == [partial_folder(out).name] and "run the same command with --resume" in stderr
                finished = reshard(args(out, "--resume", "-q"))
                assert finished.returncode == 0, finished.stderr
                assert output_tree(out) == uninterrupted and beside(out) == ["out"]
            else:
                seen.add("stopped")
                assert left == [], (when, left)
                assert "no partial output or temporary files were left" in stderr
    assert seen & {"stopped", "kept"}, seen  # some instants fell inside the run


KILL_AT_MANIFEST = """
import os, signal, sys
import reshard.engine.run.conversion as run
def write_manifest(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
run.write_manifest = write_manifest
from reshard.cli.main import main
sys.argv[0] = "reshard"
main()
"""


def killed_at_manifest(argv: list[str]) -> None:
    done = subprocess.run([sys.executable, "-c", KILL_AT_MANIFEST, *argv], capture_output=True, env=ENV, timeout=300)
    assert done.returncode == -signal.SIGKILL


def test_a_staged_folder_a_sigkill_left_is_removed_and_said(tmp_path, uninterrupted):
    out = tmp_path / "out"
    killed_at_manifest(args(out))
    left = beside(out)
    assert len(left) == 2 and left[0].startswith(".out.") and left[0].endswith(".reshard-tmp"), left
    assert left[1] == ".out.reshard-lock"  # no process holds it: the next run takes it
    rerun = reshard(args(out, "-q"))
    assert rerun.returncode == 0, rerun.stderr
    assert f"removed {out.parent / left[0]} (" in rerun.stderr
    assert "left by a run that was killed before it could clean up" in rerun.stderr
    assert output_tree(out) == uninterrupted and beside(out) == ["out"]


def test_a_partial_output_a_sigkill_left_is_said_by_a_run_without_resume(tmp_path, uninterrupted):
    out = tmp_path / "out"
    killed_at_manifest(args(out, "--resume"))
    assert partial_folder(out).is_dir()
    rerun = reshard(args(out, "-q"))
    assert rerun.returncode == 0, rerun.stderr
    assert f"{partial_folder(out)} (" in rerun.stderr and "holds the work of an earlier --resume run" in rerun.stderr
    assert output_tree(out) == uninterrupted and beside(out) == ["out"]


def test_a_retry_loop_killed_at_random_ends_with_the_uninterrupted_output(tmp_path, uninterrupted, slow_env):
    """``until reshard convert ... --resume; do :; done`` with a SIGKILL at a random instant of each try (later and
    later, so the loop ends): the output is byte for byte one uninterrupted run's, and nothing is beside it."""
    out, rng = tmp_path / "out", random.Random(47)
    for attempt in range(40):
        run = slowed(args(out, "--resume"), slow_env)
        try:
            run.wait(timeout=rng.uniform(0.3, 1.5) + 0.1 * attempt)
        except subprocess.TimeoutExpired:
            run.kill()
            run.wait()
            continue
        if run.returncode == 0:
            break
        raise AssertionError(f"try {attempt} failed: {run.communicate()[1]}")
    else:
        raise AssertionError("the loop never finished")
    assert attempt > 0  # at least one try was killed
    assert output_tree(out) == uninterrupted and beside(out) == ["out"]
