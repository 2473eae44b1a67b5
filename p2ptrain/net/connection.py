"""One authenticated connection: multiplexed RPC calls, streams, keepalive and idle close.

Theory of operation: a connection's task reads: it decodes every record and routes it, never blocking
on an application: responses wake the waiting caller, ``Data`` goes into the stream's bounded buffer,
requests start a handler task in the connection's own nursery (bounded in number). Sends from any task
go through the channel's lock. Keepalive checks (ping a quiet peer, close a dead or idle connection)
run on a timer shared by the host's connections (:class:`Keepalives`), each connection checked every
half keepalive interval from when it opened, as a task of its own would, without one per connection.
Closing the connection (by either side, by keepalive timeout, or by a protocol violation) fails every
pending call with :class:`ConnectionClosed` and cancels every handler, so nothing waits forever and no
resource outlives the connection.

Deadlines: the caller's timeout travels with the request; the handler runs under it, and the caller
gives up (sending ``Cancel``) when it expires or when the caller itself is cancelled.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Generic

import trio

from ..errors import (
    CallRefused,
    ConnectionClosed,
    DeadlineExceeded,
    LocalProtocolError,
    P2PError,
    RemoteCallError,
    RemoteProtocolError,
)
from ..identity import PeerID
from ..wire.codec import MAX_HEADER_BYTES
from ..wire.schema import Message
from .channel import MAX_CHUNK, SecureChannel
from .frames import (
    Cancel,
    Credit,
    Data,
    Error,
    GoAway,
    Ping,
    Pong,
    Req,
    Request,
    Response,
    decode_args,
    decode_header,
    encode_args,
    encode_header,
)
from .rpc import CallContext, Method, Reply, Resp, RpcRegistry
from .streams import INITIAL_WINDOW, RpcStream, SendFn

log = logging.getLogger(__name__)

_MAX_ARGS = MAX_HEADER_BYTES - 512
"""The bound the receiver puts on ``Request.args`` and ``Response.result`` (see rpc.py): checked before
sending, because a peer that receives more treats it as a protocol violation and drops the connection."""
OTHER = "other"  # sent_by_method: frames of no known call


@dataclass(frozen=True)
class ConnectionConfig:
    """Per-connection limits and timers (seconds)."""

    default_timeout: float = 30.0
    keepalive_interval: float = 10.0
    keepalive_timeout: float = 30.0
    idle_timeout: float = 120.0
    max_concurrent_calls: int = 2048
    max_streams: int = 64
    stream_window: int = 8 * MAX_CHUNK

    def __post_init__(self) -> None:
        if self.stream_window < INITIAL_WINDOW:
            raise ValueError(f"stream_window must be at least {INITIAL_WINDOW} bytes")


@dataclass
class _OutCall:
    method: Method[Any, Any]
    done: trio.Event = field(default_factory=trio.Event)
    result: bytes | None = None
    body: memoryview | None = None
    error: BaseException | None = None
    stream: RpcStream | None = None


@dataclass
class _InCall:
    scope: trio.CancelScope
    stream: RpcStream | None = None
    method: str = OTHER  # a registered method's name (an unknown name is the remote's to choose)


class Keepalives:
    """The keepalive timer of a set of connections (a host's): one task that runs each connection's check
    when it is due. A check is synchronous (it never waits on the network: a ping or a goodbye it decides
    on is sent by a task of the connection's), so one slow connection delays no other's check."""

    def __init__(self) -> None:
        self._due: list[tuple[float, int, Connection]] = []  # (when, tie-break, connection), a heap
        self._order = itertools.count()
        self._changed: trio.Event | None = None  # the runner's, while it waits

    def __len__(self) -> int:
        return len(self._due)

    def schedule(self, conn: Connection, at: float) -> None:
        """Check ``conn`` at ``at`` (on trio's clock)."""
        heapq.heappush(self._due, (at, next(self._order), conn))
        if self._due[0][2] is conn and self._changed is not None:
            self._changed.set()  # (sooner than the runner waits for)

    async def run(self) -> None:
        """Run the checks as they fall due, until cancelled."""
        while True:
            now = trio.current_time()
            while self._due and self._due[0][0] <= now:
                _, _, conn = heapq.heappop(self._due)
                conn._keepalive_check()
            self._changed = changed = trio.Event()
            if self._due:
                with trio.move_on_at(self._due[0][0]):
                    await changed.wait()
            else:
                await changed.wait()


class Connection:
    """A live, authenticated connection to one peer. Created by :class:`~p2ptrain.net.host.Host`."""

    def __init__(
        self,
        channel: SecureChannel,
        peer: PeerID,
        *,
        outbound: bool,
        remote_host: str,
        remote_port: int,
        registry: RpcRegistry,
        config: ConnectionConfig,
        admit: Callable[[PeerID], bool] | None = None,
        keepalives: Keepalives | None = None,
    ) -> None:
        """``admit(peer)`` is asked before each incoming call is served (a per-peer rate limit);
        ``keepalives``: the running timer that checks this connection (None: the connection runs its
        own)."""
        self.channel = channel
        self._admit = admit
        self.peer = peer
        self.outbound = outbound
        self.remote_host = remote_host
        self.remote_port = remote_port
        self.config = config
        self.keep_open = False
        self.relayed = False  # it runs through a relay's circuit (see ``relay``): remote_* are the relay's
        self.relayed_from = ""  # inbound through a relay: where the relay said the dialer is ("": unknown)
        self._registry = registry
        self._ids = itertools.count(1 if outbound else 2, 2)
        self._out: dict[int, _OutCall] = {}
        self._in: dict[int, _InCall] = {}
        # Bytes of frames sent, by the method of the call they belong to (before encryption and
        # framing; calls of unknown methods, pings and the rest under OTHER): what a node sends for what.
        self.sent_by_method: Counter[str] = Counter()
        self._nursery: trio.Nursery | None = None
        self._closed = trio.Event()
        self.close_reason = ""
        # ``aclose`` began (it tells the remote first): no new call starts on it (``close_soon``)
        self.closing = False
        self.opened_at = trio.current_time()
        self._last_received = self.opened_at
        self._last_busy = self.opened_at
        self._pings = itertools.count()
        self._pong_waiters: dict[int, trio.Event] = {}
        self._keepalives = keepalives
        self._reading = trio.CancelScope()  # the reader's: cancelled when the connection closes

    # ---- status ----

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    @property
    def active_calls(self) -> int:
        return len(self._out) + len(self._in)

    @property
    def last_busy(self) -> float:
        """When a call last ran on this connection (or it opened): its idleness, on trio's clock."""
        return self._last_busy

    @property
    def buffered_bytes(self) -> int:
        """Bytes received on streams and not yet consumed by the application."""
        streams = [c.stream for c in self._out.values()] + [c.stream for c in self._in.values()]
        return sum(s.buffered for s in streams if s is not None)

    @property
    def bytes_sent(self) -> int:
        return self.channel.framed.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.channel.framed.bytes_received

    def __repr__(self) -> str:
        arrow = "->" if self.outbound else "<-"
        return f"Connection({arrow}{self.peer.short()} {self.remote_host}:{self.remote_port})"

    # ---- lifecycle ----

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the connection until it closes. Owned by the host's nursery."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self._keepalives is None:  # (a connection on its own: a timer of its own)
                    self._keepalives = Keepalives()
                    nursery.start_soon(self._keepalives.run)
                self._keepalives.schedule(self, trio.current_time() + self._keepalive_period)
                task_status.started()
                with self._reading:
                    await self._reader()
                nursery.cancel_scope.cancel()
        finally:
            self._close(self.close_reason or "connection task ended")
            self._fail_pending(
                ConnectionClosed(f"connection to {self.peer.short()} closed: {self.close_reason}")
            )
            with trio.CancelScope(shield=True):
                await self.channel.aclose()

    def close_soon(self, nursery: trio.Nursery, reason: str) -> None:
        """Close in ``nursery`` (``aclose``), and start no call on it from now: a node evicting an idle
        connection tells the remote first, and a call of its own begun on it meanwhile was lost."""
        self.closing = True
        nursery.start_soon(self.aclose, reason)

    async def aclose(self, reason: str = "closed locally") -> None:
        """Close gracefully: tell the remote why (best effort, 1 s), then close."""
        if self.closed:
            return
        self.closing = True
        # Best effort: a remote that is gone already needs no explanation.
        with trio.CancelScope(shield=True), trio.move_on_after(1.0), suppress(ConnectionClosed):
            await self._send(GoAway(reason=reason[:256]))
        self._close(reason)

    def _close(self, reason: str) -> None:
        if not self.closed:
            self.close_reason = reason
            self._closed.set()
            self._reading.cancel()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    def _fail_pending(self, error: BaseException) -> None:
        for call in self._out.values():
            call.error = call.error or error
            if call.stream:
                call.stream.fail(error)
            call.done.set()
        for inc in self._in.values():
            inc.scope.cancel()
            if inc.stream:
                inc.stream.fail(error)
        for ev in self._pong_waiters.values():
            ev.set()

    async def _send(self, header: Message, body: bytes | memoryview = b"", *, bulk: bool = False) -> None:
        if self.closed:
            raise ConnectionClosed(f"connection to {self.peer.short()} is closed: {self.close_reason}")
        try:
            head = encode_header(header)
            self.sent_by_method[self._method_of(header)] += len(head) + len(body)
            await self.channel.send(head, body, bulk=bulk)
        except ConnectionClosed as e:
            self._close(str(e))
            raise

    def _method_of(self, header: Message) -> str:
        if isinstance(header, Request):
            return header.method
        call_id = getattr(header, "id", None)
        if not isinstance(call_id, int):
            return OTHER  # pings, pongs, goodbyes
        if (call_id % 2 == 1) == self.outbound:
            out = self._out.get(call_id)
            return out.method.name if out is not None else OTHER
        inc = self._in.get(call_id)
        return inc.method if inc is not None else OTHER

    # ---- outgoing calls ----

    def _new_call(self, method: Method[Any, Any], streaming: bool) -> tuple[int, _OutCall]:
        if self.closed:
            raise ConnectionClosed(f"connection to {self.peer.short()} is closed: {self.close_reason}")
        if self.closing:
            raise ConnectionClosed(f"connection to {self.peer.short()} is closing")
        call_id = next(self._ids)
        call = _OutCall(method)
        if streaming:
            call.stream = ClientStream(
                call_id, self._send, self.config.stream_window, call, self._result, self.channel.bulk_piece
            )
        self._out[call_id] = call
        self._last_busy = trio.current_time()
        return call_id, call

    async def call(
        self,
        method: Method[Req, Resp],
        request: Req,
        *,
        body: bytes | memoryview = b"",
        timeout: float | None = None,
    ) -> Resp:
        """Call a unary method and return its response message."""
        return (await self.call_with_body(method, request, body=body, timeout=timeout)).message

    async def call_with_body(
        self,
        method: Method[Req, Resp],
        request: Req,
        *,
        body: bytes | memoryview = b"",
        timeout: float | None = None,
    ) -> Reply[Resp]:
        """Call a unary method; return the response message and its raw body."""
        if method.streaming:
            raise LocalProtocolError(f"{method.name} is streaming; use open_stream")
        timeout = self.config.default_timeout if timeout is None else timeout
        call_id, call = self._new_call(method, streaming=False)
        try:
            with trio.fail_after(timeout):
                await self._send(self._request(call_id, method, request, timeout, False), body)
                await call.done.wait()
            return Reply(self._result(call_id, call), call.body if call.body is not None else b"")
        except trio.TooSlowError:
            raise DeadlineExceeded(
                f"{method.name} to {self.peer.short()} timed out after {timeout:g} s"
            ) from None
        finally:
            await self._finish_call(call_id, call)

    @asynccontextmanager
    async def open_stream(
        self, method: Method[Req, Resp], request: Req, *, timeout: float | None = None
    ) -> AsyncIterator[ClientStream[Resp]]:
        """Open a streaming call. Leaving the block before the response arrives cancels the call."""
        if not method.streaming:
            raise LocalProtocolError(f"{method.name} is unary; use call")
        if sum(1 for c in self._out.values() if c.stream) >= self.config.max_streams:
            raise LocalProtocolError(f"too many open streams to {self.peer.short()}")
        timeout = self.config.default_timeout if timeout is None else timeout
        call_id, call = self._new_call(method, streaming=True)
        try:
            # move_on_after, not fail_after: a TooSlowError from the caller's own scope inside the block
            # must pass through as it is, not be reported as this call's deadline.
            with trio.move_on_after(timeout) as scope:
                await self._send(self._request(call_id, method, request, timeout, True))
                assert isinstance(call.stream, ClientStream)
                yield call.stream
            if scope.cancelled_caught:
                raise DeadlineExceeded(f"{method.name} to {self.peer.short()} timed out after {timeout:g} s")
        finally:
            await self._finish_call(call_id, call)

    def _request(
        self, call_id: int, method: Method[Any, Any], request: Message, timeout: float, streaming: bool
    ) -> Request:
        if not isinstance(request, method.request):
            raise LocalProtocolError(f"{method.name} takes {method.request.__name__}")
        args = encode_args(request)
        if len(args) > _MAX_ARGS:
            raise LocalProtocolError(
                f"{method.name} request of {len(args)} bytes exceeds {_MAX_ARGS}; send bulk data as a body"
            )
        return Request(call_id, method.name, timeout, streaming, args)

    def _result(self, call_id: int, call: _OutCall) -> Any:
        if call.error is not None:
            if isinstance(call.error, ConnectionClosed):
                raise ConnectionClosed(str(call.error))
            raise call.error
        assert call.result is not None
        try:
            return decode_args(call.method.response, call.result)
        except RemoteProtocolError as e:
            raise RemoteProtocolError(
                f"bad response to {call.method.name} from {self.peer.short()}: {e}"
            ) from None

    async def _finish_call(self, call_id: int, call: _OutCall) -> None:
        self._out.pop(call_id, None)
        self._last_busy = trio.current_time()
        if call.stream is not None:
            call.stream.fail(ConnectionClosed("call finished"))
        if not call.done.is_set() and not self.closed:
            # We gave up (timeout, cancellation, error): tell the remote to stop working on it.
            with trio.CancelScope(shield=True), trio.move_on_after(1.0), suppress(ConnectionClosed):
                await self._send(Cancel(id=call_id))

    # ---- keepalive ----

    async def ping(self, timeout: float = 10.0) -> float:
        """Round-trip time of a keepalive ping, in seconds."""
        nonce = next(self._pings)
        ev = self._pong_waiters[nonce] = trio.Event()
        start = trio.current_time()
        try:
            with trio.fail_after(timeout):
                await self._send(Ping(nonce=nonce))
                await ev.wait()
        except trio.TooSlowError:
            raise DeadlineExceeded(f"ping to {self.peer.short()} timed out") from None
        finally:
            self._pong_waiters.pop(nonce, None)
        if self.closed:
            raise ConnectionClosed(f"connection to {self.peer.short()} closed: {self.close_reason}")
        return trio.current_time() - start

    @property
    def _keepalive_period(self) -> float:
        cfg = self.config
        return min(cfg.keepalive_interval, cfg.idle_timeout) / 2

    def _keepalive_check(self) -> None:
        """One keepalive check, when the timer says it is due: close a connection that heard nothing for
        ``keepalive_timeout`` or was idle for ``idle_timeout`` (saying why), ping a quiet one, and have
        the next check one period after this one (after the ping went out, where one is sent)."""
        if self.closed or self._nursery is None or self._keepalives is None:
            return
        cfg, now = self.config, trio.current_time()
        if now - self._last_received > cfg.keepalive_timeout:
            log.info("closing %r: no traffic for %.0f s", self, now - self._last_received)
            self._close("keepalive timeout")
        elif not self.keep_open and self.active_calls == 0 and now - self._last_busy > cfg.idle_timeout:
            log.debug("closing idle %r", self)
            self._nursery.start_soon(self.aclose, "idle")
        elif now - self._last_received > cfg.keepalive_interval:
            self._nursery.start_soon(self._keepalive_ping)
        else:
            self._keepalives.schedule(self, now + self._keepalive_period)

    async def _keepalive_ping(self) -> None:
        try:
            await self._send(Ping(nonce=next(self._pings)))
        except ConnectionClosed:
            return
        assert self._keepalives is not None
        self._keepalives.schedule(self, trio.current_time() + self._keepalive_period)

    # ---- incoming records ----

    async def _reader(self) -> None:
        opened: list[Message] = []

        def sink(header: memoryview, size: int) -> memoryview | None:
            """A stream's data may be decrypted straight where its reader wants it (RpcStream.land_in)."""
            msg = decode_header(header)
            opened.append(msg)
            if isinstance(msg, Data):
                stream = self._stream_of(msg.id)
                if stream is not None:
                    return stream.sink_for(size)
            return None

        try:
            while True:
                opened.clear()
                header, body = await self.channel.receive(sink)
                self._last_received = trio.current_time()
                await self._dispatch(opened[0] if opened else decode_header(header), body)
                # Not held while the next record is awaited: each quiet connection would keep its last.
                del header, body
                opened.clear()
        except ConnectionClosed as e:
            if not self.closed:
                log.info("connection to %s lost: %s", self.peer.short(), e)
            self._close(str(e))
        except RemoteProtocolError as e:
            log.warning("closing connection to %s: protocol violation: %s", self.peer.short(), e)
            self._close(f"protocol violation: {e}")

    async def _dispatch(self, msg: Message, body: memoryview) -> None:
        if isinstance(msg, Data):
            stream = self._stream_of(msg.id)
            if stream is not None:
                stream.deliver(msg, body)
            # Data for a call that just ended (cancel race) is dropped.
        elif isinstance(msg, Credit):
            stream = self._stream_of(msg.id)
            if stream is not None:
                stream.grant(msg.amount)
        elif isinstance(msg, Response | Error):
            self._on_reply(msg, body)
        elif isinstance(msg, Request):
            self._on_request(msg, body)
        elif isinstance(msg, Cancel):
            inc = self._in.get(msg.id)
            if inc is not None:
                inc.scope.cancel()
        elif isinstance(msg, Ping):
            await self._send(Pong(nonce=msg.nonce))
        elif isinstance(msg, Pong):
            ev = self._pong_waiters.get(msg.nonce)
            if ev is not None:
                ev.set()
        elif isinstance(msg, GoAway):
            log.info("%s is closing the connection: %s", self.peer.short(), msg.reason)
            self._close(f"remote closed: {msg.reason}")

    def _stream_of(self, call_id: int) -> RpcStream | None:
        mine = (call_id % 2 == 1) == self.outbound
        call = self._out.get(call_id) if mine else self._in.get(call_id)
        return call.stream if call is not None else None

    def _on_reply(self, msg: Response | Error, body: memoryview) -> None:
        call = self._out.get(msg.id)
        if call is None or call.done.is_set():
            return  # reply to a call we already gave up on
        if isinstance(msg, Response):
            call.result, call.body = msg.result, body
            if call.stream:
                call.stream.end_received()  # the handler returned: no more data will follow
        else:
            call.error = RemoteCallError(self.peer.short(), call.method.name, msg.code, msg.message)
            if call.stream:
                call.stream.fail(call.error)
        call.done.set()

    def _on_request(self, req: Request, body: memoryview) -> None:
        if (req.id % 2 == 1) == self.outbound:
            raise RemoteProtocolError(f"request id {req.id} has the wrong parity")
        if req.id in self._in:
            raise RemoteProtocolError(f"request id {req.id} is already in use")
        assert self._nursery is not None
        scope = trio.CancelScope(deadline=trio.current_time() + req.timeout)
        inc = _InCall(scope, method=req.method if self._registry.get(req.method) is not None else OTHER)
        if req.streaming:
            inc.stream = RpcStream(req.id, self._send, self.config.stream_window, self.channel.bulk_piece)
        self._in[req.id] = inc
        self._last_busy = trio.current_time()
        self._nursery.start_soon(self._serve, req, body, inc)

    async def _serve(self, req: Request, body: memoryview, inc: _InCall) -> None:
        try:
            with inc.scope:
                await self._serve_inner(req, body, inc)
            expired = trio.current_time() >= inc.scope.deadline
            if inc.scope.cancelled_caught and expired and not self.closed:
                await self._reply_error(req.id, "deadline", f"{req.method} exceeded its deadline")
        except ConnectionClosed:
            pass
        finally:
            self._in.pop(req.id, None)
            if inc.stream:
                inc.stream.fail(ConnectionClosed("call finished"))
            self._last_busy = trio.current_time()

    async def _serve_inner(self, req: Request, body: memoryview, inc: _InCall) -> None:
        entry = self._registry.get(req.method)
        if entry is None:
            await self._reply_error(req.id, "unknown_method", f"no method {req.method!r} here")
            return
        if entry.method.streaming != req.streaming:
            await self._reply_error(req.id, "bad_request", f"{req.method}: wrong call kind")
            return
        if len(self._in) > self.config.max_concurrent_calls or (
            req.streaming and sum(1 for c in self._in.values() if c.stream) > self.config.max_streams
        ):
            await self._reply_error(req.id, "busy", "too many concurrent calls on this connection")
            return
        if self._admit is not None and not self._admit(self.peer):
            await self._reply_error(req.id, "busy", "too many calls from this peer: slow down")
            return
        try:
            args = decode_args(entry.method.request, req.args)
        except RemoteProtocolError as e:
            await self._reply_error(req.id, "bad_request", str(e))
            return
        ctx = CallContext(
            self.peer, self.remote_host, req.method, body, inc.scope.deadline, self.relayed, self.relayed_from
        )
        try:
            if req.streaming:
                assert inc.stream is not None
                result = await entry.handler(ctx, args, inc.stream)
            else:
                result = await entry.handler(ctx, args)
        except CallRefused as e:
            await self._reply_error(req.id, e.code, e.message)
            return
        except (RemoteProtocolError, RemoteCallError) as e:
            await self._reply_error(req.id, "bad_request", str(e))
            return
        except P2PError as e:
            await self._reply_error(req.id, "refused", str(e))
            return
        except Exception as e:  # a handler bug must not take the connection down; Cancelled passes
            log.exception("handler for %s failed", req.method)
            await self._reply_error(req.id, "internal", f"{type(e).__name__}: {e}")
            return
        reply = result if isinstance(result, Reply) else Reply(result)
        if not isinstance(reply.message, entry.method.response):
            log.error("handler for %s returned %r", req.method, type(reply.message))
            await self._reply_error(req.id, "internal", "handler returned the wrong type")
            return
        result = encode_args(reply.message)
        if len(result) > _MAX_ARGS or len(reply.body) > MAX_CHUNK:
            # A handler bug must cost this call only: sent, it would break the connection (the caller
            # drops an oversized header); raised, it would crash the connection's nursery and the host.
            log.error("handler for %s returned a response too large for one record", req.method)
            await self._reply_error(req.id, "internal", "response too large; stream it instead")
            return
        await self._send(Response(req.id, result), reply.body)

    async def _reply_error(self, call_id: int, code: str, message: str) -> None:
        await self._send(Error(call_id, code[:32], message[:2048]))


class ClientStream(RpcStream, Generic[Resp]):
    """The caller's end of a streaming call: send and receive bytes, then await ``response()``."""

    def __init__(
        self,
        call_id: int,
        send: SendFn,
        window: int,
        call: _OutCall,
        result: Callable[[int, _OutCall], Any],
        background_piece: Callable[[], int] | None = None,
    ) -> None:
        """``send``, ``window`` and ``background_piece``: the connection's, as for any stream; ``call``:
        the call this stream belongs to; ``result``: how the connection turns a finished call into its
        response."""
        super().__init__(call_id, send, window, background_piece)
        self._call = call
        self._result = result

    async def response(self) -> Resp:
        """Wait for the handler's final response message (raises the remote's error)."""
        await self._call.done.wait()
        result: Resp = self._result(self.call_id, self._call)
        return result
