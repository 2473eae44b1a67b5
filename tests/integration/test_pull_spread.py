"""Where a training peer's pulls go (``ProgressBoard._pull_from``): its partners, and while those are few,
other peers of the run whose records it read, in an order of its own. The invariant: **a peer that every
reader trusts alone (the join peer of a swarm's start) serves its share of the pulls, not all of them**,
and every reader still holds every record. On the code before, readers pulled from their trusted
partners only: at a swarm's start that is the one join peer, which served every pull (at 256 simulated
peers, 18.9 MB a step, 46 times the median node's control bytes). Over the in-memory network, on the
virtual clock."""

from __future__ import annotations

import statistics

import pytest
import trio

from p2ptrain.training.optimizer.board import PULL_SOURCES
from tests.harness.training import TARGET, run_config, swarm

pytestmark = pytest.mark.timeout(300)
PEERS = 12
WINDOW = 20.0  # virtual seconds measured, with no round in them


def pulled(peer) -> int:  # type: ignore[no-untyped-def]
    return int(peer.node.host.sent_by_method().get("dht.pull", 0))


async def test_readers_that_trust_one_join_peer_spread_their_pulls(autojump_clock: object) -> None:
    # A target no swarm of 12 reaches in the window: every peer trusts its join peer (t0) alone
    config = run_config("sync").replace("progress", interval=1.0, ttl=10.0)
    config = config.replace("training", target_batch_size=10_000 * TARGET)
    async with swarm(config) as s:
        peers = [await s.start(compute=0.5) for _ in range(PEERS)]
        join = peers[0]
        await s.until(lambda: all(len(p.opt.board.records) == PEERS for p in peers), timeout=120)
        assert all(p.opt.board.trusted() == frozenset({join.node.peer_id}) for p in peers[1:])
        before = [pulled(p) for p in peers]
        await trio.sleep(WINDOW)
        sent = [pulled(p) - b for p, b in zip(peers, before, strict=True)]
        assert all(p.opt.epoch == 0 for p in peers), "a round fell into the window"
        assert all(len(p.opt.board.records) == PEERS for p in peers)  # every reader holds every record
    others = statistics.median(sent[1:])
    # Each reader takes PULL_SOURCES fellow readers in turn, the join peer among them: it serves about
    # 1/PULL_SOURCES of each reader's pulls, as each of the others does for the readers that drew it.
    assert others > 0, sent
    assert sent[0] <= 3 * others, (sent, PULL_SOURCES)
