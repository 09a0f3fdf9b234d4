"""``reshard.formats.safetensors.writer``: the streaming writer writes what safetensors.torch.save_file writes."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from fixtures.tp import arange
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from reshard.formats.readers import TensorHeader
from reshard.formats.safetensors.writer import (
    SafetensorsFileWriter,
    ShardedSafetensorsWriter,
    byte_chunks,
    ordered,
    plan_shards,
)


def headers_of(tensors: dict[str, torch.Tensor]) -> dict[str, TensorHeader]:
    return {name: TensorHeader.of(t.shape, t.dtype) for name, t in tensors.items()}


def stream(path, tensors, metadata=None):
    writer = SafetensorsFileWriter(path, headers_of(tensors), metadata=metadata)
    for name in ordered(writer.headers):
        writer.write(name, tensors[name])
    writer.close()


def test_golden_bytes_of_a_2x2_file(tmp_path):
    stream(tmp_path / "a.safetensors", {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}, metadata={"format": "pt"})
    header = b'{"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}'
    header += b" " * (-len(header) % 8)
    data = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)
    assert (tmp_path / "a.safetensors").read_bytes() == struct.pack("<Q", len(header)) + header + data


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}], ids=["no-metadata", "format-pt"])
def test_byte_for_byte_equal_to_save_file(tmp_path, metadata):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=gen),
        "bf16": torch.randn(7, generator=gen).to(torch.bfloat16),
        "f16": torch.randn(2, 2, 2, generator=gen).to(torch.float16),
        "i64": torch.arange(5),
        "i8": torch.arange(-3, 3, dtype=torch.int8),
        "u8": torch.arange(4, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "fp8": torch.arange(4, dtype=torch.float32).to(torch.float8_e4m3fn),
        "c64": torch.complex(torch.arange(2.0), torch.arange(2.0) + 5),
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(3.5),
        "a.sorted.name": torch.arange(3, dtype=torch.float32),
    }
    save_file(tensors, tmp_path / "ref.safetensors", metadata=metadata)
    stream(tmp_path / "ours.safetensors", tensors, metadata=metadata)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_non_contiguous_slices_are_written_in_c_order(tmp_path):
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    piece = full[:, 3:]  # a column slice: not contiguous
    stream(tmp_path / "p.safetensors", {"p": piece})
    assert torch.equal(load_file(tmp_path / "p.safetensors")["p"], piece)


def test_unordered_writes_from_threads_give_the_save_file_bytes(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    gen = torch.Generator().manual_seed(1)
    tensors = {f"t{i}": torch.randn(300 + i, 70, generator=gen).to(torch.bfloat16) for i in range(12)}
    tensors["col"] = torch.randn(64, 1024, generator=gen)[:, 256:768]  # strided rows
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    writer = SafetensorsFileWriter(tmp_path / "ours.safetensors", headers_of(tensors))
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda name: writer.write_unordered(name, tensors[name]), reversed(ordered(writer.headers))))
    assert writer.done
    writer.close()
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    with pytest.raises(ValueError, match="written twice"):
        writer.write_unordered("t0", tensors["t0"])


def test_tensors_written_in_parts_give_the_save_file_bytes(tmp_path):
    """Byte ranges of a tensor, in any order and beside whole tensors, land where ``save_file`` puts its bytes; a
    file kept as it is (a resumed run) is left alone."""
    tensors = {"a": arange((37, 5), torch.bfloat16), "b": arange((9, 3)), "c": arange((4,), torch.float16)}
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    writer = SafetensorsFileWriter(tmp_path / "ours.safetensors", headers_of(tensors))
    writer.write_unordered("c", tensors["c"])
    raw = memoryview(tensors["a"].view(torch.uint8).numpy()).cast("B")
    writer.begin_parts("a", (37, 5), "BF16")
    for start in (300, 0, 100, 200):
        writer.write_part("a", [raw[start : start + 40], raw[start + 40 : start + 100]], start)
    writer.write_part("a", [raw[370:]], 370)
    writer.write_part("a", [raw[360:370]], 360)
    assert not writer.done
    writer.end_parts("a")
    writer.write_unordered("b", tensors["b"])
    assert writer.done
    writer.close()
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    with pytest.raises(ValueError, match="written twice"):
        writer.begin_parts("a", (37, 5), "BF16")
    other = SafetensorsFileWriter(tmp_path / "other.safetensors", headers_of(tensors))
    with pytest.raises(ValueError, match=r"announced \(37, 5\)"):
        other.begin_parts("a", (5, 37), "BF16")
    kept = SafetensorsFileWriter(tmp_path / "kept.safetensors", headers_of(tensors), keep=True)
    kept.begin_parts("a", (37, 5), "BF16")
    kept.write_part("a", [raw], 0)
    kept.end_parts("a")
    assert not (tmp_path / "kept.safetensors").exists()


def test_wrong_order_or_shape_is_refused(tmp_path):
    tensors = {"a": torch.zeros(2), "b": torch.zeros(3)}
    writer = SafetensorsFileWriter(tmp_path / "x.safetensors", headers_of(tensors))
    with pytest.raises(ValueError, match="expected tensor 'a' next, got 'b'"):
        writer.write("b", tensors["b"])
    with pytest.raises(ValueError, match=r"announced \(2,\)"):
        writer.write("a", torch.zeros(3))


def test_sharded_folder_matches_hub_planner_and_loads(tmp_path):
    tensors = {f"layer.{i}.weight": arange((64,), start=64 * i) for i in range(6)}  # 256 bytes each
    headers = headers_of(tensors)
    writer = ShardedSafetensorsWriter(tmp_path, headers, plan_shards(headers, max_shard_size=600))
    for name in ordered(writer.headers):
        writer.write(name, tensors[name])
    writer.close()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 6 * 256
    files = sorted(set(index["weight_map"].values()))
    assert files == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    ]
    for name, filename in index["weight_map"].items():
        with safe_open(tmp_path / filename, framework="pt") as handle:
            assert torch.equal(handle.get_tensor(name), tensors[name])
            assert handle.metadata() == {"format": "pt"}


def test_small_state_dict_is_one_file_without_index(tmp_path):
    tensors = {"w": torch.arange(4.0)}
    headers = headers_of(tensors)
    writer = ShardedSafetensorsWriter(tmp_path, headers, plan_shards(headers))
    writer.write("w", tensors["w"])
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert writer.filenames == ["model.safetensors"]


def test_copies_of_short_rows_are_let_go_as_they_are_written(tmp_path, monkeypatch):
    """A column block whose rows are too short to write in place goes out as contiguous copies of a few
    rows each. Writes land asynchronously inside the caller's batch; each copy must still be released
    once written, not all held until the whole tensor is done (that would be a second tensor of memory)."""
    import time
    import weakref

    from reshard.formats.safetensors import writer as safetensors_stream
    from reshard.io import direct as direct_io

    monkeypatch.setattr(direct_io, "STAGING_BYTES", 2 * direct_io.ALIGN)
    alive, most = set(), [0]
    real_tensor_bytes = safetensors_stream.tensor_bytes

    def tracked(tensor):
        view = real_tensor_bytes(tensor)
        array = view.obj  # the numpy array the copy lives in
        alive.add(id(array))
        weakref.finalize(array, alive.discard, id(array))
        most[0] = max(most[0], len(alive))
        return view

    real_byte_chunks, real_pwrite = safetensors_stream.byte_chunks, direct_io.os.pwrite

    def slow_disk(fd, view, position):
        time.sleep(0.005)
        return real_pwrite(fd, view, position)

    monkeypatch.setattr(direct_io.os, "pwrite", slow_disk)
    monkeypatch.setattr(safetensors_stream, "tensor_bytes", tracked)
    monkeypatch.setattr(safetensors_stream, "byte_chunks", lambda t, **at: real_byte_chunks(t, limit=32 * 1024, **at))
    full = torch.randn(512, 256)
    block = full[:, 64:192]  # rows of 512 bytes: under MIN_ROW_BYTES, so 16 copies of 64 rows
    writer = SafetensorsFileWriter(tmp_path / "b.safetensors", headers_of({"b": block}))
    with direct_io.Batch():
        writer.write_unordered("b", block)
    writer.close()
    assert torch.equal(load_file(tmp_path / "b.safetensors")["b"], block)
    assert most[0] <= 2, f"{most[0]} chunk copies held at once"


def test_byte_chunks_of_a_column_block_are_its_c_order_bytes() -> None:
    full = arange((6, 5, 8))
    block = full[:, 1:4, 2:6]  # not contiguous: blocks of rows, and rows larger than the limit
    expected = block.contiguous().numpy().tobytes()
    for limit in (1, 16, 60, 10_000):
        assert b"".join(bytes(c) for c in byte_chunks(block, limit)) == expected
    assert b"".join(bytes(c) for c in byte_chunks(full, 16)) == full.numpy().tobytes()


@pytest.mark.parametrize("columns", [(256, 768), (1, 9)], ids=["long-rows", "short-rows"])
def test_a_column_block_is_written_as_save_file_writes_it(tmp_path, columns: tuple[int, int]) -> None:
    block = arange((6, 1024))[:, columns[0] : columns[1]]
    writer = SafetensorsFileWriter(tmp_path / "ours.safetensors", {"w": TensorHeader.of(block.shape, block.dtype)})
    writer.write("w", block)
    assert writer.done
    save_file({"w": block.contiguous()}, tmp_path / "theirs.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()
