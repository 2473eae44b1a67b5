"""Hole punching (``net.punch``): a relayed connection becomes a direct one where the NATs allow it.

On the in-memory network, ``MemoryNetwork.nat`` models a home router: it drops unsolicited dials and
keeps a dial's source port (endpoint-independent), so two dials from listening ports towards each other
meet (a simultaneous open); a symmetric one maps every connection to a new port. On loopback TCP, the
real socket path (a dial from the listening port, SO_REUSEPORT beside the listener) runs without a NAT:
the peer's first dial reaches the dialer's listener, and the peer initiates the handshake then. The
NAT lab test (``test_nat_lab``) punches through real MASQUERADE routers.
What is proved: two NATed peers connected through a relay end up connected directly (calls then no
longer pass the relay, which is left), a public dialer is dialed back, symmetric NATs stay relayed with
calls still working, bad or repeated requests are refused, and NATed nodes that punched reduce a share
of every round like public ones.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import pytest
import torch
import trio

from p2ptrain import Node, NodeConfig
from p2ptrain.averaging import AveragerConfig, RoundResult
from p2ptrain.identity import Identity
from p2ptrain.net import MemoryNetwork, PeerAddress
from p2ptrain.net.connection import Connection
from p2ptrain.net.punch import ATTEMPTS, PUNCH, PUNCH_TIMEOUT, RELAYED_GRACE, PunchReq
from p2ptrain.net.relay import RelayConfig


async def _direct(a, b) -> Connection:
    """Wait until ``a`` holds a connection to ``b`` that does not go through a relay."""
    while (conn := a.host.connection(b.host.peer_id)) is None or conn.relayed:  # noqa: ASYNC110
        await trio.sleep(0.05)  # (polled: the callers' deadlines bound it)
    return conn


async def _relayed_pair(cluster, memnet, *, a_nat: bool = True, symmetric: bool = False):
    relay = await cluster.start("relay")
    a = await cluster.start("a")
    b = await cluster.start("b")
    if memnet is not None:
        if a_nat:
            memnet.nat("a")
        memnet.nat("b", symmetric=symmetric)
    await b.host.relay.reserve(relay.address)
    [circuit] = b.host.relay.circuit_addresses()
    return relay, a, b, circuit


async def test_two_natted_peers_punch_through_and_leave_the_relay(mem_cluster, memnet, kit, autojump_clock):
    with trio.fail_after(300):
        relay, a, b, circuit = await _relayed_pair(mem_cluster, memnet)
        relayed = await a.host.connect(circuit)
        assert relayed.relayed
        direct = await _direct(a, b)
        assert not direct.relayed and direct.outbound
        assert a.host.punch.works and b.host.punch.works
        back = await _direct(b, a)
        assert not back.outbound  # b's listener took a's dial: its router let it in
        before = relay.host.relay.relayed_bytes
        assert (await a.host.connect(circuit)) is direct  # the newest connection is the one used
        for _ in range(20):  # 80 kB each way
            assert (await direct.call(kit.ECHO, kit.Text("x" * 4000))).text == "x" * 4000
        assert relay.host.relay.relayed_bytes - before < 10_000  # the bulk went direct
        await trio.sleep(RELAYED_GRACE + 5)
        assert relayed.closed  # the relayed connection was left, and its circuit with it
        while relay.host.relay.circuits:  # noqa: ASYNC110 (polled under the deadline)
            await trio.sleep(0.1)
        assert (await direct.call(kit.ECHO, kit.Text("still"))).text == "still"


async def test_behind_a_symmetric_nat_the_peers_stay_relayed(mem_cluster, memnet, kit, autojump_clock):
    with trio.fail_after(300):
        _, a, b, circuit = await _relayed_pair(mem_cluster, memnet, symmetric=True)
        conn = await a.host.connect(circuit)
        await trio.sleep(2 * PUNCH_TIMEOUT + 10)
        assert a.host.connection(b.host.peer_id) is conn and conn.relayed and not conn.closed
        assert not a.host.punch.works and not b.host.punch.works
        assert (await conn.call(kit.ECHO, kit.Text("via relay"))).text == "via relay"


async def test_peers_that_could_not_punch_say_so_when_their_relay_goes(
    mem_cluster, memnet, autojump_clock, caplog
):
    """Behind a symmetric NAT the punch fails and the peers stay relayed; when the relay dies, each of
    the two says at WARNING which peer it lost, why (the failed punch) and what would fix it (before:
    only "disconnected from ..." at INFO, and "out of touch with the swarm" later)."""
    with trio.fail_after(300):
        _, a, b, circuit = await _relayed_pair(mem_cluster, memnet, symmetric=True)
        await a.host.connect(circuit)
        while not (a.host.punch.failure(b.host.peer_id) and b.host.punch.failure(a.host.peer_id)):  # noqa: ASYNC110
            await trio.sleep(1.0)  # (polled under the deadline: every attempt over)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="p2ptrain.net"):
            memnet.kill("relay")
            while a.host.connection(b.host.peer_id) or b.host.connection(a.host.peer_id):  # noqa: ASYNC110
                await trio.sleep(0.5)
            await trio.sleep(1.0)
        lost = [r.getMessage() for r in caplog.records if "lost touch with peer" in r.getMessage()]
        assert len(lost) == 2, lost
        for message in lost:
            assert "hole punch with it had failed" in message
            assert "forward a port" in message and "public peer" in message
        assert {m.split()[4].rstrip(":") for m in lost} == {a.host.peer_id.short(), b.host.peer_id.short()}
        assert any("the last relay" in r.getMessage() for r in caplog.records)  # (b held one there)


async def test_reaching_a_peer_goes_only_through_a_relay_this_host_is_connected_to(
    mem_cluster, memnet, autojump_clock
):
    """A circuit address in a progress record can name any host as its relay: a node that reaches
    NATed peers ahead of rounds must not dial a host it merely read about (fresh ids would make it
    connect to third parties)."""
    with trio.fail_after(300):
        relay, a, b, circuit = await _relayed_pair(mem_cluster, memnet)
        await a.host.punch.reach(circuit)
        assert a.host.connection(relay.host.peer_id) is None  # not dialed: a knows it from a record only
        assert a.host.connection(b.host.peer_id) is None
        await a.host.connect(relay.address)  # now a real peer of a's (a DHT contact, a join peer)
        await a.host.punch.reach(circuit)
        await _direct(a, b)


async def test_a_public_dialer_is_dialed_back(mem_cluster, memnet, autojump_clock):
    with trio.fail_after(300):
        _, a, b, circuit = await _relayed_pair(mem_cluster, memnet, a_nat=False)
        a.host.location.seen_at("a")  # (what a's DHT would have learned: peers dial it)
        a.host.location.found(True)
        await a.host.connect(circuit)
        back = await _direct(b, a)
        assert back.outbound  # b dialed a: a reversal, no punch needed
        assert b.host.punch.works


async def test_punch_requests_are_refused_when_they_should_be(mem_cluster, memnet, autojump_clock):
    with trio.fail_after(300):
        relay, a, _, circuit = await _relayed_pair(mem_cluster, memnet, symmetric=True)
        direct = await a.host.connect(relay.address)
        resp = await direct.call(PUNCH, PunchReq(("a:1",)))
        assert not resp.ok and "only over a relayed connection" in resp.reason
        relayed = await a.host.connect(circuit)
        a.host.punch.enabled = False  # (so that its own upgrade attempt does not use up the request)
        resp = await relayed.call(PUNCH, PunchReq(("no port here",)))
        assert not resp.ok and "bad address" in resp.reason
        for _ in range(ATTEMPTS):  # (a dialer may retry a failed punch at once, a few times)
            assert (await relayed.call(PUNCH, PunchReq(("a:1",)))).ok
        resp = await relayed.call(PUNCH, PunchReq(("a:1",)))  # asked too often
        assert not resp.ok and f"{ATTEMPTS} punches per" in resp.reason


async def test_punching_on_real_sockets_shares_the_listening_port(tcp_cluster, kit):
    """No NAT on loopback, but the real path: b's abandoned attempt from its listening port, then a's
    dial from its own listening port (SO_REUSEPORT beside a live listener), then the handshake."""
    with trio.fail_after(60):
        _, a, b, circuit = await _relayed_pair(tcp_cluster, None)
        await a.host.connect(circuit)
        direct = await _direct(a, b)
        assert direct.remote_port == b.address.port
        assert (await direct.call(kit.ECHO, kit.Text("direct"))).text == "direct"
        inbound = await _direct(b, a)
        assert inbound.remote_port == a.address.port  # a dialed from the port it listens on
        # the listener still takes ordinary connections
        other = await tcp_cluster.start("other")
        assert (await other.host.connect(a.address)).peer == a.host.peer_id


def _home_swarm(net: MemoryNetwork) -> tuple[list[Node], Callable[[trio.Nursery], Awaitable[None]]]:
    """One public peer and two home nodes behind endpoint-independent NATs; the second home node joins
    through the first one's relayed address. ``start`` runs them and returns once both punched."""
    net.nat("home1")
    net.nat("home2")
    avg = AveragerConfig(target_size=3, min_size=2, matchmaking_time=3.0)

    def node(name: str, join: list[PeerAddress]) -> Node:
        config = NodeConfig(run_id="punch", listen=((name, 1000),), join=tuple(join), averaging=avg)
        return Node(Identity.generate(), config, transport=net.transport(name), clock=trio.current_time)

    nodes = [node("public", [])]

    async def start(nursery: trio.Nursery) -> None:
        await nursery.start(nodes[0].run)
        nodes.append(node("home1", [nodes[0].addresses[0]]))
        await nursery.start(nodes[1].run)
        [pasted] = await nodes[1].dialable_addresses()
        nodes.append(node("home2", [pasted]))
        await nursery.start(nodes[2].run)
        await nodes[2].dialable_addresses()  # (its own reservation, so it has a relayed address too)
        while not (nodes[1].host.punch.works and nodes[2].host.punch.works):  # noqa: ASYNC110
            await trio.sleep(0.5)  # (polled under the callers' deadlines)

    return nodes, start


