"""Frame ciphers, records, and length-prefixed framing over in-memory trio streams.

The async tests run under ``autojump_clock``: if code under test waited for bytes that never come, the
virtual clock jumps straight to the ``fail_after`` deadline and the test fails at once (no real waiting).
"""

from __future__ import annotations

import random
import socket
import sys

import numpy as np
import pytest
import torch
import trio
import trio.testing

from p2ptrain.errors import ConnectionClosed, LocalProtocolError, RemoteProtocolError
from p2ptrain.identity import Identity
from p2ptrain.net.channel import (
    BULK_BODY,
    LENGTH,
    MAX_CHUNK,
    MAX_FRAME,
    MIN_UNSENT_BYTES,
    TAG_BYTES,
    UNSENT_BYTES,
    UNSENT_SECONDS,
    BodyBuffers,
    FrameCipher,
    FramedStream,
    SecureChannel,
    SendGate,
    UnsentBudget,
    open_record,
    seal_record,
)
from p2ptrain.net.handshake import HandshakeResult, InitiatorHandshake, ResponderHandshake
from p2ptrain.net.memory import LinkProfile, MemoryNetwork
from p2ptrain.wire.codec import MAX_HEADER_BYTES

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
DEADLINE = 5  # virtual seconds (autojump clock)


def ciphers(key: bytes = KEY) -> tuple[FrameCipher, FrameCipher]:
    return FrameCipher(key), FrameCipher(key)


def flip(data: bytes, index: int) -> bytes:
    b = bytearray(data)
    b[index] ^= 0x01
    return bytes(b)


# ---- FrameCipher -------------------------------------------------------------------------------


def test_cipher_round_trip() -> None:
    tx, rx = ciphers()
    messages = [b"", b"a", b"hello world", bytes(range(256)) * 40]
    sealed = [tx.seal(m) for m in messages]
    for m, c in zip(messages, sealed, strict=True):
        assert len(c) == len(m) + TAG_BYTES
    assert [rx.open(c) for c in sealed] == messages


def test_same_plaintext_seals_differently_each_time() -> None:
    tx, _ = ciphers()
    first, second = tx.seal(b"same"), tx.seal(b"same")
    assert first != second
    assert b"same" not in first


@pytest.mark.parametrize("key", [b"", b"\x00" * 31, b"\x00" * 33])
def test_cipher_key_must_be_32_bytes(key: bytes) -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        FrameCipher(key)


def test_tampered_ciphertext_fails_at_every_byte() -> None:
    tx, _ = ciphers()
    sealed = tx.seal(b"some payload")
    for index in range(len(sealed)):
        _, rx = ciphers()
        with pytest.raises(RemoteProtocolError, match="failed authentication"):
            rx.open(flip(sealed, index))


def test_replayed_ciphertext_fails() -> None:
    tx, rx = ciphers()
    sealed = tx.seal(b"pay me once")
    assert rx.open(sealed) == b"pay me once"
    with pytest.raises(RemoteProtocolError, match="replayed"):
        rx.open(sealed)


def test_reordered_ciphertexts_fail() -> None:
    tx, rx = ciphers()
    first, second = tx.seal(b"first"), tx.seal(b"second")
    with pytest.raises(RemoteProtocolError, match="reordered"):
        rx.open(second)
    # The same frames in order open fine with a fresh receiver.
    _, rx = ciphers()
    assert (rx.open(first), rx.open(second)) == (b"first", b"second")


def test_dropped_ciphertext_makes_the_next_one_fail() -> None:
    tx, rx = ciphers()
    tx.seal(b"lost in transit")
    with pytest.raises(RemoteProtocolError):
        rx.open(tx.seal(b"arrives"))


@pytest.mark.parametrize("keep", [0, 1, TAG_BYTES - 1, TAG_BYTES, TAG_BYTES + 4, -1])
def test_truncated_ciphertext_fails(keep: int) -> None:
    tx, rx = ciphers()
    sealed = tx.seal(b"a payload longer than nothing")
    with pytest.raises(RemoteProtocolError):
        rx.open(sealed[:keep])


def test_wrong_key_fails() -> None:
    tx, _ = ciphers(KEY)
    _, rx = ciphers(OTHER_KEY)
    with pytest.raises(RemoteProtocolError):
        rx.open(tx.seal(b"secret"))


