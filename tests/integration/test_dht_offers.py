"""Offers (``DHT.store(offer_to=...)``): an author sends its new entry straight to the peers that read the
key, which then hold it without a read. Only what its owner signed, only for keys the peer reads, and
at a bounded rate: an offer is a shortcut past the replicas, never a way around the checks of a read.
Over the in-memory network, on the virtual clock."""

from __future__ import annotations

import pytest
import trio

from p2ptrain.dht import DHTConfig, key_id, owned_subkey
from p2ptrain.dht.protocol import OFFER, OfferReq, encode_entries
from p2ptrain.dht.records import make_entry
from p2ptrain.dht.server import OFFERS_PER_MINUTE
from tests.harness.dht import open_swarm

KEY = b"run/offers/progress"
pytestmark = pytest.mark.timeout(120)


async def read_by_all(swarm, n: int, prefix: str):  # type: ignore[no-untyped-def]
    """``n`` nodes; the first stores its record, and the others read it (so they take offers)."""
    nodes = []
    for i in range(n):
        nodes.append(await swarm.start(f"{prefix}{i}", [swarm.nodes[0].address] if swarm.nodes else []))
    author, readers = nodes[0], nodes[1:]
    mine = owned_subkey(author.host.peer_id)
    await author.dht.store(KEY, b"step 1", ttl=60, subkey=mine, sign=True)
    for r in readers:
        assert (await r.dht.get(KEY))[mine].value == b"step 1"
    return author, readers, mine


async def test_an_offered_entry_is_held_without_a_read(autojump_clock: object) -> None:
    with trio.fail_after(300):
        async with open_swarm(DHTConfig()) as swarm:
            nodes = [
                await swarm.start(f"o{i}", [swarm.nodes[0].address] if swarm.nodes else []) for i in range(6)
            ]
            author, reader = nodes[1], nodes[2]
            first = owned_subkey(author.host.peer_id)
            await author.dht.store(KEY, b"step 1", ttl=60, subkey=first, sign=True)
            assert (await reader.dht.get(KEY))[first].value == b"step 1"  # the reader reads the key

            await author.dht.store(KEY, b"step 2", ttl=60, subkey=first, sign=True, offer_to=[reader.address])
            assert reader.dht.held(KEY)[first].value == b"step 2"  # no read in between
            # A peer that never read the key takes nothing offered (it would hold any key for anyone).
            other = nodes[3]
            await author.dht.store(KEY, b"step 3", ttl=60, subkey=first, sign=True, offer_to=[other.address])
            assert not other.dht.reader.reads(key_id(KEY))
            assert reader.dht.held(KEY)[first].value == b"step 3"


async def test_offers_that_are_not_their_owners_are_not_taken(autojump_clock: object) -> None:
    with trio.fail_after(300):
        async with open_swarm(DHTConfig()) as swarm:
            nodes = [
                await swarm.start(f"f{i}", [swarm.nodes[0].address] if swarm.nodes else []) for i in range(4)
            ]
            honest, liar, reader = nodes[1], nodes[2], nodes[3]
            mine = owned_subkey(honest.host.peer_id)
            await honest.dht.store(KEY, b"true", ttl=60, subkey=mine, sign=True)
            assert (await reader.dht.get(KEY))[mine].value == b"true"
            now = trio.current_time()
            forged = [
                make_entry(
                    KEY, b"forged", now + 600, subkey=mine, signer=liar.host.identity
                ),  # not its subkey
                make_entry(KEY, b"anyone's", now + 600),  # unowned: only the replicas speak for it
            ]
            conn = await liar.host.connect(reader.address)
            resp = await conn.call(OFFER, OfferReq(), body=encode_entries(forged), timeout=5)
            assert resp.taken == 0
            held = reader.dht.held(KEY)
            assert held[mine].value == b"true" and b"" not in held
            assert (await reader.dht.get(KEY))[mine].value == b"true"

            # Its own entry (which the reader read from the replicas once), over and over: taken until
            # the rate runs out, then answered 0.
            own = owned_subkey(liar.host.peer_id)
            await liar.dht.store(KEY, b"first", ttl=30, subkey=own, sign=True)  # (older than all below)
            assert (await reader.dht.get(KEY))[own].value == b"first"
            taken = 0
            for i in range(OFFERS_PER_MINUTE + 20):
                entry = make_entry(KEY, b"%d" % i, now + 60 + i, subkey=own, signer=liar.host.identity)
                taken += (await conn.call(OFFER, OfferReq(), body=encode_entries([entry]), timeout=5)).taken
            assert taken == OFFERS_PER_MINUTE - 1  # (the forged offer above counted too)
            await trio.sleep(61.0)
            entry = make_entry(
                KEY, b"later", trio.current_time() + 600, subkey=own, signer=liar.host.identity
            )
            assert (await conn.call(OFFER, OfferReq(), body=encode_entries([entry]), timeout=5)).taken == 1

            # A subkey no read brought is not taken (a new one comes through the replicas, which share
            # a key between origins), and nobody offers another peer's entry, even a genuine one.
            newcomer = await swarm.start("fresh", [reader.address])
            fresh = newcomer.host.identity
            conn = await newcomer.host.connect(reader.address)
            new = make_entry(
                KEY, b"new", trio.current_time() + 600, subkey=owned_subkey(fresh.peer_id), signer=fresh
            )
            assert (await conn.call(OFFER, OfferReq(), body=encode_entries([new]), timeout=5)).taken == 0
            genuine = make_entry(
                KEY, b"newer", trio.current_time() + 900, subkey=mine, signer=honest.host.identity
            )
            liar_conn = await liar.host.connect(reader.address)
            assert (
                await liar_conn.call(OFFER, OfferReq(), body=encode_entries([genuine]), timeout=5)
            ).taken == 0
            assert owned_subkey(fresh.peer_id) not in reader.dht.held(KEY)
            assert all(e.value != b"newer" for e in reader.dht.held(KEY).values())


