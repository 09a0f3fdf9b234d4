"""Property-based damage: safetensors headers and DCP metadata mutated by hypothesis.

* reshard's header check accepts exactly what the ``safetensors`` library accepts (its own ``safe_open``);
* whatever the mutation, ``inspect`` and ``convert`` (and ``verify`` for DCP) exit 0 or 2, with no traceback,
  one error line naming the file, nothing left behind, the input unchanged.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from bases import copy_base
from damage import rewrite_header, rewrite_metadata, split_safetensors, storage_of
from harness import Workspace, clear_outputs, judge, run, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError, safe_open

from reshard.errors import CorruptFileError
from reshard.formats.safetensors.header import read_header

SETTINGS = settings(
    max_examples=int(__import__("os").environ.get("RESHARD_HYPOTHESIS_EXAMPLES", "60")),
    deadline=None,
    derandomize=__import__("os").environ.get("RESHARD_HYPOTHESIS_EXAMPLES") is None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
CODES = st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "C64", "F64", "X9", "f32", ""])
SIZES = st.integers(-3, 70)


@st.composite
def header_mutations(draw, names: list[str]) -> list[tuple]:
    """A few changes to a header: a field set to any JSON, a shape, offsets, a dtype, the metadata, a name."""
    changes = []
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(names))
        kind = draw(st.sampled_from(["field", "shape", "offsets", "dtype", "metadata", "drop", "add", "swap"]))
        if kind == "field":
            changes.append((kind, name, draw(st.sampled_from(["dtype", "shape", "data_offsets"])), draw(JSON)))
        elif kind == "shape":
            changes.append((kind, name, draw(st.lists(SIZES, max_size=3))))
        elif kind == "offsets":
            changes.append((kind, name, draw(st.lists(st.integers(-300, 300), min_size=2, max_size=2))))
        elif kind == "dtype":
            changes.append((kind, name, draw(CODES)))
        elif kind == "metadata":
            changes.append((kind, draw(JSON)))
        elif kind == "swap":
            changes.append((kind, name, draw(st.sampled_from(names))))
        else:
            changes.append((kind, name, draw(JSON)))
    return changes


def apply(header: dict, changes: list[tuple]) -> dict:
    for change in changes:
        kind, *rest = change
        entry = header.get(rest[0]) if kind not in ("metadata",) else None
        if kind == "field" and isinstance(entry, dict):
            entry[rest[1]] = rest[2]
        elif kind == "shape" and isinstance(entry, dict):
            entry["shape"] = rest[1]
        elif kind == "offsets" and isinstance(entry, dict):
            old = entry.get("data_offsets")
            pair = isinstance(old, list) and len(old) == 2 and all(type(o) is int for o in old)
            entry["data_offsets"] = [old[0] + rest[1][0], old[1] + rest[1][1]] if pair else rest[1]
        elif kind == "dtype" and isinstance(entry, dict):
            entry["dtype"] = rest[1]
        elif kind == "metadata":
            header["__metadata__"] = rest[0]
        elif kind == "drop":
            header.pop(rest[0], None)
        elif kind == "add":
            header[f"extra.{len(header)}"] = rest[1]
        elif kind == "swap" and isinstance(entry, dict) and isinstance(header.get(rest[1]), dict):
            entry["data_offsets"], header[rest[1]]["data_offsets"] = (
                header[rest[1]].get("data_offsets"),
                entry.get("data_offsets"),
            )
    return header


def small_file(path: Path) -> None:
    """Three tensors of three dtypes, as safetensors writes them."""
    from safetensors.torch import save_file

    save_file(
        {"a": torch.arange(6.0).reshape(2, 3), "b": torch.arange(4), "c": torch.arange(5.0).bfloat16()},
        path,
        metadata={"format": "pt"},
    )


def library_accepts(path: Path) -> bool:
    try:
        with safe_open(path, framework="pt") as handle:
            handle.keys()
        return True
    except (SafetensorError, OSError, ValueError):
        return False


def reshard_accepts(path: Path) -> bool:
    try:
        read_header(path)
        return True
    except CorruptFileError:
        return False


@SETTINGS
@given(changes=header_mutations(["a", "b", "c", "__metadata__"]), extra=st.integers(-8, 8))
def test_header_check_agrees_with_the_safetensors_library(tmp_path_factory, changes, extra) -> None:
    path = tmp_path_factory.mktemp("st") / "x.safetensors"
    small_file(path)
    header, data = split_safetensors(path)
    header = apply(header, changes)
    data = data[: len(data) + extra] if extra < 0 else data + bytes(extra)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    assert reshard_accepts(path) == library_accepts(path), (header, len(data))


@pytest.fixture
def workspace(bases, tmp_path_factory):
    def make(base: str) -> Workspace:
        ws = Workspace(tmp_path_factory.mktemp(base))
        copy_base(bases[base], ws.ckpt)
        return ws

    return make


def promises(ws: Workspace, commands: list[tuple[str, list[str]]], name: str) -> list[str]:
    before = snapshot(ws.ckpt)
    broken = []
    for command, extra in commands:
        outcome = run(command, ws.ckpt, extra, ws)
        expected = 0 if outcome.exit_code == 0 else 2
        broken += judge(outcome, ws, before, exit_code=expected, names=[name] if expected else [], several=True)
        clear_outputs(ws)
    shutil.rmtree(ws.root)
    return broken


NAMES = ["lm_head.weight", "model.norm.weight", "model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"]


@SETTINGS
@given(changes=header_mutations([*NAMES, "__metadata__"]))
def test_mutated_headers_keep_every_promise(workspace, changes) -> None:
    ws = workspace("hf")
    rewrite_header(ws.ckpt / "model.safetensors", lambda header: apply(header, changes))
    assert promises(ws, [("inspect", []), ("convert", ["--tp", "2"])], "ckpt") == []


EMBED = "model.embed_tokens.weight"
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.complex128, torch.float8_e4m3fn, torch.bool]


@st.composite
def metadata_mutations(draw) -> list[tuple]:
    changes = []
    for _ in range(draw(st.integers(1, 3))):
        fqn = draw(st.sampled_from([EMBED, "model.norm.weight", "lm_head.weight"]))
        kind = draw(st.sampled_from(["offsets", "sizes", "size", "storage", "path", "dtype", "drop", "twice"]))
        if kind in ("offsets", "sizes", "size"):
            changes.append((kind, fqn, draw(st.lists(st.integers(-2, 1100), max_size=3))))
        elif kind == "storage":
            changes.append((kind, fqn, draw(st.integers(-5, 1 << 21)), draw(st.integers(-5, 1 << 21))))
        elif kind == "path":
            changes.append((kind, fqn, draw(st.sampled_from(["__0_0.distcp", "../x", "", "missing.distcp", "a/b"]))))
        elif kind == "dtype":
            changes.append((kind, fqn, draw(st.sampled_from(DTYPES))))
        else:
            changes.append((kind, fqn))
    return changes


def damage_metadata(metadata, changes: list[tuple]) -> None:
    for kind, fqn, *values in changes:
        entry = metadata.state_dict_metadata.get(fqn)
        if entry is None:
            continue
        if kind == "offsets" and entry.chunks:
            entry.chunks[0].offsets = torch.Size(values[0])
        elif kind == "sizes" and entry.chunks:
            entry.chunks[0].sizes = torch.Size(values[0])
        elif kind == "size":
            entry.size = torch.Size(values[0])
        elif kind in ("storage", "path") and not any(key.fqn == fqn for key in metadata.storage_data):
            continue
        elif kind == "storage":
            _, info = storage_of(metadata, fqn)
            info.offset, info.length = values
        elif kind == "path":
            storage_of(metadata, fqn)[1].relative_path = values[0]
        elif kind == "dtype":
            entry.properties.dtype = values[0]
        elif kind == "drop" and any(key.fqn == fqn for key in metadata.storage_data):
            del metadata.storage_data[storage_of(metadata, fqn)[0]]
        elif kind == "twice" and entry.chunks:
            entry.chunks.append(entry.chunks[0])


@SETTINGS
@given(changes=metadata_mutations())
def test_mutated_dcp_metadata_keeps_every_promise(workspace, changes) -> None:
    ws = workspace("dcp")
    rewrite_metadata(ws.ckpt, lambda metadata: damage_metadata(metadata, changes))
    commands = [("inspect", []), ("convert", ["--tp", "2"]), ("verify", ["--roundtrip", "2"])]
    assert promises(ws, commands, "ckpt") == []
