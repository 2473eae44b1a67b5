"""The iterative Kademlia lookup, driven synchronously over a simulated network.

The network is a dict ``peer -> RoutingTable``: every peer knows its 2k nearest neighbours (as the near
buckets of a well-joined node do) and a random sample of the rest. A query is answered from that dict at
once; the order in which in-flight queries complete is drawn at random, so answers arrive out of order as
they do over a WAN.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Collection

import pytest

from p2ptrain.dht.lookup import Lookup
from p2ptrain.dht.routing import Contact, RoutingTable
from p2ptrain.identity import PEER_ID_BYTES, PeerID
from p2ptrain.net.address import PeerAddress

N_PEERS = 500
K = 20
ALPHA = 3
SAMPLE = 60
NEAR = 2 * K


def as_int(raw: bytes) -> int:
    return int.from_bytes(raw, "big")


class Network:
    def __init__(self, n: int, seed: int) -> None:
        rng = random.Random(seed)
        self.ids = [PeerID(rng.randbytes(PEER_ID_BYTES)) for _ in range(n)]
        self.contacts = {
            p: Contact(p, PeerAddress.for_host(f"10.{i // 250}.{i % 250}.1", 4000))
            for i, p in enumerate(self.ids)
        }
        self.tables: dict[PeerID, RoutingTable] = {}
        ints = {p: as_int(p.digest) for p in self.ids}
        for p in self.ids:
            table = RoutingTable(p, k=K)
            near = self.true_closest(p.digest, NEAR, exclude={p}, _ints=ints)
            # Near neighbours first, so their (small) buckets hold them all.
            for q in near + rng.sample(self.ids, SAMPLE):
                table.observe(self.contacts[q], now=0.0)
            self.tables[p] = table

    def true_closest(
        self,
        target: bytes,
        count: int = K,
        exclude: Collection[PeerID] = (),
        _ints: dict[PeerID, int] | None = None,
    ) -> list[PeerID]:
        """Brute force: the ``count`` peers closest to ``target`` in the whole network."""
        t = as_int(target)
        ints = _ints or {p: as_int(p.digest) for p in self.ids}
        return sorted((p for p in self.ids if p not in exclude), key=lambda p: ints[p] ^ t)[:count]

    def answer(self, asked: Contact, target: bytes) -> list[Contact]:
        return self.tables[asked.peer_id].closest(target, K)


@functools.cache
def network() -> Network:
    return Network(N_PEERS, seed=2024)


def drive(
    lookup: Lookup,
    net: Network,
    rng: random.Random,
    *,
    dead: Collection[PeerID] = (),
    answer: Callable[[Contact], list[Contact]] | None = None,
    max_candidates: int | None = None,
) -> list[Contact]:
    """Run ``lookup`` to the end; returns every contact it queried, in order."""
    in_flight: list[Contact] = []
    queried: list[Contact] = []
    for _ in range(10 * N_PEERS):
        new = lookup.next_queries()
        assert len(new) <= lookup.alpha
        assert not {c.peer_id for c in new} & {c.peer_id for c in in_flight}
        in_flight += new
        queried += new
        assert lookup.in_flight == len(in_flight) <= lookup.alpha
        if max_candidates is not None:
            assert len(lookup.candidates) <= max_candidates  # memory stays bounded
        if lookup.finished:
            return queried
        # Not finished and nothing in flight would be a stall: the lookup must always have work.
        assert in_flight, "lookup neither finished nor querying"
        c = in_flight.pop(rng.randrange(len(in_flight)))
        if c.peer_id in dead:
            lookup.on_failure(c.peer_id)
        else:
            lookup.on_response(c.peer_id, answer(c) if answer else net.answer(c, lookup.target))
    raise AssertionError("lookup did not finish")


def new_lookup(
    net: Network, rng: random.Random, *, k: int = K, alpha: int = ALPHA, max_candidates: int = 1000
) -> tuple[Lookup, PeerID]:
    """A lookup for a random target from a random peer, seeded from that peer's table."""
    local = rng.choice(net.ids)
    target = rng.randbytes(PEER_ID_BYTES)
    seeds = net.tables[local].closest(target, K)
    return Lookup(target, seeds, local=local, k=k, alpha=alpha, max_candidates=max_candidates), local


