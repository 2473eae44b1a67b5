"""DHT swarms in one trio run over the in-memory network, under the autojump MockClock.

What is proved here: a 64-node swarm routes (every node finds 16 others picked at random) and stores (240
keys written from random nodes are readable from every node, each reading its eighth of them, and still
from every survivor after a quarter of the swarm dies); dictionary records merge subkeys from many
writers; a client-only node works through others without ever entering a routing table; reachability is
detected by dial-back at bootstrap; and Nodes joined in a chain all come to list the whole run in their
peer list.

Every node gets a deterministic identity and DHT seed, and ``clock=trio.current_time`` so that record
expiry runs on the virtual clock. Timeouts cost no wall time under autojump.
"""

from __future__ import annotations

import itertools
import logging
import random
import types

import pytest
import trio

from p2ptrain.dht import DHTConfig, key_id, owned_subkey
from p2ptrain.dht.peers import PeerRecord, announce, list_members, peer_list
from p2ptrain.identity import PeerID
from p2ptrain.net import HostConfig, MemoryNetwork
from p2ptrain.node import MEMBERS_BACKOFF, Node, NodeConfig
from p2ptrain.wire.codec import pack
from tests.harness.dht import PORT, DhtNode, Swarm, open_swarm
from tests.harness.identities import identity


def tables_holding(swarm: Swarm, peer: PeerID) -> list[str]:
    """The nodes whose routing table holds ``peer``."""
    return [n.name for n in swarm.nodes if peer in n.dht.table]


# ---- the 64-node swarm -------------------------------------------------------------------------

SWARM_SIZE = 64
KEYS = 240
# k = 10 in a 64-node swarm leaves routing tables partial, so finding a peer often takes a multi-hop
# lookup. Reads use one query at a time and one replica: a read is still an iterative lookup from the
# reader's own routing table, but costs about one RPC instead of three. Each node reads an eighth of the
# keys (every key is read by 8 nodes before the kill and by about 6 after): 3,400 reads in all.
READ_SHARE = 8
FIND_TARGETS = 16
SWARM_CONFIG = DHTConfig(k=10, replication=10, alpha=1)


async def unreadable(node: DhtNode, keys: dict[bytes, bytes], share: tuple[int, int] = (0, 1)) -> list[bytes]:
    """The keys ``node`` cannot read back with the expected value (of those in its ``share``: (i, n)
    reads every n-th key from the i-th on)."""
    missing = []
    i, n = share
    for key, value in list(keys.items())[i::n]:
        got = await node.dht.get(key, quorum=1)
        if b"" not in got or got[b""].value != value:
            missing.append(key)
    return missing


def holders(nodes: list[DhtNode], key: bytes) -> set[str]:
    kid, now = key_id(key), trio.current_time()
    return {n.name for n in nodes if n.dht.records.get(kid, now)}


