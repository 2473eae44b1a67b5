"""Peers heard of as closer to a key than its replicas are asked themselves, not looked up.

Every ``NEWCOMERS_CHECK`` a direct read of a hot key asks one replica for its nearest contacts; a peer
it names closer than the farthest replica used to cost a whole lookup (about ``k`` queries of ``k``
contacts each: at 256 simulated training peers, 1.8 lookups a peer a step). Now the reader asks the
named peers (and those they name closer still, a few hops), and each that answers takes a farthest
replica's place. The invariants, against replicas that name fabricated ids, true ids at false
addresses, and fresh ids at every read:

- a peer becomes a replica only by answering as itself: never a fabricated id, never at an address
  nobody listens on;
- once the joins are over, the replicas are the ``replication`` closest live peers (every honest
  newcomer closer to the key took its place);
- while no reply names more than ``MAX_PROBED`` peers closer than the replicas, the key is looked up
  once (the first store), and each check sends at most ``MAX_PROBED * MAX_ADDRESSES *
  MAX_PROBE_HOPS`` queries;
- a reply that names more is answered by a lookup, as before, and the replicas stay true.
"""

from __future__ import annotations

import contextvars
import random

import pytest
import trio

from p2ptrain.dht import DHTConfig, key_id
from p2ptrain.dht.protocol import ContactMsg, NodesResp
from p2ptrain.dht.reads import MAX_PROBE_HOPS, PROBE_WAIT
from p2ptrain.dht.replicas import MAX_ADDRESSES, MAX_PROBED, NEWCOMERS_CHECK
from p2ptrain.dht.routing import Contact
from p2ptrain.errors import P2PError
from tests.harness.dht import PORT, DhtNode, open_swarm
from tests.integration.test_scale_replicas import closest_name, count_lookups

pytestmark = pytest.mark.timeout(300)

KEY = b"scale/heard"
CONFIG = DHTConfig(k=4, replication=3, get_quorum=1)  # (more nodes than k: no small-swarm shortcut)


def distance(digest: bytes, kid: bytes) -> int:
    return int.from_bytes(digest, "big") ^ int.from_bytes(kid, "big")


def lie(node: DhtNode, kid: bytes, rng: random.Random, fresh: int, victims: list[DhtNode]) -> None:
    """Make ``node`` name, beside its true nearest contacts, ``fresh`` new ids closer to ``kid`` than
    anyone's at every reply (at an address nobody listens on, or at an honest peer's), and the true ids
    of ``victims`` at an address nobody listens on."""
    server = node.dht.server
    nodes_near = server._nodes_near

    def lying(target: bytes, asker):  # type: ignore[no-untyped-def]
        honest = nodes_near(target, asker)
        if target != kid:
            return honest
        fake = []
        for _ in range(fresh):
            digest = (int.from_bytes(kid, "big") ^ rng.getrandbits(40)).to_bytes(32, "big")
            where = rng.choice(["/dns/nowhere/tcp/1000", f"/dns/{node.name}/tcp/{PORT}"])
            fake.append(ContactMsg(digest, where))
        fake += [ContactMsg(v.host.peer_id.digest, "/dns/nowhere/tcp/1000") for v in victims]
        return NodesResp(tuple(honest.contacts) + tuple(fake))

    server._nodes_near = lying


IN_LOOKUP: contextvars.ContextVar[bool] = contextvars.ContextVar("in_lookup", default=False)


