"""The in-memory network under MockClock: exact latency, bandwidth, loss, partitions, kills.

Latencies are powers of two so that virtual times add up exactly in floating point.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from p2ptrain.errors import ConnectionClosed, PeerUnavailable
from p2ptrain.net import LinkProfile

LAT = 0.125


async def test_connect_and_ping_take_exact_link_latencies(mem_cluster, memnet, autojump_clock, kit):
    memnet.default = LinkProfile(latency=LAT)
    with trio.fail_after(100):
        server, client = await mem_cluster.start(), await mem_cluster.start()
        start = trio.current_time()
        conn = await client.host.connect(server.address)
        # SYN, hello, reply: the dialer is done when it sends finish ...
        assert trio.current_time() == start + 3 * LAT
        inbound = await server.wait_conn_to(client)
        # ... and the acceptor when finish arrives.
        assert trio.current_time() == start + 4 * LAT
        assert await conn.ping() == 2 * LAT
        assert await inbound.ping() == 2 * LAT
        before = trio.current_time()
        await conn.call(kit.ECHO, kit.Text("rtt"))
        assert trio.current_time() == before + 2 * LAT


async def test_asymmetric_latency(mem_cluster, memnet, autojump_clock):
    with trio.fail_after(100):
        a, b = await mem_cluster.start(), await mem_cluster.start()
        memnet.set_link(a.name, b.name, LinkProfile(latency=LAT), both_ways=False)
        memnet.set_link(b.name, a.name, LinkProfile(latency=4 * LAT), both_ways=False)
        conn = await a.host.connect(b.address)
        assert await conn.ping() == 5 * LAT


async def test_bandwidth_serializes_writes(memnet, autojump_clock, nursery):
    rate = 1_000_000.0  # bytes per second
    memnet.set_link("src", "dst", LinkProfile(latency=LAT, bandwidth=rate))
    arrivals: list[tuple[float, int]] = []
    done = trio.Event()

    async def handler(stream: trio.abc.Stream, host: str, port: int) -> None:
        while data := await stream.receive_some(1 << 20):
            arrivals.append((trio.current_time(), len(data)))
        done.set()

    with trio.fail_after(100):
        [(host, port)] = await nursery.start(memnet.transport("dst").serve, "dst", 0, handler)
        stream = await memnet.transport("src").connect(host, port)
        start = trio.current_time()
        assert start == LAT  # the SYN's trip
        for _ in range(3):
            await stream.send_all(bytes(250_000))  # 0.25 s on the wire each
        await stream.aclose()
        await done.wait()
    # Each write arrives when its last byte has crossed the link, plus the latency.
    assert arrivals == [(start + 0.25 * (i + 1) + LAT, 250_000) for i in range(3)]


async def test_bandwidth_bounds_an_rpc_stream(mem_cluster, memnet, autojump_clock, kit):
    rate = 4 * 1024 * 1024.0
    memnet.default = LinkProfile(latency=LAT, bandwidth=rate)
    with trio.fail_after(100):
        server, client = await mem_cluster.start(), await mem_cluster.start()
        conn = await client.host.connect(server.address)
        data = kit.payload(6 * kit.CHUNK)
        sent_before, start = conn.bytes_sent, trio.current_time()
        async with conn.open_stream(kit.SINK, kit.Text("")) as stream:
            await stream.send(data)
            await stream.send_eof()
            assert (await stream.response()).hash == kit.digest(data)
        elapsed = trio.current_time() - start
        on_wire = conn.bytes_sent - sent_before
    # Every byte crossed the link at its rate, then a latency each way for the last data and the reply
    # (the reply's own serialization time is the only slack).
    assert on_wire > len(data)
    floor = on_wire / rate + 2 * LAT
    assert floor <= elapsed <= floor + 1e-3


async def test_loss_costs_one_retransmission_timeout(mem_cluster, memnet, autojump_clock):
    with trio.fail_after(100):
        a, b = await mem_cluster.start(), await mem_cluster.start()
        conn = await a.host.connect(b.address)
        memnet.default = LinkProfile(latency=LAT, loss=1.0, rto=0.5)
        assert await conn.ping() == 2 * (LAT + 0.5)


async def test_writers_feel_backpressure(memnet, autojump_clock, nursery):
    reader_go, drained = trio.Event(), trio.Event()
    got: list[int] = []

    async def handler(stream: trio.abc.Stream, host: str, port: int) -> None:
        await reader_go.wait()
        while data := await stream.receive_some(1 << 20):
            got.append(len(data))
        drained.set()

    with trio.fail_after(100):
        [(host, port)] = await nursery.start(memnet.transport("dst").serve, "dst", 0, handler)
        stream = await memnet.transport("src").connect(host, port)
        writes = 0

        async def writer() -> None:
            nonlocal writes
            for _ in range(6):
                await stream.send_all(bytes(1 << 20))
                writes += 1
            await stream.aclose()

        nursery.start_soon(writer)
        await trio.testing.wait_all_tasks_blocked()
        assert writes == 4  # 4 MiB in flight: the fifth write waits for the reader
        reader_go.set()
        await drained.wait()
        assert writes == 6
        assert sum(got) == 6 << 20


async def test_partition_stalls_and_heal_resumes(mem_cluster, memnet, autojump_clock, nursery, kit):
    memnet.default = LinkProfile(latency=LAT)
    with trio.fail_after(1000):
        a, b, c = await mem_cluster.start_many(3)
        ab = await a.host.connect(b.address)
        ac = await a.host.connect(c.address)
        cb = await c.host.connect(b.address)
        memnet.partition([a.name], [b.name])
        finished = trio.Event()
        holder: dict[str, str] = {}

        async def call() -> None:
            holder["reply"] = (await ab.call(kit.ECHO, kit.Text("across"), timeout=500)).text
            finished.set()

        nursery.start_soon(call)
        with trio.move_on_after(20):  # less than the keepalive timeout (30 s), which would close it
            await finished.wait()
        assert not finished.is_set()  # stalled, not failed
        # Only the a-b path is cut: c still talks to both sides.
        assert (await ac.call(kit.ECHO, kit.Text("a-c"))).text == "a-c"
        assert (await cb.call(kit.ECHO, kit.Text("c-b"))).text == "c-b"
        healed = trio.current_time()
        memnet.heal()
        await finished.wait()
        # The request waiting at the cut is delivered on heal; the reply takes one latency back.
        assert trio.current_time() == healed + LAT
        assert holder["reply"] == "across"
        assert not ab.closed


async def test_dial_into_a_partition_hangs_until_heal(mem_cluster, memnet, autojump_clock, nursery):
    with trio.fail_after(1000):
        a, b = await mem_cluster.start(), await mem_cluster.start()
        memnet.partition([a.name], [b.name])
        with trio.move_on_after(50):
            await a.host.connect(b.address, timeout=1000)
        assert a.host.connections() == []
        memnet.heal()
        conn = await a.host.connect(b.address)
        assert conn.peer == b.peer_id


async def test_kill_resets_connections_and_stops_listeners(mem_cluster, memnet, autojump_clock, kit):
    memnet.default = LinkProfile(latency=LAT)
    with trio.fail_after(100):
        a, b, c = await mem_cluster.start_many(3)
        ab = await a.host.connect(b.address)
        ac = await a.host.connect(c.address)
        killed = trio.current_time()
        memnet.kill(b.name)
        await ab.wait_closed()
        assert trio.current_time() == killed  # a reset, not a timeout
        with pytest.raises(ConnectionClosed):
            await ab.call(kit.ECHO, kit.Text("?"))
        # Nothing listens any more: a new dial is refused after the SYN's trip.
        with pytest.raises(PeerUnavailable, match="cannot reach"):
            await a.host.connect(b.address)
        assert trio.current_time() == killed + LAT
        # Everyone else is untouched.
        assert (await ac.call(kit.ECHO, kit.Text("fine"))).text == "fine"
