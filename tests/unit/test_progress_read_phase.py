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


@pytest.mark.parametrize("seed", range(300))
def test_a_held_record_counts_its_peers_work_until_it_expires(seed: int) -> None:
    rng = random.Random(seed)
    cfg = ProgressSection()
    heartbeat, horizon = cfg.ttl / 2, record_horizon(cfg)
    n = rng.randint(4, 160)
    landed = 1_000.0
    starts = [landed + rng.uniform(-LANDING_SPREAD / 2, LANDING_SPREAD / 2) for _ in range(n)]
    rates = [rng.uniform(4.0, 12.0) for _ in range(n)]
    # each peer's records of the step: one as it lands, then one a heartbeat (give or take a read)
    published: list[list[float]] = []
    for s in starts:
        times, t = [], s + rng.uniform(0.0, PUBLISH_DELAY)
        while t < landed + 3 * cfg.ttl:
            times.append(t)
            t += heartbeat + rng.uniform(0.0, cfg.interval)
        published.append(times)
    # the reader (peer 0) read the replicas at ``read``, after the landing records went out, and reads
    # them again a record's life later; ``now`` is any moment before that
    read = landed + LANDING_SPREAD + PUBLISH_DELAY + rng.uniform(0.0, cfg.ttl)
    now = read + rng.uniform(0.0, cfg.ttl)
    mine = ProgressRecord(EPOCH, int(rates[0] * (now - starts[0])), rates[0], now, run=RUN, since=starts[0])
    held, truth = [], rates[0] * (now - starts[0])
    for i in range(1, n):
        said = max(t for t in published[i] if t <= read)
        if now >= said + cfg.ttl:
            continue  # expired before the next read: not held (and not this invariant's)
        at = said - rng.uniform(0.0, PUBLISH_DELAY)  # what it measured, a moment before it went out
        rec = ProgressRecord(EPOCH, int(rates[i] * (at - starts[i])), rates[i], at, run=RUN, since=starts[i])
        held.append(PeerProgress(pid(i), rec))
        truth += rates[i] * (now - starts[i])
    view = swarm_view(
        pid(0),
        mine,
        held,
        now=now,
        target=TARGET,
        horizon=horizon,
        trusted=None,
        cohort={pid(i) for i in range(1, n)},
    )
    # (a count is a whole number of samples: a record's rounding, one sample a peer)
    assert math.isclose(view.samples, truth, abs_tol=n), (view.samples, truth, now - read)