def test_nonce_counter_exhaustion_is_refused() -> None:
    tx, _ = ciphers()
    tx._counter = 2**64 - 1  # the last value is never used as a nonce
    with pytest.raises(LocalProtocolError, match="nonce counter exhausted"):
        tx.seal(b"x")


# ---- records -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "body"),
    [
        (b"", b""),
        (b"h", b""),
        (b"", b"body"),
        (b"\x81\xa1k\x01", bytes(range(256))),
        (b"h" * MAX_HEADER_BYTES, b"b" * MAX_CHUNK),  # both limits are inclusive
    ],
)
def test_record_round_trip(header: bytes, body: bytes) -> None:
    tx, rx = ciphers()
    frame = seal_record(tx, header, body)
    boxes = 2 if body else 1  # an empty body takes no box at all
    assert len(frame) == 2 * LENGTH.size + len(header) + len(body) + boxes * TAG_BYTES
    assert LENGTH.unpack_from(frame)[0] == len(frame) - LENGTH.size <= MAX_FRAME
    h, b = open_record(rx, frame)
    assert (bytes(h), bytes(b)) == (header, body)
    assert body not in frame[2 * LENGTH.size :] or not body  # sealed, not copied in the clear
    # the next record uses the next nonces on both sides
    assert tuple(map(bytes, open_record(rx, seal_record(tx, b"next", b"b")))) == (b"next", b"b")


def test_record_seals_a_memoryview_body_where_it_lies() -> None:
    tx, rx = ciphers()
    source = bytearray(b"0123456789")
    h, b = open_record(rx, seal_record(tx, b"hdr", memoryview(source)[2:5]))
    assert (bytes(h), bytes(b)) == (b"hdr", b"234")


def test_seal_record_bounds() -> None:
    tx, _ = ciphers()
    with pytest.raises(LocalProtocolError, match="header too large"):
        seal_record(tx, b"h" * (MAX_HEADER_BYTES + 1))
    with pytest.raises(LocalProtocolError, match=f"exceeds {MAX_CHUNK}"):
        seal_record(tx, b"h", b"b" * (MAX_CHUNK + 1))


def _reframed(frame: bytes, hbox: int | None = None, cut: int = 0) -> bytes:
    """``frame`` with its header-box length replaced and/or ``cut`` bytes dropped from its end, the
    length prefix made to match (what an attacker on the path can do)."""
    body = bytearray(frame[: len(frame) - cut] if cut else frame)
    if hbox is not None:
        LENGTH.pack_into(body, LENGTH.size, hbox)
    LENGTH.pack_into(body, 0, len(body) - LENGTH.size)
    return bytes(body)


@pytest.mark.parametrize(
    ("mangle", "reason"),
    [
        (lambda f: f[:7], "too short"),
        (lambda f: f[: 2 * LENGTH.size + TAG_BYTES - 1], "too short"),
        (lambda f: LENGTH.pack(len(f)) + f[LENGTH.size :], "out of bounds"),  # prefix != length
        (lambda f: _reframed(f, hbox=TAG_BYTES - 1), "out of bounds"),
        (lambda f: _reframed(f, hbox=MAX_HEADER_BYTES + TAG_BYTES + 1), "out of bounds"),
        (lambda f: _reframed(f, hbox=len(f)), "out of bounds"),
        (lambda f: _reframed(f, cut=len(b"body")), "body box out of bounds"),  # a body box of a tag
        (lambda f: _reframed(f, hbox=3 + TAG_BYTES), "failed authentication"),  # split moved
        (lambda f: _reframed(f, cut=len(b"body") + TAG_BYTES), "failed authentication"),  # body cut
        (lambda f: _reframed(f, cut=1), "failed authentication"),
    ],
)
def test_open_record_refuses_malformed_and_altered_frames(mangle, reason: str) -> None:
    tx, rx = ciphers()
    frame = seal_record(tx, b"header", b"body")
    with pytest.raises(RemoteProtocolError, match=reason):
        open_record(rx, mangle(frame))


