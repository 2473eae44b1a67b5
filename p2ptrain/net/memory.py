"""An in-memory network with latency, bandwidth, loss and partitions, behind the Transport interface.

Theory of operation: each connection is a pair of one-way pipes. A write is stamped with the virtual
time at which it would arrive: the link serializes writes at its bandwidth (after the sender's access
link and before the receiver's, where hosts have one: :meth:`MemoryNetwork.set_access`, shared by all
of a host's connections), adds its latency, and a "lost" write arrives one retransmission timeout later
(a byte stream never loses data, it stalls, as TCP does). A write returns once what is ahead of it
would be through within ``SEND_QUEUE_SECONDS``, as a TCP sender's kernel takes only that much, and
pipes hold a bounded number of unread bytes, so writers feel backpressure. A partition
freezes delivery between the two sides and makes new dials hang, as a real network split does;
:meth:`MemoryNetwork.kill` resets every connection of a host, as a crashed process would.

It runs on trio's clock, so tests under ``trio.testing.MockClock`` see exact virtual times.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import trio

from .transport import StreamHandler

_PIPE_LIMIT = 4 * 1024 * 1024
SEND_QUEUE_SECONDS = 0.05
"""On a link with a bandwidth, a write returns once what is queued ahead of its last byte would leave
within this long: the time's worth of unsent data a TCP sender's kernel takes (``TCP_NOTSENT_LOWAT``,
see ``channel.UNSENT_SECONDS``) plus what its congestion window keeps queued at the bottleneck. Without
it a writer queued up to ``_PIPE_LIMIT`` ahead of the link (3.4 s at 10 Mbit/s), which no TCP
connection does, and every message written behind a bulk transfer waited that long."""


@dataclass
class LinkProfile:
    """Conditions on the path between two hosts (one direction)."""

    latency: float = 0.0
    bandwidth: float | None = None  # bytes per second; None = unlimited
    loss: float = 0.0  # probability that a write needs a retransmission
    rto: float = 0.2


class _Pipe:
    def __init__(self, net: MemoryNetwork, src: str, dst: str) -> None:
        self.net, self.src, self.dst = net, src, dst
        self.queue: deque[tuple[float, bytes]] = deque()
        self.in_flight = 0
        self.link_free_at = 0.0
        self.last_arrival = 0.0
        self.eof = False
        self.broken = False
        self.reader_gone = False
        self.changed = trio.Event()

    def wake(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def _wait(self, until: float | None = None) -> None:
        ev = self.changed
        if until is None:
            await ev.wait()
        else:
            with trio.move_on_at(until):
                await ev.wait()

    async def write(self, data: bytes) -> None:
        while self.in_flight >= _PIPE_LIMIT and not self.broken and not self.reader_gone:
            await self._wait()
        if self.broken or self.reader_gone:
            raise trio.BrokenResourceError("connection reset")
        now = trio.current_time()
        prof = self.net.profile(self.src, self.dst)
        n = len(data)
        start = max(now, self.link_free_at)
        start = self.net.through_uplink(self.src, start, n)
        if prof.bandwidth:
            start += n / prof.bandwidth
        self.link_free_at = start
        arrival = self.net.through_downlink(self.dst, start + prof.latency, n)
        leaves = arrival - prof.latency  # when its last byte is through the slowest link on the way
        if prof.loss and self.net.rng.random() < prof.loss:
            arrival += prof.rto
        self.last_arrival = max(self.last_arrival, arrival)
        self.queue.append((self.last_arrival, data))
        self.in_flight += n
        self.wake()
        await trio.lowlevel.checkpoint()
        until = leaves - SEND_QUEUE_SECONDS
        while trio.current_time() < until and not self.broken and not self.reader_gone:
            await self._wait(until)

    async def read(self, max_bytes: int) -> bytes:
        while True:
            if self.broken:
                raise trio.BrokenResourceError("connection reset")
            blocked = self.net.blocked(self.src, self.dst)
            if self.queue and not blocked:
                arrival, data = self.queue[0]
                if arrival <= trio.current_time():
                    if len(data) > max_bytes:
                        self.queue[0] = (arrival, data[max_bytes:])
                        data = data[:max_bytes]
                    else:
                        self.queue.popleft()
                    self.in_flight -= len(data)
                    self.wake()
                    return data
                await self._wait(arrival)
                continue
            if self.eof and not self.queue:
                return b""
            await self._wait()


class MemoryStream(trio.abc.HalfCloseableStream):
    """One end of an in-memory connection."""

    def __init__(self, out: _Pipe, inp: _Pipe) -> None:
        self._out, self._in = out, inp
        self._closed = False
        self._sending = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            raise trio.ClosedResourceError("stream closed")
        if self._out.eof:
            raise trio.ClosedResourceError("send_eof was called")
        if self._sending:
            raise trio.BusyResourceError("another task is sending")
        self._sending = True
        try:
            await self._out.write(bytes(data))
        finally:
            self._sending = False

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    def undelivered(self) -> int:
        """Bytes sent on this stream that the other end has not read yet (a TCP socket's SIOCOUTQ)."""
        return 0 if self._out.broken else self._out.in_flight

    async def send_eof(self) -> None:
        self._out.eof = True
        self._out.wake()
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._closed:
            raise trio.ClosedResourceError("stream closed")
        return await self._in.read(max_bytes or 65536)

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._out.eof = True
            self._out.wake()
            self._in.reader_gone = True
            self._in.wake()
        await trio.lowlevel.checkpoint()


class MemoryNetwork:
    """A simulated network of named hosts. ``transport(host)`` gives a host its Transport."""

    def __init__(self, *, default: LinkProfile | None = None, seed: int = 0) -> None:
        self.default = default or LinkProfile()
        self.links: dict[tuple[str, str], LinkProfile] = {}
        self._access: dict[str, tuple[float | None, float | None]] = {}  # host -> (up, down), bytes/s
        self._up_free: dict[str, float] = {}  # when each access link is free again, each way
        self._down_free: dict[str, float] = {}
        self.rng = random.Random(seed)
        self._listeners: dict[tuple[str, int], StreamHandler] = {}
        self._serve_nurseries: dict[tuple[str, int], trio.Nursery] = {}
        self._blocked: set[frozenset[str]] = set()
        self._natted: dict[str, bool] = {}  # host -> whether its NAT is symmetric
        # dials from a known port, waiting: (host, port it shows, remote host, remote port) -> its end, once
        # the remote's dial towards it met it (a simultaneous open)
        self._attempts: dict[tuple[str, int, str, int], list[MemoryStream]] = {}
        self._pipes: list[_Pipe] = []
        self._changed = trio.Event()
        self._next_port = 40000

    # ---- conditions ----

    def set_access(self, host: str, *, up: float | None = None, down: float | None = None) -> None:
        """Give ``host`` an access link (bytes per second each way; None: unlimited) that all its
        connections share, as a home connection's router does: bytes to and from every peer queue in
        one line each way, on top of each path's own ``LinkProfile``."""
        self._access[host] = (up, down)
        self._up_free.setdefault(host, 0.0)
        self._down_free.setdefault(host, 0.0)

    def through_uplink(self, host: str, ready: float, nbytes: int) -> float:
        """When ``nbytes`` ready to leave ``host`` at ``ready`` are through its uplink (and book it)."""
        up = self._access.get(host, (None, None))[0]
        if not up:
            return ready
        done = max(ready, self._up_free[host]) + nbytes / up
        self._up_free[host] = done
        return done

    def through_downlink(self, host: str, arriving: float, nbytes: int) -> float:
        """When ``nbytes`` arriving at ``host``'s downlink at ``arriving`` are through it (and book it)."""
        down = self._access.get(host, (None, None))[1]
        if not down:
            return arriving
        done = max(arriving, self._down_free[host]) + nbytes / down
        self._down_free[host] = done
        return done

    def profile(self, src: str, dst: str) -> LinkProfile:
        return self.links.get((src, dst), self.default)

    def set_link(self, a: str, b: str, profile: LinkProfile, *, both_ways: bool = True) -> None:
        self.links[(a, b)] = profile
        if both_ways:
            self.links[(b, a)] = profile

    def blocked(self, a: str, b: str) -> bool:
        return frozenset((a, b)) in self._blocked

    def partition(self, side_a: set[str] | list[str], side_b: set[str] | list[str]) -> None:
        """Cut every path between ``side_a`` and ``side_b`` until :meth:`heal`."""
        for a in side_a:
            for b in side_b:
                self._blocked.add(frozenset((a, b)))
        self._notify()

    def nat(self, host: str, *, symmetric: bool = False) -> None:
        """Put ``host`` behind a NAT: its own dials go out and their connections work both ways, while
        dials to it hang (the router drops unsolicited SYNs). An endpoint-independent NAT keeps a dial's
        source port (as Linux MASQUERADE does when it can): two hosts dialing each other from their
        listening ports at the same time meet (a simultaneous open, see ``punch``); a symmetric NAT maps
        every connection to a fresh port, so such dials never meet."""
        self._natted[host] = symmetric
        self._notify()

    def heal(self) -> None:
        self._blocked.clear()
        self._notify()

    def kill(self, host: str) -> None:
        """Reset every connection of ``host`` and stop its listeners, as if its process died."""
        for pipe in self._pipes:
            if host in (pipe.src, pipe.dst):
                pipe.broken = True
                pipe.wake()
        for key in [k for k in self._listeners if k[0] == host]:
            del self._listeners[key]
            self._serve_nurseries.pop(key).cancel_scope.cancel()

    def _notify(self) -> None:
        for pipe in self._pipes:
            pipe.wake()
        self._changed.set()
        self._changed = trio.Event()

    # ---- transport ----

    def transport(self, host: str) -> MemoryTransport:
        return MemoryTransport(self, host)

    def _source_port(self, src: str, local_port: int | None) -> int | None:
        """The port a dial from ``local_port`` shows the world (None: one nobody can predict)."""
        if local_port is None or self._natted.get(src, False):
            return None
        return local_port

    async def dial(self, src: str, host: str, port: int, local_port: int | None = None) -> MemoryStream:
        """A dial from host ``src`` (what its transport's ``connect`` does)."""
        shown = self._source_port(src, local_port)
        if shown is not None:
            return await self._connect_from(src, shown, host, port)
        while self.blocked(src, host) or host in self._natted:
            await self._changed.wait()  # a dial into a partition hangs (SYN dropped)
        return await self._to_listener(src, host, port, self._next_port + 1)

    async def _connect_from(self, src: str, shown: int, host: str, port: int) -> MemoryStream:
        """A dial from a known port: it meets a dial from (host, port) towards it, else goes to host's
        listener unless host is behind a NAT (then it hangs until such a dial comes)."""
        key, mirror = (src, shown, host, port), (host, port, src, shown)
        if key in self._attempts:
            raise OSError(f"address {src}:{shown} to {host}:{port} already in use")
        got: list[MemoryStream] = []
        self._attempts[key] = got
        try:
            while not got:
                if not self.blocked(src, host) and (waiting := self._attempts.get(mirror)) is not None:
                    await trio.sleep(self.profile(src, host).latency)
                    if self._attempts.get(mirror) is waiting and not waiting:
                        ours, theirs = self._pair(src, host)
                        waiting.append(theirs)
                        self._notify()
                        return ours
                    continue
                if not self.blocked(src, host) and host not in self._natted:
                    break
                await self._changed.wait()
            if got:
                return got[0]
        finally:
            if self._attempts.get(key) is got:
                del self._attempts[key]
        return await self._to_listener(src, host, port, shown)

    def _pair(self, src: str, dst: str) -> tuple[MemoryStream, MemoryStream]:
        a_to_b, b_to_a = _Pipe(self, src, dst), _Pipe(self, dst, src)
        self._pipes = [p for p in self._pipes if not (p.broken or (p.eof and p.reader_gone))]
        self._pipes += [a_to_b, b_to_a]
        return MemoryStream(a_to_b, b_to_a), MemoryStream(b_to_a, a_to_b)

    async def _to_listener(self, src: str, host: str, port: int, src_port: int) -> MemoryStream:
        await trio.sleep(self.profile(src, host).latency)  # the SYN's trip
        # (what listens when the SYN arrives: a host killed during its trip refuses it)
        handler = self._listeners.get((host, port))
        if handler is None:
            raise OSError(f"connection refused: nothing listens on {host}:{port}")
        client, server = self._pair(src, host)
        nursery = self._serve_nurseries[(host, port)]
        self._next_port = max(self._next_port, src_port)
        nursery.start_soon(handler, server, src, src_port)
        return client

    async def serve_as(
        self,
        host: str,
        port: int,
        handler: StreamHandler,
        task_status: trio.TaskStatus[list[tuple[str, int]]],
    ) -> None:
        """Listen as host ``host`` (what its transport's ``serve`` does)."""
        if port == 0:
            self._next_port += 1
            port = self._next_port
        key = (host, port)
        if key in self._listeners:
            raise OSError(f"address {host}:{port} already in use")
        async with trio.open_nursery() as nursery:
            self._listeners[key] = handler
            self._serve_nurseries[key] = nursery
            task_status.started([key])
            try:
                await trio.sleep_forever()
            finally:
                self._listeners.pop(key, None)
                self._serve_nurseries.pop(key, None)


class MemoryTransport:
    """The Transport of one named host on a :class:`MemoryNetwork`."""

    def __init__(self, net: MemoryNetwork, host: str) -> None:
        self.net = net
        self.host = host

    async def connect(self, host: str, port: int, *, local_port: int | None = None) -> trio.abc.Stream:
        return await self.net.dial(self.host, host, port, local_port)

    async def serve(
        self,
        host: str,
        port: int,
        handler: StreamHandler,
        *,
        task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        await self.net.serve_as(self.host, port, handler, task_status)
