"""Reads of a hot key: where a node stored under the key lately (its replicas looked up at most
``TARGETS_TTL`` ago), a read asks those replicas directly and without their nearest contacts; without
such replicas, or when too few of them answer, it looks the key up as before and still finds it."""

from __future__ import annotations

import trio

from p2ptrain.dht import DHTConfig, key_id
from p2ptrain.dht.client import SENDER_REFRESH
from p2ptrain.dht.reads import READ_HEDGE
from tests.harness.dht import open_swarm

KEY = b"lean/hot"


def count_value_queries(dht, log: list[tuple[bool, int]]) -> None:  # type: ignore[no-untyped-def]
    """Record, for each value query ``dht`` sends: whether it asked for contacts, how many came back."""
    query = dht.client.query

    async def counting(contact, target, value, known, tags, nearest=True):  # type: ignore[no-untyped-def]
        out = await query(contact, target, value, known, tags, nearest)
        if value:
            log.append((nearest, len(out[0])))
        return out

    dht.client.query = counting


def count_entries(dht) -> list[int]:  # type: ignore[no-untyped-def]
    """Record, for each query ``dht`` sends, how many entries came back (in the list returned)."""
    query, brought = dht.client.query, []

    async def counting(contact, target, value, known, tags, nearest=True):  # type: ignore[no-untyped-def]
        out = await query(contact, target, value, known, tags, nearest)
        brought.append(len(out[1]))
        return out

    dht.client.query = counting
    return brought


async def test_a_key_stored_lately_is_read_from_its_replicas_without_contacts(autojump_clock: object) -> None:
    config = DHTConfig(k=8, replication=3, get_quorum=3)
    with trio.fail_after(300):
        async with open_swarm(config) as swarm:
            for i in range(8):
                await swarm.start(f"r{i}", [swarm.nodes[0].address] if swarm.nodes else [])
            writer, reader = swarm.nodes[-1], swarm.nodes[-2]
            assert await writer.dht.store(KEY, b"v1", ttl=600.0) == 3
            lean: list[tuple[bool, int]] = []
            count_value_queries(writer.dht, lean)
            assert (await writer.dht.get(KEY))[b""].value == b"v1"
            assert lean and len(lean) <= 3, lean  # the three replicas, asked once each ...
            assert all(not nearest and n == 0 for nearest, n in lean), lean  # ... for values only

            looked_up: list[tuple[bool, int]] = []  # a reader that stored nothing there looks it up
            count_value_queries(reader.dht, looked_up)
            assert (await reader.dht.get(KEY))[b""].value == b"v1"
            assert looked_up and all(nearest for nearest, _ in looked_up), looked_up
            assert any(n > 0 for _, n in looked_up), looked_up

            # Two of the three replicas crash: too few answer, and the read looks the key up again.
            replicas = {c.peer_id for c in writer.dht.replicas.remembered(key_id(KEY))}
            for node in [n for n in swarm.nodes if n.host.peer_id in replicas][:2]:
                await swarm.kill(node)
            lean.clear()
            got = await writer.dht.get(KEY)  # (the quorum of 3 cannot be met now)
            assert got[b""].value == b"v1"
            assert any(nearest for nearest, _ in lean), lean  # (the lookup after the direct reads)
            remembered = writer.dht.replicas.remembered
            assert remembered(key_id(KEY)) is None or remembered(key_id(KEY))


async def test_a_silent_replica_does_not_hold_a_direct_read_up(autojump_clock: object) -> None:
    """The read ends once the quorum answered, as a lookup does: a replica whose host went silent (its
    packets dropped, no reset) would otherwise make every read of the key wait ``rpc_timeout``."""
    config = DHTConfig(k=8, replication=3, rpc_timeout=5.0)
    with trio.fail_after(300):
        async with open_swarm(config) as swarm:
            for i in range(6):
                await swarm.start(f"s{i}", [swarm.nodes[0].address] if swarm.nodes else [])
            writer = swarm.nodes[-1]
            assert await writer.dht.store(KEY, b"v1", ttl=600.0) >= 3  # (itself too, if among them)
            first = writer.dht.replicas.remembered(key_id(KEY))[0].peer_id  # (the replica a read asks first)
            silent = next(n for n in swarm.nodes if n.host.peer_id == first)
            swarm.net.partition([writer.name], [silent.name])
            began = trio.current_time()
            assert (await writer.dht.get(KEY, quorum=2))[b""].value == b"v1"
            # (asked first, it holds the others up READ_HEDGE, once: then it is asked last)
            assert trio.current_time() - began <= READ_HEDGE + 0.5
            began = trio.current_time()
            assert (await writer.dht.get(KEY, quorum=2))[b""].value == b"v1"
            assert trio.current_time() - began < 0.5


