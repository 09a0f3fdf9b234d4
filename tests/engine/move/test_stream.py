"""``reshard.engine.move.stream``: units streamed through a small buffer write the bytes, digests and finite flags the
gather writes, and a flipped bit in what they wrote still fails ``verify``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from fixtures import SAMPLES
from safetensors.torch import load_file, save_file

from reshard import ConvertOptions, convert
from reshard.engine.move import execute
from reshard.engine.move import stream as engine_stream
from reshard.engine.move.digest import digest_of
from reshard.engine.move.gather import gather_canonical
from reshard.engine.move.stream import canonical_digest
from reshard.engine.plan.open import open_checkpoint
from reshard.io.direct import in_memory
from reshard.options import ReadOptions

TP2 = SAMPLES / "tiny-llama-tp2"
Q = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture
def streamed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every file counts as in memory, blocks are small and odd-sized (they cross every slice's edges); the names
    of the units streamed are recorded."""
    names: list[str] = []
    real = engine_stream.stream

    def recording(work, *args, **kwargs):
        names.append(work.tensor.targets[0].name)
        return real(work, *args, **kwargs)

    monkeypatch.setattr(engine_stream, "in_memory", lambda path: True)
    monkeypatch.setattr(engine_stream, "BLOCK_BYTES", 3 * 1028)
    monkeypatch.setattr(execute, "stream", recording)
    return names


def _convert(source: Path, out: Path, tp: int) -> dict:
    convert(source, out, ConvertOptions(tp=tp, progress=False))
    return json.loads((out / "reshard.json").read_text())["tensors"]


def _gathered(source: Path, out: Path, tp: int) -> dict:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(execute, "streams_to", lambda writer: False)
        return _convert(source, out, tp)


def _same_files(a: Path, b: Path) -> None:
    files = sorted(p.relative_to(a) for p in a.rglob("*.safetensors"))
    assert files and files == sorted(p.relative_to(b) for p in b.rglob("*.safetensors"))
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize(
    ("sample", "tp"),
    [("tiny-llama-tp2", 1), ("tiny-llama-tp2", 2), ("tiny-llama-tp2", 4), ("tiny-llama-65535-tp2", 1)],
)
def test_streamed_units_write_what_the_gather_writes(
    streamed: list[str], tmp_path: Path, sample: str, tp: int
) -> None:
    source = SAMPLES / sample
    manifest = _convert(source, tmp_path / "streamed", tp)
    assert "model.layers.0.self_attn.q_proj.weight" in streamed  # column-parallel: runs of rank slices
    assert "model.layers.0.self_attn.o_proj.weight" in streamed  # row-parallel: blocks of rows
    assert "model.layers.0.input_layernorm.weight" in streamed  # two copies: compared block by block
    if tp == 1:
        assert "model.embed_tokens.weight" in streamed  # the source's pad rows left out
    assert manifest == _gathered(source, tmp_path / "gathered", tp)
    _same_files(tmp_path / "streamed", tmp_path / "gathered")


def test_one_copy_of_a_replicated_tensor_is_streamed_to_every_rank(streamed: list[str], tmp_path: Path) -> None:
    _gathered(TP2, tmp_path / "tp1", 1)
    manifest = _convert(tmp_path / "tp1", tmp_path / "streamed", 2)
    assert "model.norm.weight" in streamed
    assert manifest == _gathered(tmp_path / "tp1", tmp_path / "gathered", 2)
    _same_files(tmp_path / "streamed", tmp_path / "gathered")
    norm = load_file(tmp_path / "tp1" / "model.safetensors")["model.norm.weight"]
    for rank in range(2):
        assert torch.equal(
            load_file(tmp_path / "streamed" / f"rank_{rank:02d}" / "model.safetensors")["model.norm.weight"], norm
        )


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_value_past_the_first_block_is_found(streamed: list[str], tmp_path: Path, value: float) -> None:
    source = Path(shutil.copytree(TP2, tmp_path / "source"))
    path = source / "rank_01" / "model.safetensors"
    state = load_file(path)
    state[Q][-1, -1] = value  # the last value of the canonical tensor: many blocks after the first
    save_file(state, path, metadata={"format": "pt"})
    manifest = _convert(source, tmp_path / "streamed", 1)
    assert Q in streamed
    assert [name for name, entry in manifest.items() if not entry["finite"]] == [Q]
    assert manifest == _gathered(source, tmp_path / "gathered", 1)


