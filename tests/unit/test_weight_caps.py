"""A contributor's weight is capped at what its own records make plausible (pure decisions)."""

from __future__ import annotations

import pytest

from p2ptrain.averaging.agreement import Coordinator
from p2ptrain.training.optimizer.progress import ProgressRecord, plausible_samples


def test_the_coordinator_caps_weights_and_says_whose() -> None:
    c = Coordinator(b"r" * 16, [10, 10, 10])
    c.caps = {1: 50.0, 2: 1000.0}
    for reducer in range(3):
        assert c.report(reducer, {0: 64.0, 1: 5000.0, 2: 64.0}) is None
    d = c.decide()
    assert d.contributors == (0, 1, 2)
    assert d.weights == (64.0, 50.0, 64.0)
    assert c.capped == {1: (5000.0, 50.0)}


@pytest.mark.parametrize(
    ("since", "time", "now", "rate", "expected"),
    [
        pytest.param(100.0, 110.0, 110.0, 10.0, 2 * 10 * 10 + 5, id="on-epoch-10s"),
        pytest.param(100.0, 110.0, 111.0, 10.0, 2 * 10 * 11 + 5, id="extrapolated-1s"),
        pytest.param(100.0, 110.0, 500.0, 10.0, 2 * 10 * 12 + 5, id="extrapolation-capped"),
        pytest.param(100.0, 110.0, 50.0, 10.0, 2 * 10 * 10 + 5, id="reader-clock-behind"),
        pytest.param(120.0, 110.0, 110.0, 10.0, 5, id="since-after-time"),
        pytest.param(100.0, 110.0, 110.0, 0.0, 5, id="no-rate-slack-only"),
    ],
)
def test_plausible_samples(since: float, time: float, now: float, rate: float, expected: float) -> None:
    record = ProgressRecord(epoch=3, samples=10**9, rate=rate, time=time, since=since)
    assert plausible_samples(record, now, horizon=2.0, slack=5.0) == pytest.approx(expected)
