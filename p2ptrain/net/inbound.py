"""The inbound side of a host: admission, the responder's handshake, and connections through relays.

An inbound connection is admitted against the host's caps (in total, per remote IP and per subnet, and
the rate of new connections from one address) before any cryptography is done; a full table may evict
an idle newcomer for a peer this node trained with (see ``admission``). A refused connection hears
"busy" and is held open a while before it is closed (see ``linger``). An admitted one runs the
responder's handshake within ``HostConfig.handshake_timeout``, then lives as a connection of the host.

:class:`InboundSide` is a mixin of :class:`~p2ptrain.net.host.Host`, which owns the state it uses.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from ..authority import Membership
from ..errors import ConnectionClosed, HandshakeRefused, RemoteProtocolError
from ..identity import Identity, PeerID
from .admission import Arrivals, Limits, Slot, Tally, admit, subnet_of
from .channel import FramedStream
from .connection import Connection
from .handshake import MAX_HANDSHAKE_FRAME, HandshakeResult, ResponderHandshake, reject_frame
from .linger import Lingering
from .relay import Relay

if TYPE_CHECKING:
    from .host import HostConfig

log = logging.getLogger("p2ptrain.net.host")  # (the host's lines, as before)

MAX_PROTECTED = 256  # peers this node trained with, whose connections a flood never evicts
MAX_RELAYED_INBOUND = 64  # connections reaching this host through its relays at a time


@dataclass
class _Inbound:
    """An inbound connection holding a slot: in its handshake until ``conn`` is set."""

    key: int
    ip: str
    subnet: str
    arrived: float
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    conn: Connection | None = None
    probation: bool = False
    evicted: str = ""


class InboundSide:
    """Admitting, handshaking and serving inbound connections (a mixin)."""

    # Owned by Host:
    identity: Identity
    run_id: str
    config: HostConfig
    clock: Callable[[], float]
    membership: Membership | None
    work: bytes | None
    relay: Relay
    _conns: dict[PeerID, list[Connection]]
    _slots: dict[int, _Inbound]
    _next_slot: int
    _protected: OrderedDict[PeerID, set[str]]
    _protected_ips: set[str]
    _tally: Tally
    _arrivals: Arrivals
    _lingering: Lingering
    _relayed_inbound: int
    _nursery: trio.Nursery | None
    _make_connection: Callable[[FramedStream, HandshakeResult, bool, str, int], Connection]
    _run_connection: Callable[[Connection, HandshakeResult], Awaitable[None]]

    async def accept_relayed(self, stream: trio.abc.Stream, relay_host: str, seen_at: str = "") -> None:
        """A connection that reached this host through one of its relays: the handshake, then the
        connection, until it closes. It counts as coming from the relay's address (see ``relay``)."""
        framed = FramedStream(stream, MAX_HANDSHAKE_FRAME)
        if self._relayed_inbound >= MAX_RELAYED_INBOUND:
            with trio.move_on_after(1.0):
                await _send_quietly(framed, reject_frame("busy", "too many relayed connections; try later"))
            return
        self._relayed_inbound += 1
        self._next_slot += 1
        entry = _Inbound(self._next_slot, relay_host, subnet_of(relay_host), trio.current_time())
        try:
            await self._accept_admitted(framed, relay_host, 0, entry, relayed=True, seen_at=seen_at)
        finally:
            self._relayed_inbound -= 1

    def protect(self, peer: PeerID) -> None:
        """``peer`` trained with this node: its inbound connections are never evicted for a newcomer's,
        and it may use the reserved slots (the most recent ``MAX_PROTECTED`` such peers)."""
        seen = self._protected.pop(peer, set())
        seen.update(c.remote_host for c in self._conns.get(peer, []))
        self._protected[peer] = set(list(seen)[-8:])
        while len(self._protected) > MAX_PROTECTED:
            self._protected.popitem(last=False)
        self._protected_ips = set().union(*self._protected.values())

    def _slot_views(self) -> list[Slot]:
        out = []
        for e in self._slots.values():
            if e.evicted:
                continue
            c = e.conn
            since = e.arrived if c is None else c.last_busy
            protected = c is not None and (c.peer in self._protected or self.relay.holds(c.peer))
            busy = c is not None and c.active_calls > 0
            out.append(Slot(e.key, e.ip, e.subnet, since, c is not None, protected, busy))
        return out

    def _evict(self, key: int, reason: str) -> None:
        victim = self._slots[key]
        victim.evicted = reason
        who = victim.conn.peer.short() if victim.conn is not None else "a connection in its handshake"
        _say(self._tally.note(victim.ip, self.clock()), "evicting %s from %s: %s", who, victim.ip, reason)
        if victim.conn is not None and self._nursery is not None:
            self._nursery.start_soon(victim.conn.aclose, f"evicted: {reason}")
        else:
            victim.scope.cancel()

    async def _refuse(self, framed: FramedStream, reason: str) -> None:
        """Say "busy", then hold the connection open a while before it is closed (see ``linger``)."""
        with trio.move_on_after(0.1):
            await _send_quietly(framed, reject_frame("busy", reason))
        await self._lingering.hold()
        await close_quietly(framed.stream)

    async def accept_stream(self, stream: trio.abc.Stream, remote_host: str, remote_port: int) -> None:
        """Serve ``stream`` as an inbound connection (the responder's handshake, admission included),
        until it closes: what the listener does with each accepted stream (and ``punch`` with a
        simultaneous open's)."""
        await self._accept(stream, remote_host, remote_port)

    async def _accept(self, stream: trio.abc.Stream, remote_host: str, remote_port: int) -> None:
        framed = FramedStream(stream, MAX_HANDSHAKE_FRAME)
        known = remote_host in self._protected_ips
        if not self._arrivals.allow(remote_host, trio.current_time()) and not known:
            _say(
                self._tally.note(remote_host, self.clock()),
                "refusing connection from %s: more than %g new connections a second from it",
                remote_host,
                self.config.inbound_rate,
            )
            await self._refuse(framed, "too many new connections; try later")
            return
        cfg = self.config
        limits = Limits(
            cfg.max_inbound, cfg.max_inbound_per_ip, cfg.max_inbound_per_subnet, cfg.reserved_inbound
        )
        verdict = admit(self._slot_views(), remote_host, trio.current_time(), limits, reserve=known)
        if verdict.verdict == "refuse":
            _say(
                self._tally.note(remote_host, self.clock()),
                "refusing connection from %s: connection limit reached (%s)",
                remote_host,
                verdict.reason,
            )
            await self._refuse(framed, "too many connections; try later")
            return
        if verdict.victim is not None:
            self._evict(verdict.victim.key, verdict.reason)
        self._next_slot += 1
        entry = _Inbound(
            self._next_slot,
            remote_host,
            subnet_of(remote_host),
            trio.current_time(),
            probation=verdict.verdict == "probation",
        )
        self._slots[entry.key] = entry
        try:
            with entry.scope:
                await self._accept_admitted(framed, remote_host, remote_port, entry)
        finally:
            del self._slots[entry.key]
            if entry.scope.cancelled_caught:
                await close_quietly(stream)

    async def _accept_admitted(
        self,
        framed: FramedStream,
        host: str,
        port: int,
        entry: _Inbound,
        *,
        relayed: bool = False,
        seen_at: str = "",
    ) -> None:
        hs = ResponderHandshake(
            self.identity,
            self.run_id,
            version=self.config.protocol_version,
            membership=self.membership,
            now=self.clock() if self.membership is not None else None,
            work=self.work,
            required_work=self.config.id_work,
        )
        try:
            with trio.fail_after(self.config.handshake_timeout):
                reply = hs.receive(await framed.receive_frame())
                assert reply is not None
                await framed.send_frame(reply)
                verdict = hs.receive(await framed.receive_frame())
                if verdict is not None:  # a private run: the initiator's certificate admitted it
                    await framed.send_frame(verdict)
        except trio.TooSlowError:
            log.info(
                "dropping %s:%d: handshake not completed within %g s",
                host,
                port,
                self.config.handshake_timeout,
            )
            await close_quietly(framed.stream)
            return
        except HandshakeRefused as e:
            if e.by_remote:
                log.warning("%s:%d refused our handshake (%s): %s", host, port, e.code, e.reason)
            else:
                log.warning("refused handshake from %s:%d (%s): %s", host, port, e.code, e.reason)
                with trio.move_on_after(1.0):
                    await _send_quietly(framed, reject_frame(e.code, e.reason))
            await close_quietly(framed.stream)
            return
        except RemoteProtocolError as e:
            log.warning("dropping %s:%d: bad handshake: %s", host, port, e)
            await close_quietly(framed.stream)
            return
        except ConnectionClosed:
            log.debug("%s:%d closed during the handshake", host, port)
            await close_quietly(framed.stream)
            return
        assert hs.result is not None
        if entry.probation and hs.result.remote_peer not in self._protected:
            log.warning(
                "closing %s from %s: slots are full and it never trained with us",
                hs.result.remote_peer.short(),
                host,
            )
            await close_quietly(framed.stream)
            return
        conn = self._make_connection(framed, hs.result, False, host, port)
        conn.relayed = relayed
        conn.relayed_from = seen_at if seen_at.isprintable() else ""
        entry.conn = conn
        await self._run_connection(conn, hs.result)


async def _send_quietly(framed: FramedStream, data: bytes) -> None:
    with contextlib.suppress(ConnectionClosed):
        await framed.send_frame(data)


async def close_quietly(stream: trio.abc.Stream) -> None:
    """Close ``stream``, shielded from cancellation, ignoring a peer that is already gone."""
    with (
        trio.CancelScope(shield=True),
        contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError),
    ):
        await stream.aclose()


def _say(count: int, message: str, *args: object) -> None:
    """An admission decision: a WARNING when ``count`` (from :class:`Tally`) says so, else DEBUG."""
    if count:
        suffix = f" ({count - 1} more like it since the last such line)" if count > 1 else ""
        log.warning(message + suffix, *args)
    else:
        log.debug(message, *args)
