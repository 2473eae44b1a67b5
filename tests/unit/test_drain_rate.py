"""The drain rate that sizes catching-up bulk records and the kernel's unsent budget (``channel.DrainRate``),
pure: a model transport in virtual time, with randomized links, budgets and senders that the machine keeps
waiting."""

from __future__ import annotations

import bisect
import random

from p2ptrain.net.channel import FRAME_SECONDS, MAX_CHUNK, MIN_PIECE, DrainRate


class Link:
    """A transport in virtual time: a link that carries ``rate`` bytes a second, first in first out, and
    acknowledges each byte ``ack_delay`` seconds after it left; a send returns once the transport holds
    at most ``room`` bytes that it has not delivered (a kernel's unsent budget plus what is in flight).
    ``burst``: bytes a shaper lets through at once before it paces (a token bucket, full at the start)."""

    def __init__(self, rate: float, room: int, ack_delay: float = 0.0, burst: int = 0) -> None:
        self.rate, self.room, self.ack_delay, self.burst = rate, room, ack_delay, burst
        self.sent = 0
        self._starts: list[float] = []  # when each record's first byte leaves
        self._records: list[tuple[int, int, int, float]] = []  # (first byte, size, bytes at once, rate)
        self._free_at = 0.0  # when the link has carried every record so far

    def _left_by(self, t: float) -> int:
        """Bytes that have left the link by ``t``."""
        i = bisect.bisect_right(self._starts, t) - 1
        if i < 0:
            return 0
        first, size, at_once, rate = self._records[i]
        return first + min(size, at_once + int((t - self._starts[i]) * rate))

    def delivered(self, t: float) -> int:
        return self._left_by(t - self.ack_delay)

    def held(self, t: float) -> int:
        return self.sent - self.delivered(t)

    def send(self, n: int, t: float) -> float:
        """Send ``n`` bytes at ``t``: when the send returns."""
        start = max(t, self._free_at)
        at_once = min(self.burst, n)  # the shaper's burst leaves at once
        self.burst -= at_once
        self._starts.append(start)
        self._records.append((self.sent, n, at_once, self.rate))
        self._free_at = start + (n - at_once) / self.rate
        self.sent += n
        need = self.sent - self.room  # delivered by the time the send returns
        if need <= self.delivered(t):
            return t
        lo, hi = t, self._free_at + self.ack_delay + 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if self.delivered(mid) >= need else (mid, hi)
        return hi


def run_sender(
    d: DrainRate, link: Link, rng: random.Random, seconds: float, pause: float
) -> list[tuple[float, int]]:
    """A background sender with a backlog: looks, sends a record of ``d.piece()``, looks again; the
    machine keeps it waiting up to ``pause`` seconds between sends (a busy CPU), and each record costs it
    CPU time (it cannot send faster than about 1 GB/s). Returns (when, size) of each record."""
    t, records = 0.0, []
    while t < seconds:
        t += rng.random() * pause if rng.random() < 0.3 else 0.0
        n = d.piece()
        d.observe(t, link.sent, link.held(t))
        t += 20e-6 + n / 1e9
        t = link.send(n, t)
        d.sent(n, bulk=True)
        d.observe(t, link.sent, link.held(t))
        records.append((t, n))
    return records


def test_a_fresh_connection_sends_the_smallest_records_until_measured() -> None:
    d = DrainRate()
    assert d.piece() == MIN_PIECE and d.rate is None
    d.observe(0.0, 0, 0)
    d.observe(0.001, MIN_PIECE, MIN_PIECE)  # a millisecond: too soon to say anything
    assert d.rate is None and d.piece() == MIN_PIECE


