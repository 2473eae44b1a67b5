"""RPC over live connections: concurrency, error codes, deadlines, cancellation, streams, flow control."""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from typing import Any

import outcome
import pytest
import trio
import trio.testing

from p2ptrain.errors import (
    ConnectionClosed,
    DeadlineExceeded,
    LocalProtocolError,
    PeerUnavailable,
    RemoteCallError,
)
from p2ptrain.net import Method
from p2ptrain.net.channel import MAX_CHUNK
from p2ptrain.wire import Message, bounded


class Task:
    """A call run in the background: its outcome and the virtual time it finished."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.result: outcome.Outcome | None = None
        self.finished_at = -1.0
        self.scope = trio.CancelScope()

    async def run(self, fn: Callable[[], Awaitable[Any]]) -> None:
        with self.scope:
            self.result = await outcome.acapture(fn)
        self.finished_at = trio.current_time()
        self.done.set()

    def error(self) -> BaseException:
        assert isinstance(self.result, outcome.Error), self.result
        return self.result.error


def background(nursery: trio.Nursery, fn: Callable[[], Awaitable[Any]]) -> Task:
    task = Task()
    nursery.start_soon(task.run, fn)
    return task


async def pair(cluster, **kwargs):
    server, client = await cluster.start(**kwargs), await cluster.start(**kwargs)
    conn = await client.host.connect(server.address)
    return server, client, conn, await server.wait_conn_to(client)


# ---- many calls at once ----------------------------------------------------------------------


async def test_thousand_concurrent_unary_calls_on_one_connection(tcp_cluster, kit):
    with trio.fail_after(60):
        server, client, conn, inbound = await pair(tcp_cluster)
        results: dict[int, str] = {}

        async def one(i: int) -> None:
            results[i] = (await conn.call(kit.ECHO, kit.Text(f"call {i}"))).text

        async with trio.open_nursery() as nursery:
            for i in range(1000):
                nursery.start_soon(one, i)
        assert results == {i: f"call {i}" for i in range(1000)}
        assert server.service.entered["echo"] == 1000
        assert client.host.connections() == [conn]
        assert server.host.connections() == [inbound]
        assert conn.active_calls == 0


async def test_concurrent_calls_in_both_directions(cluster, kit):
    with trio.fail_after(60):
        b, a, a_to_b, b_to_a = await pair(cluster)
        got: list[tuple[str, str]] = []

        async def one(conn, who: str, i: int) -> None:
            text = f"{who}-{i}"
            got.append((text, (await conn.call(kit.ECHO, kit.Text(text))).text))

        async with trio.open_nursery() as nursery:
            for i in range(300):
                nursery.start_soon(one, a_to_b, "a", i)
                nursery.start_soon(one, b_to_a, "b", i)
        assert len(got) == 600
        assert all(sent == answer for sent, answer in got)
        assert a.service.entered["echo"] == b.service.entered["echo"] == 300
        # One connection carried both directions (odd and even call ids).
        assert a.host.connections() == [a_to_b]
        assert b.host.connections() == [b_to_a]


# ---- error replies ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "code"),
    [("refuse", "not_now"), ("value", "internal")],
    ids=["CallRefused", "ValueError"],
)
async def test_handler_errors_become_codes_and_the_connection_survives(mem_cluster, kit, text, code):
    with trio.fail_after(10):
        _server, _client, conn, _ = await pair(mem_cluster)
        with pytest.raises(RemoteCallError) as info:
            await conn.call(kit.FAIL, kit.Text(text))
        assert info.value.code == code
        assert info.value.method == "fail"
        if code == "internal":
            assert "ValueError" in info.value.message
        assert not conn.closed
        assert (await conn.call(kit.ECHO, kit.Text("after"))).text == "after"
        assert conn.active_calls == 0


async def test_unknown_method_and_the_connection_is_still_usable(mem_cluster, kit):
    with trio.fail_after(10):
        _server, _client, conn, _ = await pair(mem_cluster)
        nope = Method("nope", kit.Text, kit.Text)
        with pytest.raises(RemoteCallError) as info:
            await conn.call(nope, kit.Text("?"))
        assert info.value.code == "unknown_method"
        assert (await conn.call(kit.ECHO, kit.Text("still"))).text == "still"


async def test_bad_request_args_and_wrong_call_kind(mem_cluster, kit):
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class NotText(Message):
        text: int = bounded(ge=0, le=10)

    with trio.fail_after(10):
        server, _client, conn, _ = await pair(mem_cluster)
        with pytest.raises(RemoteCallError) as info:
            await conn.call(Method("echo", NotText, kit.Text), NotText(3))
        assert info.value.code == "bad_request"
        assert "expected a string" in info.value.message
        # A streaming method called as unary.
        with pytest.raises(RemoteCallError) as info:
            await conn.call(Method("sink", kit.Text, kit.Digest), kit.Text(""))
        assert info.value.code == "bad_request"
        assert server.service.entered["echo"] == server.service.entered["sink"] == 0
        assert (await conn.call(kit.ECHO, kit.Text("fine"))).text == "fine"


# ---- deadlines and cancellation --------------------------------------------------------------


async def test_timeout_raises_deadline_exceeded_and_cancels_the_handler(mem_cluster, autojump_clock, kit):
    with trio.fail_after(100):
        server, _client, conn, inbound = await pair(mem_cluster)
        start = trio.current_time()
        with pytest.raises(DeadlineExceeded):
            await conn.call(kit.SLEEP, kit.Text("zz"), timeout=2.5)
        assert trio.current_time() == start + 2.5
        await server.service.until(lambda: server.service.cancelled["sleep"] == 1)
        assert server.service.cancelled_at == [start + 2.5]
        await trio.testing.wait_all_tasks_blocked()
        assert conn.active_calls == 0
        assert inbound.active_calls == 0
        assert not conn.closed
        assert (await conn.call(kit.ECHO, kit.Text("next"))).text == "next"


async def test_caller_cancelled_from_outside_cancels_the_remote_handler(
    mem_cluster, memnet, autojump_clock, nursery, kit
):
    latency = 0.25
    memnet.default.latency = latency
    with trio.fail_after(100):
        server, _client, conn, inbound = await pair(mem_cluster)
        task = background(nursery, lambda: conn.call(kit.SLEEP, kit.Text("zz"), timeout=1000.0))
        await server.service.until(lambda: server.service.entered["sleep"] == 1)
        assert inbound.active_calls == 1
        await trio.sleep(3.0)
        cancelled_at = trio.current_time()
        task.scope.cancel()
        await task.done.wait()
        await server.service.until(lambda: server.service.cancelled["sleep"] == 1)
        # The Cancel record took one link latency; the handler's own deadline was far away.
        assert server.service.cancelled_at == [cancelled_at + latency]
        await trio.testing.wait_all_tasks_blocked()
        assert conn.active_calls == inbound.active_calls == 0
        assert not conn.closed


# ---- streams ---------------------------------------------------------------------------------


async def test_64_mib_upload_and_download_arrive_intact(tcp_cluster, kit):
    size = 64 << 20
    with trio.fail_after(110):
        _server, _client, conn, inbound = await pair(tcp_cluster)
        up = kit.payload(size, seed=11)
        async with conn.open_stream(kit.SINK, kit.Text("up"), timeout=100) as stream:
            await stream.send(up)
            await stream.send_eof()
            reply = await stream.response()
        assert (reply.n, reply.hash) == (size, kit.digest(up))
        del up

        h = hashlib.blake2b(digest_size=32)
        n = 0
        async with conn.open_stream(kit.SOURCE, kit.Size(size, seed=12), timeout=100) as stream:
            async for chunk in stream:
                h.update(chunk)
                n += len(chunk)
            reply = await stream.response()
        assert (n, h.digest()) == (size, reply.hash)
        assert reply.hash == kit.digest(kit.payload(size, seed=12))
        await trio.testing.wait_all_tasks_blocked()
        assert conn.active_calls == inbound.active_calls == 0
        assert conn.buffered_bytes == inbound.buffered_bytes == 0


async def test_stream_chunks_land_where_the_reader_asked(tcp_cluster, kit):
    """RpcStream.land_in: chunks are decrypted straight into the reader's buffers, in order; a chunk of
    another size than its target arrives in a buffer of its own and uses that target up."""
    chunk = MAX_CHUNK
    size = 3 * chunk + 1000  # three full chunks, then a short one
    want = kit.payload(size, seed=21)
    with trio.fail_after(30):
        _server, _client, conn, _inbound = await pair(tcp_cluster)
        places = [bytearray(chunk) for _ in range(3)] + [bytearray(7)]  # the last: the wrong size
        got: list[memoryview] = []
        async with conn.open_stream(kit.SOURCE, kit.Size(size, seed=21), timeout=20) as stream:
            stream.land_in(memoryview(p) for p in places)
            async for data in stream:
                got.append(data)
            reply = await stream.response()
    assert reply.hash == kit.digest(want)
    assert b"".join(got) == want
    assert [d.obj is p for d, p in zip(got, places, strict=True)] == [True, True, True, False]
    assert places[:3] == [want[i * chunk : (i + 1) * chunk] for i in range(3)]
    assert places[3] == bytearray(7)  # untouched


async def test_cancelling_an_upload_mid_transfer_frees_both_ends(mem_cluster, autojump_clock, nursery, kit):
    window = 8 * kit.CHUNK  # ConnectionConfig().stream_window
    with trio.fail_after(100):
        server, _client, conn, inbound = await pair(mem_cluster)

        async def upload() -> None:
            async with conn.open_stream(kit.HOLD, kit.Text("up"), timeout=1000) as stream:
                await stream.send(kit.payload(4 * window))

        task = background(nursery, upload)
        await server.service.until(lambda: server.service.entered["hold"] == 1)
        await trio.testing.wait_all_tasks_blocked()
        # Mid-transfer: the handler took one chunk; the rest of the window waits in its buffer, and
        # the uploader is blocked on credit.
        assert inbound.buffered_bytes == window - kit.CHUNK
        assert conn.active_calls == inbound.active_calls == 1
        assert not task.done.is_set()

        task.scope.cancel()
        await server.service.until(lambda: server.service.cancelled["hold"] == 1)
        await trio.testing.wait_all_tasks_blocked()
        assert task.done.is_set()
        assert conn.active_calls == inbound.active_calls == 0
        assert conn.buffered_bytes == inbound.buffered_bytes == 0
        assert (await conn.call(kit.ECHO, kit.Text("after"))).text == "after"


async def test_cancelling_a_download_mid_transfer_frees_both_ends(mem_cluster, autojump_clock, nursery, kit):
    window = 8 * kit.CHUNK
    with trio.fail_after(100):
        server, _client, conn, inbound = await pair(mem_cluster)
        first_chunk = trio.Event()

        async def download() -> None:
            async with conn.open_stream(kit.SOURCE, kit.Size(4 * window), timeout=1000) as stream:
                assert len(await stream.receive_some()) == kit.CHUNK
                first_chunk.set()
                await trio.sleep_forever()  # a consumer that stopped reading

        task = background(nursery, download)
        await first_chunk.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert conn.buffered_bytes == window - kit.CHUNK
        assert conn.active_calls == inbound.active_calls == 1

        task.scope.cancel()
        await server.service.until(lambda: server.service.cancelled["source"] == 1)
        await trio.testing.wait_all_tasks_blocked()
        assert conn.active_calls == inbound.active_calls == 0
        assert conn.buffered_bytes == inbound.buffered_bytes == 0


async def test_slow_consumer_does_not_block_other_calls(mem_cluster, autojump_clock, nursery, kit):
    window = 8 * kit.CHUNK
    with trio.fail_after(100):
        server, _client, conn, inbound = await pair(mem_cluster)
        data = kit.payload(3 * window, seed=5)
        holder: dict[str, Any] = {}

        async def upload() -> None:
            async with conn.open_stream(kit.HOLD, kit.Text("slow"), timeout=1000) as stream:
                await stream.send(data)
                await stream.send_eof()
                holder["reply"] = await stream.response()

        task = background(nursery, upload)
        await server.service.until(lambda: server.service.entered["hold"] == 1)
        await trio.testing.wait_all_tasks_blocked()
        assert inbound.buffered_bytes == window - kit.CHUNK  # the stalled stream is full

        # A unary call and another stream still go through, without any time passing.
        now = trio.current_time()
        assert (await conn.call(kit.ECHO, kit.Text("not blocked"))).text == "not blocked"
        other = kit.payload(2 * window, seed=6)
        async with conn.open_stream(kit.SINK, kit.Text("fast")) as stream:
            await stream.send(other)
            await stream.send_eof()
            assert (await stream.response()).hash == kit.digest(other)
        assert trio.current_time() == now
        assert not task.done.is_set()

        # The slow consumer reads on; the stalled upload completes intact.
        server.service.release.set()
        await task.done.wait()
        task.result.unwrap()
        assert holder["reply"] == kit.Digest(len(data), kit.digest(data))
        await trio.testing.wait_all_tasks_blocked()
        assert conn.active_calls == inbound.active_calls == 0
        assert conn.buffered_bytes == inbound.buffered_bytes == 0


# ---- a peer that goes away -------------------------------------------------------------------


async def test_killed_peer_fails_pending_calls_at_once(mem_cluster, memnet, autojump_clock, nursery, kit):
    with trio.fail_after(100):
        server, _client, conn, _ = await pair(mem_cluster)
        call = background(nursery, lambda: conn.call(kit.SLEEP, kit.Text("zz"), timeout=1000.0))
        stream_call = background(nursery, lambda: _stuck_upload(conn, kit))
        await server.service.until(
            lambda: server.service.entered["sleep"] == server.service.entered["hold"] == 1
        )
        killed_at = trio.current_time()
        memnet.kill(server.name)
        await call.done.wait()
        await stream_call.done.wait()
        assert isinstance(call.error(), ConnectionClosed)
        assert isinstance(stream_call.error(), ConnectionClosed)
        assert call.finished_at == stream_call.finished_at == killed_at
        assert conn.closed
        with pytest.raises(PeerUnavailable):
            await conn.call(kit.ECHO, kit.Text("anyone?"))


async def _stuck_upload(conn, kit) -> None:
    async with conn.open_stream(kit.HOLD, kit.Text("stuck"), timeout=1000) as stream:
        await stream.send(kit.payload(32 * kit.CHUNK))


async def test_peer_shutting_down_fails_pending_calls_with_its_reason(cluster, nursery, kit):
    with trio.fail_after(10):
        server, _client, conn, _ = await pair(cluster)
        call = background(nursery, lambda: conn.call(kit.SLEEP, kit.Text("zz"), timeout=1000.0))
        await server.service.until(lambda: server.service.entered["sleep"] == 1)
        await server.stop()
        await call.done.wait()
        err = call.error()
        assert isinstance(err, ConnectionClosed)
        assert "shutting down" in str(err)
        assert server.service.cancelled["sleep"] == 1
        assert conn.close_reason == "remote closed: shutting down"


# ---- sizes at the edge of one record ---------------------------------------------------------


async def test_unary_reply_body_of_one_chunk_arrives_intact(mem_cluster, kit):
    with trio.fail_after(10):
        _server, _client, conn, _ = await pair(mem_cluster)
        reply = await conn.call_with_body(kit.BIG, kit.Size(kit.CHUNK, seed=3))
        assert reply.message == kit.Text("xxx")
        assert bytes(reply.body) == kit.payload(kit.CHUNK)


@pytest.mark.parametrize(
    ("n", "seed"),
    [((1 << 20) + 1, 0), (0, 65_100), (0, 70_000)],
    ids=["body", "message-over-schema-bound", "message-over-record-limit"],
)
async def test_oversized_response_is_an_internal_error_not_a_crash(mem_cluster, kit, n, seed):
    # A handler returning more than fits one record (a body over one chunk, a message over the header
    # limit) is a handler bug: the caller gets "internal"; the connection and the host live on.
    with trio.fail_after(10):
        server, _client, conn, inbound = await pair(mem_cluster)
        with pytest.raises(RemoteCallError) as info:
            await conn.call_with_body(kit.BIG, kit.Size(n, seed=seed))
        assert info.value.code == "internal"
        assert not conn.closed
        assert not inbound.closed
        assert (await conn.call(kit.ECHO, kit.Text("alive"))).text == "alive"
        assert server.host.connections() == [inbound]


@pytest.mark.parametrize("size", [65_100, 70_000], ids=["over-schema-bound", "over-record-limit"])
async def test_oversized_request_is_refused_locally_and_the_connection_survives(mem_cluster, kit, size):
    # Just over the receiver's bound on Request.args, the peer would call it a protocol violation and
    # drop the connection (and every call on it): the caller must refuse to send it.
    with trio.fail_after(10):
        server, _client, conn, _ = await pair(mem_cluster)
        with pytest.raises(LocalProtocolError):
            await conn.call(kit.ECHO, kit.Text("x" * size))
        with pytest.raises(LocalProtocolError):
            await conn.call_with_body(kit.ECHO, kit.Text(""), body=bytes(kit.CHUNK + 1))
        assert server.service.entered["echo"] == 0
        assert (await conn.call(kit.ECHO, kit.Text("alive"))).text == "alive"
        assert not conn.closed


async def test_handler_answering_early_ends_the_upload(mem_cluster, autojump_clock, kit):
    # The handler reads one chunk and answers; the uploader must not wait for credit that never comes.
    with trio.fail_after(100):
        _server, _client, conn, inbound = await pair(mem_cluster)
        start = trio.current_time()
        data = kit.payload(4 * 8 * kit.CHUNK)
        async with conn.open_stream(kit.FIRST, kit.Text("")) as stream:
            await stream.send(data)
            await stream.send_eof()
            reply = await stream.response()
        assert reply == kit.Digest(kit.CHUNK, kit.digest(data[: kit.CHUNK]))
        assert trio.current_time() == start
        await trio.testing.wait_all_tasks_blocked()
        assert conn.active_calls == inbound.active_calls == 0
        assert conn.buffered_bytes == inbound.buffered_bytes == 0


async def test_peers_with_different_stream_windows_interoperate(mem_cluster, autojump_clock, nursery, kit):
    from p2ptrain.net import ConnectionConfig, HostConfig

    small = HostConfig(connection=ConnectionConfig(stream_window=2 * kit.CHUNK))
    with trio.fail_after(100):
        server = await mem_cluster.start(config=small)
        client = await mem_cluster.start()  # the default window, 8 chunks
        conn = await client.host.connect(server.address)

        async def upload() -> None:
            async with conn.open_stream(kit.HOLD, kit.Text("")) as stream:
                await stream.send(kit.payload(6 * kit.CHUNK))

        background(nursery, upload)
        await server.service.until(lambda: server.service.entered["hold"] == 1)
        await trio.testing.wait_all_tasks_blocked()
        assert not conn.closed


async def test_a_peer_making_too_many_calls_is_slowed_down_then_served_again(
    mem_cluster, kit, autojump_clock
):
    """A per-peer token bucket: a burst of a tenth of the minute's allowance, then 'busy' refusals
    (the connection stays up), and calls are served again as tokens come back."""
    from p2ptrain.errors import RemoteCallError
    from p2ptrain.net import HostConfig

    with trio.fail_after(120):
        server = await mem_cluster.start("s", config=HostConfig(max_calls_per_minute=600))
        client = await mem_cluster.start("c")
        conn = await client.host.connect(server.address)
        outcomes = []
        for i in range(70):
            try:
                await conn.call(kit.ECHO, kit.Text(str(i)))
                outcomes.append("ok")
            except RemoteCallError as e:
                outcomes.append(e.code)
        assert outcomes[:60] == ["ok"] * 60  # the burst: 600 / 10
        assert set(outcomes[60:]) == {"busy"}
        assert not conn.closed and server.service.entered["echo"] == 60
        await trio.sleep(1.0)  # ten calls a second come back
        assert (await conn.call(kit.ECHO, kit.Text("again"))).text == "again"


async def test_bytes_sent_are_counted_by_the_method_of_their_call(cluster, kit):
    """What a node sends for what (its status file's ``traffic.sent_by_method``): requests and stream
    data under the caller's method, replies under the method called, and calls of methods the
    responder does not have under "other", whatever name the caller made up (a remote cannot grow
    the table)."""
    with trio.fail_after(30):
        server, client, conn, _inbound = await pair(cluster)
        up = kit.payload(300_000, seed=3)
        async with conn.open_stream(kit.SINK, kit.Text("up"), timeout=20) as stream:
            await stream.send(up)
            await stream.send_eof()
            await stream.response()
        reply = await conn.call_with_body(kit.BIG, kit.Size(200_000))
        assert len(reply.body) == 200_000
        for i in range(3):
            with pytest.raises(RemoteCallError):
                await conn.call(Method(f"made-up-{i}", kit.Text, kit.Text), kit.Text("x"))
        sent, served = client.host.sent_by_method(), server.host.sent_by_method()
        assert 300_000 <= sent["sink"] < 300_000 + 2_000
        assert 200_000 <= served["big"] < 200_000 + 2_000 and sent["big"] < 1_000
        assert served["sink"] < 1_000  # the digest it answered with
        assert {f"made-up-{i}" for i in range(3)} <= set(sent)  # its own calls: named by the caller
        assert not any(m.startswith("made-up") for m in served) and served["other"] > 0
        # a closed connection's counts stay with the host (closing sends a goodbye: "other")
        before = client.host.sent_by_method()
        await conn.aclose()
        after = client.host.sent_by_method()
        assert {k: after[k] for k in before if k != "other"} == {
            k: v for k, v in before.items() if k != "other"
        }
