"""A peer sees the step's target about when the swarm reaches it, however few of the step's peers it
trusts.

A peer counts untrusted records for at most as much as itself and its trusted peers together (free ids
would otherwise make it step with any batch). At 128 simulated peers the 10 to 20 peers a round left out
trusted few of the others: their views counted the swarm's rate at a tenth of the truth, they looked
for the next step's group only when their partners' ``ready`` records reached them, seconds after the
others, and were left out again.

So each record carries what its author's own view counted (``seen``, ``seen_rate``), and a reader takes
the lower median of its trusted peers' views on the step where that is more than its own count. The
invariants, over random swarms (sizes, rates, landing times, how many peers the reader trusts, which of
them lie and how):

* with at least half of the trusted peers on the step honest, the reader's view of the samples and the
  rate is within the honest views' spread of the truth, whether it trusts 1 peer or all of them
  (before: at most ``2 (k + 1) / n`` of the truth with ``k`` of ``n`` trusted);
* no number of untrusted ids, and no trusted minority (at most half, rounded down), moves the view past
  the largest honest view, whatever they claim;
* a view is not passed on: the ``seen`` a peer publishes is its own count, never a view it was told;
* a record whose only change is what its view counted does not go out at once (it rides on the
  records that go out anyway: a view moves at every read, and each publication is a DHT store).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from p2ptrain.identity import PeerID
from p2ptrain.training.optimizer.progress import (
    PeerProgress,
    ProgressRecord,
    SwarmView,
    must_publish,
    swarm_view,
)

RUN = b"run-fingerprint!"
EPOCH = 11
NOW = 9_000.0
HEARTBEAT = 5.0
HORIZON = HEARTBEAT + 2.0
TARGET = 10_240
VIEW_ERROR = 0.05  # how far an honest peer's own view may be from the truth, either way
LANDING_SPREAD = 1.0  # seconds between the first and the last peer landing on the step


def pid(n: int) -> PeerID:
    return PeerID(n.to_bytes(4, "big") * 8)


def view(mine: ProgressRecord, others: list[PeerProgress], trusted: set[PeerID]) -> SwarmView:
    return swarm_view(
        pid(0), mine, others, now=NOW, target=TARGET, horizon=HORIZON, trusted=trusted, met=None
    )


def a_swarm(
    rng: random.Random,
) -> tuple[ProgressRecord, list[PeerProgress], float, float]:
    """This peer's record and the others' on the step, each with what its own (full) view counted at its
    record's time, give or take ``VIEW_ERROR``; and the true samples and rate of the swarm now."""
    n = rng.randint(4, 160)
    landed = NOW - rng.uniform(1.0, 9.0)
    rates = [rng.uniform(4.0, 12.0) for _ in range(n)]
    starts = [landed + rng.uniform(-LANDING_SPREAD / 2, LANDING_SPREAD / 2) for _ in range(n)]
    total_rate = sum(rates)

    def truth(t: float) -> float:
        return sum(r * max(t - s, 0.0) for r, s in zip(rates, starts, strict=True))

    mine = ProgressRecord(EPOCH, int(rates[0] * (NOW - starts[0])), rates[0], NOW, run=RUN, since=starts[0])
    others = []
    for i in range(1, n):
        said = rng.uniform(max(starts[i], NOW - HEARTBEAT), NOW)
        off = rng.uniform(1 - VIEW_ERROR, 1 + VIEW_ERROR)
        rec = ProgressRecord(
            EPOCH,
            int(rates[i] * (said - starts[i])),
            rates[i],
            said,
            run=RUN,
            since=starts[i],
            seen=int(truth(said) * off),
            seen_rate=total_rate * off,
        )
        others.append(PeerProgress(pid(i), rec))
    return mine, others, truth(NOW), total_rate


