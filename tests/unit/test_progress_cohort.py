"""A member of a committed round sees the next step's target when the swarm reaches it, whichever of
its round's members' new records have reached it yet.

At 128 simulated peers a peer's new record goes at once only to the 32 partners it offers it to; the
others read it from the replicas once a record's life (10 s). The view counted only records of the
step: a peer that held a quarter of its round's new records saw a quarter of the samples and the rate,
and expected the target later than a peer that held them all.

The invariant, over random rounds (sizes, rates, landing times, which members' new records arrived,
trusted or not): the view's samples and rate with any subset of the new records are those of the view
with all of them, within what the members' landing times and rate changes explain; the group a leader
gathers (its peers and those arriving) counts every member of the round, whichever records it holds (a
leader at 128 peers that held 80 of the round's 128 members' records gathered a group of 80, full at
once, and the others downloaded the step); and ids that join a
round and then claim any rate in their last record move the view no more than the trust caps allow
(untrusted: at most as much as the trusted and this peer; trusted: ``SPREAD`` times the median).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from p2ptrain.identity import PeerID
from p2ptrain.training.optimizer.progress import (
    SPREAD,
    UNREAD,
    PeerProgress,
    ProgressRecord,
    SwarmView,
    swarm_view,
)

RUN = b"run-fingerprint!"
EPOCH = 7
NOW = 5_000.0
HEARTBEAT = 5.0
HORIZON = HEARTBEAT + 2.0  # a heartbeat and two read intervals, as on a node
TARGET = 10_000
LANDING_SPREAD = 0.3  # seconds between the first and the last member landing the round
RATE_DRIFT = 0.1  # a member's rate on the new step against the one its last record said


def pid(n: int) -> PeerID:
    return PeerID(n.to_bytes(4, "big") * 8)


def view(
    mine: ProgressRecord, others: list[PeerProgress], cohort: set[PeerID], trusted: set[PeerID] | None
) -> SwarmView:
    return swarm_view(
        pid(0), mine, others, now=NOW, target=TARGET, horizon=HORIZON, trusted=trusted, cohort=cohort
    )


def a_round(rng: random.Random) -> tuple[ProgressRecord, list[PeerProgress], list[PeerProgress], float]:
    """This peer's record, its round's members' records of the new step, and of the step before (as the
    last read left them), all ``elapsed`` seconds after this peer landed."""
    n = rng.randint(2, 120)
    elapsed = rng.uniform(0.5, UNREAD * HORIZON)
    landed = NOW - elapsed
    mine_rate = rng.uniform(1.0, 2.5)
    mine = ProgressRecord(EPOCH, int(mine_rate * elapsed), mine_rate, NOW, run=RUN, since=landed)
    new, old = [], []
    for i in range(1, n):
        at = landed + rng.uniform(-LANDING_SPREAD, LANDING_SPREAD)
        rate = rng.uniform(1.0, 2.5)
        said = rng.uniform(max(at, NOW - HEARTBEAT), NOW)  # (its latest record: one a heartbeat at least)
        new.append(
            PeerProgress(
                pid(i), ProgressRecord(EPOCH, int(rate * (said - at)), rate, said, run=RUN, since=at)
            )
        )
        before = rate * rng.uniform(1 - RATE_DRIFT, 1 + RATE_DRIFT)
        old.append(
            PeerProgress(
                pid(i),
                ProgressRecord(
                    EPOCH - 1,
                    900,
                    before,
                    at - rng.uniform(0, 4),
                    run=RUN,
                    since=at - 20,
                    landing=rng.random() < 0.5,
                ),
            )
        )
    return mine, new, old, elapsed


@pytest.mark.parametrize("seed", range(200))
def test_the_view_of_a_step_does_not_hang_on_which_of_its_rounds_new_records_arrived(seed: int) -> None:
    rng = random.Random(seed)
    mine, new, old, elapsed = a_round(rng)
    cohort = {o.peer for o in new}
    trusted = None if rng.random() < 0.2 else {o.peer for o in new if rng.random() < 0.8}
    # some members' records this peer holds none of (read before they were written, or expired since)
    unread = set(rng.sample(range(len(new)), rng.randint(0, len(new) // 4)))
    full = view(mine, [o for i, o in enumerate(new) if i not in unread], cohort, trusted)
    arrived = set(rng.sample(range(len(new)), rng.randint(0, len(new))))
    held = [new[i] if i in arrived else old[i] for i in range(len(new)) if i not in unread]
    partial = view(mine, held, cohort, trusted)
    everyone = view(mine, new, cohort, trusted)
    assert everyone.peers + everyone.arriving == len(new) + 1
    # each member not yet read is off by its rate's drift and its landing time's distance from this one's
    slack_rate = RATE_DRIFT * full.rate
    slack_samples = RATE_DRIFT * full.samples + 1.0 * LANDING_SPREAD * full.rate + len(new) + 1
    assert abs(partial.rate - full.rate) <= slack_rate, (partial.reason, full.reason)
    assert abs(partial.samples - full.samples) <= slack_samples, (partial.reason, full.reason, elapsed)
    # a member whose last record is of the step before is one arriving, as before, and so is one whose
    # records this peer holds none of: the group its leader gathers waits for every member of the round
    assert partial.peers + partial.arriving == everyone.peers + everyone.arriving
    assert partial.quorum == full.quorum


@pytest.mark.parametrize("seed", range(100))
def test_members_of_a_round_that_claim_any_rate_in_their_last_record_move_the_view_within_the_caps(
    seed: int,
) -> None:
    rng = random.Random(1_000 + seed)
    mine, _, old, _ = a_round(rng)
    honest = [o for o in old if rng.random() < 0.5]
    k = rng.randint(1, 50)
    liars = [
        PeerProgress(pid(10_000 + j), replace(old[0].record, rate=rng.choice([1e6, 1e9]))) for j in range(k)
    ]
    trusted_liar = rng.random() < 0.5
    trusted = {o.peer for o in honest} | ({liars[0].peer} if trusted_liar else set())
    cohort = {o.peer for o in (*honest, *liars)}
    base = view(mine, honest, {o.peer for o in honest}, trusted)
    attacked = view(mine, [*honest, *liars], cohort, trusted)
    # what the honest members and this peer count for, with the trusted liar (if any) at its cap
    rates = sorted(
        [mine.rate, *(o.record.rate for o in honest), *([liars[0].record.rate] if trusted_liar else [])]
    )
    cap = SPREAD * rates[(len(rates) - 1) // 2] if trusted_liar else 0.0
    assert attacked.rate <= 2 * (base.rate + cap) + 1e-9, (attacked.reason, base.reason)
    assert attacked.samples <= 2 * (base.samples + cap * UNREAD * HORIZON) + 1e-6


@pytest.mark.parametrize("seed", range(200))
def test_members_whose_records_no_read_held_count_at_the_rate_of_those_read(seed: int) -> None:
    """Members of the round whose records this peer holds none of (at 128 simulated peers some peers'
    reads held 89 or 106 of the round's 128 members' records, step after step) work on the step as
    surely as it does: each counts at the lower median rate of this peer and its trusted peers there.
    With the members' rates within ``RATE_DRIFT`` of each other, the view with any members unread is
    the view with all of them read, within that drift and the landing spread; the code before counted
    nothing for them (a third of the step's samples missing at 39 unread of 128)."""
    rng = random.Random(5_000 + seed)
    n = rng.randint(3, 128)
    elapsed = rng.uniform(0.5, UNREAD * HORIZON)
    landed = NOW - elapsed
    base = rng.uniform(1.0, 2.5)
    mine = ProgressRecord(EPOCH, int(base * elapsed), base, NOW, run=RUN, since=landed)
    new = []
    for i in range(1, n):
        at = landed + rng.uniform(-LANDING_SPREAD, LANDING_SPREAD)
        rate = base * rng.uniform(1 - RATE_DRIFT, 1 + RATE_DRIFT)
        said = rng.uniform(max(at, NOW - HEARTBEAT), NOW)
        rec = ProgressRecord(EPOCH, int(rate * (said - at)), rate, said, run=RUN, since=at)
        new.append(PeerProgress(pid(i), rec))
    cohort = {o.peer for o in new}
    trusted = None if rng.random() < 0.3 else {o.peer for o in new if rng.random() < 0.8}
    unread = set(rng.sample(range(len(new)), rng.randint(1, len(new) - 1))) if len(new) > 1 else set()
    everyone = view(mine, new, cohort, trusted)
    partial = view(mine, [o for i, o in enumerate(new) if i not in unread], cohort, trusted)
    slack_rate = 2 * RATE_DRIFT * everyone.rate
    slack_samples = 2 * RATE_DRIFT * everyone.samples + 2 * LANDING_SPREAD * everyone.rate + n
    assert abs(partial.rate - everyone.rate) <= slack_rate, (partial.reason, everyone.reason)
    assert abs(partial.samples - everyone.samples) <= slack_samples, (partial.reason, everyone.reason)
    assert abs(partial.heard - everyone.heard) <= slack_samples, (partial.heard, everyone.heard)
