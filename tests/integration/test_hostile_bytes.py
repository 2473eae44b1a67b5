"""Hostile bytes on a real TCP port: the host logs, drops that connection, and keeps serving others."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2ptrain.identity import Identity
from p2ptrain.net import Host, Method, RpcRegistry
from p2ptrain.net.channel import LENGTH, MAX_FRAME, FramedStream, SecureChannel, seal_record
from p2ptrain.net.frames import Credit, Data, Ping, Pong, Request, decode_header, encode_args, encode_header
from p2ptrain.net.handshake import MAX_HANDSHAKE_FRAME, InitiatorHandshake
from p2ptrain.wire import Message, bounded, pack

HOST_LOG = "p2ptrain.net.host"
CONN_LOG = "p2ptrain.net.connection"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def warnings(self, name: str) -> list[str]:
        return [r.getMessage() for r in self.records if r.name == name and r.levelno >= logging.WARNING]


@contextmanager
def captured_logs() -> Iterator[_Records]:
    """Capture the net loggers without pytest's function-scoped caplog (hypothesis runs many examples)."""
    handler = _Records()
    loggers = [logging.getLogger(HOST_LOG), logging.getLogger(CONN_LOG)]
    saved = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        for lg, level in zip(loggers, saved, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)


async def read_until_closed(stream: trio.abc.Stream) -> bytes:
    """Everything the server says before it hangs up (a reset counts as hanging up)."""
    got = bytearray()
    while True:
        try:
            data = await stream.receive_some()
        except trio.BrokenResourceError:
            return bytes(got)
        if not data:
            return bytes(got)
        got += data


async def secure_channel(stream: trio.abc.Stream, server: Host) -> tuple[FramedStream, SecureChannel]:
    """Do the initiator's half of the handshake by hand, to get at the raw frames afterwards."""
    framed = FramedStream(stream, MAX_HANDSHAKE_FRAME)
    hs = InitiatorHandshake(Identity.generate(), server.run_id, server.peer_id)
    await framed.send_frame(hs.start())
    await framed.send_frame(hs.receive(await framed.receive_frame()))
    assert hs.result is not None
    framed.max_frame = MAX_FRAME
    return framed, SecureChannel(framed, hs.result)


async def assert_echo_works(cluster, server, kit, text: str) -> None:
    client = await cluster.start()
    conn = await client.host.connect(server.address)
    assert (await conn.call(kit.ECHO, kit.Text(text))).text == text


# Shared helpers for the sync hypothesis test (no fixtures there: each example has its own trio run).
@dataclass(frozen=True)
class _Text(Message):
    text: str = bounded(max_len=4096)


_ECHO = Method("echo", _Text, _Text)


def _echo_host() -> Host:
    reg = RpcRegistry()

    async def echo(ctx, req: _Text) -> _Text:
        return _Text(req.text)

    reg.add_unary(_ECHO, echo)
    return Host(Identity.generate(), "garbage-run", registry=reg)


# ---- before the handshake --------------------------------------------------------------------


def _framed(body: bytes) -> bytes:
    return LENGTH.pack(len(body)) + body


