"""``reshard.io.memory``: the buffers direct I/O reads into and writes from are asked to be in 2 MB pages (the
kernel's ``hg`` flag on their mapping), start on a 2 MB boundary and hold their bytes; small ones are not."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from reshard.engine.move.buffers import BufferPool
from reshard.io import direct as direct_io
from reshard.io.memory import HUGE_PAGE, huge_bytes
from reshard.io.scratch import scratch_bytes

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not Path("/sys/kernel/mm/transparent_hugepage").is_dir(),
    reason="a kernel without transparent huge pages",
)


def vm_flags(address: int) -> set[str]:
    """The ``VmFlags`` of this process's mapping that holds ``address`` (``/proc/self/smaps``)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_large_buffer_is_asked_for_in_huge_pages_on_their_boundary() -> None:
    buffer = huge_bytes(5 * HUGE_PAGE + 123)
    assert buffer.size == 5 * HUGE_PAGE + 123 and buffer.dtype == np.uint8
    assert buffer.ctypes.data % HUGE_PAGE == 0
    assert "hg" in vm_flags(buffer.ctypes.data)
    buffer[:] = 7
    assert int(buffer.min()) == int(buffer.max()) == 7


def test_a_small_buffer_is_ordinary_memory() -> None:
    buffer = huge_bytes(64 << 10)
    assert buffer.size == 64 << 10
    assert "hg" not in vm_flags(buffer.ctypes.data)


def test_staging_scratch_and_gather_buffers_are_in_huge_pages() -> None:
    staging = direct_io._staging(direct_io.STAGING_BYTES)
    address = np.frombuffer(staging, dtype=np.uint8).ctypes.data
    assert address % direct_io.ALIGN == 0 and "hg" in vm_flags(address)
    with scratch_bytes(4 << 20, phase=512) as block:
        assert block.ctypes.data % direct_io.ALIGN == 512 and "hg" in vm_flags(block.ctypes.data)
    raw, tensor = BufferPool(1 << 30).get((1024, 2048), torch.bfloat16, phase=1024)
    assert tensor.data_ptr() % direct_io.ALIGN == 1024 and "hg" in vm_flags(raw.data_ptr())
