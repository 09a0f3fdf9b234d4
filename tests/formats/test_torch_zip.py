"""The streaming torch zip writer writes exactly the bytes torch.save writes, one tensor at a time."""

from __future__ import annotations

import argparse
import errno
import io
import os
import random
import struct
import zipfile
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard.dtypes import code_of
from reshard.formats.readers import TensorHeader
from reshard.formats.torch_zip import layout as zip_layout
from reshard.formats.torch_zip import writer as torch_zip
from reshard.formats.torch_zip.writer import TensorSlot, TorchZipWriter, archive_name
from reshard.io import direct as direct_io
from reshard.layouts.megatron.args import PICKLE_MODULE, SAFE_GLOBALS, PickledEnum

DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16,
    torch.uint32, torch.uint64,
]  # fmt: skip
Leaf = Callable[[str, torch.Tensor], Any]


def filled(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Seeded values of every dtype (never all zeros), each tensor with a storage of its own and the strides
    ``torch.empty`` gives (arithmetic on empty tensors may leave others)."""
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 50
    if dtype == torch.bool:
        values = values > 0
    elif dtype in (torch.uint16, torch.uint32, torch.uint64):
        values = values.abs().to(torch.int64).to(dtype)
    return torch.empty(shape, dtype=dtype).copy_(values.to(dtype))


def slot_of(key: str, tensor: torch.Tensor) -> TensorSlot:
    return TensorSlot(key, TensorHeader.of(tensor.shape, tensor.dtype))


def save_both(
    tmp_path: Path,
    build: Callable[[Leaf], Any],
    *,
    name: str = "model.pt",
    pickle_module: Any = None,
    order: Callable[[list], list] | None = None,
    threads: int = 1,
    direct: bool = True,
) -> tuple[Path, Path]:
    """``torch.save`` of ``build(tensor)`` and our writer fed ``build(slot)``; the paths of both files."""
    tensors: dict[str, torch.Tensor] = {}

    def real(key: str, tensor: torch.Tensor) -> torch.Tensor:
        tensors[key] = tensor
        return tensor

    obj = build(real)
    (tmp_path / "ref").mkdir()
    (tmp_path / "ours").mkdir()
    kwargs = {} if pickle_module is None else {"pickle_module": pickle_module}
    torch.save(obj, tmp_path / "ref" / name, **kwargs)
    writer = TorchZipWriter(tmp_path / "ours" / name, build(slot_of), direct=direct, **kwargs)
    items = list(tensors.items())
    items = order(items) if order else items
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda item: writer.write(*item), items))
    assert writer.done == bool(items)
    writer.close()
    return tmp_path / "ref" / name, tmp_path / "ours" / name


def assert_same_bytes(ref: Path, ours: Path) -> None:
    expected, got = ref.read_bytes(), ours.read_bytes()
    first = next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b), None)
    assert (len(got), first) == (len(expected), None)


def test_golden_bytes_of_a_two_tensor_file(tmp_path: Path) -> None:
    ref, ours = save_both(
        tmp_path, lambda leaf: {"a": leaf("a", torch.arange(10.0)), "b": leaf("b", torch.arange(3.0).bfloat16())}
    )
    assert_same_bytes(ref, ours)
    with zipfile.ZipFile(ours) as archive:  # the layout torch writes, seen by an independent reader
        assert archive.namelist() == [
            "model/data.pkl", "model/.format_version", "model/.storage_alignment", "model/byteorder",
            "model/data/0", "model/data/1", "model/version", "model/.data/serialization_id",
        ]  # fmt: skip
        assert archive.testzip() is None  # every CRC checks
        assert archive.read("model/data/1") == torch.arange(3.0).bfloat16().view(torch.int16).numpy().tobytes()
        raw = ours.read_bytes()
        for info in archive.infolist():  # every record's data starts on a multiple of 64, for mmap
            names, extra = struct.unpack_from("<HH", raw, info.header_offset + 26)
            assert (info.header_offset + 30 + names + extra) % 64 == 0


def test_records_are_checksummed_by_isa_l_where_it_is_installed() -> None:
    """The dependency that makes the CRC-32 of every record cheap is the one in use, and it is zip's CRC-32."""
    isal_zlib = pytest.importorskip("isal.isal_zlib")
    data = random.Random(5).randbytes(3 << 20)
    assert torch_zip.crc32 is isal_zlib.crc32
    assert torch_zip.crc32(data, 7) == zlib.crc32(data, 7) and torch_zip.crc32(b"") == 0


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_every_dtype_scalars_and_empty_tensors(tmp_path: Path, direct: bool) -> None:
    def build(leaf: Leaf) -> dict:
        state = {str(d): leaf(str(d), filled((5, 7), d, seed=i)) for i, d in enumerate(DTYPES)}
        state["scalar"] = leaf("scalar", torch.tensor(3.5))
        state["empty"] = leaf("empty", torch.zeros(0, 4))
        state["empty_bf16"] = leaf("empty_bf16", torch.zeros(3, 0, dtype=torch.bfloat16))
        state["one"] = leaf("one", torch.tensor([7], dtype=torch.int64))
        return state

    assert_same_bytes(*save_both(tmp_path, build, direct=direct))


def test_nested_values_beside_tensors_and_real_tensors_in_the_template(tmp_path: Path) -> None:
    shared = torch.arange(12, dtype=torch.float32)
    blob = torch.arange(5, dtype=torch.uint8)
    scale = filled((2, 3), torch.float8_e4m3fn)  # a real tensor of a dtype typed storages lack

    def build(leaf: Leaf) -> dict:
        return {
            "model": {"language_model": {"embedding": {"w": leaf("w", filled((6, 4), torch.bfloat16))}}},
            "extra": {"_extra_state": io.BytesIO(b"\x00fp8 meta"), "te": blob, "none": None, "fp8": scale},
            "views": [shared[2:5], shared.view(3, 4)[1]],  # two views of one storage: one record
            "args": argparse.Namespace(hidden_size=4, lr=1e-4, name="cpu", tags=("a", "b")),
            "checkpoint_version": 3.0,
            "iteration": 1000,
            "text": "storage",
        }

    ref, ours = save_both(tmp_path, build)
    assert_same_bytes(ref, ours)
    loaded = torch.load(ours, weights_only=False)
    assert torch.equal(loaded["views"][1], shared.view(3, 4)[1]) and loaded["extra"]["te"].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("o_direct", ["accepted", "refused"])
def test_large_tensors_in_many_direct_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, o_direct: str) -> None:
    """Tensors spanning many aligned blocks (written with O_DIRECT where the file system allows) at offsets
    that are multiples of 64, not of the block size; a file system refusing O_DIRECT gets the same bytes."""
    monkeypatch.setattr(direct_io, "STAGING_BYTES", 4 * direct_io.ALIGN)
    if o_direct == "refused":
        real_open = os.open

        def refuse_direct(path: Any, flags: int, *args: Any) -> int:
            if flags & getattr(os, "O_DIRECT", 0):
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_open(path, flags, *args)

        monkeypatch.setattr(direct_io.os, "open", refuse_direct)

    def build(leaf: Leaf) -> dict:
        return {f"w{i}": leaf(f"w{i}", filled((97 + i, 211), torch.bfloat16, seed=i)) for i in range(6)}

    files: list[direct_io.DirectFile] = []

    class Recorded(direct_io.DirectFile):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            files.append(self)

    monkeypatch.setattr(torch_zip, "DirectFile", Recorded)
    shuffle = lambda items: random.Random(5).sample(items, len(items))  # noqa: E731
    assert_same_bytes(*save_both(tmp_path, build, order=shuffle, threads=4))
    assert len(files) == 1 and (files[0].direct_bytes > 200_000) == (o_direct == "accepted")


