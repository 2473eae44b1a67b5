"""What every record says (``SwarmView.heard``) does not depend on whom the reader trusts; the count a
peer leads by (``samples``) still counts free ids for at most as much as its trusted peers.

A peer counts the records of peers it does not trust for at most as much as its own and its trusted
peers' together. A peer that trusts few (a round left it out: only rounds earn trust) saw a fraction of
the swarm's samples and looked for the step's group after it had formed (see ``progress``, "A view
capped by trust"). It looks as a follower when ``heard`` puts the target within reach.

The invariants, over random honest swarms (rates within a factor of two), random trusted subsets and
random numbers of free ids claiming the most a record may: without free ids, ``heard`` is the count of a
reader that trusts every peer, whatever subset it trusts; with them, ``samples`` is at most twice the
count of the reader and its trusted peers, whatever they claim.
"""

from __future__ import annotations

import math
import random

import pytest

from p2ptrain.identity import PeerID
from p2ptrain.training.optimizer.progress import PeerProgress, ProgressRecord, swarm_view

RUN = b"run-fingerprint!"
EPOCH = 7
TARGET = 4_096
HORIZON = 10.0
NOW = 1_000.0


def pid(n: int) -> PeerID:
    return PeerID(n.to_bytes(4, "big") * 8)


def record(rng: random.Random, rate: float, landed: float, age: float) -> ProgressRecord:
    """A record of a peer that landed on the step within half a second of ``landed``, ``age`` old."""
    since = landed + rng.uniform(-0.25, 0.25)
    return ProgressRecord(EPOCH, int(rate * (NOW - age - since)), rate, NOW - age, run=RUN, since=since)


def view(mine: ProgressRecord, others: list[PeerProgress], trusted: frozenset[PeerID]):  # type: ignore[no-untyped-def]
    return swarm_view(pid(0), mine, others, now=NOW, target=TARGET, horizon=HORIZON, trusted=trusted)


@pytest.mark.parametrize("seed", range(300))
def test_what_every_record_says_does_not_depend_on_whom_the_reader_trusts(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(2, 140)
    rates = [rng.uniform(6.0, 12.0) for _ in range(n)]
    landed = NOW - rng.uniform(3.0, 20.0)
    mine = record(rng, rates[0], landed, 0.0)
    ages = [rng.uniform(0.0, min(HORIZON / 2, NOW - landed - 0.5)) for _ in range(n)]
    honest = [PeerProgress(pid(i), record(rng, rates[i], landed, ages[i])) for i in range(1, n)]
    everyone = frozenset(o.peer for o in honest)
    few = frozenset(rng.sample(sorted(everyone, key=lambda p: p.digest), rng.randint(0, n - 1)))
    full, capped = view(mine, honest, everyone), view(mine, honest, few)
    assert math.isclose(capped.heard, full.samples, rel_tol=1e-9), (capped.heard, full.samples)
    assert math.isclose(capped.heard_rate, full.rate, rel_tol=1e-9), (capped.heard_rate, full.rate)
    assert capped.samples <= capped.heard + 1e-6 and capped.rate <= capped.heard_rate + 1e-6

    # free ids claiming the most a record may: the count a peer leads by is bounded by its trusted peers
    k = rng.randint(1, 200)
    lies = [
        PeerProgress(pid(10_000 + i), ProgressRecord(EPOCH, 2**53, 1e9, NOW, run=RUN, since=NOW - 1.0))
        for i in range(k)
    ]
    attacked = view(mine, honest + lies, few)
    vouched = view(mine, [o for o in honest if o.peer in few], few)
    assert attacked.samples <= 2 * vouched.samples + 1e-6, (attacked.samples, vouched.samples)
    assert attacked.rate <= 2 * vouched.rate + 1e-6, (attacked.rate, vouched.rate)
