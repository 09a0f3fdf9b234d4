"""``reshard.formats.dcp_metadata.write``: the ``.metadata`` pickle is byte for byte what ``pickle.dump`` writes for
the real ``torch.distributed.checkpoint`` objects, and torch's own reader loads it; writing it imports no torch."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint import metadata as dcp_md

from reshard.formats.dcp_metadata import write as w
from reshard.formats.dcp_metadata.read import read_index


def real(obj: Any, memo: dict[int, Any] | None = None) -> Any:
    """The same object graph made of torch's classes (shared objects stay shared, strings stay the same objects)."""
    memo = {} if memo is None else memo
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, w.Size):
        out: Any = torch.Size(obj)
    elif isinstance(obj, type) and obj in w._DTYPES.values():
        out = getattr(torch, obj.__name__)
    elif obj is None or isinstance(obj, (str, int, float, bool)):
        out = obj
    elif type(obj) is dict:
        out = {real(k, memo): real(v, memo) for k, v in obj.items()}
    elif type(obj) is list:
        out = [real(v, memo) for v in obj]
    elif isinstance(obj, w.MetadataIndex):
        out = dcp_md.MetadataIndex(obj.fqn, real(getattr(obj, "offset", None), memo), obj.index)
    elif isinstance(obj, w.StorageInfo):
        out = dcp_fs._StorageInfo(obj.relative_path, obj.offset, obj.length, obj.transform_descriptors)
    elif isinstance(obj, w.TensorProperties):
        assert (obj.layout, obj.memory_format) == (w.STRIDED, w.CONTIGUOUS)
        out = dcp_md.TensorProperties(
            real(obj.dtype, memo), requires_grad=obj.requires_grad, pin_memory=obj.pin_memory
        )
    else:
        out = getattr(dcp_md, type(obj).__name__)(**{k: real(v, memo) for k, v in vars(obj).items()})
    memo[id(obj)] = out
    return out


def metadata(tensors: int, layers: int, objects: int) -> w.Metadata:
    """``tensors`` stacked tensors of ``layers`` chunks each (dtypes alternating) and ``objects`` byte entries."""
    entries = []
    for t in range(tensors):
        chunks = [
            w.StoredChunk((i, 0, 0), (1, 4, 8 + t), f"__0_{t % 2}.distcp", 1000 * i + t, 777 + t)
            for i in range(layers)
        ]
        entries.append(
            (f"decoder.layers.t{t}.weight", ("bfloat16", "float32", "int64")[t % 3], (layers, 4, 8 + t), chunks)
        )
    return w.build_metadata(
        entries, [(f"m.{i}._extra_state/shard_{i}_{objects}", "__0_0.distcp", 13 * i, 900) for i in range(objects)]
    )


# Sizes around pickle's batches of 1000 (the C pickler's lists and dicts differ from the pure-Python one there).
@pytest.mark.parametrize(
    ("tensors", "layers", "objects"),
    [(1, 1, 0), (3, 4, 2), (2, 1000, 1), (1, 1001, 999), (998, 1, 2), (1000, 1, 1), (5, 2000, 2001)],
)
def test_the_bytes_are_those_pickle_writes_for_torch_s_classes(tensors: int, layers: int, objects: int) -> None:
    md = metadata(tensors, layers, objects)
    assert w.dumps(md) == pickle.dumps(real(md), protocol=4)


def test_torch_and_reshard_read_it(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(w.dumps(metadata(3, 4, 2)))
    md = FileSystemReader(tmp_path).read_metadata()
    assert type(md) is dcp_md.Metadata and md.version == "1.0.0" and md.planner_data is None
    entry = md.state_dict_metadata["decoder.layers.t1.weight"]
    assert entry.size == torch.Size([4, 4, 9]) and entry.properties.dtype == torch.float32
    assert entry.properties.memory_format == torch.contiguous_format and entry.properties.layout == torch.strided
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks] == [((i, 0, 0), (1, 4, 9)) for i in range(4)]
    info = md.storage_data[dcp_md.MetadataIndex("decoder.layers.t1.weight", (2, 0, 0))]
    assert (info.relative_path, info.offset, info.length, info.transform_descriptors) == (
        "__0_1.distcp",
        2001,
        778,
        None,
    )
    assert isinstance(md.state_dict_metadata["m.1._extra_state/shard_1_2"], dcp_md.BytesStorageMetadata)
    assert md.storage_data[dcp_md.MetadataIndex("m.1._extra_state/shard_1_2")].offset == 13
    assert (md.storage_meta.checkpoint_id, md.storage_meta.save_id, md.storage_meta.modules) == (None, None, [])
    index = read_index(tmp_path)  # reshard's restricted unpickler admits it too
    assert (
        index.tensors["decoder.layers.t2.weight"].dtype == "int64"
        and index.values["m.0._extra_state/shard_0_2"] == 900
    )


def test_writing_it_imports_no_torch() -> None:
    code = (
        "import sys; from reshard.formats.dcp_metadata import write as w; "
        "w.dumps(w.build_metadata([('a', 'bfloat16', (2, 3), [w.StoredChunk((0, 0), (2, 3), 'f', 0, 9)])], [])); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