async def test_natted_nodes_that_punched_reduce_a_share_like_public_ones(autojump_clock):
    """Once the home nodes punched, every member of a round reduces a share (before: the public peer
    reduced all of it, the home nodes were client-only)."""
    nodes, start = _home_swarm(MemoryNetwork(seed=7))
    with trio.fail_after(900):
        async with trio.open_nursery() as nursery:
            await start(nursery)
            _, home1, home2 = nodes
            conn = home2.host.connection(home1.peer_id)
            assert conn is not None and not conn.relayed
            results: list[RoundResult] = []

            async def average(i: int) -> None:
                results.append(await nodes[i].average([torch.full((3000,), float(i))], timeout=30.0))

            async with trio.open_nursery() as rounds:
                for i in range(3):
                    rounds.start_soon(average, i)
            assert [len(r.contributors) for r in results] == [3, 3, 3]
            assert all(torch.equal(r.tensors[0], torch.full((3000,), 1.0)) for r in results)
            assert all(r.reduced > 0 for r in results), [r.reduced for r in results]
            nursery.cancel_scope.cancel()


async def test_home_nodes_that_punched_keep_a_dht_when_the_public_peer_leaves(autojump_clock):
    """The home nodes serve the DHT at their relayed addresses once punching works (peers reach them
    directly): when the only public peer leaves, they still store and read records among themselves,
    and average together (before: client-only, they had nowhere to keep a record)."""
    net = MemoryNetwork(seed=8)
    nodes, start = _home_swarm(net)
    with trio.fail_after(3000):
        async with trio.open_nursery() as nursery:
            await start(nursery)
            public, home1, home2 = nodes
            assert home1.dht.serving and home2.dht.serving
            await trio.sleep(60)  # (the DHT's maintenance meets the peers as contacts)
            # The relay keeps its reserving peers' circuit contacts (before: refused as not where the
            # call came from), so the others learn of them from it.
            assert public.dht.table.get(home1.peer_id) is not None
            assert public.dht.table.get(home2.peer_id) is not None
            net.kill("public")
            # Past the renewal of their reservations with it (which fails): they keep serving at the
            # circuit addresses they had (before: client-only again, no DHT, each stepping alone).
            await trio.sleep(RelayConfig().reservation_ttl)
            assert not home1.host.relay.relays and home1.dht.serving and home2.dht.serving
            await home1.dht.store(b"after-public-left", b"still one swarm", ttl=600)
            got = await home2.dht.get(b"after-public-left")
            assert [e.value for e in got.values()] == [b"still one swarm"]
            results: list[RoundResult] = []

            async def average(node: Node, value: float) -> None:
                results.append(await node.average([torch.full((100,), value)], timeout=30.0))

            async with trio.open_nursery() as rounds:
                rounds.start_soon(average, home1, 1.0)
                rounds.start_soon(average, home2, 3.0)
            assert all(torch.equal(r.tensors[0], torch.full((100,), 2.0)) for r in results)
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("text", ["1.2.3.4", "1.2.3.4:0", "1.2.3.4:70000", ":80", "a b:1", "x" * 70 + ":1"])
def test_bad_endpoints_are_refused(text):
    from p2ptrain.net.punch import parse_endpoint

    with pytest.raises(ValueError):
        parse_endpoint(text)


