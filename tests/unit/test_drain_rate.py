"""The drain rate that sizes catching-up bulk records (``channel.DrainRate``), pure."""

from __future__ import annotations

import random

from p2ptrain.net.channel import FRAME_SECONDS, MAX_CHUNK, MIN_PIECE, DrainRate

RATE = 1.25e6  # 10 Mbit/s


def busy_sends(d: DrainRate, sizes: list[int], rate: float, at: float = 0.0) -> float:
    """Back-to-back sends, each taking its bytes' time at ``rate``; returns when the last ended."""
    for n in sizes:
        d.sent(n, at, at + n / rate, bulk=True)
        at += n / rate
    return at


def test_a_fresh_connection_sends_the_smallest_records_until_measured() -> None:
    assert DrainRate().piece() == MIN_PIECE


def test_a_send_after_a_pause_or_after_a_short_one_does_not_count() -> None:
    d = DrainRate()
    d.sent(MIN_PIECE, 0.0, 0.001, bulk=True)  # found the link idle: returned before its bytes left
    assert d.rate is None
    d.sent(100, 0.001, 0.0011, bulk=False)  # a control message
    d.sent(MIN_PIECE, 0.0011, 0.002, bulk=True)  # after a control message: the link was idle too
    assert d.rate is None
    d.sent(MIN_PIECE, 1.0, 1.0 + MIN_PIECE / RATE, bulk=True)  # a second after the last: idle again
    assert d.rate is None
    d.sent(MIN_PIECE, 1.0 + MIN_PIECE / RATE, 1.0 + 2 * MIN_PIECE / RATE, bulk=True)  # back to back
    assert d.rate is not None and abs(d.rate - RATE) < 1


def sender(d: DrainRate, rate: float, queued: float, sends: int) -> list[int]:
    """A background sender's records, back to back, on a transport that takes each at once while what
    it holds drains within ``queued`` seconds (a kernel's unsent budget), and otherwise returns once the
    record's bytes left at ``rate``."""
    at, free, sizes = 0.0, 0.0, []
    for _ in range(sends):
        n = d.piece()
        free = max(free, at) + n / rate  # when the link has carried this record
        ended = max(at, free - queued)
        d.sent(n, at, ended, bulk=True)
        sizes.append(n)
        at = ended
    return sizes


def test_records_hold_about_frame_seconds_of_the_measured_rate_within_bounds() -> None:
    rng = random.Random(5)
    for _ in range(200):
        rate = 10 ** rng.uniform(4, 9)
        d = DrainRate()
        sender(d, rate, FRAME_SECONDS, 20)
        piece = d.piece()
        assert MIN_PIECE <= piece <= MAX_CHUNK
        if MIN_PIECE < rate * FRAME_SECONDS < MAX_CHUNK:
            assert piece <= rate * FRAME_SECONDS < piece + MIN_PIECE


def test_a_slower_link_is_taken_at_once_and_a_faster_sample_only_in_part() -> None:
    d = DrainRate()
    at = busy_sends(d, [MAX_CHUNK] * 2, 100 * RATE)
    assert d.piece() == MAX_CHUNK
    at = busy_sends(d, [MAX_CHUNK], RATE, at)  # the link slowed (the home's download began)
    assert d.piece() == 60 * 1024  # (62.5 kB drain in 50 ms at 10 Mbit/s)
    d.sent(MIN_PIECE, at, at, bulk=True)  # one send that took no time (the kernel had room)
    assert d.rate is not None and d.rate < 1.5 * RATE  # a quarter of the time per byte, not infinity


def test_records_that_take_no_time_grow_by_doubling_never_past_what_a_slow_link_carries_quickly() -> None:
    """A transport that takes a record at once (its queue had room) says nothing of the link's rate: a
    record grows at most twofold over the largest sent, so on any link no record, from the first on,
    takes much more than FRAME_SECONDS (or the smallest record's time) to carry. The code before took
    such a send as an infinite rate: the third record was MAX_CHUNK, 4 s on 2 Mbit/s."""
    rng = random.Random(7)
    for _ in range(200):
        rate = 10 ** rng.uniform(4, 9)
        queued = rng.uniform(0.0, 0.2)  # how much the transport takes before a send waits
        sizes = sender(DrainRate(), rate, queued, 30)
        longest = max(n / rate for n in sizes)
        assert longest <= max(2.5 * FRAME_SECONDS, MIN_PIECE / rate, 2.5 * queued), (rate, queued, sizes)
    d = DrainRate()
    at = 0.0
    for expected in (MIN_PIECE, MIN_PIECE, 2 * MIN_PIECE, 4 * MIN_PIECE, 8 * MIN_PIECE):
        assert d.piece() == expected
        d.sent(expected, at, at, bulk=True)  # taken at once
