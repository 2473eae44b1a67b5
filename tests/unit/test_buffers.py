"""The buffer pool that lets rounds reuse their large float32 buffers."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.averaging.buffers import BufferPool


def test_a_released_buffer_is_handed_out_again_for_the_same_size() -> None:
    pool = BufferPool(keep=2)
    a = pool.take(10)
    assert a.dtype == torch.float32 and a.shape == (10,)
    pool.give(a)
    assert len(pool) == 1
    assert pool.take(11).data_ptr() != a.data_ptr()  # another size: a new buffer
    assert pool.take(10).data_ptr() == a.data_ptr()
    assert len(pool) == 0
    assert pool.take(10).data_ptr() != a.data_ptr()  # it was taken: never handed out twice


def test_the_pool_keeps_at_most_keep_buffers_dropping_the_oldest_size() -> None:
    pool = BufferPool(keep=2)
    old, mid, new = pool.take(1), pool.take(2), pool.take(3)
    for t in (old, mid, new):
        pool.give(t)
    assert len(pool) == 2
    assert pool.take(1).data_ptr() != old.data_ptr()
    assert pool.take(2).data_ptr() == mid.data_ptr()
    assert pool.take(3).data_ptr() == new.data_ptr()


@pytest.mark.parametrize(
    "odd",
    [torch.zeros(4, dtype=torch.float64), torch.zeros(2, 2), torch.zeros(8)[::2], torch.zeros(0)],
    ids=["float64", "2-D", "strided", "empty"],
)
def test_buffers_it_could_not_hand_out_whole_are_not_kept(odd: torch.Tensor) -> None:
    pool = BufferPool()
    pool.give(odd)
    assert len(pool) == 0


def test_keep_zero_keeps_nothing_and_negative_is_refused() -> None:
    pool = BufferPool(keep=0)
    pool.give(pool.take(5))
    assert len(pool) == 0
    with pytest.raises(ValueError, match="keep"):
        BufferPool(keep=-1)