def test_open_record_refuses_a_body_box_moved_to_another_frame() -> None:
    # Each box has its own nonce: a body box swapped between two frames fails even with a valid header.
    tx, rx = ciphers()
    first, second = seal_record(tx, b"one", b"AAAA"), seal_record(tx, b"two", b"BBBB")
    hbox = 2 * LENGTH.size + len(b"one") + TAG_BYTES
    with pytest.raises(RemoteProtocolError, match="failed authentication"):
        open_record(rx, first[:hbox] + second[hbox:])


def test_open_record_decrypts_the_body_where_the_sink_says() -> None:
    tx, rx = ciphers()
    place = bytearray(b"?" * 4)
    asked: list[tuple[bytes, int]] = []

    def sink(header: memoryview, size: int) -> memoryview | None:
        asked.append((bytes(header), size))
        return memoryview(place)

    h, b = open_record(rx, seal_record(tx, b"hdr", b"body"), sink)
    assert (bytes(h), bytes(place), asked) == (b"hdr", b"body", [(b"hdr", 4)])
    assert b.obj is place  # the body is the sink's buffer itself, not a copy of it
    # A record without a body never asks; a sink that declines gets a fresh buffer.
    assert tuple(map(bytes, open_record(rx, seal_record(tx, b"bare"), sink))) == (b"bare", b"")
    h, b = open_record(rx, seal_record(tx, b"fresh", b"xyz"), lambda header, size: None)
    assert (bytes(h), bytes(b), len(asked)) == (b"fresh", b"xyz", 1)


def test_a_forged_body_leaves_no_plaintext_in_the_sink() -> None:
    tx, rx = ciphers()
    frame = bytearray(seal_record(tx, b"hdr", b"secret body"))
    frame[-1] ^= 0x01  # the body box's tag
    place = bytearray(len(b"secret body"))
    with pytest.raises(RemoteProtocolError, match="failed authentication"):
        open_record(rx, frame, lambda header, size: memoryview(place))
    assert b"secret" not in place


def test_open_into_refuses_a_buffer_of_the_wrong_size() -> None:
    tx, rx = ciphers()
    with pytest.raises(LocalProtocolError, match="wrong size"):
        rx.open_into(tx.seal(b"four"), memoryview(bytearray(3)))


# ---- FramedStream ------------------------------------------------------------------------------


def framed_pair(max_frame: int = MAX_FRAME) -> tuple[FramedStream, FramedStream]:
    left, right = trio.testing.memory_stream_pair()
    return FramedStream(left, max_frame), FramedStream(right, max_frame)


async def test_frames_round_trip(autojump_clock: trio.testing.MockClock) -> None:
    a, b = framed_pair()
    big = bytes(range(256)) * 1024  # 256 KiB: the large-frame path that sends parts separately
    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:

            async def send() -> None:
                await a.send_frame(b"one")
                await a.send_frame(b"")
                await a.send_frame(b"two", memoryview(b"-parts"), b"!")
                await a.send_frame(big[:1000], big[1000:])

            nursery.start_soon(send)
            got = [await b.receive_frame() for _ in range(4)]
    assert got == [b"one", b"", b"two-parts!", big]
    total = 3 + 0 + 10 + len(big) + 4 * LENGTH.size
    assert a.bytes_sent == total
    assert b.bytes_received == total


async def test_frames_arriving_byte_by_byte_and_back_to_back(autojump_clock: trio.testing.MockClock) -> None:
    left, right = trio.testing.memory_stream_pair()
    receiver = FramedStream(right)
    wire = LENGTH.pack(5) + b"hello" + LENGTH.pack(0) + LENGTH.pack(3) + b"abc"
    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:

            async def trickle() -> None:
                for i in range(len(wire)):
                    await left.send_all(wire[i : i + 1])

            nursery.start_soon(trickle)
            got = [await receiver.receive_frame() for _ in range(3)]
    assert got == [b"hello", b"", b"abc"]

    # Several frames in one chunk are all delivered, in order.
    with trio.fail_after(DEADLINE):
        await left.send_all(wire)
        got = [await receiver.receive_frame() for _ in range(3)]
    assert got == [b"hello", b"", b"abc"]


