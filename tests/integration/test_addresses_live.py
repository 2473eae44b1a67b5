"""Dialing real sockets by every address form a user may paste: IPv4, IPv6 and DNS names."""

from __future__ import annotations

import socket

import pytest
import trio

from p2ptrain.identity import Identity
from p2ptrain.net.address import PeerAddress
from p2ptrain.net.host import Host
from p2ptrain.node import PING, PingRequest


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
