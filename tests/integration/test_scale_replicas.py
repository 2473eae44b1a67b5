"""A key's replicas are looked up when they change, not on a timer: a node that writes a key every few
seconds (a progress record's heartbeat, the peer list, what it re-publishes) in a swarm larger than
``k`` (past the small-swarm shortcut) looks them up once, and peers that join closer to the key take
the farthest replicas' places without a lookup. (With a lookup every 30 s per key written, each of
about ``k`` queries answered with ``k`` contacts, node lookups were half of a 32-peer swarm's control
bytes.)"""

from __future__ import annotations

import random

import pytest
import trio

from p2ptrain.dht import DHTConfig, key_id
from p2ptrain.dht.replicas import NEWCOMERS_CHECK
from p2ptrain.net.memory import LinkProfile
from tests.harness.dht import open_swarm
from tests.harness.identities import identity

KEY = b"scale/hot"
CONFIG = DHTConfig(k=4, replication=3, get_quorum=1)  # (10 nodes: more than k, no shortcut)


def count_lookups(dht) -> list[bytes]:  # type: ignore[no-untyped-def]
    """Record the target of each node lookup ``dht`` runs."""
    find_node, targets = dht.reader.find_node, []

    async def counting(target: bytes):  # type: ignore[no-untyped-def]
        targets.append(target)
        return await find_node(target)

    dht.reader.find_node = counting
    return targets


def closest_name(kid: bytes, taken: set[str]) -> str:
    """A node name whose id is closer to ``kid`` than any of ``taken``'s."""
    t = int.from_bytes(kid, "big")

    def far(name: str) -> int:
        return int.from_bytes(identity(name).peer_id.digest, "big") ^ t

    best = min(far(n) for n in taken)
    return next(n for n in (f"near{i}" for i in range(100_000)) if far(n) < best)


async def test_a_key_written_every_few_seconds_is_looked_up_once(autojump_clock: object) -> None:
    with trio.fail_after(600):
        async with open_swarm(CONFIG) as swarm:
            for i in range(10):
                await swarm.start(f"s{i}", [swarm.nodes[0].address] if swarm.nodes else [])
            writer = swarm.nodes[-1]
            lookups = count_lookups(writer.dht)
            kid = key_id(KEY)
            for beat in range(40):  # 200 virtual seconds of heartbeats
                assert await writer.dht.store(KEY, b"beat %d" % beat, ttl=10.0) >= CONFIG.replication
                await trio.sleep(5.0)
            assert lookups.count(kid) == 1, len(lookups)  # (30 s apart before: 7)

            # A peer that joins closer to the key than every replica, met by the writer, takes the
            # farthest one's place at the next stores: no lookup.
            kid_names = {n.name for n in swarm.nodes}
            near = await swarm.start(closest_name(kid, kid_names), [writer.address])
            assert writer.dht.table.get(near.host.peer_id) is not None  # (it joined through the writer)
            lookups.clear()
            await trio.sleep(NEWCOMERS_CHECK)
            assert await writer.dht.store(KEY, b"after", ttl=10.0) >= CONFIG.replication
            assert kid not in lookups, len(lookups)
            held = near.dht.held(KEY)
            assert held[b""].value == b"after"
            replicas = writer.dht.replicas.remembered(kid) or []
            assert len(replicas) == CONFIG.replication and replicas[-1].peer_id == near.host.peer_id


async def test_a_replica_that_fails_makes_the_next_store_look_them_up(autojump_clock: object) -> None:
    """Remembered for long, but not past a failure: a replica that crashed is replaced at once."""
    with trio.fail_after(600):
        async with open_swarm(CONFIG) as swarm:
            for i in range(10):
                await swarm.start(f"f{i}", [swarm.nodes[0].address] if swarm.nodes else [])
            writer = swarm.nodes[-1]
            lookups = count_lookups(writer.dht)
            kid = key_id(KEY)
            assert await writer.dht.store(KEY, b"one", ttl=60.0) >= CONFIG.replication
            gone = {c.peer_id for c in writer.dht.replicas.remembered(kid) or []}
            victim = next(n for n in swarm.nodes if n.host.peer_id in gone and n is not swarm.nodes[0])
            await swarm.kill(victim)
            await writer.dht.store(KEY, b"two", ttl=60.0)  # (fails on the dead one: looked up next)
            assert await writer.dht.store(KEY, b"three", ttl=60.0) >= CONFIG.replication
            assert lookups.count(kid) == 2, len(lookups)
            now = {c.peer_id for c in writer.dht.replicas.remembered(kid) or []}
            assert victim.host.peer_id not in now


