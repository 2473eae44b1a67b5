"""The drain rate that sizes catching-up bulk records (``channel.DrainRate``), pure."""

from __future__ import annotations

import random

from p2ptrain.net.channel import FRAME_SECONDS, MAX_CHUNK, MIN_PIECE, DrainRate

RATE = 1.25e6  # 10 Mbit/s


def busy_sends(d: DrainRate, sizes: list[int], rate: float, at: float = 0.0) -> float:
    """Back-to-back sends, each taking its bytes' time at ``rate``; returns when the last ended."""
    for n in sizes:
        d.sent(n, at, at + n / rate)
        at += n / rate
    return at


def test_a_fresh_connection_sends_the_smallest_records_until_measured() -> None:
    assert DrainRate().piece() == MIN_PIECE


def test_a_send_after_a_pause_or_after_a_short_one_does_not_count() -> None:
    d = DrainRate()
    d.sent(MIN_PIECE, 0.0, 0.001)  # found the link idle: returned before its bytes left
    assert d.rate is None
    d.sent(100, 0.001, 0.0011)
    d.sent(MIN_PIECE, 0.0011, 0.002)  # after a short send: the link was idle too
    assert d.rate is None
    d.sent(MIN_PIECE, 1.0, 1.0 + MIN_PIECE / RATE)  # a second after the last: idle again
    assert d.rate is None
    d.sent(MIN_PIECE, 1.0 + MIN_PIECE / RATE, 1.0 + 2 * MIN_PIECE / RATE)  # back to back: counts
    assert d.rate is not None and abs(d.rate - RATE) < 1


def test_records_hold_about_frame_seconds_of_the_measured_rate_within_bounds() -> None:
    rng = random.Random(5)
    for _ in range(200):
        rate = 10 ** rng.uniform(4, 9)
        d = DrainRate()
        busy_sends(d, [MIN_PIECE] * 3, rate)
        piece = d.piece()
        assert MIN_PIECE <= piece <= MAX_CHUNK
        if MIN_PIECE < rate * FRAME_SECONDS < MAX_CHUNK:
            assert piece <= rate * FRAME_SECONDS < piece + 16 * 1024


def test_a_slower_link_is_taken_at_once_and_a_faster_sample_only_in_part() -> None:
    d = DrainRate()
    at = busy_sends(d, [MAX_CHUNK] * 2, 100 * RATE)
    assert d.piece() == MAX_CHUNK
    at = busy_sends(d, [MAX_CHUNK], RATE, at)  # the link slowed (the home's download began)
    assert d.piece() == MIN_PIECE  # (62.5 kB drain in 50 ms at 10 Mbit/s: the smallest record)
    d.sent(MIN_PIECE, at, at)  # one send that took no time (the kernel had room)
    assert d.rate is not None and d.rate < 1.5 * RATE  # a quarter of the time per byte, not infinity
