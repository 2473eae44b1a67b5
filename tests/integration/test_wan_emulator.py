"""The userspace WAN switch: what it guarantees on any machine, however loaded.

Shaping is checked as bounds that load cannot break. A byte is written to its receiver only after every
token bucket on its path has paid for it, so by time t a bucket of rate r and burst b started at t0 has
let through at most b + r * (t - t0) bytes; a late wake-up of the switch only delays bytes, which puts
the counts further under that bound (``cap_bound``). Latency is checked as a lower bound for the same
reason, ordering and the two directions' separate buckets as facts, cuts and partitions by what each
end sees. Liveness (traffic flows at all, the faster direction overtakes the slower one's cap) is
waited for, with ``fail_after`` only against a hang.

How close a link comes to its rate and latency depends on the machine's load, so that is no test: the
benchmark ``python -m simulations.benchmarks.wan_emulator`` measures it (single links, a shared upload
cap, both directions at once) and prints JSON and a table.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Callable

import pytest
import trio

from p2ptrain import Node, NodeConfig
from p2ptrain.identity import Identity
from p2ptrain.nodebase import PING, PingRequest
from simulations.labs.wan import LinkProfile, TokenBucket, WanSwitch

pytestmark = pytest.mark.timeout(60)

CHUNK = bytes(1 << 16)
FLOOD, COUNT, ECHO = b"F", b"C", b"E"  # the first byte of a connection tells the server what to do


class Server:
    """A peer's real listener: counts what it receives (C), floods its client (F), or echoes (E)."""

    def __init__(self) -> None:
        self.received = 0
        self.closed: list[str] = []  # how each connection ended: "eof" or "reset"
        self.changed = trio.Event()
        self.address: tuple[str, int] = ("", 0)

    async def run(self, *, task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.address = listeners[0].socket.getsockname()[:2]
        async with trio.open_nursery() as nursery:
            task_status.started(self)
            await trio.serve_listeners(self._serve, listeners, handler_nursery=nursery)

    async def _serve(self, stream: trio.SocketStream) -> None:
        how = "eof"
        try:
            mode = await stream.receive_some(1)
            if mode == FLOOD:
                while True:
                    await stream.send_all(CHUNK)
            while data := await stream.receive_some(1 << 16):
                self.received += len(data)
                if mode == ECHO:
                    await stream.send_all(data)
        except trio.BrokenResourceError:
            how = "reset"
        finally:
            self.closed.append(how)
            self.changed.set()
            self.changed = trio.Event()
            await stream.aclose()


async def start(nursery: trio.Nursery, switch: WanSwitch, servers: int) -> list[Server]:
    await nursery.start(switch.run)
    out = []
    for i in range(servers):
        server = await nursery.start(Server().run)
        switch.set_upstream(i, server.address)
        out.append(server)
    return out


async def dial(switch: WanSwitch, src: int, dst: int, mode: bytes) -> trio.SocketStream:
    stream = await trio.open_tcp_stream(*switch.endpoint(dst), local_address=switch.source_address(src))
    await stream.send_all(mode)
    return stream


async def flood(stream: trio.SocketStream) -> None:
    """Send as fast as the stream takes it, until cancelled (then close it)."""
    async with stream:
        while True:
            await stream.send_all(CHUNK)


async def drain(stream: trio.SocketStream, into: list[int]) -> None:
    """Count what arrives in ``into[0]`` until cancelled (then close the stream)."""
    async with stream:
        while data := await stream.receive_some(1 << 16):
            into[0] += len(data)


def cap_bound(mbit: float, now: float, since: float) -> float:
    """The most bytes a bucket of ``mbit`` that started (full) at ``since`` has let through by ``now``."""
    bucket = TokenBucket(mbit, since)
    return bucket.burst + bucket.rate * (now - since)


async def hold_caps(
    since: float, capped: list[tuple[Callable[[], int], float]], until: Callable[[], bool], span: float = 1.0
) -> int:
    """Every 20 ms, check each byte counter against the bound of its cap (Mbit/s) since ``since``, for at
    least ``span`` seconds and then until ``until()``; returns how many times it checked."""
    end, checks = trio.current_time() + span, 0
    while True:
        await trio.sleep(0.02)
        counts = [count() for count, _ in capped]
        now = trio.current_time()  # read after the counts: the bound can only be too generous
        for (_, mbit), got in zip(capped, counts, strict=True):
            assert got <= cap_bound(mbit, now, since), (got, mbit, now - since)
        checks += 1
        if now >= end and until():
            return checks


async def round_trip(stream: trio.SocketStream, msg: bytes = b"ping") -> float:
    t0 = trio.current_time()
    await stream.send_all(msg)
    got = b""
    while len(got) < len(msg):
        if not (part := await stream.receive_some(64)):
            raise trio.BrokenResourceError("closed by the other end")
        got += part
    assert got == msg
    return trio.current_time() - t0


# ---- the pure part --------------------------------------------------------------------------------


def test_token_bucket_serves_its_burst_at_once_then_charges_in_order_at_its_rate() -> None:
    bucket = TokenBucket(8.0, now=0.0)  # 1 MB/s, a burst of 32 KiB
    assert bucket.reserve(32 * 1024, 0.0) == 0.0
    assert bucket.reserve(100_000, 0.0) == pytest.approx(0.1)  # in debt: paid off 100 ms later
    assert bucket.reserve(100_000, 0.0) == pytest.approx(0.2)  # queued behind the first
    assert bucket.reserve(1, 10.0) == 10.0  # refilled (but to its burst only)
    assert bucket.reserve(64 * 1024, 10.0) == pytest.approx(10.0 + (32 * 1024 + 1) / 1e6)
    bucket.set_rate(80.0, 10.0)  # live change: the debt is paid at the new rate
    assert bucket.reserve(0, 10.0) == pytest.approx(10.0 + (32 * 1024 + 1) / 1e7)
    assert TokenBucket(float("inf"), 0.0).reserve(10**9, 5.0) == 5.0


def test_profiles_are_checked() -> None:
    with pytest.raises(ValueError, match="positive"):
        LinkProfile(up_mbit=0)
    with pytest.raises(ValueError, match="latency_ms"):
        LinkProfile(latency_ms=-1)


# ---- shaping: bounds that load cannot break --------------------------------------------------------


async def test_a_link_never_beats_its_rate_nor_its_latency(nursery: trio.Nursery) -> None:
    with trio.fail_after(30):
        switch = WanSwitch([LinkProfile(), LinkProfile(50, 50, latency_ms=80)])
        (_, server) = await start(nursery, switch, 2)
        pinger = await dial(switch, 0, 1, ECHO)
        for _ in range(3):
            assert await round_trip(pinger) >= 2 * 0.080  # a late switch only adds to it
        await pinger.aclose()
        # From here on only the flood reaches peer 1, through its 50 Mbit/s download: the bucket holds
        # at most its burst now, so the flood's bytes stay under the bound counted from now. Unshaped,
        # they would pass it within milliseconds.
        since, before = trio.current_time(), server.received
        nursery.start_soon(flood, await dial(switch, 0, 1, COUNT))

        def flooded() -> int:
            return server.received - before

        await hold_caps(since, [(flooded, 50.0)], until=lambda: flooded() > 1 << 20)


async def test_a_peers_upload_cap_holds_across_two_connections(nursery: trio.Nursery) -> None:
    with trio.fail_after(30):
        since = trio.current_time()
        switch = WanSwitch([LinkProfile(up_mbit=20, latency_ms=5), *[LinkProfile(latency_ms=5)] * 2])
        servers = await start(nursery, switch, 3)
        for dst in (1, 2):
            nursery.start_soon(flood, await dial(switch, 0, dst, COUNT))

        def both() -> int:
            return servers[1].received + servers[2].received

        await hold_caps(
            since, [(both, 20.0)], until=lambda: servers[1].received > 0 and servers[2].received > 0
        )
        assert switch.stats()["peers"][0]["connections"] == 2


@pytest.mark.parametrize(("up_mbit", "down_mbit"), [(40.0, 1.0), (1.0, 40.0)])
async def test_upload_and_download_are_shaped_in_their_own_directions(
    nursery: trio.Nursery, up_mbit: float, down_mbit: float
) -> None:
    # Each direction stays under its own cap; and the faster one overtakes what the slower one's cap would
    # allow, which it could not if both directions paid into one bucket (40 times apart: load slows both).
    with trio.fail_after(45):
        since = trio.current_time()
        switch = WanSwitch([LinkProfile(up_mbit=up_mbit, down_mbit=down_mbit, latency_ms=5), LinkProfile()])
        (_, server) = await start(nursery, switch, 2)
        nursery.start_soon(flood, await dial(switch, 0, 1, COUNT))
        downloaded = [0]
        nursery.start_soon(drain, await dial(switch, 0, 1, FLOOD), downloaded)

        def uploaded() -> int:
            return server.received

        faster, slower_cap = (
            (uploaded, down_mbit) if up_mbit > down_mbit else (lambda: downloaded[0], up_mbit)
        )
        await hold_caps(
            since,
            [(uploaded, up_mbit), (lambda: downloaded[0], down_mbit)],
            until=lambda: faster() > cap_bound(slower_cap, trio.current_time(), since),
        )


async def test_a_jittery_shaped_link_keeps_the_stream_in_order(nursery: trio.Nursery) -> None:
    # Jitter draws a delay per chunk; a later chunk drawn shorter must still wait for the one before it.
    with trio.fail_after(30):
        link = LinkProfile(20, 20, latency_ms=10, jitter_ms=9)
        switch = WanSwitch([link, link], seed=7)
        await start(nursery, switch, 2)
        stream = await dial(switch, 0, 1, ECHO)
        rng = random.Random(7)
        sent = rng.randbytes(1 << 20)
        echoed = bytearray()

        async def send() -> None:
            at = 0
            while at < len(sent):
                step = rng.randrange(1, 40_000)
                await stream.send_all(sent[at : at + step])
                at += step

        async with trio.open_nursery() as inner:
            inner.start_soon(send)
            while len(echoed) < len(sent):
                if not (data := await stream.receive_some(1 << 16)):
                    break
                echoed += data
        assert bytes(echoed) == sent
        await stream.aclose()


# ---- controls -------------------------------------------------------------------------------------


async def test_a_cut_resets_every_connection_of_the_peer_on_both_ends(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        switch = WanSwitch([LinkProfile(latency_ms=5), LinkProfile(latency_ms=5), LinkProfile()])
        servers = await start(nursery, switch, 3)
        clients = [await dial(switch, 0, 1, ECHO), await dial(switch, 2, 0, ECHO)]
        spared = await dial(switch, 2, 1, ECHO)  # not peer 0's: stays up
        for stream in [*clients, spared]:
            await round_trip(stream)
        assert switch.cut(0) == 2
        for stream in clients:
            with pytest.raises(trio.BrokenResourceError):
                await round_trip(stream)
            await stream.aclose()
        for server in servers[:2]:  # the peers' ends were reset too
            while server.closed != ["reset"]:
                await server.changed.wait()
        await round_trip(spared)
        assert switch.stats()["peers"][0] | {"sent": 0, "received": 0} == {
            "address": "127.0.0.10",
            "sent": 0,
            "received": 0,
            "connections": 0,
            "cuts": 2,
            "refused": 0,
            "partitioned": False,
        }
        await spared.aclose()


async def test_a_partition_stalls_traffic_then_it_flows_again_and_profiles_change_live(
    nursery: trio.Nursery,
) -> None:
    with trio.fail_after(15):
        switch = WanSwitch([LinkProfile(latency_ms=10), LinkProfile(latency_ms=10)])
        await start(nursery, switch, 2)
        stream = await dial(switch, 0, 1, ECHO)
        assert await round_trip(stream) >= 0.040
        t0 = trio.current_time()  # before the partition starts: the bounds below only get looser
        switch.partition(1, 1.0)
        assert switch.stats()["peers"][1]["partitioned"]
        await stream.send_all(b"during")
        with trio.move_on_at(t0 + 1.0) as waited:  # however late this task got here
            await stream.receive_some(64)
        assert waited.cancelled_caught  # nothing came back during the partition
        assert await stream.receive_some(64) == b"during"
        assert trio.current_time() - t0 >= 1.0 + 0.040
        assert not switch.stats()["peers"][1]["partitioned"]
        switch.set_profile(1, latency_ms=100)
        assert await round_trip(stream) >= 2 * 0.110
        assert switch.profile(1) == LinkProfile(latency_ms=100)
        await stream.aclose()


async def test_random_cuts_reset_connections(nursery: trio.Nursery) -> None:
    with trio.fail_after(15):
        switch = WanSwitch([LinkProfile(cuts_per_min=600), LinkProfile()], seed=1)  # ~10 a second
        await start(nursery, switch, 2)
        stream = await dial(switch, 0, 1, ECHO)
        with pytest.raises(trio.BrokenResourceError):
            while True:
                await round_trip(stream)
        await stream.aclose()
        assert switch.stats()["peers"][0]["cuts"] == 1


async def test_unknown_sources_get_the_default_profile(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        switch = WanSwitch([LinkProfile(latency_ms=10)], default=LinkProfile(latency_ms=60))
        await start(nursery, switch, 1)
        stream = await trio.open_tcp_stream(*switch.endpoint(0))  # from 127.0.0.1: no peer's address
        await stream.send_all(ECHO)
        assert await round_trip(stream, b"hello") >= 2 * 0.070
        await stream.aclose()
        unknown = switch.stats()["unknown"]["127.0.0.1"]
        assert unknown["sent"] == 6 and unknown["received"] == 5


async def test_a_connection_waits_for_the_upstream_address_or_is_reset(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        switch = WanSwitch([LinkProfile(), LinkProfile(), LinkProfile()], upstream_wait=1.0)
        await nursery.start(switch.run)
        late = await dial(switch, 0, 1, ECHO)
        await late.send_all(b"early bytes")
        await trio.sleep(0.2)
        server = await nursery.start(Server().run)
        switch.set_upstream(1, server.address)
        assert await late.receive_some(64) == b"early bytes"
        never = await dial(switch, 0, 2, ECHO)  # no upstream within upstream_wait
        with pytest.raises(trio.BrokenResourceError):
            await round_trip(never)
        with socket.socket() as unused:
            unused.bind(("127.0.0.1", 0))  # a port nobody listens on: refused upstream
            switch.set_upstream(2, unused.getsockname())
            refused = await dial(switch, 0, 2, ECHO)
            with pytest.raises(trio.BrokenResourceError):
                await round_trip(refused)
        assert switch.stats()["peers"][2]["refused"] == 2
        for stream in (late, never, refused):
            await stream.aclose()


def test_the_switch_runs_in_a_thread_for_synchronous_programs() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(10)
        switch = WanSwitch([LinkProfile(latency_ms=5), LinkProfile(latency_ms=5)])
        with switch.in_thread() as sw:
            assert sw.announce(1) == f"127.0.0.11:{sw.port(1)}"
            sw.set_upstream(1, server.getsockname())
            with socket.create_connection(sw.endpoint(1), 10, (sw.source_address(0), 0)) as client:
                client.settimeout(10)
                client.sendall(b"hi")
                conn, (remote, _) = server.accept()
                with conn:
                    assert remote == "127.0.0.10"  # the peer sees who dialed
                    assert conn.recv(16) == b"hi"
                    assert sw.stats()["peers"][0]["sent"] == 2
                    assert sw.cut(0) == 1
                    with pytest.raises(ConnectionResetError):
                        client.recv(16)
        with pytest.raises(RuntimeError, match="not running"):
            sw.cut(0)


# ---- real nodes -----------------------------------------------------------------------------------


async def test_two_nodes_join_verify_each_other_and_call_through_the_switch() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as outer:
            switch = WanSwitch([LinkProfile(50, 50, 10), LinkProfile(20, 100, 15)])
            await outer.start(switch.run)

            def config(i: int, join: tuple = ()) -> NodeConfig:
                return NodeConfig(
                    run_id="wan",
                    listen=(("127.0.0.1", 0),),
                    announce_host=switch.source_address(i),
                    announce_port=switch.port(i),
                    source_address=switch.source_address(i),
                    join=join,
                )

            async with trio.open_nursery() as nodes:
                a = await nodes.start(Node(Identity.generate(), config(0)).run)
                switch.set_upstream(0, (a.host.listen_addresses[0].host, a.host.listen_addresses[0].port))
                assert str(a.addresses[0].host) == "127.0.0.10" and a.addresses[0].port == switch.port(0)
                b = await nodes.start(Node(Identity.generate(), config(1, (a.addresses[0],))).run)
                switch.set_upstream(1, (b.host.listen_addresses[0].host, b.host.listen_addresses[0].port))
                await b.dht.bootstrapped.wait()
                assert b.dht.client_only is False  # a dialed b back at b's announced address
                conn = await b.host.connect(a.addresses[0])
                reply = await conn.call(PING, PingRequest(b"through the switch"))
                assert reply.payload == b"through the switch"
                assert conn.remote_host == "127.0.0.10"
                inbound = a.host.connection(b.peer_id)
                assert inbound is not None and inbound.remote_host == "127.0.0.11"
                known = a.dht.table.get(b.peer_id)
                assert known is not None and known.address == b.addresses[0]  # verified where it came from
                nodes.cancel_scope.cancel()
            stats = switch.stats()["peers"]
            assert stats[0]["sent"] > 0 and stats[1]["sent"] > 0 and stats[1]["received"] > 0
            outer.cancel_scope.cancel()