# Three kinds of garbage: raw bytes; a plausible length prefix with junk after it; and well-framed
# msgpack that looks like a handshake message with fields of the wrong type, size or value.
_FIELDS = ["proto", "version", "run_id", "ephemeral", "dialed", "box", "code", "reason"]
_VALUES = st.one_of(
    st.integers(-(2**63), 2**64 - 1), st.binary(max_size=40), st.text(max_size=40), st.none(), st.booleans()
)
_HANDSHAKE_LIKE = st.builds(
    lambda t, m: _framed(pack({"t": t, "m": m})),
    st.sampled_from(["hello", "reply", "finish", "reject", "x"]),
    st.dictionaries(st.sampled_from(_FIELDS), _VALUES),
)
_GARBAGE = st.one_of(
    st.binary(min_size=1, max_size=6000),
    st.builds(lambda n, tail: LENGTH.pack(n) + tail, st.integers(0, 2**32 - 1), st.binary(max_size=100)),
    _HANDSHAKE_LIKE,
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(garbage=_GARBAGE)
def test_garbage_before_handshake_is_dropped(garbage: bytes) -> None:
    async def scenario() -> None:
        with trio.fail_after(10), captured_logs() as logs:
            async with trio.open_nursery() as nursery:
                server = await nursery.start(_echo_host().run, [("127.0.0.1", 0)])
                addr = server.listen_addresses[0]
                friend = await nursery.start(_echo_host().run, [("127.0.0.1", 0)])
                before = await friend.connect(addr)

                stream = await trio.open_tcp_stream(addr.host, addr.port)
                await stream.send_all(garbage)
                await stream.send_eof()  # a short frame must not make the server wait for more
                said = await read_until_closed(stream)
                await stream.aclose()

                # The server never answered garbage with a handshake reply (a refusal at most), and it
                # logged why it hung up.
                assert b"reply" not in said
                assert logs.warnings(HOST_LOG), "the server hung up without saying why"
                # It keeps serving: the connection opened before, and a new one.
                assert (await before.call(_ECHO, _Text("before"))).text == "before"
                late = await nursery.start(_echo_host().run, [("127.0.0.1", 0)])
                after = await late.connect(addr)
                assert (await after.call(_ECHO, _Text("after"))).text == "after"
                nursery.cancel_scope.cancel()

    trio.run(scenario)


async def test_oversized_length_prefix_before_handshake(tcp_cluster, kit, caplog):
    caplog.set_level(logging.WARNING, logger=HOST_LOG)
    with trio.fail_after(10):
        server = await tcp_cluster.start()
        stream = await tcp_cluster.dial_raw(server)
        # Announce a 4 GiB frame and keep the socket open: the server must not wait for the body.
        await stream.send_all(LENGTH.pack(0xFFFFFFFF))
        assert await read_until_closed(stream) == b""
        await stream.aclose()
        assert any("exceeds" in r.getMessage() for r in caplog.records if r.name == HOST_LOG)
        await assert_echo_works(tcp_cluster, server, kit, "next")


async def test_truncated_handshake_frame(tcp_cluster, kit, caplog):
    caplog.set_level(logging.WARNING, logger=HOST_LOG)
    with trio.fail_after(10):
        server = await tcp_cluster.start()
        stream = await tcp_cluster.dial_raw(server)
        await stream.send_all(LENGTH.pack(100) + b"x" * 10)
        await stream.send_eof()
        assert await read_until_closed(stream) == b""
        await stream.aclose()
        assert any("middle of a frame" in r.getMessage() for r in caplog.records if r.name == HOST_LOG)
        await assert_echo_works(tcp_cluster, server, kit, "next")


# ---- after a valid handshake -----------------------------------------------------------------


async def _hostile_session(tcp_cluster, kit, caplog, attack) -> str:
    """Handshake properly, prove the channel works (Ping -> Pong), then run ``attack(framed, cipher)``.

    Returns the reason the server recorded for closing the connection.
    """
    caplog.set_level(logging.WARNING, logger=CONN_LOG)
    server = await tcp_cluster.start()
    bystander = await tcp_cluster.start()
    by_conn = await bystander.host.connect(server.address)

    stream = await tcp_cluster.dial_raw(server)
    framed, channel = await secure_channel(stream, server.host)
    await channel.send(encode_header(Ping(nonce=7)))
    header, _ = await channel.receive()
    assert decode_header(header) == Pong(nonce=7)
    (victim,) = [c for c in server.host.connections() if c.peer != bystander.peer_id]

    await attack(framed, channel)
    await victim.wait_closed()
    await read_until_closed(stream)
    await stream.aclose()

    assert victim not in server.host.connections()
    assert any("protocol violation" in r.getMessage() for r in caplog.records if r.name == CONN_LOG)
    # Others are unaffected: an existing connection and a new one both work.
    assert (await by_conn.call(kit.ECHO, kit.Text("bystander"))).text == "bystander"
    await assert_echo_works(tcp_cluster, server, kit, "newcomer")
    return victim.close_reason


async def test_tampered_ciphertext_closes_only_that_connection(tcp_cluster, kit, caplog):
    async def attack(framed: FramedStream, channel: SecureChannel) -> None:
        frame = bytearray(seal_record(channel._send_cipher, encode_header(Ping(nonce=8))))
        frame[len(frame) // 2] ^= 0x01
        await framed.send_raw(memoryview(frame))

    with trio.fail_after(10):
        reason = await _hostile_session(tcp_cluster, kit, caplog, attack)
    assert "failed authentication" in reason


async def test_replayed_frame_closes_only_that_connection(tcp_cluster, kit, caplog):
    async def attack(framed: FramedStream, channel: SecureChannel) -> None:
        frame = memoryview(seal_record(channel._send_cipher, encode_header(Ping(nonce=9))))
        await framed.send_raw(frame)
        await framed.send_raw(frame)  # the same bytes again: the counter nonce has moved on

    with trio.fail_after(10):
        reason = await _hostile_session(tcp_cluster, kit, caplog, attack)
    assert "failed authentication" in reason


async def test_oversized_frame_after_handshake(tcp_cluster, kit, caplog):
    async def attack(framed: FramedStream, channel: SecureChannel) -> None:
        await framed.stream.send_all(LENGTH.pack(MAX_FRAME + 1))

    with trio.fail_after(10):
        reason = await _hostile_session(tcp_cluster, kit, caplog, attack)
    assert "exceeds" in reason


async def test_truncated_frame_after_handshake(tcp_cluster, kit, caplog):
    async def attack(framed: FramedStream, channel: SecureChannel) -> None:
        await framed.stream.send_all(LENGTH.pack(1000) + b"\0" * 100)
        await framed.stream.send_eof()

    with trio.fail_after(10):
        reason = await _hostile_session(tcp_cluster, kit, caplog, attack)
    assert "middle of a frame" in reason


@pytest.mark.parametrize(
    ("header", "body", "why"),
    [
        (b"\xc1", b"", "malformed msgpack"),
        (b"\x81\xa1k\x63", b"", "unknown frame kind"),
        (encode_header(Request(id=2, method="echo", timeout=1.0)), b"", "wrong parity"),
        (encode_header(Data(id=2, end=False)), b"", None),  # data for no call: dropped, not fatal
        (encode_header(Credit(id=2, amount=2**31)), b"", None),  # credit for no call: ignored
    ],
    ids=["bad-msgpack", "unknown-kind", "request-parity", "stray-data", "stray-credit"],
)
async def test_hostile_records_after_handshake(tcp_cluster, kit, caplog, header, body, why):
    if why is None:
        # Harmless strays: the connection survives them and answers a ping afterwards.
        caplog.set_level(logging.WARNING, logger=CONN_LOG)
        with trio.fail_after(10):
            server = await tcp_cluster.start()
            stream = await tcp_cluster.dial_raw(server)
            _, channel = await secure_channel(stream, server.host)
            await channel.send(header, body)
            await channel.send(encode_header(Ping(nonce=1)))
            got, _ = await channel.receive()
            assert decode_header(got) == Pong(nonce=1)
            assert not [r for r in caplog.records if r.name == CONN_LOG]
            await stream.aclose()
        return

    async def attack(framed: FramedStream, channel: SecureChannel) -> None:
        await channel.send(header, body)

    with trio.fail_after(10):
        reason = await _hostile_session(tcp_cluster, kit, caplog, attack)
    assert why in reason


async def test_duplicate_request_id_is_a_protocol_violation(tcp_cluster, kit, caplog):
    async def attack(framed: FramedStream, channel: SecureChannel) -> None:
        # Our calls use odd ids (we dialed); the same id twice while the first is still running.
        req = encode_header(Request(id=1, method="sleep", timeout=60.0, args=encode_args(kit.Text(""))))
        await channel.send(req)
        await channel.send(req)

    with trio.fail_after(10):
        reason = await _hostile_session(tcp_cluster, kit, caplog, attack)
    assert "already in use" in reason


async def test_data_beyond_the_credit_window(tcp_cluster, kit, caplog):
    async def attack(framed: FramedStream, channel: SecureChannel) -> None:
        window = 8 * kit.CHUNK  # ConnectionConfig().stream_window
        req = Request(id=1, method="hold", timeout=60.0, streaming=True, args=encode_args(kit.Text("")))
        await channel.send(encode_header(req))
        # The handler reads one chunk and then stops: a well-behaved sender stops at the window.
        for _ in range(window // kit.CHUNK + 1):
            await channel.send(encode_header(Data(id=1)), b"\0" * kit.CHUNK)

    with trio.fail_after(20):
        reason = await _hostile_session(tcp_cluster, kit, caplog, attack)
    assert "beyond its credit window" in reason