async def test_frame_at_the_limit_is_accepted(autojump_clock: trio.testing.MockClock) -> None:
    a, b = framed_pair(max_frame=16)
    with trio.fail_after(DEADLINE):
        await a.send_frame(b"x" * 16)
        assert await b.receive_frame() == b"x" * 16


async def test_sending_an_oversized_frame_is_a_local_error(autojump_clock: trio.testing.MockClock) -> None:
    a, _ = framed_pair(max_frame=16)
    with trio.fail_after(DEADLINE):
        with pytest.raises(LocalProtocolError, match="exceeds the 16-byte limit"):
            await a.send_frame(b"x" * 10, b"y" * 7)
    assert a.bytes_sent == 0


@pytest.mark.parametrize("announced", [MAX_FRAME + 1, 2**31, 2**32 - 1])
async def test_oversized_length_prefix_is_refused_before_reading_the_body(
    autojump_clock: trio.testing.MockClock, announced: int
) -> None:
    left, right = trio.testing.memory_stream_pair()
    receiver = FramedStream(right)
    with trio.fail_after(DEADLINE):
        # Only the prefix is sent and the stream stays open: waiting for the body would hang until the
        # deadline (TooSlowError), so the refusal must come from the 4 bytes alone.
        await left.send_all(LENGTH.pack(announced))
        with pytest.raises(RemoteProtocolError, match=f"frame length {announced} exceeds"):
            await receiver.receive_frame()
    assert receiver.bytes_received == LENGTH.size
    assert trio.current_time() == 0  # refused without any (virtual) waiting


async def test_eof_in_the_middle_of_a_frame(autojump_clock: trio.testing.MockClock) -> None:
    left, right = trio.testing.memory_stream_pair()
    receiver = FramedStream(right)
    with trio.fail_after(DEADLINE):
        await left.send_all(LENGTH.pack(10) + b"abc")
        await left.aclose()
        with pytest.raises(RemoteProtocolError, match="middle of a frame"):
            await receiver.receive_frame()


async def test_eof_in_the_middle_of_a_length_prefix(autojump_clock: trio.testing.MockClock) -> None:
    left, right = trio.testing.memory_stream_pair()
    receiver = FramedStream(right)
    with trio.fail_after(DEADLINE):
        await left.send_all(b"\x00\x00")
        await left.aclose()
        with pytest.raises(RemoteProtocolError, match="middle of a frame"):
            await receiver.receive_frame()


async def test_clean_eof_is_connection_closed(autojump_clock: trio.testing.MockClock) -> None:
    a, b = framed_pair()
    with trio.fail_after(DEADLINE):
        await a.send_frame(b"last words")
        await a.stream.aclose()
        assert await b.receive_frame() == b"last words"
        with pytest.raises(ConnectionClosed, match="closed by the remote"):
            await b.receive_frame()


async def test_using_a_closed_stream_is_connection_closed(autojump_clock: trio.testing.MockClock) -> None:
    a, _ = framed_pair()
    with trio.fail_after(DEADLINE):
        await a.stream.aclose()
        with pytest.raises(ConnectionClosed, match="while sending"):
            await a.send_frame(b"x")
        with pytest.raises(ConnectionClosed, match="while receiving"):
            await a.receive_frame()


# ---- SecureChannel -----------------------------------------------------------------------------


def handshake_keys() -> tuple[HandshakeResult, HandshakeResult]:
    init = InitiatorHandshake(Identity.from_seed(b"\x01" * 32), "run", None)
    resp = ResponderHandshake(Identity.from_seed(b"\x02" * 32), "run")
    reply = resp.receive(init.start())
    assert reply is not None
    resp.receive(init.receive(reply))
    assert init.result is not None
    assert resp.result is not None
    return init.result, resp.result


async def test_secure_channel_both_directions(autojump_clock: trio.testing.MockClock) -> None:
    a_framed, b_framed = framed_pair()
    a_keys, b_keys = handshake_keys()
    a, b = SecureChannel(a_framed, a_keys), SecureChannel(b_framed, b_keys)
    with trio.fail_after(DEADLINE):
        await a.send(b"hdr-1", b"body-1")
        await a.send(b"hdr-2")
        await b.send(b"reply", memoryview(b"xyz"))
        assert [tuple(map(bytes, await b.receive())) for _ in range(2)] == [
            (b"hdr-1", b"body-1"),
            (b"hdr-2", b""),
        ]
        assert tuple(map(bytes, await a.receive())) == (b"reply", b"xyz")
    # Only ciphertext crosses the wire.
    # Only ciphertext crosses the wire: two records with a body (two boxes), one without.
    assert a_framed.bytes_sent == LENGTH.size * 2 * 2 + TAG_BYTES * 3 + 5 + 6 + 5


