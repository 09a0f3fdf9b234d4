"""``reshard.engine.run.resume`` on plain data: what a resumed conversion still has to do, and its fingerprint.

A tensor may be skipped only when the journal holds its manifest facts and every data file it is written into was
found complete and kept; anything less must be read and written again, or the output would miss bytes. The
fingerprint must change with anything that changes the output's bytes (else a partial output of another
conversion would be finished as if it were this one) and must not change with options that change no byte.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reshard.engine.plan.planner import ConversionPlan, TargetTensor, TensorPlan
from reshard.engine.run.resume import fingerprint, still_to_do
from reshard.formats.file_plan import FilePlan
from reshard.geometry import Replicate, Shard
from reshard.io.journal import Resumed, TensorRecord
from reshard.layouts.base import SourceCheckpoint
from reshard.options import ConvertOptions, ReadOptions
from reshard.vocab import VocabPlan


def unit(*names: str) -> TensorPlan:
    """A unit of work writing ``names``, F32 tensors of 4 x 2 split in two along dim 0."""
    return TensorPlan((), tuple(TargetTensor(n, (4, 2), "F32", Shard(0), ((2, 2), (2, 2))) for n in names))


PLANS = {
    "kept": unit("kept"),  # journaled, in a kept file only: skipped
    "file_redone": unit("file_redone"),  # journaled, in a file not kept: redone
    "not_journaled": unit("not_journaled"),  # in a kept file, never hashed: redone
    "split": unit("split"),  # journaled, over a kept and a file not kept: redone
    "nowhere": unit("nowhere"),  # journaled, in no data file (its facts are all the manifest needs): skipped
    "nowhere_new": unit("nowhere_new"),  # in no data file, not journaled: redone
    "half_fused": unit("q", "k"),  # two targets in kept files, only q journaled: redone
    "fused": unit("gate", "up"),  # both journaled, both in kept files: skipped
}
DATA_FILES = {
    "model-00001.safetensors": frozenset({"kept", "not_journaled", "split", "q", "k", "gate"}),
    "model-00002.safetensors": frozenset({"file_redone", "split"}),
    "model-00003.safetensors": frozenset({"up"}),
}
KEPT = frozenset({"model-00001.safetensors", "model-00003.safetensors"})
RECORD = TensorRecord("ab" * 32, True, False)
JOURNALED = ("kept", "file_redone", "split", "nowhere", "q", "gate", "up")


def conversion(plans: dict[str, TensorPlan] = PLANS) -> ConversionPlan:
    source = SourceCheckpoint(Path("/nowhere"), "hf", [])
    return ConversionPlan(source, 2, tuple(plans.values()), VocabPlan(None, "unknown"), False)


def keys(plan: ConversionPlan) -> list[str]:
    by_id = {id(unit): key for key, unit in PLANS.items()}
    return [by_id[id(unit)] for unit in plan.tensors]


def test_only_journaled_tensors_wholly_in_kept_files_are_skipped() -> None:
    resumed = Resumed(files=KEPT, tensors=dict.fromkeys(JOURNALED, RECORD))
    todo = still_to_do(conversion(), FilePlan(DATA_FILES), resumed)
    assert keys(todo) == ["file_redone", "not_journaled", "split", "nowhere_new", "half_fused"]
    assert (todo.target_tp, todo.vocab, todo.uneven) == (2, VocabPlan(None, "unknown"), False)


def test_a_tensor_split_over_a_kept_file_and_one_not_kept_is_redone() -> None:
    """Either of its two files alone being kept is not enough: the other file needs its bytes."""
    journaled = {"split": RECORD}
    for kept in ({"model-00001.safetensors"}, {"model-00002.safetensors"}):
        todo = still_to_do(conversion(), FilePlan(DATA_FILES), Resumed(files=frozenset(kept), tensors=journaled))
        assert "split" in keys(todo)
    both = frozenset({"model-00001.safetensors", "model-00002.safetensors"})
    assert "split" not in keys(still_to_do(conversion(), FilePlan(DATA_FILES), Resumed(files=both, tensors=journaled)))


def test_a_journaled_tensor_whose_file_was_not_kept_is_redone() -> None:
    """A file the journal named but that did not check out (``redone``) is not among the kept files."""
    resumed = Resumed(files=frozenset(), tensors={"file_redone": RECORD}, redone=["model-00002.safetensors"])
    assert keys(still_to_do(conversion(), FilePlan(DATA_FILES), resumed)) == list(PLANS)


def test_with_nothing_resumed_the_conversion_is_untouched() -> None:
    whole = conversion()
    assert still_to_do(whole, FilePlan(DATA_FILES), Resumed()) is whole
    assert keys(still_to_do(whole, FilePlan(DATA_FILES), Resumed(files=KEPT))) == list(PLANS)  # no tensor journaled


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    return folder


@pytest.mark.parametrize(
    "change", [{"jobs": 7}, {"progress": False}, {"overwrite": True}, {"resume": True}], ids=lambda c: next(iter(c))
)
def test_the_fingerprint_ignores_options_that_change_no_byte(ckpt: Path, change: dict[str, object]) -> None:
    options = ConvertOptions(tp=2)
    mark = fingerprint(ckpt, conversion(), "hf", options)
    assert len(mark) == 64 and int(mark, 16) >= 0
    assert fingerprint(ckpt, conversion(), "hf", dataclasses.replace(options, **change)) == mark


@pytest.mark.parametrize(
    "change",
    [{"tp": 4}, {"max_shard_size": "1MB"}, {"uneven": True}, {"vocab": 1000}, {"pad_multiple": 8}, {"pp": 2}],
    ids=lambda c: next(iter(c)),
)
def test_the_fingerprint_changes_with_an_option_that_changes_bytes(ckpt: Path, change: dict[str, object]) -> None:
    options = ConvertOptions(tp=2)
    mark = fingerprint(ckpt, conversion(), "hf", options)
    reading = {f.name for f in dataclasses.fields(ReadOptions)}
    read = dataclasses.replace(options.read, **{k: v for k, v in change.items() if k in reading})
    changed = dataclasses.replace(options, read=read, **{k: v for k, v in change.items() if k not in reading})
    assert fingerprint(ckpt, conversion(), "hf", changed) != mark


def test_the_fingerprint_changes_with_the_source_files_the_layout_and_the_targets(ckpt: Path) -> None:
    options = ConvertOptions(tp=2)
    mark = fingerprint(ckpt, conversion(), "hf", options)
    assert fingerprint(ckpt, conversion(), "hf", options) == mark  # stable
    assert fingerprint(ckpt, conversion(), "hf-ranks", options) != mark

    other_shapes = {**PLANS, "kept": TensorPlan((), (TargetTensor("kept", (4, 2), "F32", Replicate(), ((4, 2),)),))}
    assert fingerprint(ckpt, conversion(other_shapes), "hf", options) != mark
    other_dtype = {**PLANS, "kept": TensorPlan((), (TargetTensor("kept", (4, 2), "BF16", Shard(0), ((2, 2),) * 2),))}
    assert fingerprint(ckpt, conversion(other_dtype), "hf", options) != mark

    weights = ckpt / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # touched: maybe other bytes
    touched = fingerprint(ckpt, conversion(), "hf", options)
    assert touched != mark
    weights.write_bytes(b"\0" * 65)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # same time, another size
    resized = fingerprint(ckpt, conversion(), "hf", options)
    assert resized not in {mark, touched}
    (ckpt / "tokenizer.json").write_text("{}")  # a file more
    assert fingerprint(ckpt, conversion(), "hf", options) not in {mark, touched, resized}


def test_the_fingerprint_is_the_same_in_every_process(ckpt: Path) -> None:
    """A set option (``--drop``) is recorded in the same order whatever the process's string hashes, so that a
    ``--resume`` (another process) knows the output for this conversion's."""
    code = (
        "import json, sys, types; from reshard.engine.run.resume import conversion_facts; "
        "from reshard.options import ConvertOptions; "
        "options = ConvertOptions(tp=1, with_optimizer=True, drop=frozenset(sys.argv[2].split(','))); "
        "print(json.dumps(conversion_facts(sys.argv[1], types.SimpleNamespace(tensors=()), 'hf', options)))"
    )
    kinds = "rng,scheduler,loss_scaler,dataloader,other"
    facts = {
        subprocess.run(
            [sys.executable, "-c", code, str(ckpt), kinds],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
        ).stdout
        for seed in range(4)
    }
    assert len(facts) == 1, facts