async def test_a_direct_read_asks_no_more_replicas_than_its_quorum_needs(autojump_clock: object) -> None:
    """Twelve replicas of a key, a quorum of three: a read asks three of them (one first, then two),
    not all twelve (each asked costs a request and, until the read ends, most of an answer); one that
    answers without holding anything is replaced by the next."""
    config = DHTConfig(k=16, replication=12, get_quorum=3)
    with trio.fail_after(300):
        async with open_swarm(config) as swarm:
            for i in range(14):
                await swarm.start(f"q{i}", [swarm.nodes[0].address] if swarm.nodes else [])
            writer = swarm.nodes[-1]
            assert await writer.dht.store(KEY, b"v1", ttl=600.0) >= 12
            replicas = writer.dht.replicas.remembered(key_id(KEY))
            assert len(replicas) == 12
            asked: list[tuple[bool, int]] = []
            count_value_queries(writer.dht, asked)
            got = await writer.dht.get(KEY)
            assert got[b""].value == b"v1"
            mine = 1 if writer.dht.records.get(key_id(KEY), writer.dht.clock()) else 0  # (a replica itself)
            assert len(asked) == 3 - mine, asked  # the old read asked all 12
            assert all(not nearest for nearest, _ in asked), asked

            # The first replica lost the entry (restarted empty): it answers, holds nothing, and the
            # read asks one more in its place, still without a lookup.
            first = next(n for n in swarm.nodes if n.host.peer_id == replicas[0].peer_id)
            first.dht.records.clear()
            asked.clear()
            assert (await writer.dht.get(KEY))[b""].value == b"v1"
            assert len(asked) == 4 - mine and all(not nearest for nearest, _ in asked), asked


async def test_in_a_swarm_smaller_than_k_one_lookup_finds_all_replicas(autojump_clock: object) -> None:
    """Six peers, k = 20: the first store's lookup reaches them all, so stores under other keys (a new
    group key each round) find their replicas without a lookup each (the old node looked up every new
    key); a peer that joins later is among them once it called the writer, under old keys too, and
    one that fails a store is not asked again until a lookup finds it."""
    config = DHTConfig(k=20, replication=20)
    with trio.fail_after(300):
        async with open_swarm(config) as swarm:
            for i in range(6):
                await swarm.start(f"w{i}", [swarm.nodes[0].address] if swarm.nodes else [])
            writer = swarm.nodes[-1]
            lookups: list[bytes] = []
            find_node = writer.dht.reader.find_node

            async def counting(target: bytes) -> list:  # type: ignore[type-arg]
                lookups.append(target)
                return await find_node(target)

            writer.dht.reader.find_node = counting  # type: ignore[method-assign]
            for i in range(5):
                assert await writer.dht.store(b"round-%d" % i, b"v", ttl=600.0) == 6  # (5 + itself)
            assert len(lookups) == 1, lookups
            for i in range(5):
                assert {n.name for n in swarm.nodes if n.dht.records.get(key_id(b"round-%d" % i), 0.0)} == {
                    f"w{j}" for j in range(6)
                }

            late = await swarm.start("late", [swarm.nodes[0].address])
            assert writer.host.peer_id in {c.peer_id for c in late.dht.table.contacts()}
            assert late.host.peer_id in writer.dht.table  # (its bootstrap lookup called the writer)
            assert await writer.dht.store(b"round-5", b"v", ttl=600.0) == 7
            assert late.dht.records.get(key_id(b"round-5"), 0.0)
            # A key whose replicas were found before it joined: fewer than `replication`, so every peer
            # is one, and the next record under it reaches the newcomer too (not TARGETS_TTL later).
            assert await writer.dht.store(b"round-0", b"v2", ttl=600.0) == 7
            assert late.dht.records.get(key_id(b"round-0"), 0.0)
            assert len(lookups) == 1, lookups

            await swarm.kill(late)
            assert await writer.dht.store(b"round-6", b"v", ttl=600.0) == 6  # (it failed here)
            assert await writer.dht.store(b"round-7", b"v", ttl=600.0) == 6
            remembered = writer.dht.replicas.remembered
            assert late.host.peer_id not in {c.peer_id for c in remembered(key_id(b"round-7"))}
            assert len(lookups) == 1, lookups


