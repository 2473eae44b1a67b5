"""Dialing real sockets by every address form a user may paste: IPv4, IPv6 and DNS names."""

from __future__ import annotations

import socket

import pytest
import trio

from p2ptrain.identity import Identity
from p2ptrain.net.address import PeerAddress
from p2ptrain.net.host import Host
from p2ptrain.nodebase import PING, PingRequest


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


async def _ping_via(listen: tuple[str, int], make_address: object) -> str:
    from p2ptrain.node import Node, NodeConfig

    node = Node(Identity.generate(), NodeConfig(run_id="addr", listen=(listen,)))
    client = Host(Identity.generate(), "addr")
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        await nursery.start(client.run, [])
        bound = node.host.listen_addresses[0]
        addr = make_address(bound)  # type: ignore[operator]
        conn = await client.connect(addr)
        assert conn.peer == node.peer_id
        reply = await conn.call(PING, PingRequest(b"addr"), timeout=5)
        nursery.cancel_scope.cancel()
    return str(addr) if reply.payload == b"addr" else ""


async def test_dial_ipv4_multiaddr() -> None:
    with trio.fail_after(20):
        text = await _ping_via(("127.0.0.1", 0), lambda b: PeerAddress.parse(str(b)))
    assert text.startswith("/ip4/127.0.0.1/tcp/")


async def test_dial_dns_name() -> None:
    with trio.fail_after(20):
        text = await _ping_via(
            ("127.0.0.1", 0), lambda b: PeerAddress.parse(f"/dns/localhost/tcp/{b.port}/p2p/{b.peer_id}")
        )
    assert text.startswith("/dns/localhost/")


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this machine")
async def test_dial_ipv6_multiaddr() -> None:
    with trio.fail_after(20):
        text = await _ping_via(("::1", 0), lambda b: PeerAddress.parse(str(b)))
    assert text.startswith("/ip6/::1/tcp/")


async def test_dial_without_peer_id_logs_that_it_is_unverified(caplog: pytest.LogCaptureFixture) -> None:
    with trio.fail_after(20):
        await _ping_via(("127.0.0.1", 0), lambda b: PeerAddress.parse(f"127.0.0.1:{b.port}"))
    assert any("without a peer id" in r.getMessage() for r in caplog.records)


async def test_a_node_announces_another_port_and_dials_from_its_source_address() -> None:
    """What a relay in front of a node needs: the join address names the relay's port, and the node's own
    outgoing connections leave from a chosen local address (the relay tells peers apart by it)."""
    from p2ptrain import Node, NodeConfig
    from p2ptrain.identity import Identity

    a = Node(Identity.generate(), NodeConfig(run_id="relay", listen=(("127.0.0.1", 0),), announce_port=40404))
    b_config = NodeConfig(run_id="relay", listen=(("127.0.0.1", 0),), source_address="127.0.0.3")
    b = Node(Identity.generate(), b_config)
    inbound: list[str] = []
    arrived = trio.Event()

    def observe(conn: object, opened: bool) -> None:
        if opened and not conn.outbound:  # type: ignore[attr-defined]
            inbound.append(conn.remote_host)  # type: ignore[attr-defined]
            arrived.set()

    a.host.on_connection(observe)  # type: ignore[arg-type]
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(a.run)
            await nursery.start(b.run)
            assert [x.port for x in a.addresses] == [40404]
            real = a.host.listen_addresses[0]
            conn = await b.host.connect(f"/ip4/127.0.0.1/tcp/{real.port}/p2p/{a.peer_id}")
            assert conn.peer == a.peer_id
            await arrived.wait()
            assert inbound == ["127.0.0.3"]
            nursery.cancel_scope.cancel()
