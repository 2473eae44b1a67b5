"""Length-prefixed frames over a trio stream, and the encrypted record channel on top of them.

Theory of operation: every frame on the socket is a 4-byte big-endian length followed by that many
bytes. The length is checked against a hard maximum *before* anything is allocated, so a peer that
announces a 4 GiB frame is cut off after 4 bytes.

After the handshake each frame carries one *record*: a msgpack header (small, validated by the RPC
layer) and a raw body (bulk bytes, never msgpack-encoded), sealed as two AEAD boxes (AEGIS-256, 32-byte
tags)::

    frame = u32 n | u32 h | header box (h bytes) | body box (n - 4 - h bytes; none if the body is empty)

The header box authenticates the frame's first 8 bytes (n and h) as associated data, so the split and
the presence of a body box cannot be altered. The nonce is a counter per direction, never sent: the
header box takes the next value and the body box the one after, and the receiver expects exactly the
same sequence, so a replayed, dropped, reordered or altered frame fails authentication and the channel
is closed. Sealing the body as a box of its own lets the cipher read it where it lies (a slice of a
tensor) instead of first copying header and body into one plaintext: at 1 MiB per record that copy was
a tenth of a loopback all-reduce's CPU time.
"""

from __future__ import annotations

import fcntl
import socket
import struct
import sys
import termios
import time
from abc import abstractmethod
from collections.abc import Callable

import nacl.bindings  # noqa: F401  (importing it initializes libsodium: CPU feature detection)
import numpy as np
import trio
from nacl._sodium import ffi as _ffi
from nacl._sodium import lib as _lib

from ..errors import ConnectionClosed, LocalProtocolError, RemoteProtocolError
from ..wire.codec import MAX_HEADER_BYTES
from .handshake import HandshakeResult

LENGTH = struct.Struct(">I")
TAG_BYTES = 32
MAX_CHUNK = 1 << 20
"""Largest body in one record; bigger payloads are streamed in chunks of at most this size."""
MAX_FRAME = LENGTH.size + MAX_HEADER_BYTES + TAG_BYTES + MAX_CHUNK + TAG_BYTES
_RECV_SIZE = 120 * 1024
"""Bytes asked of the socket per read: below glibc's default mmap threshold (128 KiB), so the buffer
each read allocates comes from the heap instead of a fresh mapping (measured: mapping and unmapping
1 MiB buffers per frame cost more than the cipher)."""
_DIRECT_READ = 256 * 1024
"""Frames at least this large are read with recv_into (see FramedStream.receive_record)."""
_WAKE_BYTES = 128 * 1024
"""While the rest of a large frame is arriving, the reader wakes up once this much of it is buffered
(or all of it, if less is left; the sender has committed to the whole frame, so it comes or the
connection closes). Fewer, larger reads: on a shaped 100 Mbit/s link data otherwise trickles in a few
packets per wake-up."""
UNSENT_BYTES = MAX_CHUNK
"""The most TCP_NOTSENT_LOWAT of a connection may be: how much not yet sent data the kernel takes before
a send waits. A connection starts at MIN_UNSENT_BYTES and follows what it drains in UNSENT_SECONDS (see
:class:`UnsentBudget`). Kept at 16 KiB (trio's setting, which suits chatty sockets), a bulk stream runs
dry whenever the event loop is a millisecond late (16 KiB is 1.3 ms at 100 Mbit/s), and a link shaped
to 100 Mbit/s carried 80% of its rate instead of 86% (cubic, the all-reduce benchmark's netns lab)."""
MIN_UNSENT_BYTES = 16 * 1024  # (trio's default: 65 ms of a 2 Mbit/s link; where a connection starts)
UNSENT_SECONDS = 0.025
"""A connection lets the kernel hold about this long of not yet sent data, at the rate it drains:
enough that a bulk stream does not run dry when the event loop is late, little enough that a control
message sent behind it waits about this long. At a fixed 1 MiB, in the 100 Mbit/s lab where three flows
share each link, a member's report to the coordinator waited up to a quarter of a second."""
_TIMED_SEND = 256 * 1024  # sends at least this large measure how fast the connection drains
_MAX_COUNTER = 2**64 - 1
_LINUX = sys.platform.startswith("linux")  # where TIOCOUTQ on a TCP socket is SIOCOUTQ
_OUTQ = struct.Struct("i")
SEND_TIMEOUT = 60.0
"""A frame, once started, is sent whole even if its sender is cancelled (a half frame would break the
channel); if the remote reads nothing for this long, the connection is closed instead."""


