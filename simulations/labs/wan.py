"""A userspace WAN emulator for local multi-process swarms: one trio switch in front of every peer.

No root needed (the network-namespace lab in ``netns.py`` is the root-only alternative). Each simulated
peer i gets its own loopback "public address" ``127.0.0.(10+i)``; the switch listens there on port S_i
and forwards to the peer's real listener. Peer i's process is started with::

    --announce 127.0.0.(10+i):S_i --source-address 127.0.0.(10+i)     (switch.announce(i), .source_address(i))

so every address it hands out points at the switch, and every connection it dials leaves from its own
address, which tells the switch who is dialing (Linux routes all of 127.0.0.0/8 to ``lo``).

Theory of operation. Peer i has an access link (:class:`LinkProfile`): upload and download rates, a one-way
latency, optionally jitter and random connection cuts. A byte moving from j to i

- pays tokens in j's upload bucket and then in i's download bucket (one bucket per peer and direction,
  shared by all of that peer's connections, so a peer's total upload is capped however many connections
  it has). A reservation always succeeds and says when its bytes are paid for; reservations are served
  in order, which shares a link fairly. A connection that stays busy (bytes already waiting in its
  socket) goes on from where its last chunk was paid, not from when its task ran again, so the late
  wake-ups of a loaded machine (tens of ms) cost no throughput;
- then waits in the connection's delay line until ``latency_j + latency_i`` (+ jitter) has passed, and is
  written to i. Delivery stays in order (a TCP stream never reorders).

Each direction of a connection is a reader task (read a chunk of a few ms of the link's rate, pay, queue)
and a writer task (wait until due, write). The delay line holds at most about twice the bytes in flight on
the path, so memory stays small, and when the receiver stops reading, the reader stops too and the
kernel's buffers push back on the sender. TCP_NODELAY is on both sides (trio sets it).

The switch dials peer i one round trip after the dialer connected, from the dialer's own address: the
peer sees the real remote address (so the DHT's "claimed address is where the call came from" check and
the per-IP connection caps work as on a real network), and the dialer's first bytes arrive 1.5 round
trips after its connect, as over TCP. Connections from an address that is no peer's (an observer on
127.0.0.1) get the ``default`` profile (unshaped by default), with buckets of their own per address.

Controls: :meth:`WanSwitch.cut` resets every connection of a peer (both ends get a TCP RST),
:meth:`~WanSwitch.partition` blackholes a peer's traffic for a while (nothing is lost: it flows again
afterwards; TCP's retransmission back-off is not modelled), :meth:`~WanSwitch.set_profile` changes a
link live, :meth:`~WanSwitch.stats` counts bytes per peer.

Limits: one trio thread forwards everything (measured up to ~1.3 Gbit/s in total, ~12% of a core at
50 Mbit/s); Linux only (other systems route only 127.0.0.1 to loopback); no packet loss, only cuts;
latency is late by the switch's scheduling delay (~1 ms on an idle machine, 5-10 ms at a load of 8 on 2
cores); a sender's kernel buffer (Linux auto-tunes it up to 4 MB over loopback) fills before the shaping,
so a sender's ``send_all`` may return earlier than over a real path of that rate; the receiver's timing
is right.

Usage from trio::

    switch = WanSwitch([LinkProfile(50, 50, 40), LinkProfile(10, 100, 80)])
    await nursery.start(switch.run)
    switch.set_upstream(0, ("127.0.0.1", real_port_0))          # once the peer listens
    stream = await trio.open_tcp_stream(*switch.endpoint(0), local_address=switch.source_address(1))

From a synchronous program (a runner that starts peers as subprocesses)::

    with WanSwitch(profiles).in_thread() as switch:               # trio in a background thread
        argv = [..., "--announce", switch.announce(i), "--source-address", switch.source_address(i)]
        switch.set_upstream(i, ("127.0.0.1", port_i)); switch.partition(1, 5.0); switch.stats()

How close a link comes to its setting on this machine: ``python -m simulations.benchmarks.wan_emulator``.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import fcntl
import logging
import math
import random
import socket
import struct
import termios
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import trio

log = logging.getLogger(__name__)
T = TypeVar("T")

FIRST_HOST = 10  # peer i's address is 127.0.0.(FIRST_HOST + i)
MAX_PEERS = 240
BURST_S = 0.010  # a bucket holds 10 ms of its rate ...
MIN_BURST = 32 * 1024  # ... and at least this; a chunk is at most half a bucket, so tandem buckets of
MAX_CHUNK = 64 * 1024  # equal rate never stall each other (measured: one bucket of one chunk loses ~20%)
MIN_QUEUE = 256 * 1024  # delay-line bound: twice the bytes in flight on the path, within these bounds
MAX_QUEUE = 32 * 1024 * 1024
MAX_CATCHUP = 0.1  # seconds a busy link may lag behind real time and catch up (late wake-ups)
RECEIVE_BUFFER = 128 * 1024  # SO_RCVBUF of the switch's sockets (the kernel doubles it)
UPSTREAM_WAIT = 10.0  # seconds a connection waits for set_upstream() before it is reset


@dataclass(frozen=True)
class LinkProfile:
    """A peer's access link: rates in Mbit/s (``math.inf``: unshaped), one-way latency and jitter in ms.

    ``cuts_per_min``: each connection through this link is reset at random, on average this often (a
    connection between i and j is cut at the rate of both links together). Not to be confused with
    :class:`p2ptrain.net.LinkProfile`, which describes one path of the in-memory network.
    """

    up_mbit: float = math.inf
    down_mbit: float = math.inf
    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    cuts_per_min: float = 0.0

    def __post_init__(self) -> None:
        if not (self.up_mbit > 0 and self.down_mbit > 0):
            raise ValueError("rates must be positive (math.inf for unshaped)")
        for name in ("latency_ms", "jitter_ms", "cuts_per_min"):
            value = getattr(self, name)
            if not (0 <= value < math.inf):
                raise ValueError(f"{name} must be finite and >= 0, not {value}")


class TokenBucket:
    """Bytes per second with a burst of BURST_S of the rate (at least MIN_BURST); pure, time passed in.

    Debt model: :meth:`reserve` always takes the bytes and returns the time at which they are paid for.
    Reservations are served in the order they are made, which shares the rate fairly between connections.
    """

    def __init__(self, mbit: float, now: float) -> None:
        self.rate = self.burst = self.tokens = math.inf
        self.last = now
        self.set_rate(mbit, now)

    def set_rate(self, mbit: float, now: float) -> None:
        self._refill(now)
        self.rate = mbit * 1e6 / 8
        self.burst = max(MIN_BURST, self.rate * BURST_S)
        self.tokens = min(self.tokens, self.burst)

    def reserve(self, n: int, now: float) -> float:
        if self.rate == math.inf:
            return now
        self._refill(now)
        self.tokens -= n  # as of self.last, which is later than ``now`` for a reader catching up
        return now if self.tokens >= 0 else max(now, self.last) - self.tokens / self.rate

    def _refill(self, now: float) -> None:
        if now > self.last:
            if self.rate < math.inf:
                self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
            self.last = now


class _Peer:
    """One side of the switch: a link profile, its two buckets, its connections and counters."""

    def __init__(self, name: str, address: str, profile: LinkProfile, now: float) -> None:
        self.name = name
        self.address = address
        self.profile = profile
        self.up = TokenBucket(profile.up_mbit, now)
        self.down = TokenBucket(profile.down_mbit, now)
        self.blocked_until = -math.inf
        self.conns: set[_Conn] = set()
        self.upstream: tuple[str, int] | None = None
        self.upstream_known = trio.Event()
        self.sent = self.received = self.cuts = self.refused = 0

    def set_profile(self, profile: LinkProfile, now: float) -> None:
        self.profile = profile
        self.up.set_rate(profile.up_mbit, now)
        self.down.set_rate(profile.down_mbit, now)

    def stats(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "sent": self.sent,
            "received": self.received,
            "connections": len(self.conns),
            "cuts": self.cuts,
            "refused": self.refused,
            "partitioned": self.blocked_until > trio.current_time(),
        }


class _Pipe:
    """One direction of a connection: paid-for chunks waiting in the delay line until they are due."""

    def __init__(self, src: _Peer, dst: _Peer) -> None:
        self.src, self.dst = src, dst
        self.queue: deque[tuple[float, bytes | None]] = deque()  # (due, data); None is the EOF
        self.queued = 0  # bytes in the queue or being written
        self.last_due = -math.inf
        self._changed = trio.Event()

    def wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def changed(self) -> None:
        await self._changed.wait()

    def push(self, due: float, data: bytes | None) -> None:
        self.last_due = due = max(due, self.last_due)  # jitter must not reorder a stream
        self.queue.append((due, data))
        self.queued += len(data) if data else 0
        self.wake()

    def pop_due(self, now: float) -> bytes:
        """The data of every chunk due by ``now``, up to the first EOF (which stays queued)."""
        parts = []
        while self.queue and self.queue[0][0] <= now and self.queue[0][1] is not None:
            parts.append(self.queue.popleft()[1])
        return b"".join(p for p in parts if p)


class _Conn:
    """A dialer's connection through the switch: the accepted stream, the one to the peer, two pipes."""

    def __init__(self, src: _Peer, dst: _Peer, outer: trio.SocketStream) -> None:
        self.src, self.dst = src, dst
        self.outer = outer
        self.inner: trio.SocketStream | None = None
        self.scope = trio.CancelScope()
        self.clean = False  # both directions ended with an EOF: close gracefully, else reset

    def abort(self) -> None:
        self.scope.cancel()


