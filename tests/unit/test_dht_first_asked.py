"""Who a hot key's direct read asks first (``dht.reads.first_asked``), and what a slow one costs it
(``Replicas.demote``): the cost of a key's reads is spread over its ``FIRST_SPREAD`` closest replicas.

At 64 and 128 simulated peers the progress key's closest replica, asked first by every reader, sent 20x
and 50x the median node's control bytes. Drawn over many reader ids, each of the closest few comes
first for about as many of them; every read still asks the same replicas (a permutation), each reader
always in the same order for a key, and farther replicas keep their order.
"""

from __future__ import annotations

import hashlib
import random

from p2ptrain.dht.reads import FIRST_SPREAD, first_asked
from p2ptrain.dht.replicas import Replicas
from p2ptrain.dht.routing import Contact, RoutingTable
from p2ptrain.identity import PEER_ID_BYTES, PeerID
from p2ptrain.net.address import PeerAddress


def peer(rng: random.Random) -> PeerID:
    return PeerID(rng.randbytes(PEER_ID_BYTES))


def contacts(rng: random.Random, n: int) -> list[Contact]:
    return [Contact(peer(rng), PeerAddress.for_host(f"10.0.{i}.1", 4000)) for i in range(n)]


def test_each_of_the_closest_few_is_asked_first_by_about_as_many_readers() -> None:
    rng = random.Random(1)
    for n in (1, 2, 3, 5, 20):
        replicas = contacts(rng, n)
        kid = hashlib.blake2b(rng.randbytes(8), digest_size=32).digest()
        firsts: dict[Contact, int] = {}
        readers = [peer(rng) for _ in range(900)]
        for reader in readers:
            order = first_asked(replicas, reader, kid)
            assert sorted(order, key=replicas.index) == replicas  # (the same replicas: a permutation)
            assert order == first_asked(replicas, reader, kid)  # (a reader's order is fixed for the key)
            spread = min(FIRST_SPREAD, n)
            assert order[0] in replicas[:spread]
            assert [c for c in order[1:]] == [c for c in replicas if c != order[0]]  # (the rest in order)
            firsts[order[0]] = firsts.get(order[0], 0) + 1
        spread = min(FIRST_SPREAD, n)
        assert len(firsts) == spread
        share = len(readers) / spread
        assert all(0.8 * share <= count <= 1.2 * share for count in firsts.values()), firsts


def test_the_same_reader_starts_at_different_replicas_for_different_keys() -> None:
    rng = random.Random(2)
    replicas, reader = contacts(rng, 20), peer(rng)
    firsts = {first_asked(replicas, reader, rng.randbytes(32))[0] for _ in range(60)}
    assert firsts == set(replicas[:FIRST_SPREAD])


def test_a_slow_first_replica_among_the_closest_goes_last() -> None:
    rng = random.Random(3)
    local = peer(rng)
    now = [0.0]
    replicas = Replicas(RoutingTable(local), k=20, replication=5, clock=lambda: now[0])
    kid = rng.randbytes(32)
    found = contacts(rng, 5)
    replicas.found(kid, found, 0.0)
    order = replicas.known(kid)
    assert order is not None and len(order) == 5
    replicas.demote(kid, order[1], FIRST_SPREAD)  # (a reader that asks the second closest first)
    after = replicas.known(kid)
    assert after is not None and after[-1] == order[1] and after[:1] + after[1:4] == [order[0], *order[2:]]
    replicas.demote(kid, after[4], 1)  # (not among the first: stays where it is)
    assert replicas.known(kid) == after
