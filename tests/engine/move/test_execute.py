"""``reshard.engine.move.execute``: the threaded byte mover writes what one job writes, keeps the tensor memory alive
at once within its budget, and leaves no descriptor open, whether a conversion ends or fails."""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import threading
import weakref
from pathlib import Path

import pytest
import torch
from fixtures import SAMPLES
from fixtures.hf import load_folder, load_rank

from reshard import convert
from reshard.engine.move import buffers, gathered
from reshard.engine.move import execute as stream
from reshard.engine.move import gather as engine_gather
from reshard.engine.move.digest import digest_of
from reshard.engine.move.work import Work
from reshard.engine.plan.open import open_checkpoint
from reshard.engine.plan.target import plan_target
from reshard.engine.run import conversion as run
from reshard.errors import ReshardError
from reshard.io.direct import ALIGN, in_memory
from reshard.options import ConvertOptions, ReadOptions, cores

SAMPLE = SAMPLES / "tiny-llama-tp2"


def _convert(cli, out: Path, jobs: int, tp: int) -> None:
    result = cli("convert", SAMPLE, "--tp", tp, "-o", out, "--jobs", jobs, "-q")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("tp", [1, 2])
def test_threaded_convert_writes_the_same_bytes_as_one_job(cli, tmp_path: Path, tp: int) -> None:
    _convert(cli, tmp_path / "one", 1, tp)
    _convert(cli, tmp_path / "four", 4, tp)
    files = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*.safetensors"))
    assert files == sorted(p.relative_to(tmp_path / "four") for p in (tmp_path / "four").rglob("*.safetensors"))
    for name in files:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "four" / name).read_bytes()
    # and the bytes are right: rank files of the sample, joined by hand (o_proj / down_proj along dim 1)
    ranks = [load_rank(SAMPLE, r) for r in range(2)]
    written = load_folder(tmp_path / "four") if tp == 1 else load_rank(tmp_path / "four", 1)
    for name in ("model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.up_proj.weight"):
        full = torch.cat([r[name] for r in ranks], dim=1 if "o_proj" in name else 0)
        assert torch.equal(written[name], full if tp == 1 else ranks[1][name])
    embed = torch.cat([r["model.embed_tokens.weight"] for r in ranks])
    assert torch.equal(written["model.embed_tokens.weight"], embed[:1001] if tp == 1 else embed[501:])


def test_bytes_in_flight_stay_within_the_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tensor memory alive at once (storages behind prepared, unwritten slices, and gather buffers kept
    for reuse) stays under the budget."""
    budgets: list[buffers.Budget] = []
    pools: list[buffers.BufferPool] = []
    live, peak, lock = [0], [0], threading.Lock()

    class RecordingPool(buffers.BufferPool):
        def __init__(self, limit: int) -> None:
            super().__init__(limit)
            pools.append(self)

    class Recording(buffers.Budget):
        def __init__(self, limit: int) -> None:
            super().__init__(limit)
            budgets.append(self)

    def freed(nbytes: int) -> None:
        with lock:
            live[0] -= nbytes

    def tracking(work: Work, **options: object):
        results = prepare(work, **options)
        pieces = [p for _, _, slices in results for p in slices]
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in pieces}
        with lock:
            live[0] += sum(storages.values())
            peak[0] = max(peak[0], live[0])
        left = [len({id(p) for p in pieces})]

        def one_gone() -> None:
            left[0] -= 1
            if not left[0]:
                freed(sum(storages.values()))

        for piece in {id(p): p for p in pieces}.values():
            weakref.finalize(piece, one_gone)
        del pieces
        return results

    prepare = engine_gather.gather_and_split
    monkeypatch.setattr(stream, "Budget", Recording)
    monkeypatch.setattr(stream, "stream_plan", lambda work, **options: None)  # every unit gathered
    monkeypatch.setattr(gathered, "BufferPool", RecordingPool)
    monkeypatch.setattr(gathered, "gather_and_split", tracking)
    monkeypatch.setattr(buffers, "MIN_BUDGET", 0)  # the tiny model's own 2 x largest tensor
    convert(SAMPLE, tmp_path / "out", ConvertOptions(tp=2, jobs=4, progress=False))
    (budget,) = budgets
    largest = 1001 * 64 * 4  # the float32 embedding / lm_head
    assert budget.limit == 2 * (largest + ALIGN)  # each gather buffer has ALIGN bytes of slack for its phase
    assert budget.held == 0
    assert largest <= peak[0] <= budget.limit
    assert live[0] == 0
    (pool,) = pools  # gather buffers kept for reuse count too
    assert pool.limit == budget.limit and largest <= pool.peak <= pool.limit


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors in /proc/self/fd")
def test_conversions_leave_no_descriptor_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Library use (many conversions in one process, one failing midway) must not leak the descriptors
    of the rank files read (two each: direct and buffered) or of the outputs being written."""

    def open_descriptors() -> int:
        gc.collect()  # an exception's traceback keeps its frames (and their files) in a cycle
        return len(list(Path("/proc/self/fd").iterdir()))

    before = open_descriptors()
    for tp in (1, 2):
        convert(SAMPLE, tmp_path / f"tp{tp}", ConvertOptions(tp=tp, progress=False))
    assert open_descriptors() == before
    hashed = []

    def fail_midway(tensor: torch.Tensor) -> str:
        hashed.append(tensor.shape)
        if len(hashed) > 3:
            raise ReshardError("disk on fire")
        return digest_of(tensor)

    monkeypatch.setattr(stream, "stream_plan", lambda work, **options: None)  # every unit gathered
    monkeypatch.setattr(gathered, "digest_of", fail_midway)
    with pytest.raises(ReshardError, match="disk on fire"):
        convert(SAMPLE, tmp_path / "failed", ConvertOptions(tp=2, progress=False))
    assert len(hashed) > 3 and not (tmp_path / "failed").exists()
    assert open_descriptors() == before


