"""The threaded, in-place byte mover (reshard.engine.execute) against the plain gather / split of reshard.partition."""

from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from reshard.engine import buffers
from reshard.engine import execute as stream
from reshard.engine import gather as engine_gather
from reshard.engine.digest import sha256_of
from reshard.engine.planner import SourceTensor, TargetTensor, TensorPlan
from reshard.errors import CorruptFileError, DivergentReplicaError
from reshard.io.safetensors_writer import byte_chunks, tensor_bytes
from reshard.layouts.base import TensorRef
from reshard.layouts.readers import SafetensorsReader, TorchReader
from reshard.partition import Packed, Replicate, Shard, Vocab, rank_shapes
from reshard.slicing import gather, split

SAMPLE = Path(__file__).resolve().parents[1] / "sample_ckpts" / "tiny-llama-tp2"


def _full(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel()).to(dtype).reshape(shape)


def one_tensor(source: SourceTensor, rank_shapes: tuple) -> TensorPlan:
    """The plan of one tensor kept under its name and partition, with the given target rank shapes."""
    target = TargetTensor(source.name, source.shape, source.code, source.partition, tuple(rank_shapes))
    return TensorPlan((source,), (target,))


def _refs(tmp_path: Path, slices: list[torch.Tensor], fmt: str) -> tuple[TensorRef, ...]:
    """Rank slices written to one file per rank, in the given format, read back lazily."""
    refs = []
    for rank, piece in enumerate(slices):
        if fmt == "safetensors":
            path = tmp_path / f"rank{rank}.safetensors"
            save_file({"w": piece.contiguous()}, path)
            reader = SafetensorsReader(path)
        else:
            path = tmp_path / f"rank{rank}.pt"
            torch.save({"w": piece.contiguous()}, path)
            reader = TorchReader(path)
        refs.append(TensorRef("w", rank, reader, "w", reader.headers["w"]))
    return tuple(refs)


CASES = {
    "shard0": (Shard(0), (8, 6), 2, 4, {}),
    "shard1": (Shard(1), (6, 8), 4, 2, {}),
    "shard1-3d": (Shard(1), (3, 8, 5), 2, 4, {}),
    "shard1-long-rows": (Shard(1), (5, 1024), 2, 4, {}),  # rows >= 1 KB: read and written row by row
    "shard2-long-rows": (Shard(2), (2, 3, 1024), 4, 2, {}),
    "vocab1-long-rows": (Vocab(1), (3, 1001), 2, 4, {"vocab": 1001}),
    "vocab0-pad-more": (Vocab(0), (13, 4), 2, 4, {"vocab": 13}),
    "vocab0-pad-less": (Vocab(0), (13, 4), 4, 1, {"vocab": 13}),
    "vocab1": (Vocab(1), (3, 10), 4, 2, {"vocab": 10}),
    "packed0": (Packed(0, (8, 8)), (16, 3), 4, 2, {}),
    "packed1": (Packed(1, (4, 8)), (3, 12), 2, 4, {}),
    "packed0-to-1": (Packed(0, (4, 4, 8)), (16, 2), 4, 1, {}),
    "replicate": (Replicate(), (5, 3), 4, 2, {}),
    "uneven": (Shard(0), (10, 3), 3, 4, {"uneven": True}),
}