async def test_secure_channel_refuses_forged_and_replayed_frames(
    autojump_clock: trio.testing.MockClock,
) -> None:
    left, right = trio.testing.memory_stream_pair()
    a_keys, b_keys = handshake_keys()
    tap = FramedStream(left)  # an attacker writing raw frames to the receiver
    b = SecureChannel(FramedStream(right), b_keys)
    sealed = seal_record(FrameCipher(a_keys.send_key), b"hdr", b"body")
    with trio.fail_after(DEADLINE):
        await tap.send_raw(memoryview(sealed))
        assert tuple(map(bytes, await b.receive())) == (b"hdr", b"body")
        await tap.send_raw(memoryview(sealed))  # replay
        with pytest.raises(RemoteProtocolError, match="failed authentication"):
            await b.receive()


async def test_secure_channel_keys_are_per_direction(autojump_clock: trio.testing.MockClock) -> None:
    # A frame reflected back to its sender does not open: the two directions use different keys.
    left, right = trio.testing.memory_stream_pair()
    a_keys, _ = handshake_keys()
    a = SecureChannel(FramedStream(left), a_keys)
    reflector = FramedStream(right)
    with trio.fail_after(DEADLINE):
        await a.send(b"hdr")
        await reflector.send_frame(await reflector.receive_frame())
        with pytest.raises(RemoteProtocolError):
            await a.receive()
        await a.aclose()
        with pytest.raises(ConnectionClosed):
            await reflector.receive_frame()


async def test_over_tcp_a_large_frame_in_pieces_then_a_small_record_arrive() -> None:
    """Over a real TCP socket, the reader of a large frame asks to be woken only once much of the rest
    is buffered (SO_RCVLOWAT): a frame that arrives in pieces still comes whole, and a small record sent
    after it is not held back (between frames the threshold is one byte again). Real time: a reader
    stuck waiting for bytes that never come fails at the deadline."""
    a_keys, b_keys = handshake_keys()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    cipher = FrameCipher(a_keys.send_key)  # the sender's side, sealed by hand to send it in pieces

    def frame(header: bytes, body: bytes) -> bytes:
        return seal_record(cipher, header, body)

    body = bytes(range(256)) * 4096  # 1 MiB
    big = frame(b"big", body)
    got: list[tuple[bytes, bytes]] = []
    with trio.fail_after(10):
        raw = await trio.open_tcp_stream("127.0.0.1", port)
        receiver = SecureChannel(FramedStream(await listeners[0].accept()), b_keys)
        assert receiver.framed._sock is not None  # the recv_into path is the one under test

        async def read(n: int) -> None:
            for _ in range(n):
                got.append(tuple(map(bytes, await receiver.receive())))  # type: ignore[arg-type]

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read, 2)
            await raw.send_all(big[:300_000])
            await trio.testing.wait_all_tasks_blocked()  # the reader waits for the rest of the frame
            await raw.send_all(big[300_000:])
            while not got:
                await trio.testing.wait_all_tasks_blocked()
            await raw.send_all(frame(b"small", b"x"))  # to a reader waiting on an empty socket
        await raw.aclose()
        await receiver.aclose()
        for listener in listeners:
            await listener.aclose()
    assert got == [(b"big", body), (b"small", b"x")]


