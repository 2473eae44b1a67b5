"""Bare Hosts for the transport tests, over a MemoryNetwork or loopback TCP: a :class:`Cluster` starts
them in a test's nursery, each serving the :class:`Service` below, whose handlers report what happened
to them (entered, cancelled, at what virtual time) so tests can assert on the serving side as well.
The test vocabulary (message classes, methods, ``payload()``, ``digest()``) is here too; tests get all
of it through the fixtures of ``tests/integration/conftest.py``.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from p2ptrain.errors import CallRefused
from p2ptrain.identity import Identity
from p2ptrain.net import (
    CallContext,
    Connection,
    Host,
    HostConfig,
    MemoryNetwork,
    Method,
    PeerAddress,
    Reply,
    RpcRegistry,
    RpcStream,
    TcpTransport,
)
from p2ptrain.wire import Message, bounded

RUN_ID = "it-run"
CHUNK = 1 << 20


@dataclass(frozen=True)
class Text(Message):
    text: str = bounded(max_len=4096)


@dataclass(frozen=True)
class Size(Message):
    n: int = bounded(ge=0, le=2**40)
    seed: int = 0


@dataclass(frozen=True)
class Digest(Message):
    n: int = bounded(ge=0, le=2**40)
    hash: bytes = bounded(max_len=32)


ECHO = Method("echo", Text, Text)
SLEEP = Method("sleep", Text, Text)  # parks until cancelled
FAIL = Method("fail", Text, Text)  # "value" -> ValueError, "refuse" -> CallRefused("not_now")
SINK = Method("sink", Text, Digest, streaming=True)  # reads to EOF; returns size and hash
SOURCE = Method("source", Size, Digest, streaming=True)  # sends payload(n, seed); returns its hash
HOLD = Method("hold", Text, Digest, streaming=True)  # reads one chunk, waits for `release`, reads the rest
FIRST = Method("first", Text, Digest, streaming=True)  # reads one chunk and answers at once
BIG = Method("big", Size, Text)  # answers Text("x" * seed) with a body of payload(n)


def payload(n: int, seed: int = 0) -> bytes:
    """Deterministic incompressible test bytes."""
    return random.Random(seed).randbytes(n)


def digest(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


class Service:
    """The test methods of one host, with probes: what each handler did, and when (virtual time)."""

    def __init__(self) -> None:
        self.entered: Counter[str] = Counter()
        self.cancelled: Counter[str] = Counter()
        self.cancelled_at: list[float] = []
        self.received: Counter[str] = Counter()  # stream bytes read by handlers, per method
        self.release = trio.Event()  # lets HOLD handlers read on
        self._changed = trio.Event()

    def registry(self) -> RpcRegistry:
        reg = RpcRegistry()
        reg.add_unary(ECHO, self.echo)
        reg.add_unary(SLEEP, self.sleep)
        reg.add_unary(FAIL, self.fail)
        reg.add_stream(SINK, self.sink)
        reg.add_stream(SOURCE, self.source)
        reg.add_stream(HOLD, self.hold)
        reg.add_stream(FIRST, self.first)
        reg.add_unary(BIG, self.big)
        return reg

    async def until(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds; re-checked after every probe change."""
        while not predicate():
            await self._changed.wait()

    def _note(self, counter: Counter[str], method: str, n: int = 1) -> None:
        counter[method] += n
        self._changed.set()
        self._changed = trio.Event()

    def _on_cancel(self, method: str) -> None:
        self.cancelled_at.append(trio.current_time())
        self._note(self.cancelled, method)

    async def echo(self, ctx: CallContext, req: Text) -> Text:
        self._note(self.entered, "echo")
        return Text(req.text)

    async def sleep(self, ctx: CallContext, req: Text) -> Text:
        self._note(self.entered, "sleep")
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            self._on_cancel("sleep")
            raise

    async def big(self, ctx: CallContext, req: Size) -> Reply[Text]:
        self._note(self.entered, "big")
        return Reply(Text("x" * req.seed), body=payload(req.n))

    async def fail(self, ctx: CallContext, req: Text) -> Text:
        self._note(self.entered, "fail")
        if req.text == "refuse":
            raise CallRefused("not_now", "come back later")
        raise ValueError(f"handler bug: {req.text}")

    async def _drain(self, method: str, stream: RpcStream, h: Any) -> int:
        n = 0
        async for chunk in stream:
            h.update(chunk)
            n += len(chunk)
            self._note(self.received, method, len(chunk))
        return n

    async def sink(self, ctx: CallContext, req: Text, stream: RpcStream) -> Digest:
        self._note(self.entered, "sink")
        h = hashlib.blake2b(digest_size=32)
        try:
            n = await self._drain("sink", stream, h)
        except trio.Cancelled:
            self._on_cancel("sink")
            raise
        return Digest(n, h.digest())

    async def source(self, ctx: CallContext, req: Size, stream: RpcStream) -> Digest:
        self._note(self.entered, "source")
        data = payload(req.n, req.seed)
        try:
            await stream.send(data)
            await stream.send_eof()
        except trio.Cancelled:
            self._on_cancel("source")
            raise
        return Digest(len(data), digest(data))

    async def hold(self, ctx: CallContext, req: Text, stream: RpcStream) -> Digest:
        h = hashlib.blake2b(digest_size=32)
        try:
            first = await stream.receive_some()
            h.update(first)
            self._note(self.received, "hold", len(first))
            self._note(self.entered, "hold")
            await self.release.wait()
            n = len(first) + await self._drain("hold", stream, h)
        except trio.Cancelled:
            self._on_cancel("hold")
            raise
        return Digest(n, h.digest())

    async def first(self, ctx: CallContext, req: Text, stream: RpcStream) -> Digest:
        self._note(self.entered, "first")
        chunk = await stream.receive_some()
        return Digest(len(chunk), digest(chunk))