def _source_slices(partition, full: torch.Tensor, tp: int, vocab: int | None, uneven: bool) -> list[torch.Tensor]:
    padded = None
    if isinstance(partition, Vocab):
        padded = -(-vocab // tp) * tp
        if tp == 4:
            padded += tp  # a source padded further than needed: the extra rows are not data
    return split(full, partition, tp, padded=padded, uneven=uneven)


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_prepare_matches_gather_then_split(tmp_path: Path, case: str, fmt: str) -> None:
    partition, shape, source_tp, target_tp, extra = CASES[case]
    vocab, uneven = extra.get("vocab"), extra.get("uneven", False)
    full = _full(shape, torch.bfloat16 if fmt == "torch" else torch.float32)
    slices = _source_slices(partition, full, source_tp, vocab, uneven)
    refs = _refs(tmp_path, slices, fmt)
    target_padded = -(-vocab // target_tp) * target_tp if vocab else None
    targets = tuple(rank_shapes(partition, full.shape, target_tp, padded=target_padded, uneven=uneven))
    plan = one_tensor(SourceTensor("w", refs, partition, "test", tuple(full.shape)), targets)

    work = engine_gather.plan_work(plan, target_tp=target_tp)
    ((name, canonical, pieces),) = engine_gather.gather_and_split(
        work, target_tp=target_tp, uneven=uneven, allow_divergent=False
    )

    expected_full = gather([s.contiguous() for s in slices], partition, vocab_size=vocab, uneven=uneven)
    assert name == "w"
    assert torch.equal(canonical, full) and torch.equal(expected_full, full)
    expected = split(full, partition, target_tp, padded=target_padded, uneven=uneven)
    assert [tuple(p.shape) for p in pieces] == list(targets)
    for got, want in zip(pieces, expected, strict=True):
        assert bytes(tensor_bytes(got)) == bytes(tensor_bytes(want))
    assert sha256_of(canonical) == sha256_of(full.contiguous())


def test_divergent_replica_names_the_rank_and_file(tmp_path: Path) -> None:
    same = _full((4, 3))
    other = same.clone()
    other[1, 2] += 0.5
    refs = _refs(tmp_path, [same, same, other], "safetensors")
    plan = one_tensor(SourceTensor("w", refs, Replicate(), "test", (4, 3)), ((4, 3),))
    work = engine_gather.plan_work(plan, target_tp=1)
    with pytest.raises(DivergentReplicaError, match=r"rank0\.safetensors.*w.*between rank 0 and rank 2.*0\.5"):
        engine_gather.gather_and_split(work, target_tp=1, uneven=False, allow_divergent=False)
    ((_, canonical, _),) = engine_gather.gather_and_split(work, target_tp=1, uneven=False, allow_divergent=True)
    assert torch.equal(canonical, same)


def test_read_into_a_file_cut_after_opening_is_a_corrupt_file_error(tmp_path: Path) -> None:
    path = tmp_path / "cut.safetensors"
    save_file({"w": _full((64, 64))}, path)
    reader = SafetensorsReader(path)
    with path.open("r+b") as handle:
        handle.truncate(path.stat().st_size - 100)
    with pytest.raises(CorruptFileError, match=r"cut\.safetensors.*w.*file ends"):
        reader.read_into("w", torch.empty(64, 64))


def test_byte_chunks_of_a_column_block_are_its_c_order_bytes() -> None:
    full = _full((6, 5, 8))
    block = full[:, 1:4, 2:6]  # not contiguous: blocks of rows, and rows larger than the limit
    expected = block.contiguous().numpy().tobytes()
    for limit in (1, 16, 60, 10_000):
        assert b"".join(bytes(c) for c in byte_chunks(block, limit)) == expected
    assert b"".join(bytes(c) for c in byte_chunks(full, 16)) == full.numpy().tobytes()


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
    ranks = [load_file(SAMPLE / f"rank_{r:02d}" / "model.safetensors") for r in range(2)]
    merged = load_file(tmp_path / "four" / "model.safetensors") if tp == 1 else None
    if merged is not None:
        for name in ("model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.up_proj.weight"):
            dim = 1 if "o_proj" in name else 0
            assert torch.equal(merged[name], torch.cat([r[name] for r in ranks], dim=dim))
        assert torch.equal(
            merged["model.embed_tokens.weight"], torch.cat([r["model.embed_tokens.weight"] for r in ranks])[:1001]
        )


def test_bytes_in_flight_stay_within_the_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tensor memory alive at once (storages behind prepared, unwritten slices, and gather buffers kept
    for reuse) stays under the budget."""
    from reshard.commands.convert import convert
    from reshard.options import ConvertOptions

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

    def tracking(work: engine_gather.Work, **options: object):
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
    monkeypatch.setattr(stream, "BufferPool", RecordingPool)
    monkeypatch.setattr(stream, "gather_and_split", tracking)
    monkeypatch.setattr(buffers, "MIN_BUDGET", 0)  # the tiny model's own 2 x largest tensor
    convert(SAMPLE, tmp_path / "out", ConvertOptions(tp=2, jobs=4, progress=False))
    (budget,) = budgets
    largest = 1001 * 64 * 4  # the float32 embedding / lm_head
    assert budget.limit == 2 * largest
    assert budget.held == 0
    assert largest <= peak[0] <= budget.limit
    assert live[0] == 0
    (pool,) = pools  # gather buffers kept for reuse count too
    assert pool.limit == budget.limit and largest <= pool.peak <= pool.limit


def test_short_writes_and_reads_resume_where_they_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from reshard.io import vectored as _io

    data = [memoryview(bytes(range(i, i + 7))) for i in range(0, 70, 7)]
    real_pwritev, real_preadv = os.pwritev, os.preadv
    monkeypatch.setattr(_io.os, "pwritev", lambda fd, views, pos: real_pwritev(fd, [views[0][:3]], pos))  # 3 a call
    path = tmp_path / "f"
    with path.open("wb", buffering=0) as handle:
        handle.write(b"head")
        _io.pwrite_all(handle.fileno(), data, 4)
    assert path.read_bytes() == b"head" + b"".join(bytes(d) for d in data)

    calls: list[int] = []
    monkeypatch.setattr(_io, "WRITE_BYTES", 10)  # views are split and batched to at most 10 bytes a call
    monkeypatch.setattr(
        _io.os, "pwritev", lambda fd, views, pos: calls.append(sum(map(len, views))) or real_pwritev(fd, views, pos)
    )
    with path.open("wb", buffering=0) as handle:
        _io.pwrite_all(handle.fileno(), data, 0)
    assert path.read_bytes() == b"".join(bytes(d) for d in data)
    assert max(calls) <= 10 and sum(calls) == 70

    monkeypatch.setattr(_io.os, "preadv", lambda fd, views, pos: real_preadv(fd, [views[0][:5]], pos))
    out = [memoryview(bytearray(7)) for _ in range(10)]
    with path.open("rb") as handle:
        assert _io.read_all(handle.fileno(), out, 0)
        assert b"".join(bytes(o) for o in out) == path.read_bytes()
        assert not _io.read_all(handle.fileno(), [memoryview(bytearray(8))], 66)  # the file ends


def test_row_views_are_the_strided_rows_without_a_copy() -> None:
    full = _full((4, 1024))
    block = full[:, 256:768]
    views = _io_rows(block)
    assert len(views) == 4 and b"".join(bytes(v) for v in views) == block.contiguous().numpy().tobytes()
    views[0][:4] = bytes(4)  # writes through to the tensor: no copy was made
    assert full[0, 256] == 0
    assert _io_rows(full[:, 1:9]) is None  # 32-byte rows: not worth a buffer each


def _io_rows(tensor: torch.Tensor):
    from reshard.io.vectored import row_views

    return row_views(tensor)


@pytest.mark.parametrize("columns", [(256, 768), (1, 9)], ids=["long-rows", "short-rows"])
def test_a_column_block_is_written_as_save_file_writes_it(tmp_path: Path, columns: tuple[int, int]) -> None:
    from reshard.io.safetensors_writer import SafetensorsFileWriter
    from reshard.layouts.readers import TensorHeader

    block = _full((6, 1024))[:, columns[0] : columns[1]]
    writer = SafetensorsFileWriter(tmp_path / "ours.safetensors", {"w": TensorHeader.of(block.shape, block.dtype)})
    writer.write("w", block)
    assert writer.done
    save_file({"w": block.contiguous()}, tmp_path / "theirs.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()


def _mapped_rss_kb(path: Path) -> int:
    """Resident kB of this process's mappings of ``path`` (from /proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
            inside = len(fields) == 6 and fields[5] == str(path.resolve())
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_reading_a_torch_file_lets_go_of_its_mapped_pages(tmp_path: Path) -> None:
    from reshard.io.vectored import release_mapped

    path = tmp_path / "big.pt"
    torch.save({"w": _full((1024, 2048))}, path)  # 8 MB
    reader = TorchReader(path)
    out = torch.empty(1024, 2048)
    out.copy_(reader.get("w"))  # a plain read leaves the pages mapped and resident
    assert _mapped_rss_kb(path) > 4000
    reader.read_into("w", out)
    assert torch.equal(out, _full((1024, 2048)))
    assert _mapped_rss_kb(path) < 100
    assert torch.equal(reader.get("w"), _full((1024, 2048)))  # read again from the page cache
    anonymous = _full((1024, 2048))
    release_mapped(anonymous, [(0, 4096)])  # memory outside the file's mappings is never dropped
    assert torch.equal(anonymous, _full((1024, 2048)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int32])
@pytest.mark.parametrize(
    "bad", [None, float("nan"), float("inf"), float("-inf")], ids=["finite", "nan", "inf", "-inf"]
)
def test_finite_check_in_one_pass_agrees_with_isfinite(dtype: torch.dtype, bad: float | None) -> None:
    from reshard.engine.digest import all_finite_in_blocks

    tensor = (torch.arange(3000.0).reshape(100, 30) / 7).to(dtype)
    if bad is not None and dtype.is_floating_point:
        tensor[77, 11] = bad
    expected = bool(torch.isfinite(tensor.float()).all()) if dtype.is_floating_point else True
    assert all_finite_in_blocks(tensor) is expected
    assert all_finite_in_blocks(tensor[:, 8:14]) is expected  # a strided view holding the bad value


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors in /proc/self/fd")
def test_conversions_leave_no_descriptor_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Library use (many conversions in one process, one failing midway) must not leak the descriptors
    of the rank files read (two each: direct and buffered) or of the outputs being written."""
    from reshard import convert
    from reshard.errors import ReshardError
    from reshard.options import ConvertOptions

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
        return sha256_of(tensor)

    monkeypatch.setattr(stream, "sha256_of", fail_midway)
    with pytest.raises(ReshardError, match="disk on fire"):
        convert(SAMPLE, tmp_path / "failed", ConvertOptions(tp=2, progress=False))
    assert len(hashed) > 3 and not (tmp_path / "failed").exists()
    assert open_descriptors() == before
