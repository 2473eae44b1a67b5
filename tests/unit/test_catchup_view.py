"""The view of a step a catching-up peer is not on yet (pure, randomized and seeded).

A peer whose replay in flight lands it on the swarm's step joins that step's round
(``RoundRunner.start_matchmaking(ahead)``); it decides when from its view of that step
(``swarm_view(..., epoch=)``, ``ProgressBoard.view_of``). The invariant: that view is computed from the
same published records as the view of every peer on the step, its own record included as the others
read it (a record of an earlier step: no samples, no rate toward this one). So the catching-up peer
sees the target exactly when the peers on the step see it, and sizes the group as they do. Counting the
samples it computed on the state it replays from, a sync peer on a slow link saw the target seconds
before the others and led groups nobody joined in time.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from p2ptrain.identity import PeerID
from p2ptrain.training.optimizer.progress import (
    SPREAD,
    PeerProgress,
    ProgressRecord,
    SwarmView,
    spread_cap,
    swarm_view,
)

NOW = 1000.0
HORIZON = 2.0
RUN = b"run-fingerprint!"
SEEDS = range(40)


def pid(n: int) -> PeerID:
    return PeerID(bytes([n + 1]) * 32)


def record(epoch: int, samples: int, rate: float, **more: object) -> ProgressRecord:
    # measured now: an estimate equals the count, so a peer's exact own count and the others' reading
    # of its record agree, and any difference between two views is a difference in what they count
    return replace(ProgressRecord(epoch=epoch, samples=samples, rate=rate, time=NOW, run=RUN), **more)  # type: ignore[arg-type]


def view_of(
    me: PeerID,
    records: dict[PeerID, ProgressRecord],
    target: int,
    trusted: frozenset[PeerID] | None,
    epoch: int | None = None,
) -> SwarmView:
    others = [PeerProgress(p, r) for p, r in records.items() if p != me]
    return swarm_view(
        me, records[me], others, now=NOW, target=target, horizon=HORIZON, trusted=trusted, epoch=epoch
    )


def scenario(seed: int) -> tuple[dict[PeerID, ProgressRecord], PeerID, int, int, bool]:
    """A step's peers and one peer ``behind`` (1 or 2) steps back, replaying: the records, that peer, the
    step, the target and whether the run is private (every record believed)."""
    rng = random.Random(seed)
    step, target = rng.randint(2, 50), rng.choice([48, 96, 512])
    on_step = rng.randint(1, 5)
    # like peers (none past the others' cap: see ``progress.SPREAD``), or any
    low, high = (target // 8, target // 3) if rng.random() < 0.6 else (0, target)
    fastest = 3.0 if high < target else 40.0
    records = {
        pid(i): record(step, rng.randint(low, high), rng.uniform(1.0, fastest), digest=bytes([7]) * 32)
        for i in range(on_step)
    }
    home = pid(on_step)
    behind = rng.choice([1, 2])
    # what it computed on the state it replays from: up to a whole step's worth
    records[home] = record(
        step - behind, rng.randint(1, target), rng.uniform(0.1, 10.0), digest=bytes([6]) * 32
    )
    private = rng.random() < 0.3
    # A record says ``ready`` when its author's view reached the target (the flag is that view's verdict):
    # set as each on-step peer's view says, until no flag changes.
    trusted = None if private else frozenset(records)
    while True:
        said = {p: view_of(p, records, target, trusted).ready for p in records if p != home}
        if all(records[p].ready == r for p, r in said.items()):
            return records, home, step, target, private
        records.update({p: replace(records[p], ready=r) for p, r in said.items()})


@pytest.mark.parametrize("seed", SEEDS)
def test_a_catching_up_peer_sees_the_step_as_the_peers_on_it_do(seed: int) -> None:
    records, home, step, target, private = scenario(seed)
    everyone = frozenset(records)
    trusted = None if private else everyone  # (partners: each trusts the others, this one included)
    ahead = view_of(home, records, target, trusted, epoch=step)
    behind = step - records[home].epoch
    assert ahead.epoch == step and not ahead.behind
    here = [r for p, r in records.items() if p != home]
    spread = math.inf if private else SPREAD
    capped = max(r.samples for r in here) > spread_cap([r.samples for r in here], spread) or max(
        r.rate for r in here
    ) > spread_cap([r.rate for r in here], spread)
    views = [view_of(p, records, target, trusted) for p in records if p != home]
    # Never sooner than the most hopeful peer on the step: what it counts of each peer is what the
    # others count of it (a peer counts its own claims whole, however far past the others' they are).
    assert ahead.samples <= max(v.samples for v in views) and ahead.rate <= max(v.rate for v in views)
    assert not ahead.ready or any(v.ready for v in views)
    for theirs in views:
        assert theirs.epoch == step
        if not capped:  # when the target is reached, and how soon it will be: as every peer on it sees
            assert ahead.samples == theirs.samples, (ahead.reason, theirs.reason)
            assert ahead.rate == theirs.rate and ahead.ready == theirs.ready and ahead.eta == theirs.eta
        # who is on the step, and the majority a group of it needs
        assert ahead.peers == theirs.peers and ahead.quorum == theirs.quorum
        assert ahead.vouched_here == theirs.vouched_here and ahead.majority == theirs.majority
        # the group it waits for: the others count it as arriving one step behind; two behind, nobody
        # counts it but itself (it will ask to join all the same)
        assert ahead.arriving == theirs.arriving + (behind == 2)
        assert theirs.arriving == (behind == 1)


@pytest.mark.parametrize("seed", SEEDS[:10])
def test_its_own_samples_never_bring_the_step_within_reach(seed: int) -> None:
    """The lab's case: the peers on the step are short of the target by more than they do before the
    group would form; the peer behind has most of a step's samples of its own (computed on the state it
    replays from). Its view of the step is not ready, and waits as long as theirs."""
    rng = random.Random(seed)
    target = 96
    fast = {pid(i): record(4, rng.randint(20, 30), 12.0) for i in range(rng.randint(2, 3))}
    home = pid(9)
    records = {**fast, home: record(3, target, 4.0)}  # on its own, the home has the whole target
    ahead = view_of(home, records, target, frozenset(records), epoch=4)
    assert not ahead.ready and ahead.samples == sum(r.samples for r in fast.values())
    assert ahead.rate == 12.0 * len(fast)
    # on its own step, its count is exact and whole, as ever
    assert view_of(home, records, target, frozenset(records)).samples == target


def test_its_own_view_of_its_own_step_is_unchanged_by_naming_it() -> None:
    records, _, _, target, _ = scenario(3)
    trusted = frozenset(records)
    for p in records:
        epoch = records[p].epoch
        assert view_of(p, records, target, trusted, epoch=epoch) == view_of(p, records, target, trusted)
