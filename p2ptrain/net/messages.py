"""A message-level in-memory network: whole frames handed over as objects, for swarms of thousands.

Theory of operation: :mod:`.memory` simulates a byte stream (each write a chunk of bytes that the
reader re-frames and decrypts). That is the right test of the framing and the cipher, and the wrong
cost model for a thousand peers in one process: every record is sealed and opened with AEAD, every
frame is cut and joined again. Here a connection carries *frames*: the handshake's frames as bytes and,
after it, each record as its (header, body) pair, in plain text. The host asks the stream for its
framing (:func:`~p2ptrain.net.channel.framed_stream`), gets a :class:`MessageFraming`, and builds its
record channel from it (:class:`PlainChannel` instead of the encrypted one). Everything above the
channel (the RPC connection, the DHT, matchmaking, averaging, progress records) runs unchanged.

What the protocol relies on is kept:

* **Order per connection.** A message is stamped with the virtual time it arrives; a later message on
  the same direction never arrives before an earlier one.
* **Cost.** A message of ``n`` bytes (the size its sealed frame would have on the wire, so byte counts
  match the real channel's) leaves after the sender's uplink has sent what it queued before
  (``n / up``), travels the path's one-way latency, and is received at the receiver's downlink rate.
* **Loss** as TCP shows it: a lost message is retransmitted, arriving one ``rto`` later (and everything
  behind it waits: order is kept).
* **Closes.** Closing an end gives the other end, once the messages in flight were read, an end of
  stream; writing towards a closed end fails. :meth:`MessageNetwork.kill` resets every connection of a
  host at once (its process died) and stops its listeners.
* **Partitions** freeze delivery between two sides (messages wait, as in a network split) and make new
  dials between them hang; :meth:`MessageNetwork.heal` lets them through again.
* **NAT**: dials to a host behind a NAT hang (its router drops unsolicited SYNs); its own dials work
  both ways. There is no simultaneous open here (hole punching never succeeds): such hosts are reached
  through relays, whose circuits are byte streams inside connections, and are framed and encrypted as
  on a real network.
* **Backpressure**: a direction holds at most ``PIPE_LIMIT`` bytes in flight; a writer beyond it waits.

Lazy by construction: no task per connection or per host (a reader waiting for its next message sleeps
until that message's arrival time on trio's clock), an event is made only when someone waits, and
killing a host touches only that host's connections. The plain channel has no confidentiality or
integrity of its own: it exists only inside this simulated network, never on a socket.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

import trio

from ..errors import ConnectionClosed, LocalProtocolError, RemoteProtocolError
from ..wire.codec import MAX_HEADER_BYTES
from .channel import (
    LENGTH,
    MAX_CHUNK,
    BodyBuffers,
    BodySink,
    FrameCarrier,
    FramedStream,
    SecureChannel,
    sealed_size,
)
from .handshake import HandshakeResult
from .transport import StreamHandler

PIPE_LIMIT = 4 * 1024 * 1024
"""Bytes one direction of a connection holds in flight before its writer waits."""

Latency = Callable[[str, str], float]
"""One-way latency in seconds from one host to another."""


@dataclass(frozen=True)
class HostLink:
    """A host's access link: uplink and downlink rates (bytes per second; None: unlimited)."""

    up: float | None = None
    down: float | None = None


