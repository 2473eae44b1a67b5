"""The run's ban records spread over its bucket keys (``progress.buckets``; ``dht.spread``): collaborative
peers over the in-memory network on the virtual clock.

The rule of every spread key: an accuser's record counts only under an owned subkey of its own
bucket's key. Seeded ids publish ban records under random sets of the keys; each honest peer's read
hands its auditor the accusations of exactly the ids that wrote under their own bucket's key, and of
each once. (Whether an accusation convicts is the auditor's to decide, from the proof; tested apart.)
"""

from __future__ import annotations

import random

import pytest

import p2ptrain.training.optimizer.bans as bans_module
from p2ptrain.identity import Identity, PeerID
from p2ptrain.training.optimizer.bans import ROUND_BYTES
from p2ptrain.wire.codec import pack
from tests.harness.dht import store_as
from tests.harness.training import run_config, swarm

pytestmark = pytest.mark.timeout(300)

BUCKETS = 4


async def _bans(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    config = run_config("sync").replace("progress", buckets=BUCKETS)
    async with swarm(config) as s:
        honest = [await s.start(compute=0.1) for _ in range(4)]
        await s.until(lambda: all(p.opt.epoch >= 1 for p in honest), timeout=120)
        spread = honest[0].opt.bans.spread
        assert len(set(spread.keys)) == BUCKETS and spread == honest[1].opt.bans.spread
        for p in honest:
            assert p.opt.bans_key == spread.key_of(p.node.peer_id)

        ids = [Identity.generate() for _ in range(rng.randint(6, 14))]
        counted: set[PeerID] = set()
        for who in ids:
            placed = rng.sample(spread.keys, rng.randint(1, BUCKETS))
            if spread.key_of(who.peer_id) in placed:
                counted.add(who.peer_id)
            accused = rng.choice(honest).node.peer_id
            record = {"addr": "", "bans": [[accused.digest, "made up", rng.randbytes(ROUND_BYTES), 0]]}
            await store_as(rng.choice(honest).node.dht, who, placed, pack(record), 1000.0)

        # (every accusation at one read, for the test: a read hands the auditor at most a few)
        monkeypatch.setattr(bans_module, "MAX_EXAMINED_PER_READ", len(ids) + 1)
        for p in honest:  # (a run without audits reads no bans itself: the read below is the only one)
            examined: list[PeerID] = []

            async def examine(
                accuser: PeerID, addr: str, accusation: object, seen: list[PeerID] = examined
            ) -> str:
                seen.append(accuser)
                return "recorded"

            monkeypatch.setattr(p.node.averager.auditor, "examine", examine)
            await p.opt.bans.read()
            await s.until(lambda ex=examined: len(ex) >= len(counted), timeout=10)
            assert len(examined) == len(set(examined))  # each accuser once
            assert set(examined) == counted, (set(examined) - counted, counted - set(examined))


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_ban_records_count_only_under_their_accusers_bucket(
    seed: int, monkeypatch: pytest.MonkeyPatch, autojump_clock: object
) -> None:
    await _bans(seed, monkeypatch)