def test_the_rate_is_never_above_the_links_on_any_link_budget_or_sender() -> None:
    """The invariant: whatever room the transport gives before a send waits (16 KiB to the MiB the
    kernel used to start with), however late the machine runs the sender, and whatever the acknowledgment
    delay, the rate is never above the link's, so no record takes more than FRAME_SECONDS of the link (or
    the smallest record's time) and the kernel's budget is never more than UNSENT_SECONDS of it. The
    code that timed sends took a send into free room as a fast link: on 2 Mbit/s with a MiB of room its
    records were 256 KiB by the seventh send, and the kernel held 2 s of the link."""
    rng = random.Random(11)
    for _ in range(300):
        rate = 10 ** rng.uniform(3.5, 9)
        room = int(10 ** rng.uniform(4, 6.1))
        link = Link(rate, room, ack_delay=rng.choice([0.0, rng.uniform(0, 0.2)]))
        d = DrainRate()
        records = run_sender(d, link, rng, seconds=rng.uniform(0.5, 3.0), pause=rng.choice([0.0, 0.05, 0.3]))
        assert d.rate is None or d.rate <= rate * 1.01, (rate, room, d.rate)  # (the model counts whole bytes)
        longest = max(n for _, n in records)
        assert longest <= max(rate * FRAME_SECONDS, MIN_PIECE), (rate, room, longest)


def test_a_shapers_burst_raises_the_rate_at_most_twofold_a_window() -> None:
    """A shaper that lets its first bytes through at once (a token bucket, a home router's) makes the
    transport run dry faster than the link: a lower bound above the link. Each such span raises the rate
    at most twofold, from the smallest record's rate; once the burst is spent the sends wait, and the
    busy windows bring the rate back to the link's."""
    rng = random.Random(13)
    for _ in range(200):
        rate = 10 ** rng.uniform(3.5, 6.5)
        link = Link(rate, 16 * 1024, burst=int(rng.uniform(0, 128 * 1024)))
        d = DrainRate()
        records = run_sender(d, link, rng, seconds=30 * 64 * 1024 / rate + 2.0, pause=0.0)
        first = [n for t, n in records if t < 0.1]
        ceiling = MIN_PIECE
        for n in first:  # no record more than twice the one before it could have been
            assert n <= max(2 * ceiling, MIN_PIECE)
            ceiling = max(ceiling, n)
        assert d.rate is not None and 0.5 * rate <= d.rate <= 1.2 * rate, (rate, link.burst, d.rate)


def test_a_fast_link_grows_records_to_what_it_carries_in_a_frame() -> None:
    """The other side: where the transport keeps running dry (the link is faster than the sender, or
    than the records so far), lower bounds double the rate a window, and the records reach FRAME_SECONDS
    of what the sender and the link carry together (MAX_CHUNK at most) within a second."""
    rng = random.Random(17)
    for _ in range(100):
        rate = 10 ** rng.uniform(5, 9)
        link = Link(rate, 4 * 1024 * 1024, ack_delay=rng.uniform(0, 0.002))
        d = DrainRate()
        run_sender(d, link, rng, seconds=1.0, pause=0.0)
        assert d.rate is not None
        carried = min(rate, 1e9)
        assert d.piece() >= min(carried * FRAME_SECONDS / 4, MAX_CHUNK / 2), (rate, d.rate, d.piece())


def test_a_link_that_slows_is_followed_and_one_that_speeds_up_too() -> None:
    d = DrainRate()
    link = Link(1.25e6, 64 * 1024)  # 10 Mbit/s
    rng = random.Random(19)
    run_sender(d, link, rng, seconds=2.0, pause=0.0)
    assert d.rate is not None and abs(d.rate - 1.25e6) < 0.1 * 1.25e6
    link.rate = 1.25e5  # another flow took nine tenths of it
    t, n = link._free_at, 0
    for _ in range(200):
        n = d.piece()
        d.observe(t, link.sent, link.held(t))
        t = link.send(n, t)
        d.sent(n, bulk=True)
        d.observe(t, link.sent, link.held(t))
    assert abs(d.rate - 1.25e5) < 0.1 * 1.25e5 and n <= 1.25e5 * FRAME_SECONDS
