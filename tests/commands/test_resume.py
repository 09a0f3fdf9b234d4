"""``convert --resume``: a run killed with SIGKILL (after its first output file, half-way, while writing the
manifest) publishes nothing, and the same command with ``--resume`` finishes it into the output an uninterrupted
run writes, byte for byte; a kept file that was damaged meanwhile is written again; a partial output of another
conversion is refused; SIGTERM keeps the work done and says how to finish it.

The kill is sent by the converting process to itself at a known point (a patched journal or manifest writer), so
each case stops where it says.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.checks import output_tree

from reshard.io.journal import JOURNAL
from reshard.io.staging import partial_folder

SAMPLE = Path(__file__).resolve().parents[2] / "sample_ckpts" / "tiny-llama-tp2"
# target layout -> tp (small shards, so that every layout writes several data files)
TARGETS = {"hf": 1, "hf-ranks": 2, "megatron": 2, "sat": 2, "torch_dist": 1}
DATA_FILES = (".safetensors", ".distcp", "model_optim_rng.pt", "_model_states.pt")  # what the journal tracks

KILL_AFTER_FILES = """
import os, signal, sys
import reshard.io.journal as journal
real, count = journal.Journal.file_done, [0]
def file_done(self, relative):
    real(self, relative)
    count[0] += 1
    if count[0] == int(os.environ["KILL_AFTER"]):
        os.kill(os.getpid(), signal.SIGKILL)