class _Direction:
    """One direction of a connection: the messages in flight, in order of arrival."""

    __slots__ = (
        "_changed",
        "broken",
        "dst",
        "eof",
        "in_flight",
        "last_arrival",
        "net",
        "queue",
        "reader_gone",
        "src",
    )

    def __init__(self, net: MessageNetwork, src: str, dst: str) -> None:
        self.net, self.src, self.dst = net, src, dst
        # (arrival, size, frame or record); None while empty: an empty deque holds a 64-slot block
        # (about 600 bytes), and most directions of a large swarm are quiet
        self.queue: deque[tuple[float, int, object]] | None = None
        self.in_flight = 0
        self.last_arrival = 0.0
        self.eof = False
        self.broken = False
        self.reader_gone = False
        self._changed: trio.Event | None = None

    def wake(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def _wait(self, until: float | None = None) -> None:
        if self._changed is None:
            self._changed = trio.Event()
        ev = self._changed
        if until is None:
            await ev.wait()
        else:
            with trio.move_on_at(until):
                await ev.wait()

    async def put(self, item: object, size: int) -> None:
        while self.in_flight >= PIPE_LIMIT and not (self.broken or self.reader_gone):
            await self._wait()
        if self.broken or self.reader_gone:
            raise ConnectionClosed("connection lost while sending: connection reset")
        if self.eof:
            raise ConnectionClosed("connection lost while sending: this end was closed")
        if self.queue is None:
            self.queue = deque()
        self.last_arrival = self.net.arrival(self.src, self.dst, size, self.last_arrival)
        self.queue.append((self.last_arrival, size, item))
        self.in_flight += size
        self.wake()
        await trio.lowlevel.checkpoint()

    async def get(self) -> tuple[object, int] | None:
        """The next message once it arrived, or None at the end of the stream."""
        while True:
            if self.broken:
                raise ConnectionClosed("connection lost while receiving: connection reset")
            queue = self.queue
            if queue and not self.net.blocked(self.src, self.dst):
                arrival, size, item = queue[0]
                if arrival <= trio.current_time():
                    queue.popleft()
                    if not queue:
                        self.queue = None
                    self.in_flight -= size
                    self.wake()
                    self.net.received[self.dst] += size
                    return item, size
                await self._wait(arrival)
                continue
            if self.eof and not self.queue:
                return None
            await self._wait()


class MessageEnd(FrameCarrier):
    """One end of a message-level connection. It carries whole frames (see :class:`MessageFraming`);
    its byte-stream methods refuse (nothing reads it as bytes)."""

    def __init__(self, net: MessageNetwork, out: _Direction, inp: _Direction) -> None:
        self.net, self._out, self._in = net, out, inp
        self.closed = False

    def framed(self, max_frame: int) -> FramedStream:
        return MessageFraming(self, max_frame)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        raise LocalProtocolError("a message-level connection carries frames, not bytes")

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        raise LocalProtocolError("a message-level connection carries frames, not bytes")

    async def put(self, item: object, size: int) -> None:
        if self.closed:
            raise ConnectionClosed("connection closed locally")
        self.net.sent[self._out.src] += size
        await self._out.put(item, size)

    async def get(self) -> object:
        if self.closed:
            raise ConnectionClosed("connection closed locally")
        got = await self._in.get()
        if got is None:
            raise ConnectionClosed("connection closed by the remote")
        return got[0]

    def undelivered(self) -> int:
        return 0 if self._out.broken else self._out.in_flight

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self._out.eof = True
            self._out.wake()
            self._in.reader_gone = True
            self._in.wake()
            self.net._forget(self._out, self._in)
        await trio.lowlevel.checkpoint()


class MessageFraming(FramedStream):
    """The framing of a :class:`MessageEnd`: frames go over as bytes objects, records as (header, body)
    pairs, counted at the size their sealed frames would have."""

    def __init__(self, end: MessageEnd, max_frame: int) -> None:
        super().__init__(end, max_frame)
        self.end = end

    async def send_frame(self, *parts: bytes | memoryview) -> None:
        frame = b"".join(parts)
        if len(frame) > self.max_frame:
            raise LocalProtocolError(f"frame of {len(frame)} bytes exceeds the {self.max_frame}-byte limit")
        await self.end.put(frame, len(frame) + LENGTH.size)
        self.bytes_sent += len(frame) + LENGTH.size

    async def receive_frame(self) -> bytes:
        item = await self.end.get()
        if not isinstance(item, bytes):
            raise RemoteProtocolError("a record came where a handshake frame was expected")
        self.bytes_received += len(item) + LENGTH.size
        return item

    async def send_record(self, header: bytes, body: bytes | bytearray | memoryview) -> None:
        n = sealed_size(len(header), len(body))
        await self.end.put((bytes(header), bytearray(body)), n)  # (a receiver may reduce in place)
        self.bytes_sent += n

    async def receive_plain(self) -> tuple[bytes, bytearray]:
        item = await self.end.get()
        if not (isinstance(item, tuple) and len(item) == 2):
            raise RemoteProtocolError("a handshake frame came where a record was expected")
        header, body = item
        if not isinstance(header, bytes) or not isinstance(body, bytearray):
            raise RemoteProtocolError("malformed record")
        if len(header) > MAX_HEADER_BYTES or len(body) > MAX_CHUNK:
            raise RemoteProtocolError("record out of bounds")
        self.bytes_received += sealed_size(len(header), len(body))
        return header, body

    def undelivered(self) -> int:
        return self.end.undelivered()

    def secure(self, keys: HandshakeResult, bodies: BodyBuffers | None = None) -> SecureChannel:
        return PlainChannel(self)


class PlainChannel(SecureChannel):
    """Records in plain text over a message-level connection (the in-process simulated network only):
    the channel interface of :class:`~p2ptrain.net.channel.SecureChannel` without its cipher."""

    def __init__(self, framing: MessageFraming) -> None:  # (no cipher: nothing to set up)
        self.framed = framing
        self._framing = framing

    async def send(
        self, header: bytes, body: bytes | bytearray | memoryview = b"", *, bulk: bool = False
    ) -> None:
        await self._framing.send_record(header, body)

    def bulk_piece(self) -> int:
        return MAX_CHUNK  # (whole messages: nothing here is paced by the time a send takes)

    async def receive(self, sink: BodySink | None = None) -> tuple[memoryview, memoryview]:
        header, body = await self._framing.receive_plain()
        head = memoryview(header)
        if body and sink is not None:
            target = sink(head, len(body))
            if target is not None:
                target[:] = body
                return head, target
        return head, memoryview(body)

    async def aclose(self) -> None:
        await self._framing.end.aclose()


class MessageNetwork:
    """Simulated hosts exchanging whole messages. ``transport(host)`` gives a host its Transport.

    ``latency(src, dst)`` is the one-way latency (default: ``default_latency`` for every path); a host's
    access link (:class:`HostLink`) is set with :meth:`set_host`; ``loss`` is the chance a message is
    retransmitted (arriving ``rto`` later).
    """

    def __init__(
        self,
        *,
        latency: Latency | None = None,
        default_latency: float = 0.0,
        loss: float = 0.0,
        rto: float = 0.2,
        seed: int = 0,
    ) -> None:
        self.latency: Latency = latency or (lambda a, b: default_latency)
        self.loss, self.rto = loss, rto
        self.rng = random.Random(seed)
        self.links: dict[str, HostLink] = {}
        self._up_free: dict[str, float] = {}  # host -> when its uplink has sent what it was given
        self._down_free: dict[str, float] = {}
        self._listeners: dict[tuple[str, int], tuple[StreamHandler, trio.Nursery]] = {}
        self._blocked: set[frozenset[str]] = set()
        self._natted: set[str] = set()
        self._by_host: dict[str, set[_Direction]] = {}  # a host's live directions (both ways)
        self._changed: trio.Event | None = None  # dials waiting for a partition to heal, a NAT to go
        self._next_port = 40000
        self.sent: Counter[str] = Counter()  # bytes each host put on the network
        self.received: Counter[str] = Counter()  # ... and took off it
        self.connections_made = 0

    # ---- conditions ----

    def set_host(self, host: str, link: HostLink) -> None:
        self.links[host] = link

    def arrival(self, src: str, dst: str, size: int, after: float) -> float:
        """When a message of ``size`` bytes sent now from ``src`` reaches ``dst`` (not before ``after``:
        order per connection)."""
        now = trio.current_time()
        up = self.links.get(src)
        leave = now
        if up is not None and up.up:
            leave = max(now, self._up_free.get(src, 0.0)) + size / up.up
            self._up_free[src] = leave
        at = leave + self.latency(src, dst)
        down = self.links.get(dst)
        if down is not None and down.down:
            at = max(at, self._down_free.get(dst, 0.0)) + size / down.down
            self._down_free[dst] = at
        if self.loss and self.rng.random() < self.loss:
            at += self.rto
        return max(at, after)

    def blocked(self, a: str, b: str) -> bool:
        return bool(self._blocked) and frozenset((a, b)) in self._blocked

    def partition(self, side_a: set[str] | list[str], side_b: set[str] | list[str]) -> None:
        """Cut every path between ``side_a`` and ``side_b`` until :meth:`heal`."""
        for a in side_a:
            for b in side_b:
                self._blocked.add(frozenset((a, b)))
        self._notify()

    def heal(self) -> None:
        self._blocked.clear()
        self._notify()

    def nat(self, host: str) -> None:
        """Put ``host`` behind a NAT: dials to it hang; its own dials work both ways."""
        self._natted.add(host)

    def natted(self, host: str) -> bool:
        return host in self._natted

    def kill(self, host: str) -> None:
        """Reset every connection of ``host`` and stop its listeners, as if its process died."""
        for d in self._by_host.pop(host, set()):
            d.broken = True
            d.wake()
            other = d.dst if d.src == host else d.src
            self._by_host.get(other, set()).discard(d)
        for key in [k for k in self._listeners if k[0] == host]:
            _, nursery = self._listeners.pop(key)
            nursery.cancel_scope.cancel()

    def live_connections(self) -> int:
        return sum(len(ds) for ds in self._by_host.values()) // 4  # each counted at both hosts, 2 ways

    def _notify(self) -> None:
        for ds in self._by_host.values():
            for d in ds:
                d.wake()
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def _changes(self) -> None:
        if self._changed is None:
            self._changed = trio.Event()
        await self._changed.wait()

    def _forget(self, out: _Direction, inp: _Direction) -> None:
        """Both ends of a connection closed: its directions leave the hosts' sets."""
        if out.reader_gone and inp.reader_gone:
            for d in (out, inp):
                for h in (d.src, d.dst):
                    self._by_host.get(h, set()).discard(d)

    # ---- transport ----

    def transport(self, host: str) -> MessageTransport:
        return MessageTransport(self, host)

    async def dial(self, src: str, host: str, port: int) -> MessageEnd:
        while self.blocked(src, host) or host in self._natted:
            await self._changes()  # a dial into a partition or a NAT hangs (SYN dropped)
        await trio.sleep(self.latency(src, host))  # the SYN's trip
        entry = self._listeners.get((host, port))
        if entry is None:
            raise OSError(f"connection refused: nothing listens on {host}:{port}")
        handler, nursery = entry
        a_to_b, b_to_a = _Direction(self, src, host), _Direction(self, host, src)
        for d in (a_to_b, b_to_a):
            self._by_host.setdefault(src, set()).add(d)
            self._by_host.setdefault(host, set()).add(d)
        self.connections_made += 1
        self._next_port += 1
        nursery.start_soon(handler, MessageEnd(self, b_to_a, a_to_b), src, self._next_port)
        return MessageEnd(self, a_to_b, b_to_a)

    async def serve_as(
        self,
        host: str,
        port: int,
        handler: StreamHandler,
        task_status: trio.TaskStatus[list[tuple[str, int]]],
    ) -> None:
        if port == 0:
            self._next_port += 1
            port = self._next_port
        key = (host, port)
        if key in self._listeners:
            raise OSError(f"address {host}:{port} already in use")
        async with trio.open_nursery() as nursery:
            self._listeners[key] = (handler, nursery)
            task_status.started([key])
            try:
                await trio.sleep_forever()
            finally:
                if self._listeners.get(key, (None, None))[1] is nursery:
                    del self._listeners[key]


class MessageTransport:
    """The Transport of one named host on a :class:`MessageNetwork`."""

    def __init__(self, net: MessageNetwork, host: str) -> None:
        self.net = net
        self.host = host

    async def connect(self, host: str, port: int, *, local_port: int | None = None) -> trio.abc.Stream:
        # (a dial from a known port is a plain dial: no simultaneous open, so punching never succeeds)
        return await self.net.dial(self.host, host, port)

    async def serve(
        self,
        host: str,
        port: int,
        handler: StreamHandler,
        *,
        task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        await self.net.serve_as(self.host, port, handler, task_status)