@pytest.mark.skipif(not hasattr(socket, "TCP_NOTSENT_LOWAT"), reason="no TCP_NOTSENT_LOWAT here")
async def test_over_tcp_the_kernel_holds_little_until_the_connection_shows_it_drains_fast() -> None:
    """A fresh connection lets the kernel hold only MIN_UNSENT_BYTES not yet sent, on both ends: its
    rate is not known, and on a slow link whatever the kernel holds is in front of every control
    message (a MiB at the start was 4 s of a 2 Mbit/s link). A send that shows a fast link raises it to
    a whole frame (trio's 16 KiB starves a bulk stream whenever the event loop is a little late)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    with trio.fail_after(10):
        dialed = FramedStream(await trio.open_tcp_stream("127.0.0.1", port))
        accepted = FramedStream(await listeners[0].accept())
        for framed in (dialed, accepted):
            sock = framed.stream.socket  # type: ignore[attr-defined]
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT) == MIN_UNSENT_BYTES

        async def reader() -> None:
            while await accepted.stream.receive_some(1 << 20):
                pass

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            sock = dialed.stream.socket  # type: ignore[attr-defined]
            for _ in range(50):  # loopback: each MiB is gone in a few milliseconds, however busy the machine
                await dialed.send_raw(memoryview(bytes(MAX_CHUNK)))
                if sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT) == UNSENT_BYTES:
                    break
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT) == UNSENT_BYTES >= MAX_CHUNK
            await dialed.stream.aclose()
        await accepted.stream.aclose()
        for listener in listeners:
            await listener.aclose()


# ---- sending: small records first, and how much the kernel holds ----------------------------------


async def test_a_small_record_waiting_to_be_sent_goes_before_waiting_bulk_ones(
    autojump_clock: trio.testing.MockClock,
) -> None:
    left, right = trio.testing.lockstep_stream_pair()  # a send waits until the other end has read it
    a_keys, b_keys = handshake_keys()
    a, b = SecureChannel(FramedStream(left), a_keys), SecureChannel(FramedStream(right), b_keys)
    bulk = bytes(BULK_BODY)
    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:
            for header, body in ((b"bulk-1", bulk), (b"bulk-2", bulk), (b"small", b"x")):
                nursery.start_soon(a.send, header, body)  # the first is on the wire, unread
                await trio.testing.wait_all_tasks_blocked()
            got = [bytes((await b.receive())[0]) for _ in range(3)]  # and every one opens: in order
    assert got == [b"bulk-1", b"small", b"bulk-2"]


async def test_send_gate_lets_bulk_through_after_a_run_of_small_records(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = SendGate(max_run=2)
    order: list[str] = []

    async def send(name: str, urgent: bool) -> None:
        await gate.acquire(urgent)
        order.append(name)
        await trio.sleep(1)
        gate.release()

    with trio.fail_after(DEADLINE * 4):
        async with trio.open_nursery() as nursery:
            for name in ("first", "bulk", *(f"small-{i}" for i in range(4))):
                nursery.start_soon(send, name, name.startswith("small"))
                await trio.testing.wait_all_tasks_blocked()
    assert order == ["first", "small-0", "small-1", "bulk", "small-2", "small-3"]


async def test_send_gate_waiter_cancelled_takes_no_turn(autojump_clock: trio.testing.MockClock) -> None:
    gate = SendGate()
    await gate.acquire(urgent=False)
    with trio.move_on_after(1) as waited:
        await gate.acquire(urgent=True)
    assert waited.cancelled_caught
    gate.release()  # nobody waits: the gate is free
    with trio.fail_after(1):
        await gate.acquire(urgent=False)
    gate.release()


def test_unsent_budget_takes_the_drain_rate_of_records_too_small_to_time() -> None:
    """A background stream on a slow link sends records of FRAME_SECONDS (under ``_TIMED_SEND``): the
    budget follows the rate DrainRate measured from them, at once, within its bounds (and, as for
    timed sends, moved only by more than a quarter: each move is a system call)."""
    rng = random.Random(3)
    for _ in range(100):
        budget = UnsentBudget()
        rate = 10 ** rng.uniform(3, 9)
        budget.measured(rate)
        want = min(max(rate * UNSENT_SECONDS, MIN_UNSENT_BYTES), UNSENT_BYTES)
        assert budget.value == int(want) or abs(budget.value - want) <= budget.value / 4, (rate, want)
    budget = UnsentBudget()
    assert budget.value == MIN_UNSENT_BYTES  # a fresh connection: the least, until a rate is known
    assert budget.measured(250e3) is None  # 2 Mbit/s: still the least (16 KiB, 65 ms of it): no call
    assert budget.measured(100e6) == UNSENT_BYTES  # fast: the most, at once


def test_unsent_budget_follows_the_rate_a_connection_drains_at() -> None:
    budget = UnsentBudget()
    assert budget.value == MIN_UNSENT_BYTES  # nothing measured: the least
    assert budget.sent(MAX_CHUNK, 0.001) == UNSENT_BYTES  # the first sample is taken as it is
    assert all(budget.sent(MAX_CHUNK, 0.001) is None for _ in range(5))  # a fast link: the most
    slow = MAX_CHUNK / 0.25  # 4 MB/s: a 100 Mbit/s link that three flows share
    changes = [b for _ in range(30) if (b := budget.sent(MAX_CHUNK, 0.25)) is not None]
    assert changes == sorted(changes, reverse=True) and len(changes) < 15  # few system calls
    assert budget.value == pytest.approx(slow * UNSENT_SECONDS, rel=0.3)
    for _ in range(30):
        budget.sent(MAX_CHUNK, 100.0)  # a reader that stalls: never below the least
    assert budget.value == MIN_UNSENT_BYTES
    for _ in range(30):
        budget.sent(MAX_CHUNK, 0.0)  # a send that did not wait: the link keeps up again
    assert budget.value == UNSENT_BYTES


@pytest.mark.skipif(not hasattr(socket, "TCP_NOTSENT_LOWAT"), reason="no TCP_NOTSENT_LOWAT here")
async def test_over_tcp_a_connection_drained_slowly_lets_the_kernel_hold_less_not_yet_sent() -> None:
    """Real time: a reader paced to at most 13 MB/s (128 KiB per 10 ms) behind a small receive buffer
    makes the sender's large records wait; the sender then lowers TCP_NOTSENT_LOWAT towards what
    drains in UNSENT_SECONDS (a slower machine only drains slower: lower still)."""
    a_keys, _ = handshake_keys()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    with trio.fail_after(30):
        sender = SecureChannel(FramedStream(await trio.open_tcp_stream("127.0.0.1", port)), a_keys)
        raw = await listeners[0].accept()
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        sock = sender.framed.stream.socket  # type: ignore[attr-defined]

        async def paced_reader() -> None:
            while True:
                if not await raw.receive_some(128 * 1024):
                    return
                await trio.sleep(0.01)  # the pace: at most 128 KiB per 10 ms

        async with trio.open_nursery() as nursery:
            nursery.start_soon(paced_reader)
            for _ in range(20):
                await sender.send(b"h", bytes(MAX_CHUNK))
            lowat = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT)
            nursery.cancel_scope.cancel()
        await sender.aclose()
        await raw.aclose()
        for listener in listeners:
            await listener.aclose()
    assert MIN_UNSENT_BYTES <= lowat < UNSENT_BYTES // 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIOCOUTQ is Linux's")
async def test_over_tcp_bytes_sent_count_as_delivered_only_once_acknowledged() -> None:
    """A reader that reads nothing (behind a small receive buffer) leaves most of what was sent in the
    sender's queue, unacknowledged: the stream reports it undelivered until the reader takes it."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    total = 3 * MAX_CHUNK // 2
    with trio.fail_after(30):
        sender = FramedStream(await trio.open_tcp_stream("127.0.0.1", port))
        raw = await listeners[0].accept()
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        assert sender.undelivered() == 0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender.send_raw, memoryview(bytes(total)))
            while sender.undelivered() < 64 * 1024:  # noqa: ASYNC110 (the kernel's queue: no event)
                await trio.sleep(0.005)
            got = 0
            while got < total:
                got += len(await raw.receive_some(1 << 16))
        while sender.undelivered():  # noqa: ASYNC110 (the last acknowledgements are on their way)
            await trio.sleep(0.005)
        assert sender.bytes_sent == total
        await sender.stream.aclose()
        await raw.aclose()
        for listener in listeners:
            await listener.aclose()