def test_megatron_pickle_module_writes_enums_back_as_megatron_globals(tmp_path: Path) -> None:
    args = argparse.Namespace(model_type=PickledEnum("megatron.core.enums.ModelType", 1), tensor_model_parallel_size=2)

    def build(leaf: Leaf) -> dict:
        model = {"w": leaf("w", filled((4, 4), torch.half))}
        return {"args": args, "checkpoint_version": 3.0, "iteration": 1, "model": model}

    ref, ours = save_both(tmp_path, build, pickle_module=PICKLE_MODULE)
    assert_same_bytes(ref, ours)
    assert b"cmegatron.core.enums\nModelType\n" in zipfile.ZipFile(ours).read("model/data.pkl")


def test_the_same_slot_twice_is_one_tensor(tmp_path: Path) -> None:
    tensor = filled((3, 3), torch.float32)

    def build(leaf: Leaf) -> dict:
        one = leaf("w", tensor)
        return {"a": one, "b": one, "c": [one]}

    ref, ours = save_both(tmp_path, build)
    assert_same_bytes(ref, ours)
    assert len([n for n in zipfile.ZipFile(ours).namelist() if "/data/" in n]) == 1


@pytest.mark.parametrize("threads", [1, 8])
def test_out_of_order_and_threaded_writes(tmp_path: Path, threads: int) -> None:
    def build(leaf: Leaf) -> dict:
        return {f"layer.{i}": leaf(f"k{i}", filled((i % 5, 300 + i), torch.bfloat16, seed=i)) for i in range(60)}

    shuffle = lambda items: random.Random(threads).sample(items, len(items))  # noqa: E731
    assert_same_bytes(*save_both(tmp_path, build, order=shuffle, threads=threads))