def ids(contacts: list[Contact]) -> list[PeerID]:
    return [c.peer_id for c in contacts]


# ---- convergence ----------------------------------------------------------------------------------


def test_lookup_converges_to_the_true_k_closest() -> None:
    net, rng = network(), random.Random(1)
    for _ in range(60):
        lookup, local = new_lookup(net, rng)
        queried = drive(lookup, net, rng)
        assert ids(lookup.closest()) == net.true_closest(lookup.target, K, exclude={local})
        assert local not in ids(queried)
        assert len(set(ids(queried))) == len(queried)  # nobody is asked twice
        assert lookup.queries == len(queried) < 100
        assert lookup.failed() == []


def test_lookup_from_a_single_bootstrap_contact() -> None:
    """A newcomer (not in the network) that knows one peer still finds the true k closest."""
    net, rng = network(), random.Random(2)
    newcomer = PeerID(bytes(PEER_ID_BYTES))
    for _ in range(30):
        target = rng.randbytes(PEER_ID_BYTES)
        bootstrap = net.contacts[rng.choice(net.ids)]
        lookup = Lookup(target, [bootstrap], local=newcomer, k=K, alpha=ALPHA)
        drive(lookup, net, rng)
        assert ids(lookup.closest()) == net.true_closest(target, K)
        assert lookup.queries < 100


def test_lookup_for_an_existing_peer_finds_it_first() -> None:
    net, rng = network(), random.Random(3)
    for _ in range(20):
        wanted = rng.choice(net.ids)
        local = rng.choice([p for p in net.ids if p != wanted])
        lookup = Lookup(wanted.digest, net.tables[local].closest(wanted.digest, K), local=local, k=K)
        drive(lookup, net, rng)
        assert lookup.closest(1) == [net.contacts[wanted]]


@pytest.mark.parametrize("alpha", [1, 2, 3, 8])
def test_alpha_bounds_queries_in_flight(alpha: int) -> None:
    net, rng = network(), random.Random(alpha)
    for _ in range(10):
        lookup, local = new_lookup(net, rng, alpha=alpha)
        seeds = net.tables[local].closest(lookup.target, K)
        first = lookup.next_queries()
        assert len(first) == alpha  # parallelism is used from the start
        assert lookup.next_queries() == []  # and no more until one completes
        assert lookup.in_flight == alpha
        assert first == seeds[:alpha]  # the first wave is the closest seeds, closest first
        for c in first:
            lookup.on_response(c.peer_id, net.answer(c, lookup.target))
        drive(lookup, net, rng)  # asserts in_flight <= alpha at every step
        assert ids(lookup.closest()) == net.true_closest(lookup.target, K, exclude={local})


