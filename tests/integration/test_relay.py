"""Circuit relays (``net.relay``): two hosts that cannot dial each other talk through a third.

What is proved here, with real Hosts on the in-memory network (a partition stands for the NATs between
the two) and on loopback TCP: the target reserves a slot with the relay and gets a circuit address; a
dialer of that address gets a connection whose handshake proves the target's id, and calls over it go
end to end (the relay copies only ciphertext); a circuit to a peer without a reservation, through a
host that does not relay, or past a circuit's byte limit is refused or cut with the reason; a host
takes incoming circuits only from relays it reserved with.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import trio

from p2ptrain import Node, NodeConfig
from p2ptrain.averaging import AveragerConfig, RoundResult
from p2ptrain.errors import P2PError, PeerUnavailable
from p2ptrain.identity import Identity
from p2ptrain.net import HostConfig, MemoryNetwork, PeerAddress, RpcStream
from p2ptrain.net.relay import INCOMING, CircuitResp, IncomingReq, RelayConfig

MARKER = "plain-text-the-relay-must-not-see"


async def test_two_peers_that_cannot_dial_each_other_talk_through_a_relay(cluster, memnet, kit, monkeypatch):
    seen: list[bytes] = []  # every chunk of every stream: here, only the circuit's travel in streams
    receive = RpcStream.receive_some

    async def tapped(self: RpcStream) -> memoryview:
        chunk = await receive(self)
        seen.append(bytes(chunk))
        return chunk

    monkeypatch.setattr(RpcStream, "receive_some", tapped)
    relay = await cluster.start("relay")
    target = await cluster.start("target")
    dialer = await cluster.start("dialer")
    if cluster.kind == "memory":
        memnet.partition({"target"}, {"dialer"})  # (their NATs: neither can dial the other)
    with trio.fail_after(60):
        ttl = await target.host.relay.reserve(relay.address)
        assert ttl == RelayConfig().reservation_ttl
        [circuit] = target.host.relay.circuit_addresses()
        assert str(circuit) == f"{relay.address}/p2p-circuit/p2p/{target.host.peer_id}"
        assert PeerAddress.parse(str(circuit)) == circuit
        conn = await dialer.host.connect(str(circuit))
        assert conn.peer == target.host.peer_id  # the handshake proved the target's key
        reply = await conn.call(kit.ECHO, kit.Text(MARKER * 20))
        assert reply.text == MARKER * 20
        back = target.host.connection(dialer.host.peer_id)
        via = target.host.connection(relay.host.peer_id)
        assert back is not None and via is not None and back.remote_host == via.remote_host
        assert (await back.call(kit.ECHO, kit.Text("and back"))).text == "and back"
    assert relay.host.relay.relayed_bytes > 2 * len(MARKER) * 20
    assert seen and not any(MARKER.encode() in chunk for chunk in seen)
    assert b"".join(seen).find(MARKER.encode()) == -1


async def test_circuits_are_refused_with_the_reason(mem_cluster, memnet):
    relay = await mem_cluster.start("relay")
    target = await mem_cluster.start("target")
    dialer = await mem_cluster.start("dialer")
    with trio.fail_after(60):
        unreserved = relay.address.circuit_to(target.host.peer_id)
        with pytest.raises(PeerUnavailable, match="holds no reservation"):
            await dialer.host.connect(unreserved)
        closed = await mem_cluster.start("closed", config=HostConfig(relay=RelayConfig(enabled=False)))
        with pytest.raises(PeerUnavailable, match="does not relay"):
            await target.host.relay.reserve(closed.address)
        with pytest.raises(ValueError, match="through a relay's own address"):
            unreserved.circuit_to(dialer.host.peer_id)


async def test_a_circuit_past_its_byte_limit_is_cut(mem_cluster, memnet, kit):
    small = HostConfig(relay=dataclasses.replace(RelayConfig(), max_bytes=64 * 1024))
    relay = await mem_cluster.start("relay", config=small)
    target = await mem_cluster.start("target")
    dialer = await mem_cluster.start("dialer")
    memnet.partition({"target"}, {"dialer"})
    with trio.fail_after(60):
        await target.host.relay.reserve(relay.address)
        conn = await dialer.host.connect(target.host.relay.circuit_addresses()[0])
        assert (await conn.call(kit.ECHO, kit.Text("small"))).text == "small"
        with pytest.raises(P2PError):
            for _ in range(64):  # 64 x 4 KiB out and back: past 64 KiB
                await conn.call(kit.ECHO, kit.Text("x" * 4000), timeout=10)
        await conn.wait_closed()  # the relay cut the circuit: the connection over it ends
    assert relay.host.relay.circuits == {}


async def test_incoming_circuits_come_only_from_relays_reserved_with(mem_cluster):
    stranger = await mem_cluster.start("stranger")
    target = await mem_cluster.start("target")
    with trio.fail_after(60):
        conn = await stranger.host.connect(target.address)
        async with conn.open_stream(INCOMING, IncomingReq(Identity.generate().peer_id.digest)) as s:
            await s.send_eof()
            resp = await s.response()
    assert resp == CircuitResp(False, "this host holds no reservation with you")


async def test_a_home_user_pastes_another_home_users_address_and_joins_the_swarm(autojump_clock):
    """One public peer; two nodes behind NATs (dials to them hang). The first home node gives an
    address through the public peer; the second home user pastes only that, reaches the first through
    the relay, bootstraps its DHT from it, meets the public peer, and the three average together."""
    net = MemoryNetwork(seed=5)
    net.nat("home1")
    net.nat("home2")
    avg = AveragerConfig(target_size=3, min_size=3, matchmaking_time=3.0)

    def node(name: str, join: list[PeerAddress]) -> Node:
        config = NodeConfig(run_id="relay", listen=((name, 1000),), join=tuple(join), averaging=avg)
        return Node(Identity.generate(), config, transport=net.transport(name), clock=trio.current_time)

    with trio.fail_after(900):
        async with trio.open_nursery() as nursery:
            public = node("public", [])
            await nursery.start(public.run)
            home1 = node("home1", [public.addresses[0]])
            await nursery.start(home1.run)
            [pasted] = await home1.dialable_addresses()
            assert pasted.relay == public.peer_id and pasted.peer_id == home1.peer_id
            home2 = node("home2", [PeerAddress.parse(str(pasted))])  # the one address it was given
            await nursery.start(home2.run)
            await home2.dht.bootstrapped.wait()
            assert home2.host.connection(home1.peer_id) is not None
            nodes = [public, home1, home2]
            results: list[RoundResult] = []

            async def average(i: int) -> None:
                results.append(await nodes[i].average([torch.full((100,), float(i))], timeout=30.0))

            async with trio.open_nursery() as rounds:
                for i in range(3):
                    rounds.start_soon(average, i)
            assert [len(r.contributors) for r in results] == [3, 3, 3]
            assert all(torch.equal(r.tensors[0], torch.full((100,), 1.0)) for r in results)
            assert public.peer_id in {c.peer_id for c in home2.dht.table.contacts()}  # (from home1)
            # home2 is behind a NAT too: its own relay is the public peer, never home1 (which it reaches
            # only through a circuit, and which nobody can dial)
            [relayed] = await home2.dialable_addresses()
            assert relayed == public.addresses[0].circuit_to(home2.peer_id)
            nursery.cancel_scope.cancel()


async def test_a_reservation_outlives_the_idle_timeout(mem_cluster, memnet, kit, autojump_clock):
    """Between renewals the connection to the relay carries nothing for minutes; it must stay open on
    both ends, or the relay can no longer reach the target (before: closed after the idle timeout)."""
    relay = await mem_cluster.start("relay")
    target = await mem_cluster.start("target")
    dialer = await mem_cluster.start("dialer")
    memnet.partition({"target"}, {"dialer"})
    with trio.fail_after(3600):
        await target.host.relay.reserve(relay.address)
        idle = target.host.connection(relay.host.peer_id).config.idle_timeout
        await trio.sleep(5 * idle)
        assert target.host.connection(relay.host.peer_id) is not None
        conn = await dialer.host.connect(target.host.relay.circuit_addresses()[0])
        assert (await conn.call(kit.ECHO, kit.Text("still there"))).text == "still there"


async def test_a_home_node_keeps_a_relay_with_every_public_peer_and_survives_losing_one(autojump_clock):
    """Three public peers; a node behind a NAT holds a reservation with each of them (before: with two
    at most), and when the one it joined through dies, it drops that relay at once (before: it listed a
    dead relay in its addresses until the next renewal, minutes later) and is still reached through the
    others: a second home node that knows only a live public peer gets to it through a circuit."""
    net = MemoryNetwork(seed=7)
    net.nat("home1")
    net.nat("home2")

    def node(name: str, join: list[PeerAddress]) -> Node:
        config = NodeConfig(run_id="relays", listen=((name, 1000),), join=tuple(join))
        return Node(Identity.generate(), config, transport=net.transport(name), clock=trio.current_time)

    with trio.fail_after(900):
        async with trio.open_nursery() as nursery:
            publics = [node("p0", [])]
            await nursery.start(publics[0].run)
            for name in ("p1", "p2"):
                publics.append(node(name, [publics[0].addresses[0]]))
                await nursery.start(publics[-1].run)
            home1 = node("home1", [publics[0].addresses[0]])
            await nursery.start(home1.run)
            everyone = {p.peer_id for p in publics}
            while set(home1.host.relay.relays) != everyone:  # noqa: ASYNC110
                await trio.sleep(1.0)  # (polled under the deadline above)
            net.kill("p0")
            with trio.fail_after(60):
                while publics[0].peer_id in home1.host.relay.relays:  # noqa: ASYNC110
                    await trio.sleep(0.5)
            circuits = await home1.dialable_addresses()
            assert circuits and all(c.relay in everyone - {publics[0].peer_id} for c in circuits), circuits
            home2 = node("home2", [publics[1].addresses[0]])
            await nursery.start(home2.run)
            conn = await home2.host.connect(circuits[0])
            assert conn.relayed and conn.peer == home1.peer_id
            nursery.cancel_scope.cancel()