def write_in_parts(writer: TorchZipWriter, key: str, tensor: torch.Tensor, rng: random.Random) -> None:
    """Write ``tensor`` as byte ranges cut at random places, in a random order, as a stream hands them over."""
    data = memoryview(tensor.contiguous().view(torch.uint8).numpy()).cast("B")
    edges = sorted({0, len(data), *rng.sample(range(len(data) + 1), min(len(data), 6))})
    ranges = list(zip(edges, edges[1:], strict=False))
    writer.begin_parts(key, tuple(tensor.shape), code_of(tensor.dtype))
    for start, end in rng.sample(ranges, len(ranges)):
        writer.write_part(key, [data[start:end]], start)
    writer.end_parts(key)


@pytest.mark.parametrize("threads", [1, 4])
def test_tensors_written_as_byte_ranges_in_any_order_give_torch_save_bytes(tmp_path: Path, threads: int) -> None:
    """A streamed tensor's ranges carry their own CRC-32s, joined at the end: the file is torch.save's, CRCs and
    all (an independent zip reader checks them)."""
    tensors = {f"w{i}": filled((i % 4 + 1, 97 + i), DTYPES[i % len(DTYPES)], seed=i) for i in range(24)}
    torch.save(tensors, tmp_path / "ref.pt")
    (tmp_path / "ours").mkdir()
    writer = TorchZipWriter(tmp_path / "ours" / "ref.pt", {k: slot_of(k, v) for k, v in tensors.items()})
    at, first = writer.position("w0"), tensors["w0"].view(torch.uint8).numpy().tobytes()
    assert writer.takes_parts and at is not None and at % 64 == 0  # where torch.save put its bytes
    assert (tmp_path / "ref.pt").read_bytes()[at : at + len(first)] == first
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda i: write_in_parts(writer, f"w{i}", tensors[f"w{i}"], random.Random(i)), range(24)))
    assert writer.done
    writer.close()
    assert_same_bytes(tmp_path / "ref.pt", tmp_path / "ours" / "ref.pt")
    assert zipfile.ZipFile(tmp_path / "ours" / "ref.pt").testzip() is None


