"""The measured bandwidth a member announces: one round's rate window, the estimate over rounds, the
leader's share for members that have not measured theirs, and what the wire accepts (pure, no I/O)."""

from __future__ import annotations

import math

import pytest

from p2ptrain.averaging.bandwidth import (
    MAX_SPREAD,
    MIN_BYTES,
    MIN_SECONDS,
    BandwidthEstimate,
    RateMeter,
    Rates,
    partition_bandwidths,
)
from p2ptrain.averaging.matchmaking import Announcement, Gathering, Joiner
from p2ptrain.averaging.partition import partition_sizes
from p2ptrain.errors import RemoteProtocolError
from p2ptrain.identity import PeerID

MB = 1 << 20


class Counters:
    """A host's traffic counters and clock, moved by hand."""

    def __init__(self) -> None:
        self.t, self.sent, self.received = 100.0, 5 * MB, 7 * MB  # not zero: the meter takes differences

    def traffic(self) -> tuple[int, int]:
        return self.sent, self.received

    def now(self) -> float:
        return self.t


def test_the_first_completed_flow_in_each_direction_ends_its_window():
    c = Counters()
    meter = RateMeter(c.traffic, c.now)
    c.t += 0.5
    c.sent += 10 * MB
    c.received += 4 * MB
    meter.flow_done("upload")
    c.t += 0.5  # the tail, with fewer flows running: not counted
    c.sent += 1 * MB
    c.received += 2 * MB
    meter.flow_done("upload")
    meter.flow_done("download")
    meter.flow_done("download")
    assert meter.rates.upload == pytest.approx(10 * MB / 0.5)
    assert meter.rates.download == pytest.approx(6 * MB / 1.0)


@pytest.mark.parametrize(
    ("seconds", "moved"),
    [(MIN_SECONDS / 2, 100 * MB), (1.0, MIN_BYTES - 1)],
    ids=["too-short", "too-little"],
)
def test_a_window_too_short_or_too_small_gives_no_sample(seconds, moved):
    c = Counters()
    meter = RateMeter(c.traffic, c.now)
    c.t += seconds
    c.sent += moved
    c.received += moved
    meter.flow_done("upload")
    meter.flow_done("download")
    assert meter.rates == Rates(None, None)


def test_a_direction_without_completed_flows_has_no_sample():
    c = Counters()
    meter = RateMeter(c.traffic, c.now)
    c.t += 1.0
    c.sent += 8 * MB
    meter.flow_done("upload")
    assert meter.rates == Rates(upload=8 * MB, download=None)


def test_the_estimate_is_the_best_recent_rate_of_the_slower_direction():
    est = BandwidthEstimate(keep=3)
    assert est.value() is None
    est.add(Rates(upload=10e6, download=None))
    assert est.value() == 10e6  # one direction known: that one
    est.add(Rates(upload=4e6, download=30e6))  # a disturbed round measures less: the best one counts
    assert est.value() == 10e6
    est.add(Rates(upload=12e6, download=8e6))
    assert est.value() == 12e6  # download's best is 30e6
    est.add(Rates(upload=5e6, download=None))
    est.add(Rates(upload=5e6, download=None))  # 12e6 and 10e6 are forgotten (keep=3)
    assert est.value() == 12e6
    est.add(Rates(upload=6e6, download=7e6))
    assert est.value() == 6e6  # upload's last three: 5, 5, 6
    assert est.best() == Rates(upload=6e6, download=30e6)  # rounds without a download sample keep 30


def test_members_that_have_not_measured_get_the_median_share():
    assert partition_bandwidths([10.0, 0.0, 30.0, 20.0]) == [10.0, 20.0, 30.0, 20.0]
    assert partition_bandwidths([0.0, 0.0]) == [1.0, 1.0]  # nobody knows: equal shares
    sizes = partition_sizes(1000, partition_bandwidths([0.0, 0.0, 0.0]), [True, True, True])
    assert max(sizes) - min(sizes) <= 1
    # the unknown one gets the median of 1.0 and 4.0 (the upper one): 4.0
    assert partition_sizes(1000, partition_bandwidths([4.0, 1.0, 0.0]), [True, True, True]) == [445, 111, 444]


def test_no_member_counts_for_more_than_the_spread_allows():
    assert partition_bandwidths([10.0, 12.0, 1e15]) == [10.0, 12.0, MAX_SPREAD * 12.0]
    assert partition_bandwidths([10.0, 1e15]) == [10.0, MAX_SPREAD * 10.0]  # two members: the lower one
    assert partition_bandwidths([10.0, 100.0, 0.0]) == [10.0, 100.0, 100.0]  # a real 10x spread stays
    sizes = partition_sizes(1700, partition_bandwidths([10.0, 1e15]), [True, True])
    assert sizes == [100, 1600]


def _pid(i: int) -> PeerID:
    return PeerID(bytes([i]) * 32)


def test_an_announcement_may_say_its_bandwidth_is_not_measured_yet():
    a = Announcement(_pid(1), "tcp://198.18.0.1:4000/p", 12.0, 0.0, b"s" * 32)
    assert Announcement.from_bytes(_pid(1), a.to_bytes()) == a


@pytest.mark.parametrize("bandwidth", [-1.0, math.inf, math.nan, 1e16])
def test_an_announcement_with_an_impossible_bandwidth_is_refused(bandwidth):
    a = Announcement(_pid(1), "tcp://198.18.0.1:4000/p", 12.0, bandwidth, b"s" * 32)
    with pytest.raises(RemoteProtocolError, match="malformed announcement"):
        Announcement.from_bytes(_pid(1), a.to_bytes())


def test_a_leader_admits_an_unmeasured_joiner_and_refuses_a_negative_one():
    g = Gathering(Joiner(_pid(0), "a", 5.0), b"s", target_size=4, min_size=2)
    assert g.offer(Joiner(_pid(1), "b", 0.0), b"s") is None
    why = g.offer(Joiner(_pid(2), "c", -3.0), b"s")
    assert why is not None and "bandwidth" in why
    assert g.size() == 2
