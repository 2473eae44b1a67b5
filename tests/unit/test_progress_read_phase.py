"""A peer's count of the step's samples does not depend on when it last read the replicas.

A peer reads the swarm's records from the key's replicas once a record's life (``progress.ttl``); only
its partners offer it their new records at once. The records it holds were extrapolated at their rates
for a heartbeat and two read intervals (7 s of a 10 s life): at 128 simulated peers, whose records of a
step went out as they landed and whose target came 9 s later, the peers that had read the replicas just
after the landing saw the swarm's work stall at 7/9 of the target until their next read, and looked for
the step's group up to 9 s after the others (left out of it).

The invariant, over random swarms, read phases and moments before the reader's next read: every record
the reader holds (alive: it was read, and has not expired) counts its peer's work up to now, so the view
is the truth of the peers held, whenever the read was. It fails on the code before (``horizon`` a
heartbeat and two read intervals).
"""

from __future__ import annotations

import math
import random

import pytest

from p2ptrain.config import ProgressSection
from p2ptrain.identity import PeerID
from p2ptrain.training.optimizer.progress import (
    PeerProgress,
    ProgressRecord,
    record_horizon,
    swarm_view,
)

RUN = b"run-fingerprint!"
EPOCH = 5
TARGET = 10_240
LANDING_SPREAD = 1.0  # seconds between the first and the last peer landing on the step
PUBLISH_DELAY = 0.3  # a record goes out at most this long after what it says happened


def pid(n: int) -> PeerID:
    return PeerID(n.to_bytes(4, "big") * 8)


def a_read(
    rng: random.Random,
) -> tuple[ProgressRecord, list[PeerProgress], list[PeerProgress], float, float, int]:
    """A swarm of one round's members on the step, each publishing a record as it lands and then one a
    heartbeat; the reader (peer 0) read the replicas at ``read``, after the landing records went out,
    and reads them again a record's life later; ``now`` is any moment before that. Returns its record,
    the records it read that still live at ``now``, those that expired since, the truth of all of them
    now, the time since the read, and the swarm's size."""
    cfg = ProgressSection()
    heartbeat = cfg.ttl / 2
    n = rng.randint(4, 160)
    landed = 1_000.0
    starts = [landed + rng.uniform(-LANDING_SPREAD / 2, LANDING_SPREAD / 2) for _ in range(n)]
    rates = [rng.uniform(4.0, 12.0) for _ in range(n)]
    read = landed + LANDING_SPREAD + PUBLISH_DELAY + rng.uniform(0.0, cfg.ttl)
    now = read + rng.uniform(0.0, cfg.ttl)
    mine = ProgressRecord(EPOCH, int(rates[0] * (now - starts[0])), rates[0], now, run=RUN, since=starts[0])
    live, expired, truth = [], [], rates[0] * (now - starts[0])
    for i in range(1, n):
        published, t = [], starts[i] + rng.uniform(0.0, PUBLISH_DELAY)
        while t <= read:
            published.append(t)
            t += heartbeat + rng.uniform(0.0, cfg.interval)
        said = published[-1]
        at = said - rng.uniform(0.0, PUBLISH_DELAY)  # what it measured, a moment before it went out
        rec = PeerProgress(
            pid(i),
            ProgressRecord(EPOCH, int(rates[i] * (at - starts[i])), rates[i], at, run=RUN, since=starts[i]),
        )
        (live if now < said + cfg.ttl else expired).append(rec)
        truth += rates[i] * (now - starts[i])
    return mine, live, expired, truth, now - read, n


def view_of(
    mine: ProgressRecord,
    live: list[PeerProgress],
    expired: list[PeerProgress],
    n: int,
    cohort: set[PeerID] | None = None,
) -> float:
    """The reader's count; ``cohort``: its round's other members (all ``n - 1`` peers by default)."""
    return swarm_view(
        pid(0),
        mine,
        live,
        now=mine.time,
        target=TARGET,
        horizon=record_horizon(ProgressSection()),
        trusted=None,
        cohort={pid(i) for i in range(1, n)} if cohort is None else cohort,
        expired=expired,
    ).samples


@pytest.mark.parametrize("seed", range(300))
def test_a_held_record_counts_its_peers_work_until_it_expires(seed: int) -> None:
    mine, live, _, _, since, n = a_read(random.Random(seed))
    truth = mine.samples + sum(
        o.record.rate * (mine.time - o.record.since) for o in live
    )  # (the peers whose records it holds)
    # (a count is a whole number of samples: a record's rounding, one sample a peer; the peers whose
    # records it holds are the round it counts: members it holds nothing of count at a typical rate,
    # see ``tests/unit/test_progress_cohort.py``)
    held = {o.peer for o in live}
    assert math.isclose(view_of(mine, live, [], n, held), truth, abs_tol=n), since


@pytest.mark.parametrize("seed", range(300))
def test_a_members_record_that_expired_counts_until_the_next_read(seed: int) -> None:
    mine, live, expired, truth, since, n = a_read(random.Random(seed))
    assert math.isclose(view_of(mine, live, expired, n), truth, abs_tol=n), (since, len(expired))
    # and only members of the round: a record of a peer outside it counts no longer than it lives
    outsider = [PeerProgress(pid(10_000 + i), o.record) for i, o in enumerate(expired)]
    held = {o.peer for o in live}
    assert view_of(mine, live, outsider, n, held) == view_of(mine, live, [], n, held)
