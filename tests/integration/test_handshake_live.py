"""The handshake between live Hosts: success, refusals with their codes (both sides), timeouts, caps."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from p2ptrain.errors import HandshakeRefused
from p2ptrain.identity import Identity
from p2ptrain.net import HostConfig, PeerAddress
from p2ptrain.net.handshake import PROTOCOL_VERSION

HOST_LOG = "p2ptrain.net.host"


def _refusals(caplog: pytest.LogCaptureFixture, code: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == HOST_LOG
        and r.levelno == logging.WARNING
        and r.getMessage().startswith("refused handshake from")
        and f"({code})" in r.getMessage()
    ]


async def test_handshake_succeeds_and_both_sides_learn_the_peer(cluster, kit):
    with trio.fail_after(10):
        server, client = await cluster.start(), await cluster.start()
        conn = await client.host.connect(server.address)
        assert conn.peer == server.peer_id
        assert conn.outbound
        assert (await conn.call(kit.ECHO, kit.Text("hello"))).text == "hello"
        inbound = await server.wait_conn_to(client)
        assert inbound.peer == client.peer_id
        assert not inbound.outbound
        # The responder can call back over the same connection.
        assert (await inbound.call(kit.ECHO, kit.Text("back"))).text == "back"
        assert client.host.connections() == [conn]
        assert server.host.connections() == [inbound]


async def test_dial_with_wrong_peer_id_is_refused(cluster, caplog):
    caplog.set_level(logging.WARNING, logger=HOST_LOG)
    with trio.fail_after(10):
        server, client = await cluster.start(), await cluster.start()
        someone_else = Identity.generate().peer_id
        wrong = server.address.with_peer(someone_else)
        with pytest.raises(HandshakeRefused) as info:
            await client.host.connect(wrong)
        assert info.value.code == "peer_id"
        assert info.value.by_remote
        assert str(someone_else) in info.value.reason
        assert len(_refusals(caplog, "peer_id")) == 1
        assert client.host.connections() == []
        assert server.host.connections() == []


async def test_wrong_run_id_is_refused(cluster, caplog):
    caplog.set_level(logging.WARNING, logger=HOST_LOG)
    with trio.fail_after(10):
        server = await cluster.start()
        stranger = await cluster.start(run_id="another-run")
        with pytest.raises(HandshakeRefused) as info:
            await stranger.host.connect(server.address)
        assert info.value.code == "run_id"
        assert info.value.by_remote
        assert "another-run" in info.value.reason
        assert len(_refusals(caplog, "run_id")) == 1
        assert server.host.connections() == []


async def test_wrong_protocol_version_is_refused(cluster, caplog):
    caplog.set_level(logging.WARNING, logger=HOST_LOG)
    with trio.fail_after(10):
        server = await cluster.start()
        future = await cluster.start(config=HostConfig(protocol_version=PROTOCOL_VERSION + 1))
        with pytest.raises(HandshakeRefused) as info:
            await future.host.connect(server.address)
        assert info.value.code == "version"
        assert info.value.by_remote
        assert len(_refusals(caplog, "version")) == 1
        assert server.host.connections() == []


async def test_refused_dial_leaves_the_server_serving(cluster, kit):
    with trio.fail_after(10):
        server = await cluster.start()
        stranger = await cluster.start(run_id="another-run")
        with pytest.raises(HandshakeRefused):
            await stranger.host.connect(server.address)
        friend = await cluster.start()
        conn = await friend.host.connect(server.address)
        assert (await conn.call(kit.ECHO, kit.Text("still here"))).text == "still here"


async def test_dial_without_peer_id_connects_and_warns(cluster, caplog):
    caplog.set_level(logging.WARNING, logger=HOST_LOG)
    with trio.fail_after(10):
        server, client = await cluster.start(), await cluster.start()
        a = server.address
        conn = await client.host.connect(PeerAddress(a.kind, a.host, a.port))
        assert conn.peer == server.peer_id
        assert any("without a peer id" in r.getMessage() for r in caplog.records)


async def test_silent_client_is_dropped_after_handshake_timeout(mem_cluster, autojump_clock, caplog):
    caplog.set_level(logging.INFO, logger=HOST_LOG)
    cfg = HostConfig(handshake_timeout=7.5)
    with trio.fail_after(60):
        server = await mem_cluster.start(config=cfg)
        stream = await mem_cluster.dial_raw(server, src="mute")
        opened = trio.current_time()
        # Send nothing; the server must hang up at exactly the handshake deadline.
        assert await stream.receive_some() == b""
        assert trio.current_time() == opened + cfg.handshake_timeout
        assert any("handshake not completed within 7.5 s" in r.getMessage() for r in caplog.records)
        await stream.aclose()


async def test_silent_client_does_not_hold_an_inbound_slot(mem_cluster, autojump_clock, kit):
    cfg = HostConfig(handshake_timeout=5.0, max_inbound=1)
    with trio.fail_after(60):
        server = await mem_cluster.start(config=cfg)
        stream = await mem_cluster.dial_raw(server, src="mute")
        assert await stream.receive_some() == b""
        await stream.aclose()
        # The slot the silent client held is free again.
        client = await mem_cluster.start()
        conn = await client.host.connect(server.address)
        assert (await conn.call(kit.ECHO, kit.Text("ok"))).text == "ok"


async def test_per_ip_inbound_cap_refuses_with_busy(tcp_cluster, caplog, kit):
    # Over loopback every client comes from 127.0.0.1: the per-IP cap is the one that bites.
    caplog.set_level(logging.WARNING, logger=HOST_LOG)
    with trio.fail_after(10):
        server = await tcp_cluster.start(config=HostConfig(max_inbound_per_ip=2))
        first, second, third = await tcp_cluster.start_many(3)
        for client in (first, second):
            await client.host.connect(server.address)
        inbound = await server.wait_conn_to(first)
        await server.wait_conn_to(second)
        with pytest.raises(HandshakeRefused) as info:
            await third.host.connect(server.address)
        assert info.value.code == "busy"
        assert info.value.by_remote
        assert any("connection limit reached" in r.getMessage() for r in caplog.records)
        assert len(server.host.connections()) == 2
        # When one leaves, its slot is free again.
        await first.conn_to(server).aclose("leaving")
        await inbound.wait_closed()
        await trio.testing.wait_all_tasks_blocked()
        conn = await third.host.connect(server.address)
        assert (await conn.call(kit.ECHO, kit.Text("my turn"))).text == "my turn"


async def test_total_inbound_cap_refuses_with_busy(mem_cluster, kit):
    # On the memory network every host has its own address: the total cap is the one that bites.
    with trio.fail_after(10):
        server = await mem_cluster.start(config=HostConfig(max_inbound=2))
        a, b, c = await mem_cluster.start_many(3)
        conn_a = await a.host.connect(server.address)
        await b.host.connect(server.address)
        with pytest.raises(HandshakeRefused) as info:
            await c.host.connect(server.address)
        assert info.value.code == "busy"
        # Outbound connections are not capped by the inbound limit.
        out = await server.host.connect(c.address)
        assert (await out.call(kit.ECHO, kit.Text("out"))).text == "out"
        # Closing one inbound connection frees its slot.
        inbound = await server.wait_conn_to(a)
        await conn_a.aclose("leaving")
        await inbound.wait_closed()
        await trio.testing.wait_all_tasks_blocked()
        d = await mem_cluster.start()
        conn_d = await d.host.connect(server.address)
        assert (await conn_d.call(kit.ECHO, kit.Text("my turn"))).text == "my turn"
