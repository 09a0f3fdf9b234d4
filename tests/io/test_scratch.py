"""``reshard.io.scratch``: one reusable buffer per thread, never shared by two users at once."""

from __future__ import annotations

import threading

import torch

from reshard.io.scratch import scratch


def test_a_thread_copies_into_the_same_memory_again() -> None:
    with scratch(torch.empty(4, 8, dtype=torch.bfloat16)) as first:
        assert first.shape == (4, 8) and first.dtype == torch.bfloat16
        address = first.data_ptr()
    with scratch(torch.empty(2, 3, dtype=torch.float32)) as second:  # smaller: the same buffer
        assert second.shape == (2, 3) and second.data_ptr() == address


def test_nested_users_and_other_threads_get_their_own_bytes() -> None:
    like = torch.empty(16, dtype=torch.int32)
    with scratch(like) as outer:
        outer.fill_(1)
        with scratch(like) as inner:
            inner.fill_(2)
            assert inner.data_ptr() != outer.data_ptr()
        seen: list[int] = []
        worker = threading.Thread(target=lambda: seen.append(_address(like)))
        worker.start()
        worker.join()
        assert seen[0] != outer.data_ptr()
        assert torch.equal(outer, torch.ones_like(outer))


def test_a_larger_block_gets_a_larger_buffer_which_is_kept() -> None:
    with scratch(torch.empty(10, dtype=torch.uint8)):
        pass
    with scratch(torch.empty(1 << 20, dtype=torch.uint8)) as large:
        address = large.data_ptr()
    with scratch(torch.empty(10, dtype=torch.uint8)) as small:
        assert small.data_ptr() == address


def _address(like: torch.Tensor) -> int:
    with scratch(like) as buffer:
        return buffer.data_ptr()