async def test_a_partner_that_is_a_replica_gets_the_entry_once(autojump_clock: object) -> None:
    """With few peers, most partners are also the key's replicas: the store brings them the entry, and
    an offer besides would send it twice. Every reader still holds the new entry without a read."""
    with trio.fail_after(300):
        async with open_swarm(DHTConfig(replication=3)) as swarm:
            author, readers, mine = await read_by_all(swarm, 5, "p")
            offered: list[object] = []
            offer = author.dht.client.offer

            async def counting(addr, entry):  # type: ignore[no-untyped-def]
                offered.append(addr.peer_id)
                await offer(addr, entry)

            author.dht.client.offer = counting
            replicas = {c.peer_id for c in author.dht.replicas.remembered(key_id(KEY))}
            others = [r for r in readers if r.host.peer_id not in replicas]
            assert len(replicas) == 3 and len(others) == 1
            await author.dht.store(
                KEY, b"step 2", ttl=60, subkey=mine, sign=True, offer_to=[r.address for r in readers]
            )
            assert offered == [others[0].host.peer_id], offered  # the replicas had it stored
            assert all(r.dht.held(KEY)[mine].value == b"step 2" for r in readers)


async def test_a_partner_that_refuses_the_store_is_offered_the_entry(autojump_clock: object) -> None:
    """A replica that did not take the store (one not yet known to be reachable holds no records) is
    offered the entry all the same: with two peers, that is the only way its record reaches the other."""
    with trio.fail_after(300):
        async with open_swarm(DHTConfig(replication=3)) as swarm:
            author, readers, mine = await read_by_all(swarm, 3, "q")
            shy = readers[0]
            assert shy.host.peer_id in {c.peer_id for c in author.dht.replicas.remembered(key_id(KEY))}
            shy.dht.client_only = True  # (it refuses stores now: "holds no records")
            await author.dht.store(
                KEY, b"step 2", ttl=60, subkey=mine, sign=True, offer_to=[r.address for r in readers]
            )
            assert shy.dht.reader.known(key_id(KEY), trio.current_time())[0].value == b"step 2"


async def test_a_watched_key_tells_its_reader_when_an_entry_arrives(autojump_clock: object) -> None:
    """A reader of a hot key hears of a new record when it arrives (stored on it as a replica, or
    offered), not at its next read: the progress loop wakes on it (a trusted peer's view reached the
    target, and this peer looks for a group seconds sooner). Entries under other keys wake nobody."""
    with trio.fail_after(300):
        async with open_swarm(DHTConfig(replication=3)) as swarm:
            nodes = [
                await swarm.start(f"w{i}", [swarm.nodes[0].address] if swarm.nodes else []) for i in range(6)
            ]
            author = nodes[0]
            mine = owned_subkey(author.host.peer_id)
            woke: dict[str, int] = {}
            for n in nodes[1:]:
                n.dht.watch(KEY, lambda name=n.name: woke.__setitem__(name, woke.get(name, 0) + 1))
            await author.dht.store(KEY, b"step 1", ttl=60, subkey=mine, sign=True)
            replicas = {c.peer_id for c in author.dht.replicas.remembered(key_id(KEY))}
            stored_on = {n.name for n in nodes[1:] if n.host.peer_id in replicas}
            assert stored_on and set(woke) == stored_on, (woke, stored_on)  # the replicas, as it arrived

            reader = next(n for n in nodes[1:] if n.name not in stored_on)
            assert (await reader.dht.get(KEY))[mine].value == b"step 1"  # (so it takes offers)
            woke.clear()
            await author.dht.store(KEY, b"step 2", ttl=60, subkey=mine, sign=True, offer_to=[reader.address])
            assert woke.get(reader.name) == 1, woke  # offered
            before = dict(woke)
            await author.dht.store(b"run/offers/other", b"x", ttl=60)
            assert woke == before
