"""The samples/s meter a peer advertises in its progress records (``optimizer.bookkeeping.RateMeter``)."""

from __future__ import annotations

import pytest

from p2ptrain.training.optimizer.bookkeeping import RateMeter


def test_a_steady_rate_reads_true_from_the_first_reading() -> None:
    """8 samples every second. The first call only starts the clock: when its batch began is unknown.
    Counting its samples into the next interval made the first reading twice the rate (16), and the
    swarm's rate in the first step's log lines with it."""
    meter = RateMeter(half_life=5.0)
    for t in range(10):
        meter.add(8, float(t))
        if t >= 1:
            assert meter.rate == pytest.approx(8.0), (t, meter.rate)


def test_short_intervals_carry_their_samples_into_the_next() -> None:
    meter = RateMeter(half_life=5.0)
    meter.add(1, 0.0)
    meter.add(1, 0.1)  # too short to measure
    meter.add(1, 1.0)
    assert meter.rate == pytest.approx(2.0)