@dataclass
class Peer:
    """A running Host, its Service, and a handle to stop it (as a process shutting down would)."""

    name: str
    host: Host
    service: Service
    _scope: trio.CancelScope
    _stopped: trio.Event = field(default_factory=trio.Event)
    _conns_changed: trio.Event = field(default_factory=trio.Event)
    events: list[tuple[Connection, bool]] = field(default_factory=list)

    def _observe(self, conn: Connection, opened: bool) -> None:
        self.events.append((conn, opened))
        self._conns_changed.set()
        self._conns_changed = trio.Event()

    @property
    def address(self) -> PeerAddress:
        return self.host.listen_addresses[0]

    @property
    def peer_id(self) -> Any:
        return self.host.peer_id

    def conn_to(self, other: Peer) -> Connection:
        conn = self.host.connection(other.peer_id)
        assert conn is not None, f"{self.name} has no connection to {other.name}"
        return conn

    async def wait_conn_to(self, other: Peer) -> Connection:
        """The live connection to ``other`` once this side has it (the accepting side finishes the
        handshake one trip after the dialer)."""
        while (conn := self.host.connection(other.peer_id)) is None:
            await self._conns_changed.wait()
        return conn

    async def stop(self) -> None:
        """Cancel the host (it closes its connections with GoAway first) and wait until it is gone."""
        self._scope.cancel()
        await self._stopped.wait()


class Cluster:
    """Starts Hosts in a test's nursery over one kind of transport."""

    def __init__(self, nursery: trio.Nursery, kind: str, net: MemoryNetwork | None = None) -> None:
        self.nursery = nursery
        self.kind = kind
        self.net = net
        self.peers: list[Peer] = []

    async def start(
        self,
        name: str | None = None,
        *,
        run_id: str = RUN_ID,
        config: HostConfig | None = None,
        identity: Identity | None = None,
    ) -> Peer:
        name = name or f"h{len(self.peers)}"
        service = Service()
        if self.kind == "memory":
            assert self.net is not None
            transport: Any = self.net.transport(name)
            listen = [(name, 0)]
        else:
            transport, listen = TcpTransport(), [("127.0.0.1", 0)]
        host = Host(
            identity or Identity.generate(),
            run_id,
            transport=transport,
            registry=service.registry(),
            config=config,
        )
        scope = trio.CancelScope()
        peer = Peer(name, host, service, scope)
        host.on_connection(peer._observe)

        async def run_host(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            try:
                with scope:
                    await host.run(listen, task_status=task_status)
            finally:
                peer._stopped.set()

        await self.nursery.start(run_host)
        self.peers.append(peer)
        return peer

    async def start_many(self, n: int, **kwargs: Any) -> list[Peer]:
        return [await self.start(**kwargs) for _ in range(n)]

    async def dial_raw(self, target: Peer, src: str = "raw") -> trio.abc.Stream:
        """A bare byte stream to ``target``'s listener (no handshake): for hostile-client tests."""
        addr = target.address
        if self.kind == "memory":
            assert self.net is not None
            return await self.net.transport(src).connect(addr.host, addr.port)
        return await trio.open_tcp_stream(addr.host, addr.port)
