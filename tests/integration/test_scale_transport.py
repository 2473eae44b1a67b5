"""The message-level in-memory network (``p2ptrain.net.messages``): what the protocol relies on is kept.

Order per connection and exact arrival times (latency + size / bandwidth), closes, partitions, loss as
a retransmission, kills, NATs; and two hosts doing RPC over it with the plain record channel.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import trio

from p2ptrain.errors import ConnectionClosed
from p2ptrain.net import Host, Method, RpcRegistry
from p2ptrain.net.channel import LENGTH, FramedStream, framed_stream, sealed_size
from p2ptrain.net.messages import HostLink, MessageEnd, MessageNetwork, PlainChannel
from p2ptrain.wire import Message, bounded
from tests.harness.identities import identity

pytestmark = pytest.mark.timeout(30)


async def _connect(
    nursery: trio.Nursery, net: MessageNetwork, a: str = "a", b: str = "b"
) -> tuple[FramedStream, FramedStream]:
    got: list[FramedStream] = []
    ready = trio.Event()

    async def on_stream(stream: trio.abc.Stream, host: str, port: int) -> None:
        got.append(framed_stream(stream, 1 << 16))
        ready.set()
        await trio.sleep_forever()

    await nursery.start(net.transport(b).serve, "", 7, on_stream)
    stream = await net.transport(a).connect(b, 7)
    assert isinstance(stream, MessageEnd)
    await ready.wait()
    return framed_stream(stream, 1 << 16), got[0]


async def test_frames_arrive_in_order_after_latency_and_serialization(autojump_clock: object) -> None:
    net = MessageNetwork(default_latency=0.05)
    net.set_host("a", HostLink(up=1000.0))
    async with trio.open_nursery() as nursery:
        client, server = await _connect(nursery, net)
        t0 = trio.current_time()
        for i in range(3):
            await client.send_frame(bytes([i]) * 96)  # 100 bytes with the length prefix: 0.1 s each
        arrivals = []
        for i in range(3):
            assert await server.receive_frame() == bytes([i]) * 96
            arrivals.append(round(trio.current_time() - t0, 6))
        assert arrivals == [0.15, 0.25, 0.35]  # serialized on the uplink, then the path's latency
        assert client.bytes_sent == 300 and server.bytes_received == 300
        nursery.cancel_scope.cancel()


async def test_loss_is_a_retransmission_and_order_is_kept(autojump_clock: object) -> None:
    net = MessageNetwork(default_latency=0.01, loss=1.0, rto=0.2)
    async with trio.open_nursery() as nursery:
        client, server = await _connect(nursery, net)
        t0 = trio.current_time()
        for i in range(5):
            await client.send_frame(bytes([i]))
        for i in range(5):
            assert await server.receive_frame() == bytes([i])
        assert trio.current_time() - t0 == pytest.approx(0.21)
        nursery.cancel_scope.cancel()


async def test_close_drains_then_ends_and_the_other_side_cannot_send(autojump_clock: object) -> None:
    net = MessageNetwork(default_latency=0.02)
    async with trio.open_nursery() as nursery:
        client, server = await _connect(nursery, net)
        await client.send_frame(b"last words")
        await client.stream.aclose()
        assert await server.receive_frame() == b"last words"  # what was in flight still arrives
        with pytest.raises(ConnectionClosed):
            await server.receive_frame()
        with pytest.raises(ConnectionClosed):
            await server.send_frame(b"anyone there?")
        assert net.live_connections() == 1  # the other end is still open
        await server.stream.aclose()
        assert net.live_connections() == 0
        nursery.cancel_scope.cancel()


async def test_partition_freezes_delivery_and_dials_until_healed(autojump_clock: object) -> None:
    net = MessageNetwork(default_latency=0.01)
    async with trio.open_nursery() as nursery:
        client, server = await _connect(nursery, net)
        net.partition(["a"], ["b"])
        await client.send_frame(b"held")
        with trio.move_on_after(5.0) as scope:
            await server.receive_frame()
        assert scope.cancelled_caught  # nothing crosses the split
        with trio.move_on_after(5.0) as scope:
            await net.transport("a").connect("b", 7)
        assert scope.cancelled_caught  # a dial into the split hangs
        net.heal()
        with trio.fail_after(1.0):
            assert await server.receive_frame() == b"held"
        nursery.cancel_scope.cancel()


async def test_kill_resets_every_connection_and_the_listener(autojump_clock: object) -> None:
    net = MessageNetwork(default_latency=0.01)
    async with trio.open_nursery() as nursery:
        client, _ = await _connect(nursery, net)
        net.kill("b")
        with pytest.raises(ConnectionClosed):
            await client.receive_frame()
        with pytest.raises(ConnectionClosed):
            await client.send_frame(b"x")
        with pytest.raises(OSError, match="refused"):
            await net.transport("a").connect("b", 7)
        nursery.cancel_scope.cancel()


async def _ignore(stream: trio.abc.Stream, host: str, port: int) -> None:
    await stream.aclose()


async def test_a_natted_host_dials_out_but_is_not_dialed(autojump_clock: object) -> None:
    net = MessageNetwork(default_latency=0.01)
    net.nat("b")
    async with trio.open_nursery() as nursery:
        await nursery.start(net.transport("b").serve, "", 7, _ignore)
        await nursery.start(net.transport("a").serve, "", 7, _ignore)
        with trio.move_on_after(5.0) as scope:
            await net.transport("a").connect("b", 7)
        assert scope.cancelled_caught
        end = await net.transport("b").connect("a", 7)
        assert isinstance(end, MessageEnd)
        nursery.cancel_scope.cancel()


@dataclass(frozen=True)
class Echo(Message):
    text: str = bounded(max_len=64)


ECHO = Method("test.echo", Echo, Echo)


async def test_hosts_call_each_other_over_plain_records(autojump_clock: object) -> None:
    net = MessageNetwork(default_latency=0.025)
    registry = RpcRegistry()

    async def echo(ctx: object, req: Echo) -> Echo:
        return Echo(text=req.text.upper())

    registry.add_unary(ECHO, echo)
    server = Host(
        identity("s"), "run", transport=net.transport("s"), registry=registry, clock=trio.current_time
    )
    client = Host(identity("c"), "run", transport=net.transport("c"), clock=trio.current_time)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run, [("s", 9)])
        await nursery.start(client.run, [("c", 9)])
        conn = await client.connect(server.advertised_addresses()[0])
        assert isinstance(conn.channel, PlainChannel)  # the handshake ran; records go in plain text
        t0 = trio.current_time()
        assert (await conn.call(ECHO, Echo(text="hi"))).text == "HI"
        assert trio.current_time() - t0 == pytest.approx(0.05)  # one round trip
        sent = conn.sent_by_method["test.echo"]
        assert sent > 0
        # the wire counts a record at the size its sealed frame would have
        assert conn.bytes_sent >= sent + sealed_size(0, 0) - LENGTH.size
        nursery.cancel_scope.cancel()