@pytest.mark.timeout(600)
async def test_64_node_swarm_routes_stores_and_survives_losing_a_quarter(autojump_clock):
    rng = random.Random(2024)
    with trio.fail_after(3600):
        async with open_swarm(SWARM_CONFIG) as swarm:
            for i in range(SWARM_SIZE):
                boot = [rng.choice(swarm.nodes).address] if swarm.nodes else []
                await swarm.start(f"n{i}", boot)
            nodes = swarm.nodes
            assert not any(n.dht.client_only for n in nodes)

            # Routing: every node finds others chosen at random (FIND_TARGETS each, the same pairs every
            # run), at the address each advertises. Peers a node does not know yet take an iterative
            # lookup; count those so the check is not vacuous.
            looked_up = 0
            for a in nodes:
                for b in rng.sample([n for n in nodes if n is not a], FIND_TARGETS):
                    looked_up += b.host.peer_id not in a.dht.table
                    found = await a.dht.find_peer(b.host.peer_id)
                    assert found is not None, f"{a.name} cannot find {b.name}"
                    assert found.address == b.address
            assert looked_up > SWARM_SIZE * 3  # routing tables are partial: many pairs took a lookup

            # Storage: KEYS keys, each from a random node, reach the full replication factor ...
            keys = {f"key-{j}".encode(): f"value-{j}-{rng.random()}".encode() for j in range(KEYS)}
            for key, value in keys.items():
                accepted = await rng.choice(nodes).dht.store(key, value, ttl=3600)
                assert accepted >= SWARM_CONFIG.replication, (key, accepted)
            # ... and every key reads back from many nodes (each node reads its share of them).
            for i, node in enumerate(nodes):
                share = (i % READ_SHARE, READ_SHARE)
                assert await unreadable(node, keys, share) == [], f"{node.name} cannot read some keys"

            # A quarter of the swarm crashes. Many keys lose replicas, none loses all of them, and the
            # replicas left serve every key to every survivor.
            dead = rng.sample(nodes, SWARM_SIZE // 4)
            held = {key: holders(nodes, key) for key in keys}
            dead_names = {n.name for n in dead}
            assert sum(1 for h in held.values() if h & dead_names) > KEYS // 2
            assert all(h - dead_names for h in held.values())
            for node in dead:
                await swarm.kill(node)
            survivors = [n for n in nodes if n not in dead]
            for i, node in enumerate(survivors):
                share = (i % READ_SHARE, READ_SHARE)
                assert await unreadable(node, keys, share) == [], f"{node.name} lost keys after the kill"
            assert trio.current_time() < SWARM_CONFIG.refresh_interval  # no re-replication was needed


# ---- dictionary records --------------------------------------------------------------------------


async def test_subkeys_from_many_writers_merge_on_every_node(autojump_clock):
    key = b"run/dict-merge/progress"
    with trio.fail_after(600):
        async with open_swarm(DHTConfig()) as swarm:
            for i in range(12):
                await swarm.start(f"m{i}", [swarm.nodes[i // 2].address] if swarm.nodes else [])
            writers = swarm.nodes[:8]

            async def write(i: int, node: DhtNode) -> None:
                assert await node.dht.store(key, f"step {i}".encode(), ttl=600, subkey=b"w%d" % i) > 0
                owned = owned_subkey(node.host.peer_id)
                assert await node.dht.store(key, b"mine", ttl=600, subkey=owned, sign=True) > 0

            async with trio.open_nursery() as writes:  # concurrent writers of one key
                for i, node in enumerate(writers):
                    writes.start_soon(write, i, node)

            # One subkey, two writers: the later expiry wins everywhere, whatever the arrival order.
            a, b = swarm.nodes[8], swarm.nodes[9]
            await b.dht.store(key, b"later", ttl=500, subkey=b"shared")
            await a.dht.store(key, b"earlier", ttl=300, subkey=b"shared")

            expected = {b"w%d" % i: f"step {i}".encode() for i in range(8)}
            expected |= {owned_subkey(n.host.peer_id): b"mine" for n in writers}
            expected[b"shared"] = b"later"
            for node in swarm.nodes:
                got = await node.dht.get(key)
                assert {sub: e.value for sub, e in got.items()} == expected, node.name
                for n in writers:  # owned subkeys come back signed by their owner
                    assert got[owned_subkey(n.host.peer_id)].public_key == n.host.identity.public_key


# ---- client-only peers ---------------------------------------------------------------------------


async def test_client_only_node_works_through_others_and_enters_no_routing_table(autojump_clock):
    run_id = "client-only-run"
    with trio.fail_after(600):
        async with open_swarm(DHTConfig()) as swarm:
            for i in range(10):
                await swarm.start(f"s{i}", [swarm.nodes[-1].address] if swarm.nodes else [])
            servers = list(swarm.nodes)
            client = await swarm.start(
                "client",
                [servers[3].address, servers[7].address],
                config=DHTConfig(client_only=True),
                listen=False,
            )
            assert client.dht.client_only and client.host.listen_addresses == []
            assert len(client.dht.table) >= len(servers) // 2  # it learned the swarm

            assert await client.dht.store(b"client/key", b"from the client", ttl=600) >= len(servers) // 2
            assert (await servers[0].dht.get(b"client/key"))[b""].value == b"from the client"
            await servers[5].dht.store(b"server/key", b"from a server", ttl=600)
            assert (await client.dht.get(b"server/key"))[b""].value == b"from a server"

            record = PeerRecord(addresses=(), reachable=False, version="test")
            assert await announce(client.dht, run_id, record, ttl=300) > 0
            for node in servers[:3]:
                assert await announce(node.dht, run_id, PeerRecord(addresses=(str(node.address),)), ttl=300)
            everyone = {client.host.peer_id} | {n.host.peer_id for n in servers[:3]}
            for reader in (client, servers[9]):
                members = await list_members(reader.dht, run_id)
                assert {m.peer_id for m in members} == everyone
                mine = next(m for m in members if m.peer_id == client.host.peer_id)
                assert mine.record == record

            # Keep running through two re-publications of its peer-list entry: still in no table,
            # and it holds no records for others.
            await trio.sleep(2 * DHTConfig().republish_interval + DHTConfig().maintenance_interval)
            assert tables_holding(swarm, client.host.peer_id) == []
            assert len(client.dht.records) == 0
            members = await list_members(servers[9].dht, run_id)
            assert client.host.peer_id in {m.peer_id for m in members}


# ---- reachability (NAT detection) ----------------------------------------------------------------


async def test_undialable_node_detects_it_and_runs_client_only(autojump_clock, caplog):
    caplog.set_level(logging.INFO, logger="p2ptrain.dht.service")
    with trio.fail_after(600):
        async with open_swarm(DHTConfig()) as swarm:
            for i in range(4):
                await swarm.start(f"s{i}", [swarm.nodes[-1].address] if swarm.nodes else [])
            # It listens, but advertises a host nobody can reach (as behind a NAT without forwarding).
            natted = await swarm.start(
                "natted",
                [swarm.nodes[0].address, swarm.nodes[2].address],
                host_config=HostConfig(announce_host="nat-outside"),
            )
            assert natted.dht.config.client_only is None
            assert natted.dht.client_only
            assert natted.address.host == "nat-outside"
            warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
            assert any("client-only" in w and "nat-outside" in w for w in warnings), warnings
            assert sum("could not dial us back" in r.getMessage() for r in caplog.records) == 2
            assert tables_holding(swarm, natted.host.peer_id) == []
            # It still takes part through others.
            assert await natted.dht.store(b"nat/key", b"v", ttl=60) > 0
            assert (await swarm.nodes[1].dht.get(b"nat/key"))[b""].value == b"v"


async def test_dialable_node_detects_it_and_serves(autojump_clock, caplog):
    caplog.set_level(logging.INFO, logger="p2ptrain.dht.service")
    with trio.fail_after(600):
        async with open_swarm(DHTConfig()) as swarm:
            for i in range(4):
                await swarm.start(f"s{i}", [swarm.nodes[-1].address] if swarm.nodes else [])
            node = await swarm.start("open", [swarm.nodes[0].address])
            assert node.dht.config.client_only is None
            assert not node.dht.client_only
            assert not any("client-only" in r.getMessage() for r in caplog.records)
            assert swarm.nodes[0].name in tables_holding(swarm, node.host.peer_id)


# ---- the Node's peer list ------------------------------------------------------------------------


async def test_five_chained_nodes_all_list_all_five_members(autojump_clock):
    net = MemoryNetwork(seed=3)
    interval = 2.0
    nodes: list[Node] = []
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            for i in range(5):
                config = NodeConfig(
                    run_id="five",
                    listen=((f"node{i}", PORT),),
                    join=(nodes[-1].addresses[0],) if nodes else (),
                    members_interval=interval,
                )
                node = Node(
                    identity(f"node{i}"), config, transport=net.transport(f"node{i}"), clock=trio.current_time
                )
                nodes.append(await nursery.start(node.run))
            start = trio.current_time()
            ids = {n.peer_id for n in nodes}
            # The first node announced before anyone else existed; its re-publication (every
            # republish_interval) reaches the others, so the lists converge within about that long.
            bound = DHTConfig().republish_interval + DHTConfig().maintenance_interval + 2 * interval
            with trio.fail_after(bound):
                while True:  # the member lists change only every `interval`: look that often
                    if all({m.peer_id for m in n.members} == ids for n in nodes):
                        break
                    await trio.sleep(interval)
            assert trio.current_time() - start <= bound
            for n in nodes:
                assert not n.dht.client_only
                assert all(m.record.reachable for m in n.members)
                assert {m.record.addresses for m in n.members} == {(str(x.addresses[0]),) for x in nodes}
            nursery.cancel_scope.cancel()


async def test_the_peer_list_says_what_is_true_now_and_drops_a_member_that_left(autojump_clock):
    """Each entry is re-published with the member's current throughput and time (before: the first
    record, throughput 0.0, forever re-published, so a live node read "last seen 198 s ago"), and a
    member that stops cleanly is gone from everyone's list at once (before: listed as a reachable
    member until its entry expired). A steady list is read less often, but never staler than
    ``MEMBERS_BACKOFF`` intervals, and a connection that closes has it read again soon."""
    net = MemoryNetwork(seed=4)
    interval = 2.0
    nodes: list[Node] = []
    scopes = [trio.CancelScope() for _ in range(3)]

    async def run_in(scope: trio.CancelScope, node: Node, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            await node.run(task_status=task_status)

    with trio.fail_after(900):
        async with trio.open_nursery() as nursery:
            for i in range(3):
                config = NodeConfig(
                    run_id="fresh",
                    listen=((f"f{i}", PORT),),
                    join=(nodes[-1].addresses[0],) if nodes else (),
                    members_interval=interval,
                )
                node = Node(
                    identity(f"f{i}"), config, transport=net.transport(f"f{i}"), clock=trio.current_time
                )
                nodes.append(await nursery.start(run_in, scopes[i], node))
            nodes[1].report_throughput(12.5)
            ids = {n.peer_id for n in nodes}
            while not all({m.peer_id for m in n.members} == ids for n in nodes):  # noqa: ASYNC110
                await trio.sleep(interval)  # (the lists change every interval; the deadline bounds it)
            ttl = NodeConfig().announce_ttl
            await trio.sleep(2 * ttl)
            for reader in (nodes[0], nodes[2]):
                [entry] = [m for m in reader.members if m.peer_id == nodes[1].peer_id]
                assert entry.record.throughput == 12.5
                assert (
                    trio.current_time() - entry.record.published <= ttl / 3 + (MEMBERS_BACKOFF + 1) * interval
                )
            await nodes[2].leave()  # a clean stop: its last word, then its connections close
            scopes[2].cancel()
            await trio.sleep(2 * interval)
            for reader in nodes[:2]:
                assert {m.peer_id for m in reader.members} == {nodes[0].peer_id, nodes[1].peer_id}
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("listed", [8, 64, 256, 1024])
async def test_a_peer_reads_a_long_peer_list_no_more_bytes_a_second_than_a_short_one(
    autojump_clock, monkeypatch, listed
):
    """A read of the peer list names every entry held and brings every one changed, and each connection
    that closes is a hint to read it again soon: a peer of a swarm of n read O(n) bytes every interval.
    A list of more than ``MEMBERS_PER_READ`` members is read at most every n / ``MEMBERS_PER_READ``
    intervals (never less often than the backoff's bound), whatever the hints: over 600 s of closing
    connections, reads times entries stay within what a list of ``MEMBERS_PER_READ`` costs."""
    from p2ptrain.dht.peers import Member
    from p2ptrain.node import MEMBERS_PER_READ

    interval = 5.0
    members = [
        Member(identity(f"m{i}").peer_id, PeerRecord(addresses=(f"m{i}:1",)), 1e9) for i in range(listed)
    ]
    reads: list[float] = []

    async def list_members(dht: object, run_id: str, **kw: object) -> list[Member]:
        reads.append(trio.current_time())
        return members

    monkeypatch.setattr("p2ptrain.node.list_members", list_members)
    net = MemoryNetwork(seed=5)
    config = NodeConfig(run_id="long", listen=(("solo", PORT),), members_interval=interval)
    node = Node(identity("solo"), config, transport=net.transport("solo"), clock=trio.current_time)
    closed = types.SimpleNamespace(peer=members[0].peer_id, outbound=False)
    with trio.fail_after(3600):
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            start = trio.current_time()
            while trio.current_time() - start < 600:
                node._on_connection(closed, False)  # type: ignore[arg-type]  # (a connection closed)
                await trio.sleep(1.0)
            nursery.cancel_scope.cancel()
    window = [t for t in reads if t >= start]
    gaps = [b - a for a, b in itertools.pairwise(window)]
    spacing = min(interval * max(1, listed / MEMBERS_PER_READ), MEMBERS_BACKOFF * interval)
    assert gaps and min(gaps) >= spacing - 1e-6  # (hints bring no read forward)
    assert max(gaps) <= MEMBERS_BACKOFF * interval + 1e-6  # (never staler than the backoff's bound)
    # entries named a second (what a read's bytes follow): a list of MEMBERS_PER_READ's, at most, up to
    # the size whose spacing reaches the backoff's bound; past it, one read a bound
    per_second = len(window) * listed / 600
    assert per_second <= 1.05 * max(MEMBERS_PER_READ / interval, listed / (MEMBERS_BACKOFF * interval))


@pytest.mark.parametrize("buckets", [2, 4, 8])
async def test_a_spread_peer_list_costs_a_reader_its_bucket_and_lists_nobody_outside_theirs(
    autojump_clock, buckets
):
    """A peer list every member reads whole costs each reader every entry once per re-announcement (each
    entry is new that often), however seldom it reads: O(N) bytes a second a reader, O(N^2) at the key's
    replicas (the busiest node of 1,024 simulated peers: 52x the median, ``dht.find_value``). Spread over
    ``buckets`` keys, a node's read is its bucket's key alone and brings its bucket's members only; a tool
    reads every bucket and lists everyone; and an entry a member writes under another bucket's key than
    its own (a free id placing itself where it does not belong, under every key) is listed nowhere."""
    run_id = f"spread{buckets}"
    rng = random.Random(buckets)
    with trio.fail_after(600):
        async with open_swarm(DHTConfig()) as swarm:
            for i in range(12):
                await swarm.start(f"s{i}", [rng.choice(swarm.nodes).address] if swarm.nodes else [])
            spread = peer_list(run_id, buckets)
            for node in swarm.nodes:
                record = PeerRecord(addresses=(str(node.address),))
                assert await announce(node.dht, run_id, record, ttl=600, buckets=buckets) > 0
            liar = swarm.nodes[rng.randrange(len(swarm.nodes))]
            for key in spread.keys:
                if key != spread.key_of(liar.host.peer_id):
                    record = PeerRecord(addresses=("elsewhere:1",))
                    await liar.dht.store(
                        key, pack(record.to_obj()), ttl=600, subkey=owned_subkey(liar.host.peer_id), sign=True
                    )
            everyone = {n.host.peer_id for n in swarm.nodes}
            for reader in rng.sample(swarm.nodes, 4):
                mine = spread.key_of(reader.host.peer_id)
                near = await list_members(reader.dht, run_id, buckets=buckets, near=reader.host.peer_id)
                assert {m.peer_id for m in near} == {p for p in everyone if spread.key_of(p) == mine}
                whole = await list_members(reader.dht, run_id, buckets=buckets)
                assert {m.peer_id for m in whole} == everyone
                [listed] = [m for m in whole if m.peer_id == liar.host.peer_id]
                assert listed.record.addresses == (str(liar.address),)  # (its own bucket's entry only)
            # the whole list at one key is the same list, as it always was
            assert {m.peer_id for m in await list_members(swarm.nodes[0].dht, run_id)} == set()


async def test_nodes_of_a_run_with_a_spread_peer_list_each_list_their_bucket(autojump_clock):
    """Nodes of a run whose list spreads over 2 keys (``NodeConfig.peer_list_buckets``, a run's
    ``progress.buckets``) each come to list exactly the members of their own bucket."""
    net = MemoryNetwork(seed=4)
    interval = 2.0
    nodes: list[Node] = []
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            for i in range(6):
                config = NodeConfig(
                    run_id="halves",
                    listen=((f"h{i}", PORT),),
                    join=(nodes[-1].addresses[0],) if nodes else (),
                    members_interval=interval,
                    peer_list_buckets=2,
                )
                node = Node(
                    identity(f"h{i}"), config, transport=net.transport(f"h{i}"), clock=trio.current_time
                )
                nodes.append(await nursery.start(node.run))
            spread = peer_list("halves", 2)
            assert len({spread.key_of(n.peer_id) for n in nodes}) == 2  # (both halves have members)

            def expected(n: Node) -> set[PeerID]:
                return {m.peer_id for m in nodes if spread.key_of(m.peer_id) == spread.key_of(n.peer_id)}

            bound = DHTConfig().republish_interval + DHTConfig().maintenance_interval + 2 * interval
            with trio.fail_after(bound):
                while not all({m.peer_id for m in n.members} == expected(n) for n in nodes):  # noqa: ASYNC110
                    await trio.sleep(interval)  # (the lists change every interval; the deadline bounds it)
            nursery.cancel_scope.cancel()


def test_a_peer_list_spreads_over_a_power_of_2_of_keys() -> None:
    with pytest.raises(ValueError, match="power of 2"):
        peer_list("run", 3)
    with pytest.raises(ValueError, match="power of 2"):
        Node(identity("x"), NodeConfig(run_id="run", peer_list_buckets=0))