def test_byte_ranges_that_leave_a_gap_or_overlap_are_refused(tmp_path: Path) -> None:
    data = memoryview(filled((4, 4), torch.float32).numpy()).cast("B")  # 64 bytes
    for name, ranges, said in [
        ("gap", [(0, 16), (32, 64)], r"bytes \[16, 32\) were written never"),
        ("short", [(0, 48)], r"bytes \[48, 64\) were never written"),
        ("overlap", [(0, 40), (32, 64)], r"bytes \[32, 40\) were written twice"),
    ]:
        writer = TorchZipWriter(tmp_path / f"{name}.pt", {"w": slot_of("w", torch.zeros(4, 4))})
        writer.begin_parts("w", (4, 4), "F32")
        for start, end in ranges:
            writer.write_part("w", [data[start:end]], start)
        with pytest.raises(ValueError, match=f"{name}.pt: w: {said}"):
            writer.end_parts("w")
        writer.abort()
        assert not (tmp_path / f"{name}.pt").exists()


def test_non_contiguous_tensors_are_written_in_c_order(tmp_path: Path) -> None:
    wide = filled((64, 1024), torch.float32)  # rows of 2 KB: written row by row
    narrow = filled((64, 12), torch.float16)  # rows of 12 bytes: written through contiguous copies
    reference = {"cols": wide[:, 512:].contiguous(), "narrow": narrow[:, 6:].contiguous(), "t": wide.t().contiguous()}
    views = {"cols": wide[:, 512:], "narrow": narrow[:, 6:], "t": wide.t()}
    torch.save(reference, tmp_path / "ref.pt")
    (tmp_path / "ours").mkdir()
    writer = TorchZipWriter(tmp_path / "ours" / "ref.pt", {k: slot_of(k, v) for k, v in reference.items()})
    for key, view in views.items():
        writer.write(key, view)
    writer.close()
    assert_same_bytes(tmp_path / "ref.pt", tmp_path / "ours" / "ref.pt")


def test_loads_with_weights_only_and_mmap(tmp_path: Path) -> None:
    tensors = {str(d): filled((9, 3), d, seed=i) for i, d in enumerate(DTYPES)}
    args = argparse.Namespace(model_type=PickledEnum("megatron.core.enums.ModelType", 1), hidden=3)
    template = {"model": {k: slot_of(k, v) for k, v in tensors.items()}, "args": args, "iteration": 7}
    writer = TorchZipWriter(tmp_path / "model_optim_rng.pt", template, pickle_module=PICKLE_MODULE)
    for key, tensor in reversed(tensors.items()):
        writer.write(key, tensor)
    writer.close()
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        loaded = torch.load(tmp_path / "model_optim_rng.pt", weights_only=True, mmap=True)
    assert loaded["iteration"] == 7 and loaded["args"].hidden == 3 and loaded["args"].model_type.value == 1
    for key, tensor in tensors.items():
        got = loaded["model"][key]
        assert got.dtype == tensor.dtype and torch.equal(got.view(torch.uint8), tensor.view(torch.uint8))


def test_a_missing_tensor_at_close_is_an_error_and_leaves_no_file(tmp_path: Path) -> None:
    tensors = {f"w{i}": filled((4, 4), torch.float32, seed=i) for i in range(3)}
    writer = TorchZipWriter(tmp_path / "model.pt", {k: slot_of(k, v) for k, v in tensors.items()})
    writer.write("w0", tensors["w0"])
    writer.write("w2", tensors["w2"])
    assert (tmp_path / "model.pt").exists() and not writer.done
    with pytest.raises(ValueError, match=r"model.pt: closed before every tensor was written \(missing: w1\)"):
        writer.close()
    assert not (tmp_path / "model.pt").exists()
    with pytest.raises(ValueError, match="already closed"):
        writer.write("w1", tensors["w1"])