async def test_a_node_tells_a_peer_its_contact_once_a_minute_and_stays_fresh_there(
    autojump_clock: object,
) -> None:
    """A contact (about 150 bytes) rode on every store and read; now a node sends it on its first call
    to a peer and again once ``SENDER_REFRESH`` passed. In between, the peer's calls still refresh it
    in the routing table (a known peer that calls is alive, at the address it told)."""
    config = DHTConfig(k=8, replication=3)
    with trio.fail_after(300):
        async with open_swarm(config) as swarm:
            for i in range(3):
                await swarm.start(f"t{i}", [swarm.nodes[0].address] if swarm.nodes else [])
            a, b = swarm.nodes[-1], swarm.nodes[0]
            heard: list[bool] = []
            heard_from = b.dht.contacts.heard_from

            def logging(ctx, sender):  # type: ignore[no-untyped-def]
                if ctx.peer == a.host.peer_id:
                    heard.append(sender is not None)
                heard_from(ctx, sender)

            b.dht.contacts.heard_from = logging
            table = b.dht.table

            def last_seen() -> float:
                return table.buckets[table.bucket_index(a.host.peer_id)].entries[a.host.peer_id].last_seen

            await trio.sleep(SENDER_REFRESH + 1)  # (whatever the joins told)
            for _ in range(3):
                await a.dht.store(KEY, b"v", ttl=600.0)
                await a.dht.get(KEY)
                await trio.sleep(5.0)
            # (the stores reach b; a read may ask another replica first: ``reads.first_asked``)
            assert len(heard) >= 3 and heard[0], heard  # told once, on the first call ...
            assert not any(heard[1:]), heard  # ... and not on the calls that followed within a minute
            seen = last_seen()
            assert trio.current_time() - seen <= 5.0 + 1e-6  # refreshed by calls without the contact
            await trio.sleep(SENDER_REFRESH)
            heard.clear()
            await a.dht.store(KEY, b"w", ttl=600.0)
            assert heard and heard[0], heard  # a minute on: told again
            assert last_seen() > seen


async def test_a_changed_entry_comes_once_not_from_every_replica(autojump_clock: object) -> None:
    """A hot key's read asks one replica first and the others once it answered, naming what it sent:
    they prove they hold the new entry instead of sending it again (a quorum of 3 brought each new
    announcement or record three times)."""
    config = DHTConfig(k=8, replication=3, get_quorum=3)
    with trio.fail_after(300):
        async with open_swarm(config) as swarm:
            for i in range(6):
                await swarm.start(f"c{i}", [swarm.nodes[0].address] if swarm.nodes else [])
            writer = swarm.nodes[-1]
            assert await writer.dht.store(KEY, b"v1", ttl=600.0, subkey=b"a") == 3
            assert (await writer.dht.get(KEY))[b"a"].value == b"v1"
            brought = count_entries(writer.dht)
            for version in (b"v2", b"v3"):
                assert await writer.dht.store(KEY, version, ttl=600.0, subkey=b"a") == 3
                brought.clear()
                got = await writer.dht.get(KEY)
                assert got[b"a"].value == version
                assert len(brought) == 3 and sum(brought) == 1, brought  # all three asked, one sent it


async def test_a_replica_names_what_it_holds_and_is_not_sent_it_again(autojump_clock: object) -> None:
    """A reader that is one of the key's replicas itself (most partners are, in a small swarm) holds
    the new entries stored there: its reads name them, and the other replicas leave them out."""
    config = DHTConfig(k=8, replication=3, get_quorum=3)
    with trio.fail_after(300):
        async with open_swarm(config) as swarm:
            for i in range(5):
                await swarm.start(f"h{i}", [swarm.nodes[0].address] if swarm.nodes else [])
            writer = swarm.nodes[0]
            assert await writer.dht.store(KEY, b"v1", ttl=600.0, subkey=b"a") == 3
            replicas = {c.peer_id for c in writer.dht.replicas.remembered(key_id(KEY))}
            reader = next(n for n in swarm.nodes if n.host.peer_id in replicas)
            assert reader.dht.records.get(key_id(KEY), trio.current_time())  # (stored there)
            brought = count_entries(reader.dht)
            assert (await reader.dht.get(KEY))[b"a"].value == b"v1"
            assert brought and sum(brought) == 0, brought  # named: no replica sent it
