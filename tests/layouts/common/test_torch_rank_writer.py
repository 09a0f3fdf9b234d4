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


def test_safetensors_writers_take_byte_parts_and_torch_rank_files_do_not() -> None:
    """The stream writes byte ranges only into a writer whose every rank writer is a PartsWriter (a torch zip
    record's CRC-32 needs the whole slice)."""
    from reshard.formats.safetensors.writer import SafetensorsFileWriter, ShardedSafetensorsWriter
    from reshard.layouts.base import PartsWriter
    from reshard.layouts.common.torch_rank_writer import _RankFiles

    assert issubclass(SafetensorsFileWriter, PartsWriter)
    assert issubclass(ShardedSafetensorsWriter, PartsWriter)
    assert not issubclass(_RankFiles, PartsWriter)