def test_bad_writes_are_refused(tmp_path: Path) -> None:
    writer = TorchZipWriter(tmp_path / "model.pt", {"w": slot_of("w", torch.zeros(2, 3))})
    with pytest.raises(ValueError, match="'v' is not a slot of the template"):
        writer.write("v", torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"w: announced \(2, 3\) F32, got \(3, 2\) F32"):
        writer.write("w", torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"w: announced \(2, 3\) F32, got \(2, 3\) F16"):
        writer.write("w", torch.zeros(2, 3, dtype=torch.half))
    with pytest.raises(ValueError, match="two slots of the template are written as 'w'"):
        TorchZipWriter(tmp_path / "x.pt", [slot_of("w", torch.zeros(1)), slot_of("w", torch.zeros(1))])
    assert not (tmp_path / "model.pt").exists()


def test_a_template_without_tensors_is_written_at_close(tmp_path: Path) -> None:
    ref, ours = save_both(tmp_path, lambda leaf: {"iteration": 3, "args": argparse.Namespace(x=1)})
    assert_same_bytes(ref, ours)


@pytest.mark.parametrize("name", ["mp_rank_00_model_states.pt", "weights", "a.b.pt", "caf\u00e9.pt"])
def test_archive_names_follow_torch(tmp_path: Path, name: str) -> None:
    assert_same_bytes(*save_both(tmp_path, lambda leaf: {"w": leaf("w", torch.arange(3))}, name=name))
    assert archive_name(Path("/x/caf\u00e9/model.pt")) == "archive"


@pytest.mark.parametrize("records", [0, 1, 12, 13, 14, 28, 29, 30, 58, 59, 60, 126, 127, 128, 256, 540, 1108, 2356])
def test_serialization_id_matches_torch_across_hash_table_growth(records: int) -> None:
    """torch folds the record names in the order of a libstdc++ unordered_set, which reorders as it grows."""
    names = ["data.pkl", ".format_version", ".storage_alignment", "byteorder"] + [f"data/{i}" for i in range(records)]
    writer = torch._C.PyTorchFileWriter(io.BytesIO(), True, 64)  # torch's own writer, as the oracle
    for name in names:
        writer.write_record(name, name.encode(), len(name))
    writer.write_end_of_file()
    ours = zip_layout.layout(b"archive/", [(n, len(n)) for n in names] + [("version", 2)], 64)
    for record in ours:
        record.crc = zipfile.crc32(record.name.encode() if record.name != "version" else b"3\n")
    assert zip_layout.serialization_id(ours) == writer.serialization_id()


class _Sink:
    """A file object for torch's writer that keeps what it writes by offset and skips what it seeks over."""

    def __init__(self) -> None:
        self.position, self.parts = 0, {}

    def write(self, data: bytes) -> int:
        self.parts[self.position] = bytes(data)
        self.position += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.position += offset
        return self.position

    def flush(self) -> None:
        pass


def merged(parts: dict[int, bytes]) -> list[tuple[int, bytes]]:
    """Written pieces by offset, adjacent ones joined: the file with its skipped ranges left out."""
    runs: list[tuple[int, bytes]] = []
    for offset in sorted(parts):
        if runs and runs[-1][0] + len(runs[-1][1]) == offset:
            runs[-1] = (runs[-1][0], runs[-1][1] + parts[offset])
        elif parts[offset]:
            runs.append((offset, parts[offset]))
    return runs


