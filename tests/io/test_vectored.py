"""``reshard.io.vectored``: vectored reads and writes resume after short calls; strided rows are written in place."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fixtures.tp import arange

from reshard.io import vectored
from reshard.io.vectored import MIN_ROW_BYTES, row_views


def test_short_writes_and_reads_resume_where_they_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = [memoryview(bytes(range(i, i + 7))) for i in range(0, 70, 7)]
    real_pwritev, real_preadv = os.pwritev, os.preadv

    def three_a_call(fd, views, pos):
        return real_pwritev(fd, [views[0][:3]], pos)

    monkeypatch.setattr(vectored.os, "pwritev", three_a_call)
    path = tmp_path / "f"
    with path.open("wb", buffering=0) as handle:
        handle.write(b"head")
        vectored.pwrite_all(handle.fileno(), data, 4)
    assert path.read_bytes() == b"head" + b"".join(bytes(d) for d in data)

    calls: list[int] = []
    monkeypatch.setattr(vectored, "WRITE_BYTES", 10)  # views are split and batched to at most 10 bytes a call

    def counted(fd, views, pos):
        calls.append(sum(map(len, views)))
        return real_pwritev(fd, views, pos)

    monkeypatch.setattr(vectored.os, "pwritev", counted)
    with path.open("wb", buffering=0) as handle:
        vectored.pwrite_all(handle.fileno(), data, 0)
    assert path.read_bytes() == b"".join(bytes(d) for d in data)
    assert max(calls) <= 10 and sum(calls) == 70

    monkeypatch.setattr(vectored.os, "preadv", lambda fd, views, pos: real_preadv(fd, [views[0][:5]], pos))
    out = [memoryview(bytearray(7)) for _ in range(10)]
    with path.open("rb") as handle:
        assert vectored.read_all(handle.fileno(), out, 0)
        assert b"".join(bytes(o) for o in out) == path.read_bytes()
        assert not vectored.read_all(handle.fileno(), [memoryview(bytearray(8))], 66)  # the file ends


def test_row_views_are_the_strided_rows_without_a_copy() -> None:
    full = arange((4, 4 * MIN_ROW_BYTES // 4))  # float32 rows of 4 x MIN_ROW_BYTES
    block = full[:, MIN_ROW_BYTES // 4 : 3 * MIN_ROW_BYTES // 4]
    views = row_views(block)
    assert len(views) == 4 and b"".join(bytes(v) for v in views) == block.contiguous().numpy().tobytes()
    views[0][:4] = bytes(4)  # writes through to the tensor: no copy was made
    assert full[0, MIN_ROW_BYTES // 4] == 0
    assert row_views(full[:, 1:9]) is None  # 32-byte rows: not worth a buffer each
    assert row_views(full[:, : MIN_ROW_BYTES // 4 - 1]) is None  # just under the threshold