class _Recorder:
    """A writer that records the order tensors reach it (a concurrent one from any thread)."""

    takes_parts = False  # CheckpointWriter's declared property: whole slices only, nothing streamed in byte parts

    def __init__(self, concurrent: bool) -> None:
        self.concurrent = concurrent
        self.order: list[str] = []

    def write(self, name: str, slices: list[torch.Tensor]) -> None:
        self.order.append(name)

    write_unordered = write


@pytest.mark.parametrize("concurrent", [True, False])
def test_concurrent_writers_get_the_largest_tensors_first(concurrent: bool) -> None:
    """The tensors of the largest size first, then plan order (a run does not end on the hash of a large
    tensor); writers that are not concurrent get plan order."""
    options = ConvertOptions(tp=1, read=ReadOptions(vocab=500), progress=False)
    plan = plan_target(open_checkpoint(SAMPLES / "tiny-megatron-tp8", options.read, target_tp=1), options).conversion
    writer = _Recorder(concurrent)
    stream.execute(plan, writer, jobs=1, progress=False)
    names = [t.name for tensor in plan.tensors for t in tensor.targets]
    size = {t.name: tensor.nbytes for tensor in plan.tensors for t in tensor.targets}
    largest = [name for name in names if size[name] == max(size.values())]
    assert names[-1] == "output_layer.weight" and names[-1] in largest  # where plan order puts the largest
    assert writer.order == ([*largest, *(name for name in names if name not in largest)] if concurrent else names)


def test_jobs_default_to_the_cores_in_memory_and_to_twice_them_on_a_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No job waits for a device when checkpoint and output are in tmpfs: one a core there, two a core elsewhere."""
    memory_root = Path("/dev/shm")
    if not (memory_root.is_dir() and os.access(memory_root, os.W_OK) and in_memory(memory_root)):
        pytest.skip("no writable tmpfs at /dev/shm")
    jobs: list[int] = []
    real = run.execute
    monkeypatch.setattr(
        run, "execute", lambda *args, **options: jobs.append(options["jobs"]) or real(*args, **options)
    )
    with tempfile.TemporaryDirectory(dir=memory_root) as folder:
        source = Path(folder) / "source"
        shutil.copytree(SAMPLE, source)
        convert(source, Path(folder) / "out", ConvertOptions(tp=2, progress=False))
        convert(source, tmp_path / "out", ConvertOptions(tp=2, progress=False))
        convert(source, Path(folder) / "three", ConvertOptions(tp=2, jobs=3, progress=False))
    on_disk = cores() if in_memory(tmp_path) else 2 * cores()
    assert jobs == [cores(), on_disk, 3]