def test_zip64_layout_of_records_past_4_gib_matches_torch() -> None:
    """Sizes and offsets past 4 GiB add zip64 fields and 64-bit descriptors: laid out as torch does, without
    writing 8 GB (torch's writer is asked for the big records' headers only, and skips their data)."""
    plan = [
        ("data.pkl", b"pkl"),
        ("byteorder", b"little"),
        ("data/0", 5 << 30),
        ("data/1", 4 << 30),
        ("data/2", b"xyz"),
    ]
    sink = _Sink()
    writer = torch._C.PyTorchFileWriter(sink, True, 64)
    for name, data in plan:
        if isinstance(data, int):
            writer.write_record_metadata(name, data)
        else:
            writer.write_record(name, data, len(data))
    writer.write_end_of_file()

    contents = {name: data for name, data in plan if isinstance(data, bytes)} | {"version": b"3\n"}
    sizes = [(name, data if isinstance(data, int) else len(data)) for name, data in plan] + [("version", 2)]
    records = zip_layout.layout(b"archive/", sizes, 64)
    for record in records:
        record.crc = zipfile.crc32(contents[record.name]) if record.name in contents else 0  # torch skips those CRCs
    sid = zip_layout.serialization_id(records).encode()
    last = zip_layout.local_record(b"archive/", zip_layout.SERIALIZATION_ID, len(sid), records[-1].end, 64)
    last.crc = zipfile.crc32(sid)
    contents[zip_layout.SERIALIZATION_ID] = sid
    ours = {last.end: zip_layout.directory(b"archive/", [*records, last])}
    for record in [*records, last]:
        ours[record.header_offset] = record.header
        ours[record.data_offset] = contents.get(record.name, b"")
        ours[record.data_offset + record.size] = record.descriptor()
    assert [r.name for r in records if r.zip64] == ["data/0", "data/1", "data/2", "version"]
    assert merged(ours) == merged(sink.parts)
    assert sink.position == last.end + zip_layout.directory_size(b"archive/", [*records, last])


leaves = st.builds(
    lambda shape, dtype: (tuple(shape), dtype),
    st.lists(st.integers(0, 5), max_size=3),
    st.sampled_from([torch.float32, torch.bfloat16, torch.bool, torch.float8_e5m2, torch.int64, torch.uint32]),
)
plain = st.one_of(st.none(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False), st.text(max_size=8))
templates = st.recursive(
    st.one_of(leaves, plain),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=25,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=templates, seed=st.integers(0, 2**16))
def test_random_templates_give_torch_save_bytes(
    tmp_path_factory: pytest.TempPathFactory, shape: Any, seed: int
) -> None:
    def build(leaf: Leaf) -> Any:
        numbering = iter(range(10**6))

        def walk(node: Any) -> Any:
            if isinstance(node, tuple) and len(node) == 2 and isinstance(node[1], torch.dtype):
                index = next(numbering)
                return leaf(f"t{index}", filled(node[0], node[1], seed=seed + index))
            if isinstance(node, list):
                return [walk(child) for child in node]
            if isinstance(node, dict):
                return {key: walk(child) for key, child in node.items()}
            return node

        return walk(shape)

    tmp = tmp_path_factory.mktemp("random")
    shuffle = lambda items: random.Random(seed).sample(items, len(items))  # noqa: E731
    assert_same_bytes(*save_both(tmp, build, order=shuffle, threads=3))


def test_archives_back_to_back_in_one_file_are_torch_save_to_a_stream(tmp_path: Path) -> None:
    """What DCP writes: torch.save to a file object (folder ``archive``), one archive after another in a shared file,
    each written from its own thread, offsets inside each counting from its start."""
    tensors = [filled((3, 5), torch.bfloat16, seed=1), filled((2, 7, 4), torch.float32, seed=2)]
    expected = []
    for tensor in tensors:
        buffer = io.BytesIO()
        torch.save(tensor, buffer)
        expected.append(buffer.getvalue())
    writers = [TorchZipWriter(tmp_path / f"t{i}", slot_of("t", t), archive="archive") for i, t in enumerate(tensors)]
    assert [w.size for w in writers] == [len(e) for e in expected]
    shared = direct_io.DirectFile(tmp_path / "__0_0.distcp", 100 + sum(len(e) for e in expected))
    bases = [100, 100 + len(expected[0])]
    archives = [
        TorchZipWriter(tmp_path / "unused", slot_of("t", t), archive="archive", region=torch_zip.Region(shared, base))
        for t, base in zip(tensors, bases, strict=True)
    ]
    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(a.write, "t", t) for a, t in zip(archives, tensors, strict=True)]:
            future.result()
    shared.close()
    data = (tmp_path / "__0_0.distcp").read_bytes()
    assert data[100:] == b"".join(expected) and not (tmp_path / "unused").exists()
