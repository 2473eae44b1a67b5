"""Connection management: reuse, shared dials, idle close, keepalive, graceful shutdown, observers."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from p2ptrain.errors import ConnectionClosed, PeerUnavailable
from p2ptrain.net import ConnectionConfig, HostConfig, PeerAddress

CONN_LOG = "p2ptrain.net.connection"


async def test_connect_reuses_a_live_connection(cluster, kit):
    with trio.fail_after(10):
        server, client = await cluster.start(), await cluster.start()
        first = await client.host.connect(server.address)
        again = await client.host.connect(server.address)
        by_string = await client.host.connect(str(server.address))
        assert first is again is by_string
        assert client.host.connections() == [first]
        # The accepting side may dial back: it reuses the inbound connection.
        back = await server.host.connect(client.address)
        assert back is await server.wait_conn_to(client)
        assert not back.outbound
        assert len(server.host.connections()) == 1
        assert client.host.connected_peers() == [server.peer_id]


async def test_concurrent_connects_share_one_dial(cluster):
    with trio.fail_after(10):
        server, client = await cluster.start(), await cluster.start()
        conns = []

        async def dial(address) -> None:
            conns.append(await client.host.connect(address))

        async with trio.open_nursery() as nursery:
            for _ in range(10):
                nursery.start_soon(dial, server.address)
        assert len(conns) == 10
        assert all(c is conns[0] for c in conns)
        assert client.host.connections() == [conns[0]]
        await server.wait_conn_to(client)
        assert len(server.host.connections()) == 1
        assert [opened for _, opened in server.events] == [True]


async def test_concurrent_connects_without_peer_id_share_one_dial(cluster):
    with trio.fail_after(10):
        server, client = await cluster.start(), await cluster.start()
        a = server.address
        bare = PeerAddress(a.kind, a.host, a.port)
        conns = []

        async def dial() -> None:
            conns.append(await client.host.connect(bare))

        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(dial)
        assert len(conns) == 5
        assert all(c is conns[0] for c in conns)
        assert conns[0].peer == server.peer_id
        assert client.host.connections() == [conns[0]]


async def test_concurrent_failed_dials_share_one_timeout(mem_cluster, memnet, autojump_clock):
    cfg = HostConfig(connect_timeout=10.0)
    with trio.fail_after(100):
        server, client = await mem_cluster.start(), await mem_cluster.start(config=cfg)
        memnet.partition([server.name], [client.name])  # dials into the partition hang
        start = trio.current_time()
        failures: list[tuple[float, BaseException]] = []

        async def dial() -> None:
            try:
                await client.host.connect(server.address)
            except PeerUnavailable as e:
                failures.append((trio.current_time(), e))

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(dial)
        # One attempt, one timeout, shared by every caller: not 10, 20, 30 s.
        assert [t for t, _ in failures] == [start + 10.0] * 3
        assert all("did not answer within 10 s" in str(e) for _, e in failures)
        memnet.heal()
        conn = await client.host.connect(server.address)
        assert conn.peer == server.peer_id


async def test_connect_errors(cluster):
    with trio.fail_after(10):
        server, client = await cluster.start(), await cluster.start()
        with pytest.raises(PeerUnavailable, match="ourselves"):
            await client.host.connect(client.address)
        await server.stop()
        with pytest.raises(PeerUnavailable):
            await client.host.connect(server.address)


def _idle_config(**kw) -> HostConfig:
    conn = ConnectionConfig(idle_timeout=60.0, keepalive_interval=10.0, keepalive_timeout=30.0, **kw)
    return HostConfig(connection=conn)


async def test_idle_connection_is_closed_after_idle_timeout(mem_cluster, autojump_clock, kit):
    cfg = _idle_config()
    idle, interval = cfg.connection.idle_timeout, cfg.connection.keepalive_interval
    with trio.fail_after(1000):
        server, client = await mem_cluster.start(config=cfg), await mem_cluster.start(config=cfg)
        conn = await client.host.connect(server.address)
        inbound = await server.wait_conn_to(client)
        await conn.call(kit.ECHO, kit.Text("last use"))
        last_use = trio.current_time()
        # Keepalive pings flow meanwhile, but they are not "use": still open at the idle timeout...
        with trio.move_on_at(last_use + idle):
            await conn.wait_closed()
        assert not conn.closed
        # ... and closed within one keepalive interval after it, on both sides, by agreement.
        with trio.fail_at(last_use + idle + interval):
            await conn.wait_closed()
            await inbound.wait_closed()
        assert "idle" in conn.close_reason
        assert "idle" in inbound.close_reason
        assert client.host.connections() == server.host.connections() == []


async def test_busy_connection_is_not_idle(mem_cluster, autojump_clock, kit):
    cfg = _idle_config()
    with trio.fail_after(1000):
        server, client = await mem_cluster.start(config=cfg), await mem_cluster.start(config=cfg)
        conn = await client.host.connect(server.address)
        # A call in flight for 10x the idle timeout keeps the connection open.
        with trio.move_on_after(10 * cfg.connection.idle_timeout):
            await conn.call(kit.SLEEP, kit.Text("long"), timeout=1e5)
        assert not conn.closed
        await server.service.until(lambda: server.service.cancelled["sleep"] == 1)  # our give-up arrived
        assert (await conn.call(kit.ECHO, kit.Text("still"))).text == "still"


async def test_a_connection_being_closed_starts_no_new_call(mem_cluster, autojump_clock, kit):
    """A node evicting an idle connection (``Inbound``) tells the remote why before it closes it; a call
    of its own begun on it meanwhile was lost (at 128 simulated peers, a round's slices). From the
    moment it is closing, ``Host.connection`` no longer hands it out and a call on it fails at once; a
    new connection carries the call."""
    with trio.fail_after(100):
        server, client = await mem_cluster.start(), await mem_cluster.start()
        await client.host.connect(server.address)
        held = await server.wait_conn_to(client)
        nursery = server.host.nursery
        assert nursery is not None
        held.close_soon(nursery, "evicted: over 1 inbound connections")
        assert server.host.connection(client.peer_id) is not held
        with pytest.raises(ConnectionClosed):
            await held.call(kit.ECHO, kit.Text("on the evicted one"))
        conn = await server.host.connect(client.address)
        assert conn is not held
        assert (await conn.call(kit.ECHO, kit.Text("on a new one"))).text == "on a new one"
        await held.wait_closed()
        assert held.close_reason.startswith("evicted")


async def test_keep_open_connection_outlives_the_idle_timeout(mem_cluster, autojump_clock, kit):
    cfg = _idle_config()
    with trio.fail_after(10_000):
        server, client = await mem_cluster.start(config=cfg), await mem_cluster.start(config=cfg)
        conn = await client.host.connect(server.address)
        inbound = await server.wait_conn_to(client)
        # keep_open is a local decision: each end that wants the connection kept marks its own.
        conn.keep_open = inbound.keep_open = True
        with trio.move_on_after(20 * cfg.connection.idle_timeout):
            await conn.wait_closed()
        assert not conn.closed and not inbound.closed
        assert (await conn.call(kit.ECHO, kit.Text("still"))).text == "still"


async def test_keepalive_detects_a_partitioned_peer(mem_cluster, memnet, autojump_clock, kit):
    cfg = _idle_config()
    timeout, interval = cfg.connection.keepalive_timeout, cfg.connection.keepalive_interval
    with trio.fail_after(1000):
        server, client = await mem_cluster.start(config=cfg), await mem_cluster.start(config=cfg)
        conn = await client.host.connect(server.address)
        inbound = await server.wait_conn_to(client)
        conn.keep_open = inbound.keep_open = True  # only the keepalive may close it
        await conn.call(kit.ECHO, kit.Text("last word"))
        cut = trio.current_time()
        memnet.partition([server.name], [client.name])
        with trio.move_on_at(cut + timeout):
            await conn.wait_closed()
        assert not conn.closed
        with trio.fail_at(cut + timeout + interval):
            await conn.wait_closed()
            await inbound.wait_closed()
        assert conn.close_reason == inbound.close_reason == "keepalive timeout"
        assert client.host.connections() == server.host.connections() == []


def _tasks() -> int:
    """Every task of this trio run."""
    todo, count = [trio.lowlevel.current_root_task()], 0
    while todo:
        task = todo.pop()
        count += 1
        todo.extend(t for n in task.child_nurseries for t in n.child_tasks)
    return count


async def test_a_connection_costs_one_task_per_end(cluster):
    # The keepalive checks run on the host's one timer and the reader in the connection's own task:
    # an idle connection holds one task at each end (it held three before the timer was shared).
    with trio.fail_after(20):
        client = await cluster.start()
        servers = [await cluster.start() for _ in range(4)]
        before = _tasks()
        conns = [await client.host.connect(s.address) for s in servers]
        for s in servers:
            await s.wait_conn_to(client)
        await trio.testing.wait_all_tasks_blocked()
        assert _tasks() - before == 2 * len(conns)
        assert len(client.host._keepalives) == len(conns)  # each connection's next check, on one timer


async def test_one_timer_closes_only_the_partitioned_connection(mem_cluster, memnet, autojump_clock, kit):
    cfg = _idle_config()
    timeout, interval = cfg.connection.keepalive_timeout, cfg.connection.keepalive_interval
    with trio.fail_after(1000):
        client = await mem_cluster.start(config=cfg)
        servers = [await mem_cluster.start(config=cfg) for _ in range(3)]
        conns = []
        for s in servers:
            conns.append(await client.host.connect(s.address))
            (await s.wait_conn_to(client)).keep_open = True
            conns[-1].keep_open = True
            await trio.sleep(1.5)  # (each connection's checks fall at their own times)
        await conns[0].call(kit.ECHO, kit.Text("last word"))
        cut = trio.current_time()
        memnet.partition([servers[0].name], [client.name])
        with trio.fail_at(cut + timeout + interval):
            await conns[0].wait_closed()
        assert trio.current_time() > cut + timeout
        assert conns[0].close_reason == "keepalive timeout"
        # The others' pings and pongs keep flowing on the same timer, for as long as one cares to wait.
        received = [c.bytes_received for c in conns[1:]]
        await trio.sleep(10 * timeout)
        assert not any(c.closed for c in conns[1:])
        assert all(c.bytes_received > r for c, r in zip(conns[1:], received, strict=True))


async def test_keepalive_keeps_a_quiet_healthy_connection(mem_cluster, memnet, autojump_clock):
    cfg = _idle_config()
    memnet.default.latency = 0.2
    with trio.fail_after(10_000):
        server, client = await mem_cluster.start(config=cfg), await mem_cluster.start(config=cfg)
        conn = await client.host.connect(server.address)
        inbound = await server.wait_conn_to(client)
        conn.keep_open = inbound.keep_open = True
        before = conn.bytes_received
        with trio.move_on_after(50 * cfg.connection.keepalive_timeout):
            await conn.wait_closed()
        assert not conn.closed
        assert conn.bytes_received > before  # pings and pongs kept it alive


async def test_closing_a_host_sends_goaway_with_its_reason(cluster, caplog):
    caplog.set_level(logging.INFO, logger=CONN_LOG)
    with trio.fail_after(10):
        server, client = await cluster.start(), await cluster.start()
        conn = await client.host.connect(server.address)
        await server.wait_conn_to(client)
        await server.stop()
        await conn.wait_closed()
        assert conn.close_reason == "remote closed: shutting down"
        assert any(
            r.name == CONN_LOG and r.getMessage().endswith("is closing the connection: shutting down")
            for r in caplog.records
        )
        assert client.host.connections() == []


async def test_aclose_tells_the_remote_why(cluster):
    with trio.fail_after(10):
        server, client = await cluster.start(), await cluster.start()
        conn = await client.host.connect(server.address)
        inbound = await server.wait_conn_to(client)
        await conn.aclose("rebalancing")
        assert conn.closed and conn.close_reason == "rebalancing"
        await inbound.wait_closed()
        assert inbound.close_reason == "remote closed: rebalancing"


async def test_observers_hear_open_and_close_on_both_sides(cluster):
    with trio.fail_after(10):
        server, client = await cluster.start(), await cluster.start()
        seen: list[tuple[str, object, bool]] = []
        client.host.on_connection(lambda c, up: seen.append(("client", c, up)))
        server.host.on_connection(lambda c, up: seen.append(("server", c, up)))
        conn = await client.host.connect(server.address)
        inbound = await server.wait_conn_to(client)
        assert ("client", conn, True) in seen
        assert ("server", inbound, True) in seen
        assert len(seen) == 2
        await conn.aclose("done")
        await inbound.wait_closed()
        await trio.testing.wait_all_tasks_blocked()
        assert ("client", conn, False) in seen
        assert ("server", inbound, False) in seen
        assert len(seen) == 4
        # Each connection is reported open before it is reported closed.
        for side, c in (("client", conn), ("server", inbound)):
            assert seen.index((side, c, True)) < seen.index((side, c, False))