async def test_in_memory_bytes_sent_count_as_delivered_once_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = MemoryNetwork()
    net.set_link("a", "b", LinkProfile(latency=0.01, bandwidth=1e6))
    async with trio.open_nursery() as nursery:
        accepted: list[trio.abc.Stream] = []
        arrived = trio.Event()

        async def on_stream(stream: trio.abc.Stream, host: str, port: int) -> None:
            accepted.append(stream)
            arrived.set()
            await trio.sleep_forever()

        await nursery.start(net.transport("b").serve, "b", 1, on_stream)
        sender = FramedStream(await net.transport("a").connect("b", 1))
        with trio.fail_after(10):
            await sender.send_raw(memoryview(bytes(300_000)))
            assert sender.undelivered() == 300_000  # written, not read
            await arrived.wait()
            got = 0
            while got < 300_000:
                got += len(await accepted[0].receive_some(1 << 16))
                assert sender.undelivered() == 300_000 - got
        nursery.cancel_scope.cancel()


# ---- reused body buffers ----------------------------------------------------------------------------


async def test_body_buffers_hand_a_buffer_out_again_only_once_no_view_of_it_lives(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool = BodyBuffers(keep=2, size=1 << 16, min_size=1 << 10)
    first = pool.take(1 << 16)
    assert first is not None
    first_address = address(first)
    # Every kind of view a reader makes keeps the buffer out of the pool.
    for view in (
        first[10:20],
        torch.frombuffer(first, dtype=torch.float32),
        np.frombuffer(first, dtype=np.uint8).reshape(16, -1),
    ):
        del first
        second = pool.take(1 << 16)
        assert second is not None and address(second) != first_address
        assert pool.take(1 << 16) is None  # both kept buffers are in use: the caller allocates
        del second
        first = view  # type: ignore[assignment]  # only the view refers to the first buffer now
    del first, view
    again = pool.take(4096)  # a smaller body: a prefix of a free buffer
    assert again is not None and len(again) == 4096
    assert address(again) == first_address
    assert len(pool) == 2


async def test_body_buffers_leave_small_and_oversized_bodies_to_the_allocator(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool = BodyBuffers(keep=4, size=1 << 16, min_size=1 << 10)
    assert pool.take(100) is None
    assert pool.take((1 << 16) + 1) is None
    assert len(pool) == 0


async def test_body_buffers_drop_a_free_buffer_idle_for_long(autojump_clock: trio.testing.MockClock) -> None:
    pool = BodyBuffers(keep=4, idle=10.0, size=1 << 16, min_size=1 << 10)
    first, second = pool.take(1 << 16), pool.take(1 << 16)
    del first, second
    await trio.sleep(5)
    assert pool.take(1 << 16) is not None  # the first serves; the second is idle 5 s: kept
    assert len(pool) == 2
    await trio.sleep(6)
    assert pool.take(1 << 16) is not None  # the second has been idle 11 s: dropped
    assert len(pool) == 1
    busy = pool.take(1 << 16)
    held = pool.take(1 << 16)  # the last buffer, held for long
    del busy
    await trio.sleep(11)
    assert pool.take(1 << 16) is not None  # the first serves; the last is idle 11 s but in use: kept
    assert len(pool) == 2 and held is not None
    del held
    assert pool.take(1 << 16) is not None  # and once free, it goes
    assert len(pool) == 1


async def test_a_received_body_kept_by_its_reader_is_never_overwritten(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Bodies land in reused buffers; one the reader still holds keeps its bytes while more arrive, and
    one it let go is reused for the next body."""
    a_framed, b_framed = framed_pair()
    a_keys, b_keys = handshake_keys()
    a = SecureChannel(a_framed, a_keys)
    b = SecureChannel(b_framed, b_keys, BodyBuffers(keep=2))
    bodies = [bytes([i]) * MAX_CHUNK for i in range(5)]
    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:
            for body in bodies:
                nursery.start_soon(a.send, b"h", body)
                await trio.testing.wait_all_tasks_blocked()
            kept = [(await b.receive())[1] for _ in range(3)]  # the third needs a fresh buffer
            let_go = address(kept[1])
            del kept[1]
            reused = (await b.receive())[1]
            fresh = (await b.receive())[1]  # both kept buffers are held again: a fresh one
    assert [bytes(v) for v in (*kept, reused, fresh)] == [bodies[0], bodies[2], bodies[3], bodies[4]]
    assert address(reused) == let_go
    assert len({address(v) for v in (*kept, reused, fresh)}) == 4


def address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
