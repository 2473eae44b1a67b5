"""The run's ban records spread over its bucket keys (``progress.buckets``; ``dht.spread``): collaborative
peers over the in-memory network on the virtual clock.

The rule: an accusation goes under the key of its *accused's* bucket and counts only there, in a record
its accuser signed (an owned subkey). So a peer reads the ban keys of the buckets whose peers it may
average with (a split swarm's region's, ``ProgressBoard.ban_buckets``), a bounded number whatever the
swarm's size, instead of every key (``B`` lookups a read, O(N) as ``B`` grows). Seeded ids publish ban
records under random sets of the keys, each accusing random peers; each honest peer's read of a random
set of buckets hands its auditor exactly the accusations under their accused's bucket's key among those
read, each once. (Whether an accusation convicts is the auditor's to decide, from the proof; tested
apart.)
"""

from __future__ import annotations

import random

import pytest
import trio

import p2ptrain.training.optimizer.bans as bans_module
from p2ptrain.averaging.auditor import Accusation
from p2ptrain.dht.records import owned_subkey, subkey_owner
from p2ptrain.identity import Identity, PeerID
from p2ptrain.training.optimizer.bans import ROUND_BYTES, _parse_bans
from p2ptrain.training.optimizer.buckets import Regions
from p2ptrain.wire.codec import pack
from tests.harness.dht import store_as
from tests.harness.training import run_config, swarm

pytestmark = pytest.mark.timeout(300)

BUCKETS = 4


async def _bans(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    config = run_config("sync").replace("progress", buckets=BUCKETS, regions=2)
    async with swarm(config) as s:
        honest = [await s.start(compute=0.1) for _ in range(4)]
        await s.until(lambda: all(p.opt.epoch >= 1 for p in honest), timeout=120)
        spread = honest[0].opt.bans.spread
        assert len(set(spread.keys)) == BUCKETS and spread == honest[1].opt.bans.spread
        for p in honest:
            assert p.opt.bans_key == spread.key_of(p.node.peer_id)
            # a split swarm's peer reads its region's buckets at its step and the next: never all four
            regions = Regions.of(BUCKETS, 2)
            read = p.opt.board.ban_buckets()
            assert read is not None and len(read) <= 2 ** (regions.span + 1) and len(read) < BUCKETS, read

        # the accused: honest peers and made-up ids, so that every bucket holds some
        accused = [p.node.peer_id for p in honest] + [Identity.generate().peer_id for _ in range(12)]
        ids = [Identity.generate() for _ in range(rng.randint(6, 14))]
        counted: set[tuple[PeerID, PeerID]] = set()
        for who in ids:
            placed = rng.sample(spread.keys, rng.randint(1, BUCKETS))
            targets = rng.sample(accused, rng.randint(1, 3))
            bans = [[t.digest, "made up", rng.randbytes(ROUND_BYTES), 0] for t in targets]
            counted |= {(who.peer_id, t) for t in targets if spread.key_of(t) in placed}
            await store_as(rng.choice(honest).node.dht, who, placed, pack({"addr": "", "bans": bans}), 1000.0)

        assert counted  # (some accusations stand where they count)
        # (every accusation at one read, for the test: a read hands the auditor at most a few)
        monkeypatch.setattr(bans_module, "MAX_EXAMINED_PER_READ", 3 * len(ids) + 1)
        for p in honest:  # (a run without audits reads no bans itself: the reads below are the only ones)
            examined: list[tuple[PeerID, PeerID]] = []

            async def examine(
                accuser: PeerID,
                addr: str,
                accusation: Accusation,
                seen: list[tuple[PeerID, PeerID]] = examined,
            ) -> str:
                seen.append((accuser, accusation.accused))
                return "recorded"

            monkeypatch.setattr(p.node.averager.auditor, "examine", examine)
            chosen = sorted(rng.sample(range(BUCKETS), rng.randint(1, BUCKETS)))
            wanted = {(a, t) for a, t in counted if spread.keys.index(spread.key_of(t)) in chosen}
            await p.opt.bans.read(chosen)
            size = len(wanted)
            await s.until(lambda ex=examined, n=size: len(ex) >= n, timeout=10)
            assert len(examined) == len(set(examined))  # each accusation once
            assert set(examined) == wanted, (set(examined) - wanted, wanted - set(examined))

        # an honest accuser's own accusations go under each accused's bucket's key, one record a key
        me = honest[0]
        auditor = me.node.averager.auditor
        for t in rng.sample(accused[1:], 5):
            auditor.accusations[t] = Accusation(t, "proven", rng.randbytes(ROUND_BYTES), 0)
        await me.opt.bans._publish_bans()
        for key in spread.keys:
            held = await honest[1].node.dht.get(key, quorum=3)
            mine = [e for sk, e in held.items() if subkey_owner(sk) == me.node.peer_id]
            expected = {t for t in auditor.accusations if spread.key_of(t) == key}
            assert len(mine) == (1 if expected else 0), key
            if mine:
                assert {a.accused for a in _parse_bans(mine[0].value)[1]} == expected

        # it publishes its last few accusations only: a key whose accusations all fell out of them is
        # left holding a record of this accuser that accuses nobody, and is no longer re-published
        monkeypatch.setattr(bans_module, "MAX_BANS_PUBLISHED", 2)
        for t in rng.sample([a for a in accused[1:] if a not in auditor.accusations], 2):
            auditor.accusations[t] = Accusation(t, "proven", rng.randbytes(ROUND_BYTES), 0)
        await trio.sleep(1)  # (virtual: a record replaces one that expires sooner, not one of the same time)
        await me.opt.bans._publish_bans()
        last = list(auditor.accusations)[-2:]
        writer = me.node.dht.writer
        for key in spread.keys:
            held = await honest[1].node.dht.get(key, quorum=3)
            mine = [e for sk, e in held.items() if subkey_owner(sk) == me.node.peer_id]
            expected = {t for t in last if spread.key_of(t) == key}
            assert {a.accused for e in mine for a in _parse_bans(e.value)[1]} == expected, key
            assert writer.republishes(key, owned_subkey(me.node.peer_id)) == bool(expected), key


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_ban_records_count_only_under_their_accuseds_bucket(
    seed: int, monkeypatch: pytest.MonkeyPatch, autojump_clock: object
) -> None:
    await _bans(seed, monkeypatch)