def count_probes(node: DhtNode) -> list[bytes]:
    """Record the peer ids ``node`` sends node queries for ``KEY`` to outside a lookup."""
    client, reader, asked = node.dht.client, node.dht.reader, []
    query, find_node = client.query, reader.find_node

    async def counting(contact, target, value, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not value and target == key_id(KEY) and not IN_LOOKUP.get():
            asked.append(contact.peer_id.digest)
        return await query(contact, target, value, *args, **kwargs)

    async def looking_up(target: bytes):  # type: ignore[no-untyped-def]
        token = IN_LOOKUP.set(True)  # (the lookup's queries run in tasks that inherit it)
        try:
            return await find_node(target)
        finally:
            IN_LOOKUP.reset(token)

    client.query = counting
    reader.find_node = looking_up
    return asked


@pytest.mark.parametrize("seed", range(12))
async def test_peers_heard_of_as_closer_become_replicas_only_by_answering(
    autojump_clock: object, seed: int
) -> None:
    rng = random.Random(seed)
    kid = key_id(KEY)
    flood = seed % 4 == 3  # one liar names more fresh ids than a check asks: a lookup answers it
    with trio.fail_after(600):
        async with open_swarm(CONFIG) as swarm:
            for i in range(rng.randint(8, 12)):
                await swarm.start(f"h{seed}-{i}", [swarm.nodes[0].address] if swarm.nodes else [])
            reader = swarm.nodes[-1]
            lookups = count_lookups(reader.dht)
            assert await reader.dht.store(KEY, b"first", ttl=600.0) >= CONFIG.replication
            replicas = {c.peer_id for c in reader.dht.replicas.remembered(kid) or []}
            # Newcomers closer to the key than every peer, met by the replicas, not by the reader
            names = {n.name for n in swarm.nodes}
            newcomers = []
            for _ in range(rng.randint(1, 2)):
                name = closest_name(kid, names)
                names.add(name)
                near_replica = next(n for n in swarm.nodes if n.host.peer_id in replicas)
                swarm.net.partition([name], [reader.name])  # (it joins without meeting the reader)
                newcomers.append(await swarm.start(name, [near_replica.address]))
            swarm.net.heal()
            for n in newcomers:
                assert reader.dht.table.get(n.host.peer_id) is None
                for other in swarm.nodes:  # (the replicas know it: the first one a read asks names it)
                    if other not in (reader, n):
                        assert await other.dht.ping(Contact(n.host.peer_id, n.address))
            liars = [n for n in swarm.nodes if n.host.peer_id in replicas and rng.random() < 0.7]
            liars = liars or [next(n for n in swarm.nodes if n.host.peer_id in replicas)]
            for n in liars:
                fresh = MAX_PROBED + 2 if flood else rng.randint(0, 1)
                lie(n, kid, random.Random(rng.random()), fresh, victims=newcomers)
            probes = count_probes(reader)
            for _ in range(6):
                await trio.sleep(NEWCOMERS_CHECK)
                before = len(probes)
                try:
                    await reader.dht.get(KEY)
                except P2PError:
                    pass
                # (the reader asks them in the background: each address of each hop waited for at most)
                await trio.sleep(PROBE_WAIT * MAX_ADDRESSES * MAX_PROBE_HOPS)
                assert len(probes) - before <= MAX_PROBED * MAX_ADDRESSES * MAX_PROBE_HOPS

            live = {n.host.peer_id: n for n in swarm.nodes}
            remembered = reader.dht.replicas.remembered(kid)
            if remembered is None:  # (dropped after a flood: the next read looks them up)
                await reader.dht.get(KEY)
                remembered = reader.dht.replicas.remembered(kid)
            assert remembered is not None
            for c in remembered:
                assert c.peer_id in live, "a replica that never answered"
                assert c.address.host == live[c.peer_id].name, "a replica at an address nobody listens on"
            others = [p for p in live if p != reader.host.peer_id]  # (its own records are local)
            truth = sorted(others, key=lambda p: distance(p.digest, kid))[: CONFIG.replication]
            assert {c.peer_id for c in remembered} == set(truth), (
                [(c.peer_id.short(), distance(c.peer_id.digest, kid).bit_length()) for c in remembered],
                [(p.short(), distance(p.digest, kid).bit_length()) for p in truth],
                [n.host.peer_id.short() for n in newcomers],
            )
            assert {n.host.peer_id for n in newcomers} <= {c.peer_id for c in remembered}
            if not flood:
                assert lookups.count(kid) == 1, f"{lookups.count(kid)} lookups of the key"
