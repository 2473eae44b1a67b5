"""A contributor's weight is capped at what its own records make plausible (pure decisions)."""

from __future__ import annotations

import random

import pytest

from p2ptrain.averaging.agreement import Coordinator
from p2ptrain.training.optimizer.board import capped_weights
from p2ptrain.training.optimizer.progress import SPREAD, ProgressRecord, plausible_samples


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


def _one_at_a_time(
    peer: object, me: object, trusted: frozenset, records: list, epoch: int, plausible: dict
) -> float:
    """The cap of ``peer`` as the board worked it out before the caps were taken for a round at once
    (``records``: (peer, epoch) pairs as read): the trusted peers on the step found again for it."""
    cap = plausible[peer]
    if peer == me:
        return cap
    if peer in trusted:
        on_step = {p for p, e in records if p in trusted and p not in (peer, me) and e == epoch}
        ordered = sorted(plausible[p] for p in (me, peer, *on_step))
        return min(cap, SPREAD * ordered[len(ordered) // 2])
    vouched = {p for p, _ in records if p in trusted and p != peer}
    return min(cap, max(plausible[p] for p in (me, *vouched)))


@pytest.mark.parametrize("seed", range(8))
def test_a_rounds_caps_taken_at_once_are_each_members_cap(seed: int) -> None:
    """``capped_weights`` gives every member of a round the cap the board gave it when asked for that
    member alone, over random swarms: trusted and untrusted peers, records of this step, others' or none,
    plausible figures with ties (a median's edge cases), this peer itself among the members or not."""
    rng = random.Random(seed)
    for _ in range(60):
        n = rng.randint(1, 40)
        peers = [f"p{i}" for i in range(n)]
        me = rng.choice(peers)
        trusted = frozenset(p for p in peers if rng.random() < rng.random())
        epoch = 5
        records = [(p, rng.choice([epoch, epoch, epoch - 1, epoch + 1])) for p in peers if rng.random() < 0.8]
        plausible = {p: float(rng.choice([8, 16, 64, 64, 200, rng.uniform(1, 500)])) for p in peers}
        members = rng.sample(peers, rng.randint(1, n))
        recorded = {p for p, _ in records if p in trusted}
        on_step = {p for p, e in records if p in recorded and e == epoch} - {me}
        got = capped_weights(members, me, trusted, recorded, on_step, plausible.__getitem__)
        for m in members:
            assert got[m] == _one_at_a_time(m, me, trusted, records, epoch, plausible), (seed, m)
