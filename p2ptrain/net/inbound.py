"""The inbound side of a host: admission, the responder's handshake, and connections through relays.

An inbound connection is admitted against the host's caps (in total, per remote IP and per subnet, and
the rate of new connections from one address) before any cryptography is done; a full table may evict
an idle newcomer for a peer this node trained with (see ``admission``). A refused connection hears
"busy" and is held open a while before it is closed (see ``linger``). An admitted one runs the
responder's handshake within ``HostConfig.handshake_timeout``, then lives as a connection of the host.

:class:`Inbound` owns the admission state (slots, protected peers, arrival rates, refused connections
held open); the host builds it and hands it what it needs from the host at construction: how to run a
responder's handshake, how to make and run a connection, which peers a relay reservation protects.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import trio

from ..errors import ConnectionClosed, HandshakeRefused, RemoteProtocolError
from ..identity import PeerID
from .admission import Admission, Arrivals, Limits, Slot, Tally, Turnover, admit, subnet_of
from .channel import FramedStream, framed_stream
from .connection import Connection
from .handshake import MAX_HANDSHAKE_FRAME, HandshakeResult, ResponderHandshake, reject_frame
from .linger import Lingering

log = logging.getLogger("p2ptrain.net.host")  # (the host's lines, as before)

MAX_PROTECTED = 256  # peers this node trained with, whose connections a flood never evicts
MAX_RELAYED_INBOUND = 64  # connections reaching this host through its relays at a time
K = TypeVar("K")
MAX_EXPECTED = 512  # addresses of round members expected at a time (``expect``): the most recent kept


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
    expected: bool = False  # from an expected round member's address (``Inbound.expect``)
    lent: bool = False  # a slot a stranger would not have had, lent to that address: the member's alone
    evicted: str = ""


@dataclass(frozen=True)
class InboundLimits:
    """The caps an inbound connection is admitted against (see ``HostConfig``)."""

    limits: Limits
    inbound_rate: float  # new connections a second per address (4x per subnet; bursts: 2x the caps)
    refused_hold: float  # seconds a refused connection is held open before it is closed
    handshake_timeout: float
    turnover_rate: float = 1.0  # slots a second a full table may turn over to newcomers (``Turnover``)


class Inbound:
    """Admitting, handshaking and serving a host's inbound connections."""

    def __init__(
        self,
        limits: InboundLimits,
        *,
        responder: Callable[[], ResponderHandshake],
        make_connection: Callable[[FramedStream, HandshakeResult, str, int], Connection],
        run_connection: Callable[[Connection, HandshakeResult], Awaitable[None]],
        connections_of: Callable[[PeerID], list[Connection]],
        reserved: Callable[[PeerID], bool],
        nursery: Callable[[], trio.Nursery | None],
        clock: Callable[[], float],
    ) -> None:
        """``responder``: a fresh responder's handshake with the host's credentials; ``make_connection``
        and ``run_connection``: the host's, for an admitted connection; ``connections_of``: a peer's
        connections (where it was seen); ``reserved``: does the peer hold a relay reservation here (its
        connection is never evicted); ``nursery``: where evicted connections close; ``clock``: the wall
        clock of log-line tallies."""
        self.limits = limits
        self._responder = responder
        self._make_connection = make_connection
        self._run_connection = run_connection
        self._connections_of = connections_of
        self._reserved = reserved
        self._nursery = nursery
        self._clock = clock
        self._slots: dict[int, _Inbound] = {}
        # the slots not evicted, counted by address and by subnet (``_admit``: most arrivals need no more)
        self._held = 0
        self._by_ip: Counter[str] = Counter()
        self._by_subnet: Counter[str] = Counter()
        self._next_slot = 0
        self._protected: OrderedDict[PeerID, set[str]] = OrderedDict()  # peer -> addresses seen it at
        self._protected_ips: set[str] = set()
        self._expected: OrderedDict[str, float] = OrderedDict()  # address -> until when (``expect``)
        self._expected_peers: OrderedDict[PeerID, float] = OrderedDict()  # round members -> until when
        self._tally = Tally()  # evictions and refusals worth a log line (one a minute per address)
        caps = limits.limits
        self._arrivals = Arrivals(  # bursts of twice the caps: a full address may still replace its own
            limits.inbound_rate, 2 * caps.per_ip, 4 * limits.inbound_rate, 2 * caps.per_subnet
        )
        self._lingering = Lingering(limits.refused_hold)  # refused connections, held open a while
        self._turnover = Turnover(limits.turnover_rate, max(1.0, 4.0 * limits.turnover_rate))
        self._relayed_inbound = 0

    async def accept_relayed(self, stream: trio.abc.Stream, relay_host: str, seen_at: str = "") -> None:
        """A connection that reached this host through one of its relays: the handshake, then the
        connection, until it closes. It counts as coming from the relay's address (see ``relay``)."""
        framed = framed_stream(stream, MAX_HANDSHAKE_FRAME)
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
        seen.update(c.remote_host for c in self._connections_of(peer))
        self._protected[peer] = set(list(seen)[-8:])
        while len(self._protected) > MAX_PROTECTED:
            self._protected.popitem(last=False)
        self._protected_ips = set().union(*self._protected.values())

    def expect(self, peers: list[PeerID], hosts: list[str], until: float) -> None:
        """The members ``peers`` of a round this node takes part in will connect from ``hosts`` until
        ``until`` (trio seconds): over the total, a connection from one of those addresses may take an
        idle slot that is not protected (see ``admission``), and the members' own connections (and
        handshakes from those addresses) count as protected meanwhile: members arriving together took
        each other's slots, a handshake first, and their slices never arrived. The most recent
        ``MAX_EXPECTED`` of each are kept."""
        _until(self._expected, hosts, until)
        _until(self._expected_peers, peers, until)

    def expects(self, host: str) -> bool:
        """Whether a round member is expected from ``host`` now (see :meth:`expect`)."""
        return self._expected.get(host, -1.0) >= trio.current_time()

    def _slot_views(self) -> list[Slot]:
        out = []
        now = trio.current_time()
        for e in self._slots.values():
            if e.evicted:
                continue
            c = e.conn
            since = e.arrived if c is None else c.last_busy
            if c is None:  # in its handshake: protected only as a round member's, while expected
                protected = e.expected and self._expected.get(e.ip, -1.0) >= now
            else:
                protected = (
                    c.peer in self._protected
                    or self._reserved(c.peer)
                    or self._expected_peers.get(c.peer, -1.0) >= now
                )
            busy = c is not None and c.active_calls > 0
            out.append(Slot(e.key, e.ip, e.subnet, since, c is not None, protected, busy))
        return out

    def _hold(self, entry: _Inbound) -> None:
        self._slots[entry.key] = entry
        self._count(entry, 1)

    def _release(self, entry: _Inbound) -> None:
        del self._slots[entry.key]
        if not entry.evicted:
            self._count(entry, -1)

    def _count(self, entry: _Inbound, n: int) -> None:
        self._held += n
        self._by_ip[entry.ip] += n
        self._by_subnet[entry.subnet] += n
        for counts, key in ((self._by_ip, entry.ip), (self._by_subnet, entry.subnet)):
            if not counts[key]:
                del counts[key]

    def _admit(self, remote_host: str, reserve: bool, expected: bool = False) -> Admission:
        """``admission.admit`` over the slots in use. Below every limit its answer is "accept", whatever
        the slots hold: that is told from the counts (kept as slots come and go), without a view of each
        slot, which cost a node accepting its thousandth connection a thousand views (a swarm's first
        peer, every joiner's bootstrap: a fifth of a 1,024-peer simulation's joins)."""
        caps = self.limits.limits
        below = (
            self._held < caps.total
            and self._by_ip[remote_host] < caps.per_ip
            and self._by_subnet[subnet_of(remote_host)] < caps.per_subnet
        )
        if below:
            return Admission("accept")
        now = trio.current_time()
        verdict = admit(
            self._slot_views(),
            remote_host,
            now,
            caps,
            reserve=reserve,
            expected=expected,
            turnover=self._turnover.ready(now),
        )
        if verdict.turnover:
            self._turnover.spend(now)
        return verdict

    def _evict(self, key: int, reason: str) -> None:
        victim = self._slots[key]
        if not victim.evicted:
            self._count(victim, -1)
        victim.evicted = reason
        who = victim.conn.peer.short() if victim.conn is not None else "a connection in its handshake"
        _say(self._tally.note(victim.ip, self._clock()), "evicting %s from %s: %s", who, victim.ip, reason)
        nursery = self._nursery()
        if victim.conn is not None and nursery is not None:
            victim.conn.close_soon(nursery, f"evicted: {reason}")
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
        framed = framed_stream(stream, MAX_HANDSHAKE_FRAME)
        known = remote_host in self._protected_ips
        if not self._arrivals.allow(remote_host, trio.current_time()) and not known:
            _say(
                self._tally.note(remote_host, self._clock()),
                "refusing connection from %s: more than %g new connections a second from it",
                remote_host,
                self.limits.inbound_rate,
            )
            await self._refuse(framed, "too many new connections; try later")
            return
        expected = self.expects(remote_host)
        verdict = self._admit(remote_host, known, expected)
        if verdict.verdict == "refuse":
            _say(
                self._tally.note(remote_host, self._clock()),
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
            expected=expected,
            # Lent as a member's only where a stranger would have been refused: the address is a
            # joiner's claim in a manifest, and any other peer there is served as before (a liar naming
            # another peer's address must not have that peer's connections closed after their handshakes).
            lent=verdict.lent,
        )
        self._hold(entry)
        try:
            with entry.scope:
                await self._accept_admitted(framed, remote_host, remote_port, entry)
        finally:
            self._release(entry)
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
        hs = self._responder()
        timeout = self.limits.handshake_timeout
        try:
            with trio.fail_after(timeout):
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
                timeout,
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
        remote = hs.result.remote_peer
        why = ""
        member = self._expected_peers.get(remote, -1.0) >= trio.current_time()
        if entry.probation and remote not in self._protected and not (entry.expected and member):
            why = "slots are full and it neither trained with us nor is a member of a round here"
        elif entry.lent and not member:
            why = "admitted as a round member's, and it is none"
        if why:
            log.warning("closing %s from %s: %s", remote.short(), host, why)
            await close_quietly(framed.stream)
            return
        conn = self._make_connection(framed, hs.result, host, port)
        conn.relayed = relayed
        conn.relayed_from = seen_at if seen_at.isprintable() else ""
        entry.conn = conn
        await self._run_connection(conn, hs.result)


def _until(table: OrderedDict[K, float], keys: list[K], until: float) -> None:
    """Each of ``keys`` in ``table`` until ``until`` at least, the most recent last; the passed ones and
    all but the most recent ``MAX_EXPECTED`` dropped."""
    now = trio.current_time()
    for key in keys:
        table[key] = max(until, table.pop(key, until))
    while table and (len(table) > MAX_EXPECTED or next(iter(table.values())) < now):
        table.popitem(last=False)


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
