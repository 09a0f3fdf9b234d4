"""``formats/torch_zip/structure``: what ``torch.save`` pickles beside plain tensors, read without running it."""

from __future__ import annotations

import os
import pickletools
import zipfile
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from reshard.formats.torch_zip.structure import Inert, TensorRecord, data_start, read_structure


def saved(tmp_path: Path, obj: object) -> tuple[Path, bytes]:
    file = tmp_path / "saved.pt"
    torch.save(obj, file)
    with zipfile.ZipFile(file) as archive:
        return file, archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))


def test_sizes_and_tensors_with_attributes(tmp_path):
    """``torch.Size`` (DeepSpeed's ``param_shapes``) is a tuple; a tensor with Python attributes (ZeRO-3's flat groups
    carry ``ds_id``, pickled through ``_rebuild_from_type_v2``) is the record of its bytes, found in the file."""
    tagged = torch.arange(12, dtype=torch.float32)[2:]
    tagged.ds_id = "0_6"
    file, data = saved(tmp_path, {"shape": torch.Size([3, 4]), "flat": tagged})
    assert "_rebuild_from_type_v2" in "".join(str(arg) for _, arg, _ in pickletools.genops(data))
    found = read_structure(data)
    assert found["shape"] == (3, 4) and type(found["shape"]) is tuple
    record = found["flat"]
    assert isinstance(record, TensorRecord) and (record.sizes, record.dtype, record.offset) == ((10,), "float32", 2)
    with zipfile.ZipFile(file) as archive, file.open("rb") as handle:
        info = next(i for i in archive.infolist() if i.filename.endswith(f"/data/{record.storage.key}"))
        start = data_start(handle.fileno(), info) + record.offset * record.itemsize
        stored = os.pread(handle.fileno(), 10 * record.itemsize, start)
    assert torch.equal(torch.frombuffer(bytearray(stored), dtype=torch.float32), tagged)


def test_a_refusal_may_tolerate_a_global(tmp_path):
    """``refuse`` returning None lets that global through as an inert object; an error it returns is raised."""
    _, data = saved(tmp_path, {"args": Namespace(lr=0.1), "w": torch.ones(2)})
    found = read_structure(data, refuse=lambda module, name: None)
    assert isinstance(found["args"], Inert) and isinstance(found["w"], TensorRecord)
    with pytest.raises(ValueError, match="argparse.Namespace"):
        read_structure(data, refuse=lambda module, name: ValueError(f"{module}.{name}"))