async def test_a_key_read_every_few_seconds_by_a_non_writer_is_read_from_its_replicas(
    autojump_clock: object,
) -> None:
    """A node that reads a key it never writes (a large run's progress records under the other peers'
    bucket keys) looks its replicas up once and asks them directly from then on, as a writer does. On
    the code before, each read was a lookup of the value, whose every hop that held the entries sent
    them: at 256 nodes that tripled the bytes of the reads of four bucket keys."""
    with trio.fail_after(600):
        async with open_swarm(CONFIG) as swarm:
            for i in range(10):
                await swarm.start(f"r{i}", [swarm.nodes[0].address] if swarm.nodes else [])
            writer, reader = swarm.nodes[0], swarm.nodes[-1]
            lookups = count_lookups(reader.dht)
            value_lookups: list[bytes] = []
            lookup = reader.dht.reader.lookup

            async def counting(target: bytes, **kw: object):  # type: ignore[no-untyped-def]
                if kw.get("value"):
                    value_lookups.append(target)
                return await lookup(target, **kw)  # type: ignore[arg-type]

            reader.dht.reader.lookup = counting
            kid = key_id(KEY)
            for beat in range(40):  # 200 virtual seconds: written every 5 s, read every 2.5 s
                assert await writer.dht.store(KEY, b"beat %d" % beat, ttl=10.0) >= CONFIG.replication
                for _ in range(2):
                    got = await reader.dht.get(KEY)
                    assert got[b""].value == b"beat %d" % beat
                    await trio.sleep(2.5)
            assert value_lookups.count(kid) <= 1, len(value_lookups)  # (80 before: one a read)
            assert lookups.count(kid) <= 2, len(lookups)  # (its replicas, once, and once more at most)


async def test_the_first_read_of_a_key_others_write_asks_its_replicas_not_a_lookup_of_the_value(
    autojump_clock: object,
) -> None:
    """A run's progress keys are written by the others (``written``): even a node's first read of one
    looks its replicas up and asks them directly, so that the readers' first reads, all at the start of
    a run, are spread over the replicas instead of each being a lookup of the value that ends at the
    key's closest replicas, which each send it whole. The answer is the same; a key nobody wrote yet
    still reads as empty (its replicas hold nothing: a lookup of the value then confirms it). On the code
    before, every node's first read of every key was a lookup of the value."""
    with trio.fail_after(600):
        async with open_swarm(CONFIG) as swarm:
            for i in range(10):
                await swarm.start(f"w{i}", [swarm.nodes[0].address] if swarm.nodes else [])
            writer, readers = swarm.nodes[0], swarm.nodes[1:]
            assert await writer.dht.store(KEY, b"record", ttl=60.0) >= CONFIG.replication
            kid = key_id(KEY)
            value_lookups: list[bytes] = []
            for r in readers:
                lookup = r.dht.reader.lookup

                async def counting(target: bytes, _lookup=lookup, **kw: object):  # type: ignore[no-untyped-def]
                    if kw.get("value"):
                        value_lookups.append(target)
                    return await _lookup(target, **kw)

                r.dht.reader.lookup = counting  # type: ignore[method-assign]
            for r in readers:  # (each reader's first read of the key)
                got = await r.dht.get(KEY, quorum=1, written=True)
                assert got[b""].value == b"record"
            assert value_lookups.count(kid) == 0, len(value_lookups)
            empty = await readers[0].dht.get(b"scale/nobody", quorum=1, written=True)
            assert empty == {}


@pytest.mark.parametrize("seed", range(8))
async def test_reads_and_stores_of_a_key_at_once_look_it_up_once(autojump_clock: object, seed: int) -> None:
    """However many stores and reads of one key a node starts before its replicas are known, and in
    whatever order, it looks the key up once; a store or read cancelled while its lookup runs leaves
    the others waiting on it to look the key up themselves, and they all finish (one lookup a
    cancelled leader, at most). Before, each started its own lookup: a peer's publish and read of its
    own bucket's key, started together, were two. Keys, mixes, starts and cancellations drawn."""
    rng = random.Random(seed)
    with trio.fail_after(600):
        async with open_swarm(CONFIG) as swarm:
            for i in range(10):
                await swarm.start(f"s{i}", [swarm.nodes[0].address] if swarm.nodes else [])
            writer = swarm.nodes[-1]
            for i in range(3):  # (others wrote the keys: reads find entries)
                await swarm.nodes[i].dht.store(b"scale/at-once/%d" % i, b"there", ttl=600.0)
            swarm.net.default = LinkProfile(latency=0.01)  # (a lookup takes tens of ms: starts overlap it)
            lookups = count_lookups(writer.dht)
            done: list[bytes] = []
            cancelled: dict[bytes, int] = {}

            async def one(key: bytes, cancel: bool) -> None:
                await trio.sleep(rng.choice([0.0, 0.0, 0.01, 0.03]))
                with trio.CancelScope() as scope:
                    if cancel:
                        scope.deadline = trio.current_time() + rng.uniform(0.0, 0.05)
                    if rng.random() < 0.5:
                        await writer.dht.store(key, b"mine %d" % rng.randrange(99), ttl=600.0)
                    else:
                        await writer.dht.get(key, quorum=1, written=True)
                    done.append(key)
                if scope.cancelled_caught:
                    cancelled[key] = cancelled.get(key, 0) + 1

            keys = [b"scale/at-once/%d" % i for i in range(rng.randrange(1, 4))]
            ops = rng.randrange(4, 12)
            async with trio.open_nursery() as nursery:
                for _ in range(ops):
                    nursery.start_soon(one, rng.choice(keys), rng.random() < 0.3)
            for key in keys:
                started = lookups.count(key_id(key))
                assert 1 <= started <= 1 + cancelled.get(key, 0), (key, started, cancelled)
            assert len(done) + sum(cancelled.values()) == ops  # (every one not cancelled finished)