@pytest.mark.parametrize("dead_fraction", [0.1, 0.2, 0.3])
def test_dead_peers_are_skipped(dead_fraction: float) -> None:
    """Dead peers stay in everyone's table (nobody has noticed yet) and fail every query.

    Honest answers then carry dead contacts in place of live ones, so a lookup for k = K/2 (half the
    answer size, the usual replication margin) is checked against the brute-force truth; the full-k
    lookup is checked against everything it heard, which is all that an answer of K contacts can tell.
    """
    net, rng = network(), random.Random(int(dead_fraction * 100))
    for k in [K // 2] * 15 + [K] * 5:
        lookup, local = new_lookup(net, rng, k=k)
        dead = set(rng.sample([p for p in net.ids if p != local], int(dead_fraction * N_PEERS)))
        heard = set(lookup.candidates)  # the seeds

        def answer(c: Contact, lookup: Lookup = lookup, heard: set[PeerID] = heard) -> list[Contact]:
            contacts = net.answer(c, lookup.target)
            heard.update(ids(contacts))
            return contacts

        queried = drive(lookup, net, rng, dead=dead, answer=answer)
        found = ids(lookup.closest())
        assert not set(found) & dead
        t = as_int(lookup.target)
        live_heard = sorted(heard - dead - {local}, key=lambda p: as_int(p.digest) ^ t)
        assert found == live_heard[:k]
        if k < K:
            assert found == net.true_closest(lookup.target, k, exclude=dead | {local})
        failed = lookup.failed()
        assert set(failed) <= dead
        assert sorted(failed) == sorted(p for p in ids(queried) if p in dead)
        assert len(set(ids(queried))) == len(queried)  # a failed peer is not asked again
        assert lookup.queries < 100


def test_all_seeds_dead_ends_with_nothing() -> None:
    net, rng = network(), random.Random(4)
    lookup, _ = new_lookup(net, rng)
    seeds = [c.contact.peer_id for c in lookup.candidates.values()]
    drive(lookup, net, rng, dead=set(net.ids))
    assert lookup.finished
    assert lookup.closest() == []
    assert sorted(lookup.failed()) == sorted(seeds)


def test_no_seeds_is_finished_at_once() -> None:
    lookup = Lookup(bytes(PEER_ID_BYTES), [], local=network().ids[0])
    assert lookup.finished
    assert lookup.next_queries() == []
    assert lookup.closest() == []
    assert lookup.queries == 0


# ---- hostile and unhelpful answers ----------------------------------------------------------------


def empty(c: Contact, net: Network, target: bytes, local: PeerID) -> list[Contact]:
    return []


def far_away(c: Contact, net: Network, target: bytes, local: PeerID) -> list[Contact]:
    t = as_int(target)
    return sorted(net.contacts.values(), key=lambda x: as_int(x.peer_id.digest) ^ t)[-K:]


def duplicates_and_self(c: Contact, net: Network, target: bytes, local: PeerID) -> list[Contact]:
    honest = net.answer(c, target)[:3]
    local_contact = Contact(local, PeerAddress.for_host("10.9.9.9", 1))
    return [c, c, local_contact, local_contact, *honest, *honest, *honest]


def only_itself(c: Contact, net: Network, target: bytes, local: PeerID) -> list[Contact]:
    return [c] * 50


def wrong_addresses(c: Contact, net: Network, target: bytes, local: PeerID) -> list[Contact]:
    """The right ids, but every address points at the liar: they are still asked by id."""
    return [Contact(x.peer_id, c.address) for x in net.answer(c, target)]


@pytest.mark.parametrize("behaviour", [empty, far_away, duplicates_and_self, only_itself, wrong_addresses])
def test_unhelpful_answers_do_not_break_the_lookup(behaviour: Callable[..., list[Contact]]) -> None:
    net, rng = network(), random.Random(5)
    liars = set(rng.sample(net.ids, N_PEERS // 5))
    for _ in range(20):
        lookup, local = new_lookup(net, rng)

        def answer(c: Contact, lookup: Lookup = lookup, local: PeerID = local) -> list[Contact]:
            if c.peer_id in liars:
                return behaviour(c, net, lookup.target, local)
            return net.answer(c, lookup.target)

        queried = drive(lookup, net, rng, answer=answer)
        # Liars answered, so they are live results when they are among the closest.
        assert ids(lookup.closest()) == net.true_closest(lookup.target, K, exclude={local})
        assert local not in ids(queried)
        assert len(set(ids(queried))) == len(queried)
        assert lookup.queries < 150


def test_answers_out_of_turn_are_ignored() -> None:
    net, rng = network(), random.Random(6)
    lookup, _ = new_lookup(net, rng)
    first = lookup.next_queries()
    stranger = next(c for c in net.contacts.values() if c.peer_id not in lookup.candidates)
    # An answer from a peer never asked, or asked but not yet sent to (pending), adds nothing.
    assert lookup.on_response(stranger.peer_id, net.answer(stranger, lookup.target)) == 0
    pending = next(c.contact for c in lookup.candidates.values() if c.state == "pending")
    assert lookup.on_response(pending.peer_id, net.answer(pending, lookup.target)) == 0
    assert lookup.candidates[pending.peer_id].state == "pending"
    # A failure report for a peer not in flight changes nothing either.
    lookup.on_failure(stranger.peer_id)
    lookup.on_failure(pending.peer_id)
    assert lookup.failed() == []
    # A second answer (or a late failure) from a peer that already answered is ignored.
    c = first[0]
    lookup.on_response(c.peer_id, net.answer(c, lookup.target))
    assert lookup.on_response(c.peer_id, list(net.contacts.values())) == 0
    lookup.on_failure(c.peer_id)
    assert c.peer_id not in lookup.failed()
    assert lookup.in_flight == len(first) - 1


def test_on_response_counts_new_candidates_only() -> None:
    net = network()
    local, a, b, c, d = net.ids[:5]
    contact = net.contacts
    lookup = Lookup(bytes(PEER_ID_BYTES), [contact[a], contact[a], contact[local]], local=local, k=K)
    assert [x.peer_id for x in lookup.next_queries()] == [a]  # duplicate and own seed dropped
    assert lookup.on_response(a, [contact[a], contact[b], contact[b], contact[local], contact[c]]) == 2
    assert set(lookup.candidates) == {a, b, c}
    assert lookup.on_response(d, [contact[d]]) == 0


# ---- stop, memory, results ------------------------------------------------------------------------


def test_stop_ends_a_value_lookup_once_in_flight_queries_drain() -> None:
    net, rng = network(), random.Random(7)
    lookup, _ = new_lookup(net, rng)
    in_flight = lookup.next_queries()
    assert len(in_flight) == ALPHA
    c = in_flight.pop(0)
    lookup.on_response(c.peer_id, net.answer(c, lookup.target))
    lookup.stop()  # the driver found the value it wanted
    assert lookup.next_queries() == []
    assert not lookup.finished  # two queries still in flight
    c = in_flight.pop(0)
    lookup.on_response(c.peer_id, net.answer(c, lookup.target))
    assert not lookup.finished
    assert lookup.next_queries() == []
    c = in_flight.pop(0)
    lookup.on_failure(c.peer_id)
    assert lookup.finished
    assert lookup.queries == ALPHA
    assert len(lookup.closest()) == 2
    assert lookup.failed() == [c.peer_id]


def test_stop_with_nothing_in_flight_finishes_at_once() -> None:
    net, rng = network(), random.Random(8)
    lookup, _ = new_lookup(net, rng)
    lookup.stop()
    assert lookup.finished
    assert lookup.next_queries() == []
    assert lookup.queries == 0


@pytest.mark.parametrize("max_candidates", [K + ALPHA + 2, 2 * K, 3 * K, 1000])
def test_max_candidates_caps_memory_and_the_lookup_still_converges(max_candidates: int) -> None:
    net, rng = network(), random.Random(max_candidates)
    for _ in range(20):
        lookup, local = new_lookup(net, rng, max_candidates=max_candidates)
        drive(lookup, net, rng, max_candidates=max_candidates)
        assert ids(lookup.closest()) == net.true_closest(lookup.target, K, exclude={local})


def test_max_candidates_with_a_flood_of_far_contacts() -> None:
    """A peer that answers with hundreds of far contacts cannot push the close ones out."""
    net, rng = network(), random.Random(9)
    cap = 50
    for _ in range(10):
        lookup, local = new_lookup(net, rng, max_candidates=cap)
        t = as_int(lookup.target)
        flood = sorted(net.contacts.values(), key=lambda x: as_int(x.peer_id.digest) ^ t)[-300:]

        def answer(c: Contact, lookup: Lookup = lookup, flood: list[Contact] = flood) -> list[Contact]:
            return flood + net.answer(c, lookup.target)

        drive(lookup, net, rng, answer=answer, max_candidates=cap)
        assert ids(lookup.closest()) == net.true_closest(lookup.target, K, exclude={local})


def test_closest_returns_only_answered_contacts_sorted_and_honours_count() -> None:
    net, rng = network(), random.Random(10)
    lookup, local = new_lookup(net, rng)
    dead = set(net.true_closest(lookup.target, 5, exclude={local}))
    drive(lookup, net, rng, dead=dead)
    t = as_int(lookup.target)
    result = lookup.closest(1000)
    assert ids(result) == sorted(ids(result), key=lambda p: as_int(p.digest) ^ t)
    assert len(result) >= K and not set(ids(result)) & dead
    assert lookup.closest(5) == result[:5]
    assert lookup.closest(0) == []
    assert lookup.closest() == result[:K]
