"""A step's matchmaking announcements spread over the run's bucket keys (``progress.buckets``, carried
to the averager as ``RoundPolicy.key_bits``): collaborative peers over the in-memory network on the
virtual clock.

The invariant, the progress records' (``dht.spread``): an announcement counts only under an owned
subkey of its owner's bucket's key. So a looker that reads every bucket's key sees each peer once, an
id that writes under another bucket's key, or under several, is not seen there, and no key's replicas
hold more than their bucket's lookers. Tested with seeded adversaries that write announcements under
random sets of the keys of the steps the swarm is about to take, while it takes them.
"""

from __future__ import annotations

import random

import pytest
import trio

from p2ptrain.averaging.matchmaking import Announcement
from p2ptrain.identity import Identity, PeerID
from tests.harness.dht import store_as
from tests.harness.training import Peer, check_identical_per_epoch, run_config, swarm

pytestmark = pytest.mark.timeout(600)  # (swarms of 4 nodes train meanwhile: real CPU, a busy machine)

BUCKETS = 4


async def announce_under(p: Peer, who: Identity, keys: list[bytes], a: Announcement, ttl: float) -> None:
    """``who``'s signed announcement stored under each of ``keys`` from ``p``'s node."""
    await store_as(p.node.dht, who, keys, a.to_bytes(), p.opt.clock() + ttl)


async def _announcements(seed: int) -> None:
    rng = random.Random(seed)
    config = run_config("sync").replace("progress", buckets=BUCKETS)
    async with swarm(config) as s:
        honest = [await s.start(compute=rng.choice([0.1, 0.15, 0.2])) for _ in range(4)]
        # every announcement an honest peer stores, and under which key
        stored: list[tuple[PeerID, bytes]] = []
        for p in honest:
            groups = p.node.averager.groups

            async def recording(
                key: bytes, me: Announcement, expiry: float, announce=groups.announce
            ) -> None:
                stored.append((me.peer, key))
                await announce(key, me, expiry)

            groups.announce = recording  # type: ignore[method-assign]
        await s.until(lambda: all(p.opt.epoch >= 2 for p in honest), timeout=120)
        groups = honest[0].node.averager.groups
        group_key = honest[0].opt.rounds.group_key
        spread = groups.keys(group_key(1))
        assert len(set(spread.keys)) == BUCKETS and spread == honest[1].node.averager.groups.keys(
            group_key(1)
        )
        # each honest announcement under its own bucket's key of some step's, and no other
        last = max(p.opt.epoch for p in honest) + 2
        assert stored
        for peer, key in stored:
            assert any(key == groups.keys(group_key(e)).key_of(peer) for e in range(last)), key

        # ids that announce under random sets of the bucket keys: their own bucket's among them or not
        # (client-only: no address, so that nobody waits for them and the swarm trains on)
        start = max(p.opt.epoch for p in honest)
        steps = range(start, start + 4)  # (the steps read below)
        ids = [Identity.generate() for _ in range(rng.randint(6, 14))]
        placed = {who.peer_id: rng.sample(range(BUCKETS), rng.randint(1, BUCKETS)) for who in ids}
        # (bucket b's key of every step: ``SpreadKey.of`` names a bucket the same way for each key)
        counted = {
            who.peer_id for who in ids if spread.keys.index(spread.key_of(who.peer_id)) in placed[who.peer_id]
        }

        # their announcements name one step's group key: the run's spread keys are every step's, and
        # an announcement counts for the group key it names alone
        target = start + 1
        spread_t, tag = groups.keys(group_key(target)), groups.tag(group_key(target))
        assert tag and tag != groups.tag(group_key(target + 1))

        async def keep_announcing(who: Identity) -> None:
            while True:
                now = trio.current_time()
                a = Announcement(
                    who.peer_id,
                    "",
                    now + rng.uniform(1, 5),
                    rng.uniform(0, 1e9),
                    rng.randbytes(16),
                    group=tag,
                )
                keys = [spread_t.keys[b] for b in placed[who.peer_id]]
                await announce_under(rng.choice(honest), who, keys, a, 30.0)
                await trio.sleep(3.0)

        async with trio.open_nursery() as attackers:
            for who in ids:
                attackers.start_soon(keep_announcing, who)
            await s.until(lambda: all(p.opt.epoch >= start + 3 for p in honest), timeout=180)
            honest_ids = {p.node.peer_id for p in honest}
            seen_all: set[object] = set()
            for p in honest:
                groups_p = p.node.averager.groups
                for e in steps:
                    read = await groups_p.announcements(
                        groups_p.keys(group_key(e)), groups_p.tag(group_key(e))
                    )
                    peers = [a.peer for a in read]
                    assert len(peers) == len(set(peers))  # once each
                    strangers = set(peers) - honest_ids
                    if e != target:  # (another step's group key: none of theirs)
                        assert not strangers, strangers
                        continue
                    assert strangers <= counted, strangers - counted  # only under its own bucket's key
                    seen_all |= strangers
            assert seen_all == counted  # (and those read: the test sees the ones that must not count)
            attackers.cancel_scope.cancel()
        check_identical_per_epoch(honest, 0)


@pytest.mark.parametrize("seed", [1, 2])
async def test_announcements_count_once_and_only_under_their_bucket(
    seed: int, autojump_clock: object
) -> None:
    await _announcements(seed)
