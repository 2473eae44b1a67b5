"""A live node's passing refusal is not its absence, in the DHT too (``errors.passing``).

A node whose inbound slots are full answers "busy", or closes an idle connection as a newcomer takes its
slot (``net.admission``), and a call may be on its way over it. Taken for failures, those answers made a
reader forget a hot key's replicas and look them up again, and counted against the nodes in its routing
table: at 128 simulated peers with 48 slots a node, reads "failed" by a replica went from 0.4 to 3.3
per peer per step once full tables turned idle connections over, and node lookups doubled.

What is proved here, over random faults of the replicas of a key a node writes and reads (each op's
replicas answer, are busy at the handshake or the call, close the connection under it, or are gone):
after an op whose every failure was passing, the replicas are still remembered and no node that failed
so has a failure against it in the routing table, as no failure at all would have left them (an op
with a lasting failure, an unreachable node, forgets them as before).
"""

from __future__ import annotations

import random

import pytest
import trio

from p2ptrain.dht import DHTConfig, key_id
from p2ptrain.errors import ConnectionClosed, HandshakeRefused, PeerUnavailable, RemoteCallError, passing
from tests.harness.dht import open_swarm

KEY = b"scale/hot"
CONFIG = DHTConfig(k=4, replication=3, get_quorum=1)  # (10 nodes: more than k, no shortcut)

FAULTS = {
    "handshake busy": lambda: HandshakeRefused("busy", "too many connections; try later", by_remote=True),
    "call busy": lambda: RemoteCallError("ab..cd", "dht.find_value", "busy", "this origin's share is spent"),
    "closed under the call": lambda: ConnectionClosed("connection closed by the remote: evicted"),
    "gone": lambda: PeerUnavailable("cannot reach it: connection refused"),
}


@pytest.mark.parametrize("seed", range(4))
async def test_replicas_that_fail_passingly_are_kept_and_count_no_failure(autojump_clock, seed: int) -> None:
    rng = random.Random(seed)
    with trio.fail_after(600):
        async with open_swarm(CONFIG) as swarm:
            for i in range(10):
                await swarm.start(f"s{i}", [swarm.nodes[0].address] if swarm.nodes else [])
            node = swarm.nodes[-1]
            dht, kid = node.dht, key_id(KEY)
            client = dht.client
            faults: dict[object, str] = {}  # peer id -> the fault of its calls in this op
            hit: list[str] = []  # the faults the op's calls met

            def faulty(call, about):  # type: ignore[no-untyped-def]
                async def wrapped(contact, *args, **kwargs):  # type: ignore[no-untyped-def]
                    kind = faults.get(contact.peer_id)
                    if kind is not None and about(*args) == kid:  # (the key's calls, not maintenance)
                        hit.append(kind)
                        raise FAULTS[kind]()
                    return await call(contact, *args, **kwargs)

                return wrapped

            client.query = faulty(client.query, lambda target, *_: target)
            client.store = faulty(client.store, lambda entries, *_: key_id(entries[0].key))
            looked_up: list[bytes] = []
            lookup = dht.reader.lookup

            async def counting(target, *args, **kwargs):  # type: ignore[no-untyped-def]
                looked_up.append(target)
                return await lookup(target, *args, **kwargs)

            dht.reader.lookup = counting
            assert await dht.store(KEY, b"first", ttl=60.0) >= CONFIG.replication
            kinds, met = list(FAULTS), {"passing": 0, "lasting": 0}
            for op in range(24):
                replicas = dht.replicas.remembered(kid) or await dht.reader.replicas_of(kid)
                faults.clear()
                hit.clear()
                looked_up.clear()
                for contact in replicas:
                    if rng.random() < 0.6:
                        faults[contact.peer_id] = rng.choice(kinds[:3] if rng.random() < 0.8 else kinds)
                before = {c.peer_id for c in dht.table.answering()}
                if op % 2:
                    await dht.store(KEY, b"beat %d" % op, ttl=60.0)
                else:
                    await dht.get(KEY)
                lasting = any(not passing(FAULTS[k]()) for k in hit)
                if not hit:
                    continue
                met["lasting" if lasting else "passing"] += 1
                if lasting:  # (forgotten as before: taken again from a lookup, or the swarm's set)
                    continue
                assert dht.replicas.remembered(kid) is not None, hit
                if len(faults) < len(replicas):  # (one answered: nothing to look up)
                    assert kid not in looked_up, hit
                answering = {c.peer_id for c in dht.table.answering()}
                for peer in faults:
                    if peer in before:
                        assert peer in answering, (faults[peer], hit)
            assert met["passing"] >= 3, met  # (the faults were met, not just drawn)