async def test_a_circuit_contact_is_taken_only_through_a_relay_this_node_is_connected_to(mem_cluster):
    """A caller may name a circuit to itself as its DHT contact (how a NATed node serves the DHT), but
    only through a peer this node is connected to: a circuit through any other host would have others
    dial a third party an attacker names."""
    from p2ptrain.dht import DHT, Contact
    from p2ptrain.dht.protocol import ContactMsg
    from p2ptrain.net.rpc import CallContext

    a = await mem_cluster.start("a")
    relay = await mem_cluster.start("relay")
    dht = DHT(a.host)
    caller = Identity.generate().peer_id

    def heard_through(relay_id) -> bool:
        addr = PeerAddress.parse(f"/ip4/198.18.0.9/tcp/4001/p2p/{relay_id}/p2p-circuit/p2p/{caller}")
        ctx = CallContext(caller, "198.18.0.50", "dht.ping", memoryview(b""), 0.0)
        dht.contacts.heard_from(ctx, ContactMsg.of(Contact(caller, addr)))
        return caller in {c.peer_id for c in dht.table.contacts()}

    with trio.fail_after(60):
        assert not heard_through(Identity.generate().peer_id)
        assert not heard_through(relay.host.peer_id)  # (not connected to it yet)
        await a.host.connect(relay.address)
        assert heard_through(relay.host.peer_id)