def test_a_flipped_bit_in_a_streamed_tensor_fails_verify(cli, streamed: list[str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    _convert(TP2, out, 1)
    assert Q in streamed
    assert cli("verify", out).exit_code == 0
    path = out / "model.safetensors"
    raw = bytearray(path.read_bytes())
    length = int.from_bytes(raw[:8], "little")
    start = 8 + length + json.loads(raw[8 : 8 + length])[Q]["data_offsets"][0]
    raw[start + 4097] ^= 0x01
    path.write_bytes(bytes(raw))
    result = cli("verify", out, "--json")
    assert result.exit_code == 1
    assert {d["tensor"] for c in json.loads(result.stdout)["checks"] for d in c["differences"]} == {Q}


@pytest.mark.parametrize("allow", [False, True])
def test_copies_that_differ_are_found_as_the_gather_finds_them(
    cli, streamed: list[str], tmp_path: Path, allow: bool
) -> None:
    source = Path(shutil.copytree(TP2, tmp_path / "source"))
    path = source / "rank_01" / "model.safetensors"
    state = load_file(path)
    state["model.norm.weight"][-1] += 1
    save_file(state, path, metadata={"format": "pt"})
    flag = ["--allow-divergent-replicas"] if allow else []
    done = cli("convert", source, "--tp", 1, "-o", tmp_path / "streamed", "-q", *flag)
    assert "model.norm.weight" in streamed
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(execute, "streams_to", lambda writer: False)
        gathered = cli("convert", source, "--tp", 1, "-o", tmp_path / "gathered", "-q", *flag)
    assert (done.exit_code, done.output) == (gathered.exit_code, gathered.output)
    if not allow:
        assert done.exit_code == 2 and "model.norm.weight" in done.output and "rank 0 and rank 1" in done.output
        assert not (tmp_path / "streamed").exists()
        return
    manifest = json.loads((tmp_path / "streamed" / "reshard.json").read_text())
    assert manifest["tensors"]["model.norm.weight"]["divergent"]
    assert manifest["tensors"] == json.loads((tmp_path / "gathered" / "reshard.json").read_text())["tensors"]
    _same_files(tmp_path / "streamed", tmp_path / "gathered")


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_verify_streams_the_digest_the_gather_gives(tmp_path: Path, tp: int, algorithm: str) -> None:
    manifest = _convert(TP2, tmp_path / "out", tp)
    opened = open_checkpoint(tmp_path / "out", ReadOptions(), target_tp=1, recorded_plan=True)
    streamed = 0
    for tensor in opened.tensors:
        got = canonical_digest(tensor, finite=True, algorithm=algorithm)
        if got is None:
            continue
        streamed += 1
        whole = gather_canonical(tensor)
        assert got == (digest_of(whole, algorithm), manifest[tensor.name]["finite"]), tensor.name
        if algorithm == "blake3":
            assert got[0] == f"blake3:{manifest[tensor.name]['blake3']}"
    assert streamed == len(opened.tensors)  # every tensor of a bf16 Llama: runs, blocks of rows, copies, pad rows


def test_a_flipped_bit_in_one_ranks_row_parallel_slice_fails_verify(cli, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _convert(TP2, out, 2)
    name = "model.layers.1.self_attn.o_proj.weight"
    path = out / "rank_01" / "model.safetensors"
    raw = bytearray(path.read_bytes())
    length = int.from_bytes(raw[:8], "little")
    raw[8 + length + json.loads(raw[8 : 8 + length])[name]["data_offsets"][1] - 3] ^= 0x10
    path.write_bytes(bytes(raw))
    result = cli("verify", out, "--json")
    assert result.exit_code == 1
    checks = {c["check"]: c for c in json.loads(result.stdout)["checks"]}
    assert [(d["kind"], d["tensor"]) for d in checks["manifest"]["differences"]] == [("blake3", name)]


MODULES_AFTER = """
import json, sys
from reshard.cli.main import main
sys.argv = ["reshard", *sys.argv[1:]]
try:
    main()
except SystemExit as done:
    code = done.code or 0
print(json.dumps([code, sorted(name for name in sys.modules if name.split(".")[0] == "torch")]))
"""


def _modules_after(*args: object) -> tuple[int, list[str]]:
    """The exit code of a ``reshard`` command run in a fresh interpreter, and the torch modules it imported."""
    done = subprocess.run(
        [sys.executable, "-c", MODULES_AFTER, *map(str, args)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    code, imported = json.loads(done.stdout.splitlines()[-1])
    return code, imported


@pytest.mark.parametrize("target", [["--tp", "1"], ["--tp", "4"], ["--tp", "1", "--dtype", "bfloat16"]])
def test_a_conversion_that_only_moves_bytes_never_imports_torch(tmp_path: Path, target: list[str]) -> None:
    """On a disk, without any patching: when every unit streams, torch is not imported (its import costs more
    than moving a small model's bytes); a cast needs it. The bytes are the gather's."""
    out = tmp_path / "out"
    code, imported = _modules_after("convert", TP2, *target, "-o", out, "-q")
    assert code == 0
    assert bool(imported) == ("--dtype" in target), imported[:5]
    options = ConvertOptions(tp=int(target[1]), dtype="bfloat16" if "--dtype" in target else None, progress=False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(execute, "streams_to", lambda writer: False)
        convert(TP2, tmp_path / "gathered", options)
    _same_files(out, tmp_path / "gathered")


@pytest.mark.parametrize("tp", [1, 2])
def test_verify_of_an_output_that_streams_never_imports_torch(tmp_path: Path, tp: int) -> None:
    """The manifest's digests stream, each rank's slice is its piece by the numbers or a copy compared block by block:
    no byte needs torch. A flipped bit is still found, and the error's max difference then imports it."""
    out = tmp_path / "out"
    _convert(TP2, out, tp)
    assert _modules_after("verify", out, "-q") == (0, [])
    path = out / ("model.safetensors" if tp == 1 else "rank_01/model.safetensors")
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x01
    path.write_bytes(bytes(raw))
    code, _ = _modules_after("verify", out, "-q")
    assert code == 1


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_a_conversion_in_tmpfs_streams_by_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without any patching: a source and an output in tmpfs take the streamed path."""
    root = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        if not in_memory(root):
            pytest.skip(f"{root} is not in memory")
        names: list[str] = []
        real = engine_stream.stream
        monkeypatch.setattr(
            execute, "stream", lambda work, *a, **k: names.append(work.tensor.name) or real(work, *a, **k)
        )
        source = Path(shutil.copytree(TP2, root / "source"))
        manifest = _convert(source, root / "out", 1)
        assert len(names) == 21  # every tensor, the 5 norms too (the copies of each rank compared as they stream)
        assert manifest == _gathered(TP2, root / "gathered", 1)
        _same_files(root / "out", root / "gathered")
    finally:
        shutil.rmtree(root)
