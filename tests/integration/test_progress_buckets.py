"""Progress records spread over bucket keys (``progress.buckets``): collaborative peers over the
in-memory network on the virtual clock.

The invariant: a peer's records count only under its own bucket's key, and once. So the view a reader
builds from all the keys is the view one key gave (every honest peer in it, once), ids that write a
record under another bucket's key, or under several, add nothing there, and filling a bucket's key
takes ids whose hash falls in it. Tested with seeded adversaries that write records of random steps
under random sets of keys beside a swarm that trains.
"""

from __future__ import annotations

import random

import pytest
import trio

from p2ptrain.dht.records import owned_subkey
from p2ptrain.dht.spread import bucket_of
from p2ptrain.identity import Identity
from p2ptrain.training.optimizer.progress import ProgressRecord
from p2ptrain.wire.codec import pack
from tests.harness.dht import store_as
from tests.harness.training import Peer, check_identical_per_epoch, run_config, swarm

pytestmark = pytest.mark.timeout(600)  # (swarms of 4 nodes train meanwhile: real CPU, a busy machine)

BUCKETS = 4


def records_by_peer(p: Peer) -> dict[object, int]:
    counts: dict[object, int] = {}
    for r in p.opt.board.records:
        counts[r.peer] = counts.get(r.peer, 0) + 1
    return counts


async def write_under(p: Peer, who: Identity, keys: list[bytes], record: ProgressRecord, ttl: float) -> None:
    """``who``'s signed record stored under each of ``keys`` from ``p``'s node."""
    await store_as(p.node.dht, who, keys, pack(record.to_obj()), p.opt.clock() + ttl)


async def _buckets(seed: int) -> None:
    rng = random.Random(seed)
    config = run_config("sync").replace("progress", buckets=BUCKETS)
    async with swarm(config) as s:
        honest = [await s.start(compute=rng.choice([0.1, 0.15, 0.2])) for _ in range(4)]
        await s.until(lambda: all(p.opt.epoch >= 2 for p in honest), timeout=120)
        board = honest[0].opt.board
        assert len(set(board.keys)) == BUCKETS and board.keys == honest[1].opt.board.keys
        for p in honest:  # each honest record under its own bucket's key, and no other
            mine = owned_subkey(p.node.peer_id)
            under = [k for k in board.keys if any(mine in q.node.dht.held(k) for q in honest)]
            assert under == [board.key_of(p.node.peer_id)]
            assert p.opt.key == under[0]

        # ids that write records under random sets of keys: their own bucket's among them or not
        ids = [Identity.generate() for _ in range(rng.randint(6, 14))]
        placed = {who.peer_id: rng.sample(board.keys, rng.randint(1, BUCKETS)) for who in ids}
        counted = {
            who.peer_id
            for who in ids
            if board.keys[bucket_of(who.peer_id.digest, board.bits)] in placed[who.peer_id]
        }
        epoch = max(p.opt.epoch for p in honest)
        ttl = config.progress.ttl

        async def keep_writing(who: Identity) -> None:
            while True:
                record = ProgressRecord(
                    epoch=epoch + rng.choice([0, 1, 50]),
                    samples=rng.randrange(10**6),
                    rate=rng.uniform(0, 1e6),
                    time=trio.current_time(),
                    digest=rng.randbytes(32),
                    run=honest[0].opt.fingerprint,
                )
                await write_under(rng.choice(honest), who, placed[who.peer_id], record, ttl)
                await trio.sleep(ttl / 3)

        async with trio.open_nursery() as attackers:
            for who in ids:
                attackers.start_soon(keep_writing, who)
            start = max(p.opt.epoch for p in honest)
            await s.until(lambda: all(p.opt.epoch >= start + 3 for p in honest), timeout=180)
            # a read of the replicas by each, now (the loops' own reads hold what they held)
            for p in honest:
                await p.opt.board.refresh(network=True)
            honest_ids = {p.node.peer_id for p in honest}
            seen: set[object] = set()
            for p in honest:
                counts = records_by_peer(p)
                assert all(c == 1 for c in counts.values()), counts  # once each
                assert honest_ids <= counts.keys()  # every honest peer, whatever its bucket
                sybils_seen = counts.keys() - honest_ids
                assert sybils_seen <= counted, sybils_seen - counted  # only from its own bucket's key
                seen |= sybils_seen
            assert seen == counted  # (and those read: the test can see the ones that must not count)
            attackers.cancel_scope.cancel()
        check_identical_per_epoch(honest, 0)


@pytest.mark.parametrize("seed", [1, 2])
async def test_records_count_once_and_only_under_their_bucket(seed: int, autojump_clock: object) -> None:
    await _buckets(seed)


def test_buckets_setting_is_checked() -> None:
    from p2ptrain.errors import ConfigError

    for bad in (0, 3, 6, 128):
        with pytest.raises(ConfigError, match=r"progress\.buckets"):
            run_config("sync").replace("progress", buckets=bad)