class WanSwitch:
    """The switch: one listener per peer, shaping every connection between peers (see module docstring)."""

    def __init__(
        self,
        profiles: list[LinkProfile],
        upstream: list[tuple[str, int] | None] | None = None,
        *,
        default: LinkProfile | None = None,
        seed: int | None = None,
        upstream_wait: float = UPSTREAM_WAIT,
    ) -> None:
        """``upstream``: each peer's real (host, port), or None until :meth:`set_upstream`.

        ``default``: the link of connections from addresses that are no peer's (unshaped if None);
        ``seed``: for jitter and random cuts.
        """
        if not 1 <= len(profiles) <= MAX_PEERS:
            raise ValueError(f"1 to {MAX_PEERS} peers")
        if upstream is not None and len(upstream) != len(profiles):
            raise ValueError("one upstream address (or None) per peer")
        self.n = len(profiles)
        self.default = default or LinkProfile()
        self.upstream_wait = upstream_wait
        self.rng = random.Random(seed)
        self._profiles = list(profiles)
        self._initial_upstream = list(upstream or [None] * self.n)
        self._peers: list[_Peer] = []
        self._by_address: dict[str, _Peer] = {}
        self._unknown: dict[str, _Peer] = {}
        self._ports: list[int] = []
        self._partitions_changed = trio.Event()
        self._profiles_changed = trio.Event()

    # ---- addresses ----

    def source_address(self, i: int) -> str:
        """Peer i's own address: its ``--source-address``, and the host of its announced address."""
        if not 0 <= i < self.n:
            raise IndexError(i)
        return f"127.0.0.{FIRST_HOST + i}"

    def port(self, i: int) -> int:
        """S_i, the switch's port for peer i (known once :meth:`run` has started)."""
        if not self._ports:
            raise RuntimeError("the switch is not running yet")
        return self._ports[i]

    def endpoint(self, i: int) -> tuple[str, int]:
        """Where others dial peer i: (its address, S_i)."""
        return self.source_address(i), self.port(i)

    def announce(self, i: int) -> str:
        """Peer i's ``--announce HOST:PORT``."""
        return f"{self.source_address(i)}:{self.port(i)}"

    # ---- running ----

    async def run(self, *, task_status: trio.TaskStatus[WanSwitch] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen for every peer and forward until cancelled; reports itself once all ports listen."""
        if self._peers:
            raise RuntimeError("a switch runs once")
        now = trio.current_time()
        for i, profile in enumerate(self._profiles):
            peer = _Peer(str(i), self.source_address(i), profile, now)
            self._peers.append(peer)
            self._by_address[peer.address] = peer
            if (addr := self._initial_upstream[i]) is not None:
                self.set_upstream(i, addr)
        listeners: list[trio.SocketListener] = []
        try:
            for peer in self._peers:
                listeners += await trio.open_tcp_listeners(0, host=peer.address)
        except BaseException:
            for lst in listeners:
                await lst.aclose()
            raise
        self._ports = [lst.socket.getsockname()[1] for lst in listeners]
        try:
            async with trio.open_nursery() as nursery:
                for peer, lst in zip(self._peers, listeners, strict=True):
                    handler = partial(self._handle, peer)
                    nursery.start_soon(partial(trio.serve_listeners, handler, [lst], handler_nursery=nursery))
                log.info("WAN switch for %d peers on ports %s", self.n, self._ports)
                task_status.started(self)
        finally:
            for lst in listeners:  # closed already when their serve_listeners ran; not if it never did
                await _close(lst, rst=False)

    @contextlib.contextmanager
    def in_thread(self, *, timeout: float = 10.0) -> Iterator[SwitchThread]:
        """Run the switch in a background thread (its own trio loop); yields thread-safe controls."""
        handle = SwitchThread(self)
        handle.start(timeout)
        try:
            yield handle
        finally:
            handle.close(timeout)

    # ---- controls (from the switch's trio thread) ----

    def set_upstream(self, i: int, address: tuple[str, int]) -> None:
        """Peer i's real listening (host, port); connections to S_i wait for it (``upstream_wait``)."""
        peer = self._peer(i)
        peer.upstream = (address[0], int(address[1]))
        peer.upstream_known.set()

    def set_profile(self, i: int, profile: LinkProfile | None = None, **changes: float) -> None:
        """Change peer i's link now: a whole new profile, or some fields (``set_profile(2, up_mbit=5)``)."""
        peer = self._peer(i)
        peer.set_profile(dataclasses.replace(profile or peer.profile, **changes), trio.current_time())
        self._profiles_changed.set()
        self._profiles_changed = trio.Event()

    def profile(self, i: int) -> LinkProfile:
        return self._peer(i).profile

    def cut(self, i: int) -> int:
        """Reset every connection of peer i now (both ends get an RST); returns how many."""
        peer = self._peer(i)
        conns = list(peer.conns)
        for conn in conns:
            self._cut(conn, peer)
        return len(conns)

    def partition(self, i: int, seconds: float) -> None:
        """Blackhole peer i for ``seconds`` from now (0 heals): its bytes wait, new connections hang."""
        peer = self._peer(i)
        peer.blocked_until = trio.current_time() + seconds
        self._partitions_changed.set()
        self._partitions_changed = trio.Event()
        log.info("peer %s partitioned for %.3g s", peer.name, seconds)

    def stats(self) -> dict[str, Any]:
        """Per peer: bytes sent and received through the switch, open connections, cuts, partitioned."""
        return {
            "peers": [p.stats() for p in self._peers],
            "unknown": {addr: p.stats() for addr, p in self._unknown.items()},
        }

    def _peer(self, i: int) -> _Peer:
        if not self._peers:
            raise RuntimeError("the switch is not running yet")
        return self._peers[i]

    def _cut(self, conn: _Conn, by: _Peer) -> None:
        by.cuts += 1
        conn.abort()

    # ---- connections ----

    def _source(self, stream: trio.SocketStream) -> _Peer:
        try:
            address = stream.socket.getpeername()[0]
        except OSError:
            address = "?"
        if peer := self._by_address.get(address):
            return peer
        if address not in self._unknown:
            self._unknown[address] = _Peer(f"unknown {address}", address, self.default, trio.current_time())
        return self._unknown[address]

    async def _handle(self, dst: _Peer, outer: trio.SocketStream) -> None:
        src = self._source(outer)
        _small_receive_buffer(outer)
        conn = _Conn(src, dst, outer)
        src.conns.add(conn)
        dst.conns.add(conn)
        try:
            with conn.scope:
                conn.inner = await self._dial(conn)
                if conn.inner is None:
                    dst.refused += 1
                    return
                _small_receive_buffer(conn.inner)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._random_cuts, conn)
                    async with trio.open_nursery() as flows:
                        flows.start_soon(self._forward, conn, _Pipe(src, dst), outer, conn.inner)
                        flows.start_soon(self._forward, conn, _Pipe(dst, src), conn.inner, outer)
                    conn.clean = True
                    nursery.cancel_scope.cancel()
        finally:
            src.conns.discard(conn)
            dst.conns.discard(conn)
            await _close(outer, rst=not conn.clean)
            if conn.inner is not None:
                await _close(conn.inner, rst=not conn.clean)

    async def _dial(self, conn: _Conn) -> trio.SocketStream | None:
        """Connect to the destination's real address from the dialer's, one round trip late (as TCP's
        handshake would); None if its address is not known in time or it refuses."""
        dst = conn.dst
        with trio.move_on_after(self.upstream_wait):
            await dst.upstream_known.wait()
        if dst.upstream is None:
            log.warning("no upstream address for peer %s: resetting a connection to it", dst.name)
            return None
        await trio.sleep(2 * self._one_way(conn.src, dst, jitter=False))
        await self._unblocked(conn.src, dst)
        try:
            return await trio.open_tcp_stream(*dst.upstream, local_address=conn.src.address)
        except OSError as e:
            log.info("peer %s at %s:%d refused: %s", dst.name, *dst.upstream, e)
            return None

    async def _forward(
        self, conn: _Conn, pipe: _Pipe, source: trio.SocketStream, sink: trio.SocketStream
    ) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read, pipe, source)
                nursery.start_soon(self._write, pipe, sink)
        except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as group:
            log.debug("%s -> %s broken: %r", pipe.src.name, pipe.dst.name, group.exceptions[0])
            conn.abort()

    async def _read(self, pipe: _Pipe, source: trio.SocketStream) -> None:
        src, dst = pipe.src, pipe.dst
        paid: float | None = None  # when the last chunk was paid for, while the sender kept us busy
        while True:
            if pipe.queued >= self._queue_limit(src, dst):
                paid = None  # the receiver holds us back: a real pause, not our lateness
                while pipe.queued >= self._queue_limit(src, dst):
                    await pipe.changed()
            data = await source.receive_some(int(min(MAX_CHUNK, src.up.burst / 2, dst.down.burst / 2)))
            if not data:
                pipe.push(trio.current_time() + self._one_way(src, dst), None)
                return
            if await self._unblocked(src, dst):
                paid = None
            # A busy link goes on from where the last chunk was paid, not from when this task got to
            # run again: on a loaded machine wake-ups are late by tens of ms, which would be lost.
            now = trio.current_time()
            start = now if paid is None else max(paid, now - MAX_CATCHUP)
            paid = src.up.reserve(len(data), start)
            await trio.sleep_until(paid)
            paid = dst.down.reserve(len(data), paid)
            await trio.sleep_until(paid)
            src.sent += len(data)
            pipe.push(paid + self._one_way(src, dst), data)
            if not _pending(source):
                paid = None

    async def _write(self, pipe: _Pipe, sink: trio.SocketStream) -> None:
        while True:
            while not pipe.queue:
                await pipe.changed()
            await trio.sleep_until(pipe.queue[0][0])
            await self._unblocked(pipe.src, pipe.dst)
            data = pipe.pop_due(trio.current_time())
            if not data:  # the EOF is next
                await sink.send_eof()
                return
            await sink.send_all(data)
            pipe.queued -= len(data)
            pipe.dst.received += len(data)
            pipe.wake()

    async def _random_cuts(self, conn: _Conn) -> None:
        while True:
            per_s = (conn.src.profile.cuts_per_min + conn.dst.profile.cuts_per_min) / 60
            if per_s <= 0:  # no cuts: sleep until a profile changes (a second's poll per connection
                await self._profiles_changed.wait()  # cost the switch a core under a connection flood)
                continue
            wait = self.rng.expovariate(per_s)
            if wait < 1.0:  # memoryless: re-drawing every second follows live profile changes exactly
                await trio.sleep(wait)
                log.info("random cut of a connection %s -> %s", conn.src.name, conn.dst.name)
                self._cut(conn, conn.src if conn.src.profile.cuts_per_min else conn.dst)
                return
            await trio.sleep(1.0)

    async def _unblocked(self, *peers: _Peer) -> bool:
        """Wait while any of ``peers`` is partitioned (partitions may be extended or healed meanwhile);
        returns whether it waited."""
        waited = False
        while (until := max(p.blocked_until for p in peers)) > trio.current_time():
            waited = True
            with trio.move_on_at(until):
                await self._partitions_changed.wait()
        return waited

    def _one_way(self, src: _Peer, dst: _Peer, *, jitter: bool = True) -> float:
        base = (src.profile.latency_ms + dst.profile.latency_ms) / 1e3
        spread = (src.profile.jitter_ms + dst.profile.jitter_ms) / 1e3
        if jitter and spread:
            base += self.rng.uniform(-spread, spread)
        return max(0.0, base)

    def _queue_limit(self, src: _Peer, dst: _Peer) -> float:
        delay = self._one_way(src, dst, jitter=False) + (src.profile.jitter_ms + dst.profile.jitter_ms) / 1e3
        rate = min(src.up.rate, dst.down.rate)
        if delay == 0:
            return MIN_QUEUE
        return min(MAX_QUEUE, max(MIN_QUEUE, 2 * rate * delay))