async def test_home_peers_find_their_public_peer_soon_after_it_comes_back(autojump_clock, monkeypatch):
    """Two home peers that punched (so each still has a DHT contact: the other) and their public peer,
    which is gone 45 s and comes back as itself on the same address: the home peers' re-dials of their
    join address find it within 10 s (before: their back-off had grown to 30 s, and they found it 16 s
    later; 30 s in the NAT lab's public-returns scenario)."""
    import p2ptrain.node as node_module

    monkeypatch.setattr(node_module.random, "uniform", lambda a, b: 1.0)  # (no jitter: a fixed schedule)
    net = MemoryNetwork(seed=9)
    net.nat("home1")
    net.nat("home2")
    identity = Identity.generate()
    scopes: list[trio.CancelScope] = []

    def node(name: str, join: tuple[PeerAddress, ...], ident: Identity | None = None) -> Node:
        config = NodeConfig(run_id="punch", listen=((name, 1000),), join=join)
        ident = ident or Identity.generate()
        return Node(ident, config, transport=net.transport(name), clock=trio.current_time)

    async def run_public(task_status=trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            scopes.append(scope)
            await node("public", (), identity).run(task_status=task_status)

    with trio.fail_after(900):
        async with trio.open_nursery() as nursery:
            await nursery.start(run_public)
            public_address = PeerAddress.for_host("public", 1000, identity.peer_id)
            home1 = node("home1", (public_address,))
            await nursery.start(home1.run)
            [pasted] = await home1.dialable_addresses()
            home2 = node("home2", (pasted,))
            await nursery.start(home2.run)
            await home2.dialable_addresses()
            while not (home1.host.punch.works and home2.host.punch.works):  # noqa: ASYNC110
                await trio.sleep(0.5)  # (polled under the deadline)
            await trio.sleep(30)
            scopes[0].cancel()  # the public peer leaves
            await trio.sleep(45)
            assert home1.host.connection(home2.peer_id) is not None  # (the homes still have each other)
            await nursery.start(run_public)
            back = trio.current_time()
            while home1.host.connection(identity.peer_id) is None:  # noqa: ASYNC110 (polled, deadline)
                await trio.sleep(0.1)
            assert trio.current_time() - back <= 10.0
            nursery.cancel_scope.cancel()