journal.Journal.file_done = file_done
"""
KILL_AT_MANIFEST = """
import os, signal
import reshard.engine.run.conversion as run
def write_manifest(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
run.write_manifest = write_manifest
"""
MAIN = "\nfrom reshard.cli.main import main\nsys.argv[0] = 'reshard'\nmain()\n"


def reshard(args: list[str], *, patch: str = "", env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    code = "import sys\n" + patch + MAIN
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def convert_args(layout: str, out: Path, *extra: str) -> list[str]:
    args = ["convert", str(SAMPLE), "--tp", str(TARGETS[layout]), "--layout", layout, "-o", str(out)]
    return [*args, "--max-shard-size", "200KB", "--jobs", "2", "-q", *extra]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("uninterrupted")
    outputs = {}
    for layout in TARGETS:
        done = reshard(convert_args(layout, root / layout))
        assert done.returncode == 0, done.stderr
        outputs[layout] = output_tree(root / layout)
    return outputs


def journaled_files(staging: Path) -> list[str]:
    journals = sorted(staging.glob(JOURNAL.format(rank="*")))
    lines = [json.loads(line) for journal in journals for line in journal.read_text().splitlines()]
    return [line["file"] for line in lines if "file" in line]


@pytest.mark.parametrize("layout", list(TARGETS))
@pytest.mark.parametrize("point", ["first file", "half-way", "manifest"])
def test_resume_after_sigkill_writes_what_an_uninterrupted_run_writes(
    tmp_path: Path, uninterrupted: dict[str, dict[str, bytes]], layout: str, point: str
) -> None:
    out = tmp_path / "out"
    files = sum(1 for name in uninterrupted[layout] if name.endswith(DATA_FILES))
    if point == "manifest":
        killed = reshard(convert_args(layout, out, "--resume"), patch=KILL_AT_MANIFEST)
    else:
        after = 1 if point == "first file" else max(1, files // 2)
        killed = reshard(convert_args(layout, out, "--resume"), patch=KILL_AFTER_FILES, env={"KILL_AFTER": str(after)})
    assert killed.returncode == -signal.SIGKILL
    assert not out.exists()  # nothing published
    staging = partial_folder(out)
    journaled = journaled_files(staging)
    assert len(journaled) == (files if point == "manifest" else after)

    resumed = reshard(convert_args(layout, out, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    assert output_tree(out) == uninterrupted[layout]
    assert not staging.exists()


def test_a_kept_file_damaged_after_the_kill_is_written_again(
    tmp_path: Path, uninterrupted: dict[str, dict[str, bytes]]
) -> None:
    out = tmp_path / "out"
    killed = reshard(convert_args("hf-ranks", out, "--resume"), patch=KILL_AFTER_FILES, env={"KILL_AFTER": "3"})
    assert killed.returncode == -signal.SIGKILL
    staging = partial_folder(out)
    damaged = staging / journaled_files(staging)[1]
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))

    resumed = reshard(convert_args("hf-ranks", out, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    assert output_tree(out) == uninterrupted["hf-ranks"]


def test_the_partial_output_of_another_conversion_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    killed = reshard(convert_args("hf-ranks", out, "--resume"), patch=KILL_AFTER_FILES, env={"KILL_AFTER": "1"})
    assert killed.returncode == -signal.SIGKILL
    other = reshard([*convert_args("hf-ranks", out, "--resume"), "--vocab", "1000", "--allow-vocab-shrink"])
    assert other.returncode == 2
    assert other.stderr.count("\n") == 1
    assert "of another conversion" in other.stderr and str(partial_folder(out)) in other.stderr
    assert "(--vocab unset then, 1000 now)" in other.stderr  # the option that differs, by name
    assert partial_folder(out).exists() and not out.exists()


@pytest.mark.parametrize(
    "damage",
    [
        lambda line: line | {"digest": "blake3:" + "0" * 64},  # zeroed: the line's check no longer matches
        lambda line: {key: value for key, value in line.items() if key != "finite"},  # a field missing
        lambda line: line | {"finite": "yes"},  # a field of another type
        lambda line: line | {"digest": "not a digest", "check": "x"},
    ],
    ids=["zeroed-digest", "no-finite", "finite-a-string", "malformed"],
)
def test_damaged_journal_lines_are_dropped_and_their_work_redone(
    tmp_path: Path, uninterrupted: dict[str, dict[str, bytes]], damage
) -> None:
    out = tmp_path / "out"
    killed = reshard(convert_args("hf", out, "--resume"), patch=KILL_AT_MANIFEST)  # every tensor line written
    assert killed.returncode == -signal.SIGKILL
    journal = partial_folder(out) / JOURNAL.format(rank=0)
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    assert any("tensor" in line for line in lines)
    lines = [damage(line) if "tensor" in line else line for line in lines]
    journal.write_text("".join(json.dumps(line) + "\n" for line in lines))

    resumed = reshard(convert_args("hf", out, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    assert output_tree(out) == uninterrupted["hf"]  # every digest in reshard.json is the true one again
    assert reshard(["verify", str(out), "-q"]).returncode == 0


def test_sigterm_keeps_the_work_done_and_says_how_to_finish(
    tmp_path: Path, uninterrupted: dict[str, dict[str, bytes]]
) -> None:
    out = tmp_path / "out"
    term = KILL_AFTER_FILES.replace("signal.SIGKILL", "signal.SIGTERM")
    stopped = reshard(convert_args("megatron", out, "--resume"), patch=term, env={"KILL_AFTER": "1"})
    assert stopped.returncode == 128 + signal.SIGTERM
    assert stopped.stderr.strip() == (
        f"Error: interrupted by SIGTERM: the work done is kept in {partial_folder(out)}: "
        "run the same command with --resume to finish it"
    )
    assert journaled_files(partial_folder(out)) and not out.exists()
    assert reshard(convert_args("megatron", out, "--resume")).returncode == 0
    assert output_tree(out) == uninterrupted["megatron"]


def test_a_run_without_resume_removes_a_stale_partial_output(tmp_path: Path) -> None:
    out = tmp_path / "out"
    reshard(convert_args("hf", out, "--resume"), patch=KILL_AFTER_FILES, env={"KILL_AFTER": "1"})
    assert partial_folder(out).exists()
    assert reshard(convert_args("hf", out)).returncode == 0
    assert not partial_folder(out).exists()


def test_a_run_shared_by_workers_resumes_after_one_is_killed(
    tmp_path: Path, uninterrupted: dict[str, dict[str, bytes]]
) -> None:
    """torchrun stops the other worker when one dies; the next run, with another number of workers, finishes."""
    script = tmp_path / "kill_rank_1.py"
    script.write_text(
        "import sys\n" + KILL_AFTER_FILES.replace("count[0] ==", 'os.environ["RANK"] == "1" and count[0] ==') + MAIN
    )
    out = tmp_path / "out"
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    killed = subprocess.run(
        [*run, *convert_args("hf-ranks", out, "--resume")],
        capture_output=True,
        text=True,
        env={**os.environ, "KILL_AFTER": "1"},
        timeout=300,
    )
    assert killed.returncode != 0
    assert not out.exists() and journaled_files(partial_folder(out))

    resumed = reshard([*convert_args("hf-ranks", out, "--resume"), "--workers", "3"])
    assert resumed.returncode == 0, resumed.stderr
    assert output_tree(out) == uninterrupted["hf-ranks"]
    assert not partial_folder(out).exists()


RECORD_WORK = """
import json, os
import reshard.engine.move.execute as execute_module
import reshard.io.journal as journal
real_execute, real_move_unit = execute_module.execute, execute_module.move_unit
real_file_done = journal.Journal.file_done
def log(**line):
    with open(os.environ["RECORD"], "a") as record:
        record.write(json.dumps(line) + "\\n")
def execute(conversion, writer, **kwargs):
    log(execute=[t.name for plan in conversion.tensors for t in plan.targets])
    return real_execute(conversion, writer, **kwargs)
def move_unit(*args, **kwargs):
    log(moved=1)
    return real_move_unit(*args, **kwargs)
def file_done(self, relative):
    log(file=relative)
    real_file_done(self, relative)
execute_module.execute, execute_module.move_unit, journal.Journal.file_done = execute, move_unit, file_done
"""


def safetensors_names(data: bytes) -> set[str]:
    """The tensor names in a safetensors file's header (8 bytes of length, then JSON)."""
    length = int.from_bytes(data[:8], "little")
    return set(json.loads(data[8 : 8 + length])) - {"__metadata__"}


def test_a_resumed_run_neither_rewrites_kept_files_nor_reads_their_tensors_again(
    tmp_path: Path, uninterrupted: dict[str, dict[str, bytes]]
) -> None:
    """Killed when its third file of four is complete, the resumed run executes (reads, gathers, hashes) only the
    tensors that are not both journaled and in a kept file, completes only the other files, and leaves the kept
    files' inodes and modification times alone. Byte identity of the output cannot tell: redoing a kept file's
    tensors writes nothing (the writer drops them), it only costs the reading that ``--resume`` exists to save.

    The killed run has one job, so what the journal holds at the kill is certain: a tensor is journaled after
    its bytes are handed to the writer, hence every tensor of the first two files and all but the last of the
    third (that one is redone, as it must be)."""
    out, record = tmp_path / "out", tmp_path / "record.jsonl"
    tree = uninterrupted["hf"]
    shards = sorted(name for name in tree if name.endswith(".safetensors"))
    in_file = {name: safetensors_names(tree[name]) for name in shards}
    assert len(shards) == 4
    one_job = [*convert_args("hf", out, "--resume"), "--jobs", "1"]
    killed = reshard(one_job, patch=KILL_AFTER_FILES, env={"KILL_AFTER": str(len(shards) - 1)})
    assert killed.returncode == -signal.SIGKILL
    staging = partial_folder(out)
    kept = journaled_files(staging)
    assert len(kept) == len(shards) - 1 and set(kept) < set(shards)
    stats = {name: ((staging / name).stat().st_ino, (staging / name).stat().st_mtime_ns) for name in kept}
    lines = [json.loads(line) for line in (staging / JOURNAL.format(rank=0)).read_text().splitlines()]
    journaled = {line["tensor"] for line in lines if "tensor" in line}
    finished = {name for file in kept for name in in_file[file]} & journaled  # each tensor is in one file at tp 1
    assert len(finished) >= len(kept)

    resumed = reshard(convert_args("hf", out, "--resume"), patch=RECORD_WORK, env={"RECORD": str(record)})
    assert resumed.returncode == 0, resumed.stderr
    assert output_tree(out) == tree
    log = [json.loads(line) for line in record.read_text().splitlines()]
    (executed,) = [line["execute"] for line in log if "execute" in line]
    every = {name for names in in_file.values() for name in names}
    assert sorted(executed) == sorted(every - finished)
    assert sum(1 for line in log if "moved" in line) == len(every - finished)
    assert sorted(line["file"] for line in log if "file" in line) == sorted(set(shards) - set(kept))
    assert {name: ((out / name).stat().st_ino, (out / name).stat().st_mtime_ns) for name in kept} == stats