def _small_receive_buffer(stream: trio.SocketStream) -> None:
    """Cap what waits in the kernel before the shaping: the bottleneck is here, not in a buffer before
    it (with Linux's auto-tuned MBs, a sender would think it had sent seconds before it had)."""
    with contextlib.suppress(OSError):
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)


def _pending(stream: trio.SocketStream) -> bool:
    """Whether bytes are waiting in the socket already (FIONREAD)."""
    count = array.array("i", [0])
    try:
        fcntl.ioctl(stream.socket.fileno(), termios.FIONREAD, count, True)
    except OSError:
        return False
    return count[0] > 0


async def _close(resource: trio.SocketStream | trio.SocketListener, *, rst: bool) -> None:
    """Close at once; ``rst``: abort with a TCP reset (SO_LINGER 0) rather than a FIN."""
    with trio.CancelScope(shield=True):
        if rst:
            with contextlib.suppress(OSError):
                resource.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        with contextlib.suppress(OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            await resource.aclose()


class SwitchThread:
    """A :class:`WanSwitch` running in a background thread; every method is safe to call from any thread.

    Made by :meth:`WanSwitch.in_thread`. Controls run in the switch's trio loop (so they act at once and
    see a consistent state); a failure inside the switch is raised again by :meth:`close`.
    """

    def __init__(self, switch: WanSwitch) -> None:
        self.switch = switch
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="wan-switch", daemon=True)

    def start(self, timeout: float = 10.0) -> SwitchThread:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the WAN switch did not start in time")
        if self._error is not None:
            raise RuntimeError(f"the WAN switch failed to start: {self._error!r}") from self._error
        return self

    def close(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive() and self._token is not None and self._stop is not None:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("the WAN switch did not stop in time")
        if self._error is not None:
            raise RuntimeError(f"the WAN switch failed: {self._error!r}") from self._error

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as e:  # handed to the caller by start() or close()
            self._error = e
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            await nursery.start(self.switch.run)
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._token is None or not self._thread.is_alive():
            raise RuntimeError("the WAN switch is not running")
        return trio.from_thread.run_sync(partial(fn, *args, **kwargs), trio_token=self._token)

    # Fixed once running: read directly.
    def source_address(self, i: int) -> str:
        return self.switch.source_address(i)

    def port(self, i: int) -> int:
        return self.switch.port(i)

    def endpoint(self, i: int) -> tuple[str, int]:
        return self.switch.endpoint(i)

    def announce(self, i: int) -> str:
        return self.switch.announce(i)

    # Run in the switch's loop.
    def set_upstream(self, i: int, address: tuple[str, int]) -> None:
        self._call(self.switch.set_upstream, i, address)

    def set_profile(self, i: int, profile: LinkProfile | None = None, **changes: float) -> None:
        self._call(self.switch.set_profile, i, profile, **changes)

    def profile(self, i: int) -> LinkProfile:
        return self._call(self.switch.profile, i)

    def cut(self, i: int) -> int:
        return self._call(self.switch.cut, i)

    def partition(self, i: int, seconds: float) -> None:
        self._call(self.switch.partition, i, seconds)

    def stats(self) -> dict[str, Any]:
        return self._call(self.switch.stats)
