"""The buffer pool that lets rounds reuse their large float32 buffers."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.averaging.buffers import HEADROOM, BufferPool


def test_a_released_buffer_is_handed_out_again_for_the_same_size() -> None:
    pool = BufferPool(keep=2)
    a = pool.take(10)
    assert a.dtype == torch.float32 and a.shape == (10,) and a.is_contiguous()
    pool.give(a)
    assert len(pool) == 1
    assert pool.take(100).data_ptr() != a.data_ptr()  # too large for it: a new buffer
    assert pool.take(10).data_ptr() == a.data_ptr()
    assert len(pool) == 0
    assert pool.take(10).data_ptr() != a.data_ptr()  # it was taken: never handed out twice


def test_a_slightly_larger_request_fits_the_headroom_of_a_kept_buffer() -> None:
    # a partition follows its reducer's measured bandwidth: a few percent more next round must not
    # cost a fresh allocation (whose pages the kernel faults in and zeroes)
    pool = BufferPool()
    a = pool.take(1000)
    pool.give(a)
    bigger = pool.take(int(1000 * HEADROOM))
    assert bigger.data_ptr() == a.data_ptr() and bigger.shape == (int(1000 * HEADROOM),)
    pool.give(bigger)
    smaller = pool.take(900)
    assert smaller.data_ptr() == a.data_ptr() and smaller.shape == (900,)
    pool.give(smaller)
    assert pool.take(int(1000 * HEADROOM) + 1).data_ptr() != a.data_ptr()  # past the headroom
    assert pool.take(600).data_ptr() != a.data_ptr()  # it would waste more than half of it


def test_the_best_fitting_buffer_serves_so_a_large_one_stays_for_a_large_request() -> None:
    pool = BufferPool()
    large, small = pool.take(1100), pool.take(1000)
    pool.give(large)
    pool.give(small)
    assert pool.take(1300).data_ptr() == large.data_ptr()  # the small one cannot hold it
    pool.give(large)
    assert pool.take(1050).data_ptr() == small.data_ptr()  # both could: the smaller fits best
    assert pool.take(1300).data_ptr() == large.data_ptr()


def test_the_pool_keeps_at_most_keep_buffers_dropping_the_oldest() -> None:
    pool = BufferPool(keep=2)
    old, mid, new = pool.take(10), pool.take(100), pool.take(1000)
    for t in (old, mid, new):
        pool.give(t)
    assert len(pool) == 2
    assert pool.take(10).data_ptr() != old.data_ptr()
    assert pool.take(100).data_ptr() == mid.data_ptr()
    assert pool.take(1000).data_ptr() == new.data_ptr()


@pytest.mark.parametrize(
    "odd",
    [
        torch.zeros(4, dtype=torch.float64),
        torch.zeros(2, 2),
        torch.zeros(8)[::2],
        torch.zeros(0),
        torch.zeros(8)[2:],
    ],
    ids=["float64", "2-D", "strided", "empty", "inner view"],
)
def test_buffers_it_could_not_hand_out_whole_are_not_kept(odd: torch.Tensor) -> None:
    pool = BufferPool()
    pool.give(odd)
    assert len(pool) == 0


def test_keep_zero_keeps_nothing_and_negative_is_refused() -> None:
    pool = BufferPool(keep=0)
    pool.give(pool.take(5))
    assert len(pool) == 0
    assert pool.take(0).numel() == 0
    with pytest.raises(ValueError, match="keep"):
        BufferPool(keep=-1)