FRAME_SECONDS = 0.05
"""Background bulk (a state download, a replayed result: catching up, never a round's own traffic) is
sent in records of about this long at the rate the connection drains (:meth:`DrainRate.piece`), so that a
control message sent behind it (a progress record, a join request, a DHT reply) waits for at most one
such record plus what the kernel and the network hold (see ``UNSENT_SECONDS``). At a fixed 1 MiB a record
takes 0.84 s on a 10 Mbit/s link, and a home peer catching up on one had its records and join requests
arrive a second or more late behind the records in flight."""
MIN_PIECE = 4 * 1024
"""The smallest background record: FRAME_SECONDS' worth on a 640 kbit/s link, and the size of every one
until the connection's rate is measured (see :class:`DrainRate`). A background record is bulk at the
:class:`SendGate` because its sender says so, whatever its size. When the gate told bulk by size alone,
no background record could be smaller than ``BULK_BODY`` (64 KiB), which is more than FRAME_SECONDS on
any link under 10 Mbit/s: on 160 kbit/s a control message waited 3.2 s behind one record, and a joiner
replaying a step's result there found its group's leader after the group had formed (in about one
run in five)."""
_PIECE_STEP = MIN_PIECE


class DrainRate:
    """How fast a connection drains, from what its transport delivered (pure: counters in, a size out).

    The transport says how many of the bytes sent so far it still holds (TCP's unacknowledged and
    unsent bytes, SIOCOUTQ; the in-memory network's unread ones), and the sender looks before and after
    each send, so what it delivered between two looks is known. Between two looks where it delivered
    less than it held at the first, it never ran dry: the link was busy. Consecutive busy spans make a
    window, and a window's bytes over its time are the link's rate (a sample, smoothed). A span in which
    the transport delivered all it held may have idled: its bytes over its time are only a lower bound,
    which raises the rate at most twofold (from the smallest record's rate, before a sample), and never
    lowers it.

    No time a send takes counts. A send that took no time says only that the transport had room (the
    kernel's unsent budget, the network's queue, a shaper's burst): taken as a fast link, a fresh
    connection's records doubled to 256 KiB within a millisecond, and the kernel took half a MiB, 2 s of
    a 2 Mbit/s link, in front of every control message (a ping in the namespace lab waited 1.7 s to
    4.3 s). A sender that the machine kept waiting (a busy CPU) only makes a lower bound lower; a busy
    window's sample is the link's whatever the sender's timing.

    A record is at most twice the largest bulk send so far; until the first sample or bound, a
    background record is the smallest size.
    """

    ALPHA = 0.25
    MIN_WINDOW = 0.01  # seconds: a window or span shorter than this waits for the next look
    MIN_BYTES = 16 * 1024  # a busy window is sampled once it delivered this much (ACKs come in bursts) ...
    MAX_WINDOW = 0.1  # ... or lasted this long (a link so slow that it delivered less)

    def __init__(self) -> None:
        self.rate: float | None = None  # bytes a second, once a window measured it or a span bounded it
        self._look: tuple[float, int, int] | None = None  # (when, delivered, held) at the last look
        self._window: tuple[float, int] | None = None  # (when, delivered) where the busy window began
        self._largest = 0  # the largest bulk send so far

    def sent(self, nbytes: int, bulk: bool) -> None:
        """Account for a send of ``nbytes``; ``bulk``: a record of bulk data, not a control message."""
        if bulk:
            self._largest = max(self._largest, nbytes)

    def observe(self, now: float, sent_total: int, held: int) -> None:
        """A look at the transport at ``now`` (seconds): of the ``sent_total`` bytes sent over it so far,
        it still holds ``held``."""
        delivered = sent_total - held
        look, self._look = self._look, (now, delivered, held)
        if look is None:
            self._window = (now, delivered)
            return
        if delivered - look[1] < look[2]:  # busy since the last look: the window goes on
            assert self._window is not None
            began, was_delivered = self._window
            moved, seconds = delivered - was_delivered, now - began
            if seconds >= self.MAX_WINDOW or (seconds >= self.MIN_WINDOW and moved >= self.MIN_BYTES):
                rate, sample = self.rate, moved / seconds
                self.rate = sample if rate is None else rate + self.ALPHA * (sample - rate)
                self._window = (now, delivered)
            return
        self._window = (now, delivered)  # it may have run dry: a lower bound, and a new window
        seconds = now - look[0]
        if seconds >= self.MIN_WINDOW:
            bound = (delivered - look[1]) / seconds
            known = self.rate if self.rate is not None else MIN_PIECE / FRAME_SECONDS
            if bound > known:
                self.rate = min(bound, 2 * known)
        else:
            self._look = look  # too short to bound anything: the span goes on from the earlier look

    def piece(self, seconds: float = FRAME_SECONDS) -> int:
        """The size of a background record: what drains in ``seconds``, between MIN_PIECE and MAX_CHUNK,
        and at most twice the largest bulk send so far (MIN_PIECE until measured)."""
        rate = self.rate
        if rate is None:
            return MIN_PIECE
        most = min(max(2 * self._largest // _PIECE_STEP * _PIECE_STEP, MIN_PIECE), MAX_CHUNK)
        want = int(rate * seconds) // _PIECE_STEP * _PIECE_STEP
        return min(max(want, MIN_PIECE), most)


class UnsentBudget:
    """How much not yet sent data a connection lets the kernel hold (pure: sends in, a size out).

    A large send returns once the kernel has taken all of it, and it had to take as much out first, so
    its bytes over its duration sample the rate the connection drains at (a send that did not have to
    wait samples a high rate: the link keeps up). The rate is smoothed, and the budget is what drains
    in UNSENT_SECONDS, between MIN_UNSENT_BYTES and UNSENT_BYTES. It starts at the least: until a rate
    is known, what the kernel holds is in front of every control message, and a large send that must
    wait on a small budget samples the rate at once (the first sample is taken as it is).

    On a link too slow for large sends (a background stream's records are FRAME_SECONDS of it), the
    rate comes from :class:`DrainRate` instead (:meth:`measured`). Without it the budget kept its first
    MiB there: in the namespace lab at 2 Mbit/s a ping over a state download's connection waited about
    3 s at the median, up to 4.7 s (0.29 s at the median with it).
    """

    ALPHA = 0.25  # weight of a new sample
    _CAP = 2 * UNSENT_BYTES / UNSENT_SECONDS  # samples above it count as it (twice the rate that
    # gives the largest budget, so that a smoothed rate coming back up reaches it)

    def __init__(self) -> None:
        self.rate: float | None = None  # bytes a second, once a send measured it
        self.value = MIN_UNSENT_BYTES

    def sent(self, nbytes: int, seconds: float) -> int | None:
        """Account for a send of ``nbytes`` that took ``seconds``: the new budget when it changed by
        more than a quarter (worth a system call) or reached a bound, else None."""
        sample = min(nbytes / seconds, self._CAP) if seconds > 0 else self._CAP
        self.rate = sample if self.rate is None else self.rate + self.ALPHA * (sample - self.rate)
        return self._follow()

    def measured(self, rate: float) -> int | None:
        """The drain rate as :class:`DrainRate` measured it (smoothed there already): taken as it is;
        the new budget as :meth:`sent` returns it."""
        self.rate = min(rate, self._CAP)
        return self._follow()

    def _follow(self) -> int | None:
        assert self.rate is not None
        want = int(min(max(self.rate * UNSENT_SECONDS, MIN_UNSENT_BYTES), UNSENT_BYTES))
        at_bound = want in (MIN_UNSENT_BYTES, UNSENT_BYTES)
        if want == self.value or (abs(want - self.value) <= self.value // 4 and not at_bound):
            return None
        self.value = want
        return want


class FrameCarrier(trio.abc.Stream):
    """A stream that carries whole frames rather than bytes (the message-level simulated network's,
    ``messages``): it frames itself, and :func:`framed_stream` asks it to."""

    @abstractmethod
    def framed(self, max_frame: int) -> FramedStream: ...


def framed_stream(stream: trio.abc.Stream, max_frame: int = 0) -> FramedStream:
    """Length-prefixed framing over ``stream`` (or the stream's own, where it carries frames)."""
    limit = max_frame or MAX_FRAME
    return stream.framed(limit) if isinstance(stream, FrameCarrier) else FramedStream(stream, limit)


class FramedStream:
    """Length-prefixed frames over a byte stream, with a hard frame size limit."""

    def __init__(self, stream: trio.abc.Stream, max_frame: int = MAX_FRAME) -> None:
        self.stream = stream
        self.max_frame = max_frame
        self._buf = bytearray()
        self._frame_buf: bytearray | None = None  # where large frames are read straight from the socket
        sock = getattr(stream, "socket", None)  # a trio.SocketStream's socket, for recv_into
        self._sock = sock if hasattr(sock, "recv_into") else None
        self._lowat = 1  # the socket's SO_RCVLOWAT (see _wake_at)
        self._unsent: UnsentBudget | None = None  # its TCP_NOTSENT_LOWAT, where it has one
        if self._sock is not None and hasattr(socket, "TCP_NOTSENT_LOWAT"):
            try:
                self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, MIN_UNSENT_BYTES)
                self._unsent = UnsentBudget()
            except OSError:  # not TCP: nothing to tune
                pass
        self.drain = DrainRate()
        self.bytes_sent = 0
        self.bytes_received = 0

    async def send_frame(self, *parts: bytes | memoryview) -> None:
        n = sum(len(p) for p in parts)
        if n > self.max_frame:
            raise LocalProtocolError(f"frame of {n} bytes exceeds the {self.max_frame}-byte limit")
        try:
            if n < 64 * 1024:
                await self.stream.send_all(b"".join([LENGTH.pack(n), *parts]))
            else:
                await self.stream.send_all(LENGTH.pack(n))
                for p in parts:
                    await self.stream.send_all(p)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            raise ConnectionClosed(f"connection lost while sending: {e}") from None
        self.bytes_sent += n + LENGTH.size

    def secure(self, keys: HandshakeResult, bodies: BodyBuffers | None = None) -> SecureChannel:
        """The encrypted record channel over these frames, once the handshake gave ``keys``."""
        return SecureChannel(self, keys, bodies)

    async def send_raw(self, data: memoryview, bulk: bool = False) -> None:
        """Send bytes that already carry their length prefix (the encrypted channel's frames); ``bulk``:
        a record of bulk data. The transport is looked at before and after (see :class:`DrainRate`)."""
        timed = self._unsent is not None and len(data) >= _TIMED_SEND
        began = time.perf_counter() if timed else 0.0
        self.drain.observe(trio.current_time(), self.bytes_sent, self.undelivered())
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            raise ConnectionClosed(f"connection lost while sending: {e}") from None
        self.bytes_sent += len(data)
        self.drain.sent(len(data), bulk)
        self.drain.observe(trio.current_time(), self.bytes_sent, self.undelivered())
        if timed:
            self._retune(len(data), time.perf_counter() - began)
        elif bulk and self._unsent is not None and (rate := self.drain.rate) is not None:
            self._set_budget(self._unsent.measured(rate))  # (a record too small to time: see UnsentBudget)

    def undelivered(self) -> int:
        """Bytes sent that the remote has not yet acknowledged (TCP) or read (the in-memory network): 0
        where the transport cannot tell."""
        if self._sock is None:
            count = getattr(self.stream, "undelivered", None)
            return int(count()) if callable(count) else 0
        if not _LINUX:
            return 0
        try:
            out = fcntl.ioctl(self._sock.fileno(), termios.TIOCOUTQ, _OUTQ.pack(0))
        except (OSError, ValueError):  # closed, or not a socket that keeps a send queue
            return 0
        return int(_OUTQ.unpack(out)[0])

    def _retune(self, nbytes: int, seconds: float) -> None:
        assert self._unsent is not None
        self._set_budget(self._unsent.sent(nbytes, seconds))

    def _set_budget(self, budget: int | None) -> None:
        assert self._sock is not None
        if budget is not None:
            try:
                self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, budget)
            except OSError:  # closed meanwhile: nothing to tune
                self._unsent = None

    async def _fill(self, need: int) -> None:
        while len(self._buf) < need:
            try:
                data = await self.stream.receive_some(_RECV_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
                raise ConnectionClosed(f"connection lost while receiving: {e}") from None
            if not data:
                if self._buf:
                    raise RemoteProtocolError("connection closed in the middle of a frame")
                raise ConnectionClosed("connection closed by the remote")
            self._buf += data
            self.bytes_received += len(data)

    async def _peek_length(self) -> int:
        """The next frame's length, checked against the limit before any of the frame is read."""
        await self._fill(LENGTH.size)
        (n,) = LENGTH.unpack_from(self._buf)
        if n > self.max_frame:
            raise RemoteProtocolError(
                f"frame length {n} exceeds the {self.max_frame}-byte limit; refusing before reading it"
            )
        return int(n)

    async def _next_length(self) -> int:
        n = await self._peek_length()
        await self._fill(LENGTH.size + n)
        return n

    async def receive_frame(self) -> bytes:
        n = await self._next_length()
        frame = bytes(memoryview(self._buf)[LENGTH.size : LENGTH.size + n])
        del self._buf[: LENGTH.size + n]
        return frame

    async def receive_record(
        self, cipher: FrameCipher, sink: BodySink | None = None
    ) -> tuple[memoryview, memoryview]:
        """Receive one sealed record and open it straight out of the read buffer: (header, body); the
        body goes where ``sink`` says (see :func:`open_record`).

        The rest of a large frame is read with ``recv_into`` into a reused buffer: one copy out of the
        kernel instead of two, and no allocation per read.
        """
        n = await self._peek_length()
        if self._sock is not None and n >= _DIRECT_READ and len(self._buf) < LENGTH.size + n:
            return open_record(cipher, await self._read_direct(n), sink)
        await self._fill(LENGTH.size + n)
        with memoryview(self._buf) as view:
            record = open_record(cipher, view[: LENGTH.size + n], sink)
        del self._buf[: LENGTH.size + n]
        return record

    async def _read_direct(self, n: int) -> memoryview:
        """The frame (its length prefix, which starts the buffer, and ``n`` bytes), most of it read with
        recv_into."""
        if self._frame_buf is None:
            self._frame_buf = bytearray(LENGTH.size + self.max_frame)
        end = LENGTH.size + n
        view = memoryview(self._frame_buf)[:end]
        have = len(self._buf)
        view[:have] = self._buf
        self._buf.clear()
        pos = have
        try:
            while pos < end:
                # The rest of the frame is on its way: wake up once a good part of it is here, not for
                # every few packets (on a slow link that is thousands of wake-ups a second).
                self._wake_at(min(end - pos, _WAKE_BYTES))
                try:
                    got = await self._sock.recv_into(view[pos:], end - pos)  # type: ignore[union-attr]
                except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
                    raise ConnectionClosed(f"connection lost while receiving: {e}") from None
                if not got:
                    raise RemoteProtocolError("connection closed in the middle of a frame")
                pos += got
                self.bytes_received += got
        finally:
            self._wake_at(1)  # between frames: any byte may start a small message
        return view

    def _wake_at(self, nbytes: int) -> None:
        """Make the socket readable only once ``nbytes`` are buffered (SO_RCVLOWAT), where it can."""
        if nbytes == self._lowat or self._sock is None:
            return
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
        except OSError:  # not a TCP socket, or closed: reads just wake up more often
            nbytes = self._lowat
        self._lowat = nbytes


class FrameCipher:
    """AEAD with a counter nonce for one direction of a channel (pure, no I/O).

    It calls libsodium directly (through pynacl's bindings, which have initialized it) so that frames
    are sealed into and opened from caller-owned buffers: the Python wrappers allocate and copy a
    fresh output for every call, which at 1 MiB per frame cost more than the cipher itself.
    """

    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise ValueError("key must be 32 bytes")
        self._key = key
        self._counter = 0
        self._len = _ffi.new("unsigned long long *")

    def _next_nonce(self) -> bytes:
        if self._counter >= _MAX_COUNTER:
            raise LocalProtocolError("nonce counter exhausted; the connection must be re-established")
        nonce = self._counter.to_bytes(8, "little") + bytes(24)
        self._counter += 1
        return nonce

    def seal_into(
        self, out: bytearray, offset: int, plaintext: bytes | bytearray | memoryview, ad: bytes = b""
    ) -> int:
        """Write the ciphertext of ``plaintext`` (authenticating ``ad`` too) at ``out[offset:]``; return
        its length."""
        need = len(plaintext) + TAG_BYTES
        if len(out) - offset < need:
            raise LocalProtocolError("output buffer too small")
        nonce = self._next_nonce()
        with memoryview(out) as view:
            rc = _lib.crypto_aead_aegis256_encrypt(
                _ffi.from_buffer(view[offset : offset + need]),
                self._len,
                _ffi.from_buffer(plaintext),
                len(plaintext),
                ad,
                len(ad),
                _ffi.NULL,
                nonce,
                self._key,
            )
        if rc != 0:
            raise LocalProtocolError("encryption failed")
        return need

    def seal(self, plaintext: bytes | bytearray | memoryview, ad: bytes = b"") -> bytes:
        out = bytearray(len(plaintext) + TAG_BYTES)
        self.seal_into(out, 0, plaintext, ad)
        return bytes(out)

    def open(self, ciphertext: bytes | bytearray | memoryview, ad: bytes = b"") -> memoryview:
        """Decrypt into a fresh buffer (the caller keeps views into it); RemoteProtocolError if forged.

        The buffer is allocated uninitialized (numpy), not zero-filled as a bytearray is: decryption
        writes every byte, and clearing a megabyte per frame first cost ~8% of an all-reduce round.
        """
        if len(ciphertext) < TAG_BYTES:
            raise RemoteProtocolError("frame is shorter than its authentication tag")
        plain = np.empty(len(ciphertext) - TAG_BYTES, dtype=np.uint8).data
        self.open_into(ciphertext, plain, ad)
        return plain

    def open_into(self, ciphertext: bytes | bytearray | memoryview, out: memoryview, ad: bytes = b"") -> None:
        """Decrypt into ``out`` (exactly the plaintext's size); RemoteProtocolError if forged, and then
        ``out`` holds no plaintext (libsodium clears it)."""
        if len(ciphertext) < TAG_BYTES:
            raise RemoteProtocolError("frame is shorter than its authentication tag")
        if len(out) != len(ciphertext) - TAG_BYTES:
            raise LocalProtocolError("output buffer of the wrong size")
        nonce = self._next_nonce()
        rc = _lib.crypto_aead_aegis256_decrypt(
            _ffi.from_buffer(out, require_writable=True),
            self._len,
            _ffi.NULL,
            _ffi.from_buffer(ciphertext),
            len(ciphertext),
            ad,
            len(ad),
            nonce,
            self._key,
        )
        if rc != 0:
            raise RemoteProtocolError(
                "frame failed authentication (tampered, replayed, reordered or truncated)"
            )


def sealed_size(header_len: int, body_len: int) -> int:
    """The whole frame's size (length prefix included) for a record of these sizes; LocalProtocolError
    if a record may not be that large (checked before any buffer is sized for it)."""
    if header_len > MAX_HEADER_BYTES:
        raise LocalProtocolError("record header too large")
    if body_len > MAX_CHUNK:
        raise LocalProtocolError(f"record body of {body_len} bytes exceeds {MAX_CHUNK}")
    return 2 * LENGTH.size + header_len + TAG_BYTES + (body_len + TAG_BYTES if body_len else 0)


def seal_record_into(
    cipher: FrameCipher, out: bytearray, header: bytes, body: bytes | bytearray | memoryview = b""
) -> int:
    """Write one whole frame (length prefix included) for the record at the start of ``out``; return its
    length. The body is sealed from where it lies, never copied."""
    total = sealed_size(len(header), len(body))
    if len(out) < total:
        raise LocalProtocolError("output buffer too small")
    hbox = len(header) + TAG_BYTES
    LENGTH.pack_into(out, 0, total - LENGTH.size)
    LENGTH.pack_into(out, LENGTH.size, hbox)
    cipher.seal_into(out, 2 * LENGTH.size, header, bytes(out[: 2 * LENGTH.size]))
    if body:
        cipher.seal_into(out, 2 * LENGTH.size + hbox, body)
    return total


def seal_record(cipher: FrameCipher, header: bytes, body: bytes | bytearray | memoryview = b"") -> bytes:
    """One whole frame (length prefix included) for the record."""
    out = bytearray(sealed_size(len(header), len(body)))
    return bytes(out[: seal_record_into(cipher, out, header, body)])


BodySink = Callable[[memoryview, int], "memoryview | None"]
"""Where a record's body may be decrypted: called with the opened header and the body's size, it
returns a writable buffer of exactly that size, or None for a fresh one."""


def open_record(
    cipher: FrameCipher, frame: bytes | bytearray | memoryview, sink: BodySink | None = None
) -> tuple[memoryview, memoryview]:
    """Open one whole frame (length prefix included): (header, body). The header comes in a fresh
    buffer; the body too, unless ``sink`` names a place for it once the header is open.

    RemoteProtocolError if the layout is malformed or a box fails authentication.
    """
    view = memoryview(frame)
    if len(view) < 2 * LENGTH.size + TAG_BYTES:
        raise RemoteProtocolError("frame too short for a record")
    (n,) = LENGTH.unpack_from(view)
    (hbox,) = LENGTH.unpack_from(view, LENGTH.size)
    rest = n - LENGTH.size - hbox
    if n != len(view) - LENGTH.size or not TAG_BYTES <= hbox <= MAX_HEADER_BYTES + TAG_BYTES or rest < 0:
        raise RemoteProtocolError("record header box out of bounds")
    if 0 < rest <= TAG_BYTES or rest > MAX_CHUNK + TAG_BYTES:
        raise RemoteProtocolError("record body box out of bounds")
    start = 2 * LENGTH.size
    header = cipher.open(view[start : start + hbox], bytes(view[:start]))
    if not rest:
        return header, memoryview(b"")
    box = view[start + hbox :]
    target = sink(header, rest - TAG_BYTES) if sink is not None else None
    if target is None:
        return header, cipher.open(box)
    cipher.open_into(box, target)
    return header, target


def _refs(arrays: list[np.ndarray], i: int) -> int:
    """``sys.getrefcount`` of ``arrays[i]``, always asked the same way (see BodyBuffers._UNSHARED)."""
    return sys.getrefcount(arrays[i])


class BodyBuffers:
    """Buffers for received record bodies, each handed out again only once nothing refers to it.

    Why: a bulk stream delivers a 1 MiB body per record. Allocated fresh, most of them are new pages the
    kernel must fault in and zero (glibc returns freed memory above its trim threshold): measured in the
    loopback all-reduce, ~18,000 page faults per peer per round, a tenth of the round's CPU time. A
    reducer keeps every chunk of a round (to reduce again over the agreed senders), so a host needs as
    many buffers as a round keeps: they are shared by all of a host's connections.

    Whether a buffer is free is read from its reference count: every view of it (a memoryview slice, a
    tensor from ``torch.frombuffer``, a numpy view) refers to it, so the count comes back to the pool's
    own once the last view is gone. At most ``keep`` are kept; one handed out last more than ``idle``
    seconds ago (trio's clock) is dropped when found free, so a host that stopped streaming gives the
    memory back. Bodies below ``min_size`` are left to the allocator, which serves them without faults.
    """

    _UNSHARED = _refs([np.empty(1, dtype=np.uint8)], 0)
    """The count of an array only its list refers to, measured by the very call that checks one (so an
    interpreter that counts differently counts differently here too)."""

    def __init__(
        self, keep: int = 256, idle: float = 30.0, size: int = MAX_CHUNK, min_size: int = 64 * 1024
    ) -> None:
        self.keep, self.idle, self.size, self.min_size = keep, idle, size, min_size
        self._arrays: list[np.ndarray] = []
        self._taken: list[float] = []  # when each was last handed out

    def __len__(self) -> int:
        return len(self._arrays)

    def take(self, n: int) -> memoryview | None:
        """A writable buffer of exactly ``n`` bytes that nothing else refers to, or None (allocate one)."""
        if not self.min_size <= n <= self.size:
            return None
        now = trio.current_time()
        for i in range(len(self._arrays)):
            if _refs(self._arrays, i) == self._UNSHARED:
                self._taken[i] = now
                self._drop_idle(now)
                return self._arrays[i].data[:n]
        if len(self._arrays) >= self.keep:
            return None
        self._arrays.append(np.empty(self.size, dtype=np.uint8))
        self._taken.append(now)
        return self._arrays[-1].data[:n]

    def _drop_idle(self, now: float) -> None:
        """Drop the last buffer if it is free and was handed out last more than ``idle`` ago. Called
        when an earlier one served: the first free buffers are the ones reused, so the last ones age,
        and one check per take trims a pool bigger than its use."""
        last = len(self._arrays) - 1
        if now - self._taken[last] > self.idle and _refs(self._arrays, last) == self._UNSHARED:
            self._arrays.pop()
            self._taken.pop()


BULK_BODY = 64 * 1024
"""Records with a body at least this large are bulk data, and so is every background record whatever its
size (``SecureChannel.send``'s ``bulk``): waiting to be sent, they let the others go first (see
:class:`SendGate`)."""


class SendGate:
    """One sender at a time; among those waiting, small records (control messages) go before bulk ones.

    Why: a control message queued behind bulk records waits for each of them to drain at its flow's
    rate (in the 100 Mbit/s lab a member's report to the coordinator queued behind a reducer's 1 MiB
    result records). Ownership passes straight from the holder to the next waiter (as with
    ``trio.Lock``), so the order of turns is the order of sealing, which must be the order on the wire.
    After ``max_run`` small records in a row while bulk ones wait, a bulk one goes: small records
    cannot starve bulk ones.
    """

    def __init__(self, max_run: int = 32) -> None:
        self.max_run = max_run
        self._held = False
        self._urgent = trio.lowlevel.ParkingLot()
        self._bulk = trio.lowlevel.ParkingLot()
        self._run = 0  # small records let through in a row while bulk ones waited

    async def acquire(self, urgent: bool) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self._held:
            self._held = True
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        await (self._urgent if urgent else self._bulk).park()  # the releaser made us the holder

    def release(self) -> None:
        if self._urgent and (self._run < self.max_run or not self._bulk):
            self._run = self._run + 1 if self._bulk else 0
            self._urgent.unpark()
        elif self._bulk:
            self._run = 0
            self._bulk.unpark()
        else:
            self._held = False


class SecureChannel:
    """Encrypted records over a framed stream. Sends are serialized, small records first (see
    :class:`SendGate`); one reader at a time.

    Sending reuses one buffer per channel for the sealed frame, grown to the largest record sent so
    far, so bulk transfers do not allocate per chunk.
    """

    def __init__(
        self, framed: FramedStream, keys: HandshakeResult, bodies: BodyBuffers | None = None
    ) -> None:
        self.framed = framed
        self._send_cipher = FrameCipher(keys.send_key)
        self._recv_cipher = FrameCipher(keys.recv_key)
        self._gate = SendGate()
        self._out = bytearray()
        self._bodies = BodyBuffers(keep=8) if bodies is None else bodies  # a host shares one

    async def send(
        self, header: bytes, body: bytes | bytearray | memoryview = b"", *, bulk: bool = False
    ) -> None:
        """Send one record; ``bulk``: background bulk (catching up), which lets control messages go
        first whatever its size; a body of ``BULK_BODY`` or more is bulk anyway."""
        n = sealed_size(len(header), len(body))  # refuses an oversized record before growing _out
        bulk = bulk or len(body) >= BULK_BODY
        await self._gate.acquire(urgent=not bulk)
        try:
            # Seal while holding the gate: the nonce order must equal the order on the wire.
            if len(self._out) < n:
                self._out = bytearray(n)
            out = self._out
            seal_record_into(self._send_cipher, out, header, body)
            with trio.CancelScope(shield=True) as scope:
                scope.deadline = trio.current_time() + SEND_TIMEOUT
                with memoryview(out) as view:
                    await self.framed.send_raw(view[:n], bulk)
            if scope.cancelled_caught:
                await self.aclose()
                raise ConnectionClosed(f"the remote read nothing for {SEND_TIMEOUT:g} s")
        finally:
            self._gate.release()

    def bulk_piece(self) -> int:
        """The body size for background bulk records on this channel (see :data:`FRAME_SECONDS`)."""
        return self.framed.drain.piece()

    async def receive(self, sink: BodySink | None = None) -> tuple[memoryview, memoryview]:
        """The next record: (header, body); the body goes where ``sink`` says (see :func:`open_record`),
        else into a reused buffer (:class:`BodyBuffers`) or a fresh one."""

        def sink_or_reused(header: memoryview, size: int) -> memoryview | None:
            target = sink(header, size) if sink is not None else None
            return target if target is not None else self._bodies.take(size)

        return await self.framed.receive_record(self._recv_cipher, sink_or_reused)

    async def aclose(self) -> None:
        await self.framed.stream.aclose()