@pytest.mark.parametrize("seed", range(300))
def test_a_peer_that_trusts_few_sees_the_swarms_progress(seed: int) -> None:
    rng = random.Random(seed)
    mine, others, samples, rate = a_swarm(rng)
    n = len(others) + 1
    k = rng.randint(1, max(1, n // 4))
    trusted = {o.peer for o in rng.sample(others, k)}
    seen = view(mine, others, trusted)
    # (give or take the views' error and a landing spread's samples: a view told before some peers
    # landed is extrapolated at the whole swarm's rate)
    slack = rate * LANDING_SPREAD
    assert (1 - VIEW_ERROR) * samples - slack <= seen.samples <= (1 + 2 * VIEW_ERROR) * samples + slack
    assert (1 - VIEW_ERROR) * rate <= seen.rate <= (1 + VIEW_ERROR) * rate, (seen.rate, rate)
    # what it publishes is its own count, under its caps: not what it was told
    told_nothing = view(
        mine, [PeerProgress(o.peer, replace(o.record, seen=0, seen_rate=0.0)) for o in others], trusted
    )
    assert seen.counted == pytest.approx(told_nothing.samples)
    assert seen.counted_rate == pytest.approx(told_nothing.rate)
    # the view without the trusted peers' views (the code before): at most twice what this peer and
    # those it trusts do, far short of the swarm when it trusts few (what a peer left out of a round saw)
    capped = 2 * (mine.rate + sum(o.record.rate for o in others if o.peer in trusted))
    assert told_nothing.rate <= capped + 1e-6
    if capped < 0.5 * rate:
        assert told_nothing.rate < 0.5 * rate <= seen.rate


@pytest.mark.parametrize("seed", range(300))
def test_no_untrusted_ids_and_no_trusted_minority_move_the_view_past_the_honest_views(seed: int) -> None:
    rng = random.Random(seed)
    mine, others, _, rate = a_swarm(rng)
    k = rng.randint(1, max(1, len(others) // 2))
    chosen = rng.sample(others, k)
    trusted = {o.peer for o in chosen}
    liars = {o.peer for o in rng.sample(chosen, rng.randint(0, k // 2))}
    honest = [o for o in chosen if o.peer not in liars]
    # untrusted ids, any number of them, and the trusted liars claim any view, rate and count
    lying = [
        PeerProgress(
            o.peer,
            replace(
                o.record,
                seen=rng.choice([2**53, TARGET, 10 * TARGET]),
                seen_rate=rng.choice([1e12, 1e6, rate * 100]),
                time=NOW,
            ),
        )
        if o.peer in liars or (o.peer not in trusted and rng.random() < 0.5)
        else o
        for o in others
    ]
    sybils = [
        PeerProgress(
            pid(10_000 + j),
            ProgressRecord(EPOCH, 0, 0.0, NOW, run=RUN, since=NOW - 1, seen=2**53, seen_rate=1e12),
        )
        for j in range(rng.randint(0, 300))
    ]
    seen = view(mine, lying + sybils, trusted)
    honest_samples = max(
        o.record.seen + o.record.seen_rate * min(max(NOW - o.record.time, 0.0), HORIZON) for o in honest
    )
    honest_rate = max(o.record.seen_rate for o in honest)
    assert seen.samples <= max(seen.counted, honest_samples) + 1e-6
    assert seen.rate <= max(seen.counted_rate, honest_rate) + 1e-6
    # and the count it publishes is its own, which untrusted ids move only as far as the caps allow
    assert (
        seen.counted
        <= 2 * sum(o.record.samples + o.record.rate * HORIZON for o in others if o.peer in trusted)
        + 2 * mine.samples
        + 1e-6
    )


def test_a_record_whose_only_change_is_its_view_does_not_go_out_at_once() -> None:
    last = ProgressRecord(EPOCH, 100, 10.0, NOW, run=RUN, since=NOW - 10, seen=4_000, seen_rate=400.0)
    moved = replace(last, time=NOW + 1, samples=110, seen=9_000, seen_rate=900.0)
    assert not must_publish(last, moved, heartbeat=HEARTBEAT, tolerance=TARGET / 16)
    assert must_publish(last, replace(moved, ready=True), heartbeat=HEARTBEAT, tolerance=TARGET / 16)
