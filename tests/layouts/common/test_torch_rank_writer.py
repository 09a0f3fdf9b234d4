"""Megatron and SAT rank files, streamed tensor by tensor from the worker threads, are the bytes
``torch.save`` writes for what they hold, whatever the number of jobs."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from fixtures.megatron import TINY, full_model, write_megatron
from fixtures.sat import full_tensors, sat_config, write_sat

from reshard.formats.readers import load_torch_file
from reshard.layouts.megatron.args import PICKLE_MODULE, SAFE_GLOBALS


@pytest.fixture(scope="module")
def megatron_tp8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_megatron(tmp_path_factory.mktemp("megatron") / "tp8", full_model(TINY), 8)


@pytest.fixture(scope="module")
def sat_tp8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sat") / "tp8"
    cfg = sat_config()
    write_sat(root, cfg, full_tensors(cfg, torch.bfloat16), 8)
    return root


def assert_torch_save_bytes(path: Path, tmp_path: Path, pickle_module: object) -> None:
    """Load the file as reshard reads sources and ``torch.save`` it again: the same bytes come out."""
    obj = load_torch_file(path, trust_pickle=False, notes=[], allowed=SAFE_GLOBALS)
    again = tmp_path / "again" / path.parent.name / path.name  # the same file name: the same archive name
    again.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, again, pickle_module=pickle_module)
    assert path.read_bytes() == again.read_bytes(), path


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_rank_files_are_torch_save_files(cli, megatron_tp8: Path, tmp_path: Path, tp: int) -> None:
    outputs = []
    for jobs in (1, 4):
        out = tmp_path / f"tp{tp}-jobs{jobs}"
        assert (
            cli("convert", megatron_tp8, "--tp", tp, "--vocab", TINY.vocab, "--jobs", jobs, "-o", out, "-q").exit_code
            == 0
        )
        outputs.append(sorted(out.rglob("model_optim_rng.pt")))
        assert not list(out.rglob("*.safetensors")), "nothing is spooled"
    for one, other in zip(*outputs, strict=True):
        assert one.read_bytes() == other.read_bytes()
    for path in outputs[1]:
        assert_torch_save_bytes(path, tmp_path, PICKLE_MODULE)


def test_sat_rank_files_are_torch_save_files(cli, sat_tp8: Path, tmp_path: Path) -> None:
    out = tmp_path / "tp2"
    assert cli("convert", sat_tp8, "--tp", 2, "--layout", "sat", "--jobs", 4, "-o", out, "-q").exit_code == 0
    files = sorted(out.rglob("mp_rank_*_model_states.pt"))
    assert [f.name for f in files] == ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    for path in files:
        assert_torch_save_bytes(path, tmp_path, pickle)


def test_megatron_rank_files_are_streamed_as_byte_ranges(
    cli, megatron_tp8: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every tensor of a Megatron conversion goes out as the byte ranges of a stream, never as a whole slice in
    memory, and the files are still torch.save's (their records' CRC-32s joined from the ranges')."""
    from reshard.formats.torch_zip.writer import TorchZipWriter

    wholes, parts = [], []
    write, write_part = TorchZipWriter.write, TorchZipWriter.write_part
    monkeypatch.setattr(
        TorchZipWriter, "write", lambda self, key, tensor: (wholes.append(key), write(self, key, tensor))
    )
    monkeypatch.setattr(
        TorchZipWriter,
        "write_part",
        lambda self, key, views, start: (parts.append(key), write_part(self, key, views, start)),
    )
    out = tmp_path / "tp4"
    assert cli("convert", megatron_tp8, "--tp", 4, "--vocab", TINY.vocab, "-o", out, "-q").exit_code == 0
    held = load_torch_file(sorted(out.rglob("model_optim_rng.pt"))[0], trust_pickle=False, notes=[],
                           allowed=SAFE_GLOBALS)["model"]  # fmt: skip
    resharded = {key for key, value in held.items() if isinstance(value, torch.Tensor)}
    tensors = {key for key in resharded if not key.endswith("._extra_state")}  # carried in the template
    assert not wholes and set(parts) == tensors
    for path in sorted(out.rglob("model_optim_rng.pt")):
        assert_torch_save_bytes(path, tmp_path, PICKLE_MODULE)
