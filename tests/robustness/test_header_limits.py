"""The safetensors header limits that protect the parser itself: size, nesting, time."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest

from reshard.errors import CorruptFileError
from reshard.formats.safetensors.header import MAX_HEADER, read_header


def write(path: Path, header: bytes, data: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


@pytest.mark.parametrize("depth", [9, 1000, 200_000])
def test_deep_nesting_is_refused_before_parsing(tmp_path: Path, depth: int) -> None:
    path = write(tmp_path / "x.safetensors", b'{"a": ' + b"[" * depth + b"]" * depth + b"}")
    with pytest.raises(CorruptFileError, match="nests deeper than 8 levels"):
        read_header(path)


def test_nesting_inside_strings_is_not_nesting(tmp_path: Path) -> None:
    text = (
        b'{"__metadata__": {"k": "'
        + b"[{" * 500
        + b'\\"]"}, "t": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}'
    )
    entries, metadata = read_header(write(tmp_path / "x.safetensors", text, b"ab"))
    assert list(entries) == ["t"] and metadata["k"].startswith("[{[{")


def test_a_huge_unbalanced_header_is_refused_in_bounded_time(tmp_path: Path) -> None:
    path = write(tmp_path / "x.safetensors", b"[" * 30_000_000)
    start = time.monotonic()
    with pytest.raises(CorruptFileError, match="nests deeper"):
        read_header(path)
    assert time.monotonic() - start < 5


def test_a_header_over_the_limit_is_refused_without_reading_it(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", MAX_HEADER + 1) + b"{}")
    with pytest.raises(CorruptFileError, match=f"header too large \\({MAX_HEADER + 1} bytes announced"):
        read_header(path)


@pytest.mark.parametrize("size", [1 << 62, 1 << 40, 7_959_382_690_968_147_026])
def test_a_pickle_claiming_a_huge_bytearray_is_one_line(tmp_path: Path, capfd, cli, size: int) -> None:
    """CPython's C unpickler prints a SystemError on stderr when a BYTEARRAY8 it cannot allocate is freed;
    reshard reads such data with the pure unpickler, which refuses the opcode."""
    ckpt = tmp_path / "dcp"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(b"\x80\x04\x96" + struct.pack("<Q", size) + b"\x00" * 16)
    result = cli("inspect", ckpt)
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
    assert ".metadata: cannot read DCP metadata: a bytearray (BYTEARRAY8) is not part of this format" in result.stderr
    assert "SystemError" not in capfd.readouterr().err
