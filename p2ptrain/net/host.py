"""The host: listeners, dialing, handshakes and the table of live connections.

Theory of operation: a host owns one nursery in which its listeners and every connection run. Dialing
a peer reuses a live connection when there is one, and concurrent dials to the same peer share one
attempt. Inbound connections are admitted against caps (in total and per remote IP) before any
cryptography is done, and a peer that does not finish the handshake in time is dropped. Refusals are
sent to the remote as a reason it can print, then the socket is closed (that side is
:mod:`.inbound`).

Observers registered with :meth:`Host.on_connection` hear about every connection that opens and closes
(the node logs them and keeps its status file from them).

Private runs (``HostConfig.authority``): the handshake admits only peers with a valid membership
certificate (refusal code ``membership``, logged on both sides), and a connection is closed when the
remote's certificate expires. The certificates are checked against ``clock`` (wall-clock seconds).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from ..authority import Membership
from ..errors import (
    ConfigError,
    DeadlineExceeded,
    HandshakeRefused,
    P2PError,
    PeerUnavailable,
)
from ..identity import Identity, PeerID
from ..idwork import find_work, work_bits
from .address import PeerAddress, concrete_host
from .admission import Limits
from .channel import MAX_FRAME, BodyBuffers, FramedStream, framed_stream
from .connection import Connection, ConnectionConfig, Keepalives
from .handshake import (
    MAX_HANDSHAKE_FRAME,
    PROTOCOL_VERSION,
    HandshakeResult,
    InitiatorHandshake,
    ResponderHandshake,
    WorkRefused,
    reject_frame,
)
from .inbound import Inbound, InboundLimits, close_quietly
from .location import Location
from .punch import Puncher
from .relay import Relay, RelayConfig
from .rpc import RpcRegistry
from .transport import TcpTransport, Transport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostConfig:
    """Limits and timers of a host (seconds)."""

    connect_timeout: float = 10.0
    handshake_timeout: float = 10.0
    max_inbound: int = 512
    max_inbound_per_ip: int = 32
    max_inbound_per_subnet: int = 64  # per IPv4 /24 or IPv6 /64 (see ``admission``)
    reserved_inbound: int = 32  # beyond max_inbound: for peers it trained with (``protect``) or trains with
    inbound_rate: float = 1.0  # new connections a second per address (4x per subnet; bursts: 2x the caps)
    refused_hold: float = 120.0  # seconds a refused connection is held open before it is closed (``linger``)
    turnover_rate: float = 1.0  # slots a second a full table turns over to newcomers (``admission``; 0: none)
    connection: ConnectionConfig = field(default_factory=ConnectionConfig)
    protocol_version: int = PROTOCOL_VERSION
    announce_host: str | None = None  # host to advertise instead of the listener's (NAT, containers)
    announce_port: int | None = None  # port to advertise instead of the listener's (port forwarding, relays)
    authority: bytes | None = None  # a private run: the swarm authority's public key (None: open swarm)
    certificate: bytes | None = None  # this host's membership certificate (private runs)
    max_calls_per_minute: int = 60_000  # incoming RPCs one peer may make (bursts of a tenth); 0: no limit
    id_work: int = 0  # bits of id work asked of every remote (and done for our own id: see ``idwork``)
    work: bytes | None = None  # our id's work nonce when already found (else found at start if needed)
    relay: RelayConfig = field(default_factory=RelayConfig)  # circuits for peers nobody can dial (``relay``)
    punch: bool = True  # upgrade relayed connections to direct ones where the NATs allow (``punch``)


MAX_TRACKED_PEERS = 10_000
MAX_WORK_ON_DEMAND = 28  # bits of id work a dialer does when a listener asks (minutes of a core at most)


ConnectionObserver = Callable[[Connection, bool], None]
"""Called with (connection, opened): True when it opens, False when it closes."""


@dataclass
class _Dial:
    """A dial in progress; concurrent connect() calls to the same peer wait for its outcome."""

    done: trio.Event = field(default_factory=trio.Event)
    conn: Connection | None = None
    error: P2PError | None = None


class Host:
    """A p2ptrain network endpoint: an identity, listeners, and authenticated connections."""

    def __init__(
        self,
        identity: Identity,
        run_id: str,
        *,
        transport: Transport | None = None,
        registry: RpcRegistry | None = None,
        config: HostConfig | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``clock`` is the wall clock certificates are checked against (tests pass trio.current_time)."""
        self.identity = identity
        self.peer_id = identity.peer_id
        self.run_id = run_id
        self.transport: Transport = transport or TcpTransport()
        self.registry = registry or RpcRegistry()
        self.config = config or HostConfig()
        self.clock = clock
        self.membership = _membership(self.config, identity.peer_id, run_id, clock)
        self.work = self.config.work  # this id's work nonce (see ``idwork``)
        if work_bits(identity.peer_id, self.work) < self.config.id_work:
            self.work = find_work(identity.peer_id, self.config.id_work)
        self.listen_addresses: list[PeerAddress] = []
        self._conns: dict[PeerID, list[Connection]] = {}
        self._dialing: dict[PeerID | tuple[str, int], _Dial] = {}
        self._bodies = BodyBuffers()  # received bulk bodies, reused by all connections
        self._keepalives = Keepalives()  # the timer of every connection's keepalive checks
        self._observers: list[ConnectionObserver] = []
        self._nursery: trio.Nursery | None = None
        self._closed_traffic = (0, 0)  # bytes sent and received over connections that have closed
        self._closed_by_method: Counter[str] = Counter()  # ... and what they sent, by method
        self._call_tokens: dict[PeerID, tuple[float, float]] = {}  # peer -> (tokens, when counted)
        self._throttled: dict[PeerID, bool] = {}
        self.relay = Relay(self, self.config.relay)
        self.location = Location()  # where peers see this host, as the DHT's checks find out
        self.punch = Puncher(
            self, self.location, enabled=self.config.punch, handshake_timeout=self.config.handshake_timeout
        )
        cfg = self.config
        limits = Limits(
            cfg.max_inbound, cfg.max_inbound_per_ip, cfg.max_inbound_per_subnet, cfg.reserved_inbound
        )
        self.inbound = Inbound(
            InboundLimits(
                limits, cfg.inbound_rate, cfg.refused_hold, cfg.handshake_timeout, cfg.turnover_rate
            ),
            responder=self._responder,
            make_connection=lambda framed, result, host, port: self._make_connection(
                framed, result, False, host, port
            ),
            run_connection=self._run_connection,
            connections_of=lambda peer: list(self._conns.get(peer, [])),
            reserved=self.relay.holds,
            nursery=lambda: self._nursery,
            clock=clock,
        )

    # ---- lifecycle ----

    async def run(
        self,
        listen: list[tuple[str, int]] | None = None,
        *,
        task_status: trio.TaskStatus[Host] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``listen`` [(host, port)] and serve until cancelled. Reports itself when ready.

        When cancelled, every connection is first closed gracefully (the remote hears why), then the
        listeners and connection tasks are torn down.
        """
        async with trio.open_nursery() as guard:
            scope = await guard.start(self._serve, listen or [])
            task_status.started(self)
            try:
                await trio.sleep_forever()
            finally:
                with trio.CancelScope(shield=True):
                    with trio.move_on_after(2.0):
                        await self.close_all("shutting down")
                    scope.cancel()

    async def _serve(
        self, listen: list[tuple[str, int]], *, task_status: trio.TaskStatus[trio.CancelScope]
    ) -> None:
        # Shielded: outside cancellation must not cut connections before run() has closed them.
        async with trio.open_nursery() as nursery:
            nursery.cancel_scope.shield = True
            self._nursery = nursery
            try:
                nursery.start_soon(self._keepalives.run)
                for host, port in listen:
                    bound = await nursery.start(self.transport.serve, host, port, self.inbound.accept_stream)
                    self.listen_addresses += [PeerAddress.for_host(h, p, self.peer_id) for h, p in bound]
                task_status.started(nursery.cancel_scope)
                await trio.sleep_forever()
            finally:
                self._nursery = None

    @property
    def nursery(self) -> trio.Nursery | None:
        """Where the host's connections run (None unless it is running)."""
        return self._nursery

    async def close_all(self, reason: str) -> None:
        """Close every connection gracefully (GoAway first)."""
        async with trio.open_nursery() as nursery:
            for conn in self.connections():
                nursery.start_soon(conn.aclose, reason)

    def on_connection(self, observer: ConnectionObserver) -> None:
        self._observers.append(observer)

    async def accept_stream(self, stream: trio.abc.Stream, remote_host: str, remote_port: int) -> None:
        """Serve ``stream`` as an inbound connection (admission, the responder's handshake), until it
        closes: what a listener does with each accepted stream, and a hole punch with a simultaneous
        open's (see ``inbound``)."""
        await self.inbound.accept_stream(stream, remote_host, remote_port)

    async def accept_relayed(self, stream: trio.abc.Stream, relay_host: str, seen_at: str = "") -> None:
        """A connection that reached this host through one of its relays (see ``inbound``)."""
        await self.inbound.accept_relayed(stream, relay_host, seen_at)

    def protect(self, peer: PeerID) -> None:
        """``peer`` trained with this node: its inbound connections are never evicted for a newcomer's
        (see ``inbound``)."""
        self.inbound.protect(peer)

    def expect(self, peers: list[PeerID], addresses: list[str], until: float) -> None:
        """The members ``peers`` of a round this node takes part in, at ``addresses`` (their listen
        addresses, as a manifest names them), connect to it until ``until``: over the inbound cap, they
        may take an idle connection's slot, and theirs are not taken meanwhile (see ``admission``).
        Circuit addresses (they arrive through a relay, outside the cap) and addresses that do not
        parse are left out."""
        hosts = []
        for text in addresses:
            try:
                address = PeerAddress.parse(text)
            except ValueError:
                continue
            if address.relay is None:
                hosts.append(address.host)
        self.inbound.expect(peers, hosts, until)

    # ---- connections ----

    def advertised_addresses(self) -> list[PeerAddress]:
        """Addresses others can dial: wildcard listeners replaced by a concrete (or announced) host."""
        return [
            PeerAddress.for_host(
                self.config.announce_host or concrete_host(a.host),
                self.config.announce_port or a.port,
                self.peer_id,
            )
            for a in self.listen_addresses
        ]

    async def probe(self, address: PeerAddress, *, timeout: float | None = None) -> None:
        """Dial ``address`` afresh (never reusing a connection), complete the handshake, hang up.

        Proves that the peer named in the address is reachable there; raises PeerUnavailable,
        HandshakeRefused or RemoteProtocolError otherwise.
        """
        if address.peer_id is None:
            raise PeerUnavailable("a probe needs an address with a peer id")
        limit = timeout or self.config.connect_timeout
        try:
            with trio.fail_after(limit):
                try:
                    stream = await self.transport.connect(address.host, address.port)
                except OSError as e:
                    raise PeerUnavailable(
                        f"cannot reach {address.host}:{address.port}: {_os_reason(e)}"
                    ) from None
                try:
                    framed = framed_stream(stream, MAX_HANDSHAKE_FRAME)
                    await self._initiate(framed, address.peer_id)
                finally:
                    await close_quietly(stream)
        except trio.TooSlowError:  # (a NAT drops the SYN: the dial hangs)
            where = f"{address.host}:{address.port}"
            raise PeerUnavailable(f"{where} did not answer within {limit:g} s") from None

    def traffic(self) -> tuple[int, int]:
        """Bytes sent and received on the wire since the host started, over every connection."""
        sent, received = self._closed_traffic
        for conn in (c for conns in self._conns.values() for c in conns):  # closing ones too
            sent, received = sent + conn.bytes_sent, received + conn.bytes_received
        return sent, received

    def sent_by_method(self) -> dict[str, int]:
        """Bytes sent since the host started, by the RPC method of the call they belong to (frames
        before encryption and framing: a little less than :meth:`traffic` counts), largest first."""
        total = Counter(self._closed_by_method)
        for conn in (c for conns in self._conns.values() for c in conns):
            total.update(conn.sent_by_method)
        return dict(total.most_common())

    def delivered_traffic(self) -> tuple[int, int]:
        """Like :meth:`traffic`, but only the bytes sent that the remotes have acknowledged so far (the
        kernel's send queues hold the rest), so that a rate measured from it is the network's, not how
        fast the kernel takes data in."""
        sent, received = self.traffic()
        for conn in self.connections():
            sent -= conn.channel.framed.undelivered()
        return sent, received

    def connections(self) -> list[Connection]:
        return [c for conns in self._conns.values() for c in conns if not c.closed]

    def connection(self, peer: PeerID) -> Connection | None:
        """The newest live connection to ``peer``, if any; not one that is closing (a node evicting an
        idle connection tells the remote first, and a call of its own begun on it meanwhile was lost)."""
        for c in reversed(self._conns.get(peer, ())):
            if not c.closed and not c.closing:
                return c
        return None

    def connected_peers(self) -> list[PeerID]:
        return [p for p, conns in self._conns.items() if any(not c.closed for c in conns)]

    async def in_touch(self, timeout: float) -> bool:
        """Whether any connected peer answers a ping within ``timeout`` (False with none connected)."""
        answered = False

        async def ping(conn: Connection) -> None:
            nonlocal answered
            with contextlib.suppress(P2PError):
                await conn.ping(timeout)
                answered = True
                nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            for conn in self.connections():
                nursery.start_soon(ping, conn)
        return answered

    async def connect(
        self, address: PeerAddress | str, *, timeout: float | None = None, direct: bool = False
    ) -> Connection:
        """Return a live connection to the peer at ``address``, dialing if needed (``direct``: a
        connection through a relay does not count).

        Raises PeerUnavailable (unreachable, timed out), HandshakeRefused (run id, version, peer id),
        or RemoteProtocolError (the remote broke the handshake).
        """
        addr = PeerAddress.parse(address) if isinstance(address, str) else address
        if addr.peer_id == self.peer_id:
            raise PeerUnavailable("refusing to dial ourselves")
        key: PeerID | tuple[str, int] = addr.peer_id or (addr.host, addr.port)
        if direct:
            key = (addr.host, addr.port)
        while True:
            conn = self.connection(addr.peer_id) if addr.peer_id is not None else None
            if conn is not None and not (direct and conn.relayed):
                return conn
            pending = self._dialing.get(key)
            if pending is None:
                break
            await pending.done.wait()  # someone else is dialing the same peer: share the outcome
            if pending.error is not None:
                raise pending.error  # not a fresh attempt per waiter: N waiters must not take N timeouts
            if pending.conn is not None and not pending.conn.closed:
                return pending.conn
            # That dialer was cancelled, or its connection is gone already: dial ourselves.
        dial = self._dialing[key] = _Dial()
        try:
            try:
                dial.conn = await self._dial(addr, timeout or self.config.connect_timeout)
            except WorkRefused as e:
                if e.needs > MAX_WORK_ON_DEMAND:
                    raise
                await self._do_work(e.needs)  # the listener asks more of our id than we did: do it, once
                dial.conn = await self._dial(addr, timeout or self.config.connect_timeout)
            return dial.conn
        except P2PError as e:
            dial.error = e
            raise
        finally:
            del self._dialing[key]
            dial.done.set()

    async def _do_work(self, bits: int) -> None:
        if work_bits(self.peer_id, self.work) >= bits:
            return
        log.info("a peer asks for %d bits of id work: computing it (about 2**%d hashes)", bits, bits)
        self.work = await trio.to_thread.run_sync(find_work, self.peer_id, bits)

    async def _dial(self, addr: PeerAddress, timeout: float) -> Connection:
        if self._nursery is None:
            raise PeerUnavailable("host is not running")
        try:
            with trio.fail_after(timeout):
                if addr.relay is not None:
                    stream = await self._open_circuit(addr, timeout)
                else:
                    stream = await self.transport.connect(addr.host, addr.port)
        except trio.TooSlowError:
            raise PeerUnavailable(f"{addr.host}:{addr.port} did not answer within {timeout:g} s") from None
        except OSError as e:
            reason = _os_reason(e)
            raise PeerUnavailable(f"cannot reach {addr.host}:{addr.port}: {reason}") from None
        relayed = addr.relay is not None
        conn = await self.establish(stream, addr.host, addr.port, addr.peer_id, relayed=relayed)
        if conn.relayed and self.punch.enabled:
            self._nursery.start_soon(self.punch.upgrade, conn)
        return conn

    async def establish(
        self, stream: trio.abc.Stream, host: str, port: int, expected: PeerID | None, *, relayed: bool = False
    ) -> Connection:
        """The initiator's handshake over a dialed ``stream``, then the connection, running in the host's
        nursery. Raises HandshakeRefused, RemoteProtocolError, ConnectionClosed or DeadlineExceeded (the
        stream closed)."""
        if self._nursery is None:
            await close_quietly(stream)
            raise PeerUnavailable("host is not running")
        framed = framed_stream(stream, MAX_HANDSHAKE_FRAME)
        try:
            with trio.fail_after(self.config.handshake_timeout):
                result = await self._initiate(framed, expected)
        except trio.TooSlowError:
            await close_quietly(stream)
            raise DeadlineExceeded(f"handshake with {host}:{port} timed out") from None
        except BaseException:  # (refused, broken, cancelled)
            await close_quietly(stream)
            raise
        if expected is None:
            log.warning(
                "connected to %s:%d without a peer id in the address: it claims to be %s "
                "(not verified against what you meant to dial)",
                host,
                port,
                result.remote_peer,
            )
        conn = self._make_connection(framed, result, True, host, port)
        conn.relayed = relayed
        await self._nursery.start(self._run_connection, conn, result)
        return conn

    async def _open_circuit(self, addr: PeerAddress, timeout: float) -> trio.abc.Stream:
        """A stream to ``addr.peer_id`` through the relay ``addr`` names (see ``relay``)."""
        via = addr.relay_address
        if via is None or addr.peer_id is None:
            raise PeerUnavailable(f"{addr} is not a circuit address with a target peer id")
        if via.peer_id == self.peer_id:
            raise PeerUnavailable("refusing to relay through ourselves")
        relay = await self.connect(via, timeout=timeout)
        assert self._nursery is not None
        stream: trio.abc.Stream = await self._nursery.start(self.relay.open_circuit, relay, addr.peer_id)
        return stream

    def _responder(self) -> ResponderHandshake:
        """A responder's handshake with this host's credentials as they are now (its id work may grow)."""
        return ResponderHandshake(
            self.identity,
            self.run_id,
            version=self.config.protocol_version,
            membership=self.membership,
            now=self.clock() if self.membership is not None else None,
            work=self.work,
            required_work=self.config.id_work,
        )

    async def _initiate(self, framed: FramedStream, expected: PeerID | None) -> HandshakeResult:
        hs = InitiatorHandshake(
            self.identity,
            self.run_id,
            expected,
            version=self.config.protocol_version,
            membership=self.membership,
            now=self.clock() if self.membership is not None else None,
            work=self.work,
            required_work=self.config.id_work,
        )
        await framed.send_frame(hs.start())
        reply = await framed.receive_frame()
        try:
            finish = hs.receive(reply)
        except HandshakeRefused as e:
            if not e.by_remote:
                if e.code == "membership":
                    log.warning("refused to connect (%s): %s", e.code, e.reason)
                with trio.move_on_after(1.0):
                    await framed.send_frame(reject_frame(e.code, e.reason))
            raise
        await framed.send_frame(finish)
        if hs.expects_verdict:  # a private run's listener judges our certificate
            hs.receive_verdict(await framed.receive_frame())
        assert hs.result is not None
        return hs.result

    def _make_connection(
        self, framed: FramedStream, result: HandshakeResult, outbound: bool, host: str, port: int
    ) -> Connection:
        framed.max_frame = MAX_FRAME
        return Connection(
            framed.secure(result, self._bodies),
            result.remote_peer,
            outbound=outbound,
            remote_host=host,
            remote_port=port,
            registry=self.registry,
            config=self.config.connection,
            admit=self._admit_call if self.config.max_calls_per_minute else None,
            keepalives=self._keepalives,
        )

    def _admit_call(self, peer: PeerID) -> bool:
        """A token bucket per peer (over all its connections): a call costs a token; tokens come back at
        ``max_calls_per_minute`` a minute, up to a tenth of that in reserve."""
        now = trio.current_time()
        rate = self.config.max_calls_per_minute / 60.0
        burst = max(1.0, self.config.max_calls_per_minute / 10.0)
        tokens, last = self._call_tokens.get(peer, (burst, now))
        tokens = min(burst, tokens + (now - last) * rate)
        if len(self._call_tokens) > MAX_TRACKED_PEERS:  # forget peers whose buckets are full again
            self._call_tokens = {
                p: v for p, v in self._call_tokens.items() if v[0] + (now - v[1]) * rate < burst
            }
        if tokens < 1.0:
            self._call_tokens[peer] = (tokens, now)
            if not self._throttled.get(peer):
                log.warning(
                    "peer %s makes more than %d calls a minute: refusing some",
                    peer.short(),
                    self.config.max_calls_per_minute,
                )
                self._throttled[peer] = True
            return False
        self._call_tokens[peer] = (tokens - 1.0, now)
        self._throttled.pop(peer, None)
        return True

    async def _run_connection(
        self,
        conn: Connection,
        result: HandshakeResult,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        self._conns.setdefault(conn.peer, []).append(conn)
        log.info(
            "connected to %s (%s %s:%d)",
            conn.peer.short(),
            "outbound" if conn.outbound else "inbound",
            conn.remote_host,
            conn.remote_port,
        )
        self._notify(conn, True)
        try:
            if result.remote_certificate is None:
                await conn.run(task_status=task_status)
            else:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._close_at_expiry, conn, result.remote_certificate.expires)
                    await conn.run(task_status=task_status)
                    nursery.cancel_scope.cancel()
        finally:
            peers = self._conns.get(conn.peer, [])
            if conn in peers:
                peers.remove(conn)
            if not peers:
                self._conns.pop(conn.peer, None)
            sent, received = self._closed_traffic
            self._closed_traffic = (sent + conn.bytes_sent, received + conn.bytes_received)
            self._closed_by_method.update(conn.sent_by_method)
            log.info("disconnected from %s: %s", conn.peer.short(), conn.close_reason or "closed")
            self._notify(conn, False)

    async def _close_at_expiry(self, conn: Connection, expires: float) -> None:
        """A private run: the remote is a member only while its certificate is valid."""
        await trio.sleep(max(0.0, expires - self.clock()))
        log.warning("closing the connection to %s: its membership certificate expired", conn.peer.short())
        await conn.aclose("membership certificate expired")

    def _notify(self, conn: Connection, opened: bool) -> None:
        for observer in self._observers:
            observer(conn, opened)


def _membership(
    config: HostConfig, peer: PeerID, run_id: str, clock: Callable[[], float]
) -> Membership | None:
    """The admission rule of a private run (None: open), with this host's own certificate checked."""
    if config.authority is None:
        if config.certificate is not None:
            raise ConfigError("a membership certificate needs the run's authority public key as well")
        return None
    membership = Membership(config.authority, run_id, config.certificate)
    if membership.check_own(peer, clock()) is None:
        log.warning(
            "this run is private but this node has no membership certificate: its peers will refuse it"
        )
    return membership


def _os_reason(e: BaseException) -> str:
    """The most specific reason inside an OSError (trio wraps per-address failures in a group)."""
    seen: set[int] = set()
    todo: list[BaseException] = [e]
    while todo:
        exc = todo.pop(0)
        if id(exc) in seen:
            continue
        seen.add(id(exc))
        if isinstance(exc, socket.gaierror) and exc.strerror:
            return f"cannot resolve the name: {exc.strerror}"
        if isinstance(exc, OSError) and exc.errno:
            return os.strerror(exc.errno)
        if isinstance(exc, BaseExceptionGroup):
            todo.extend(exc.exceptions)
        todo.extend(x for x in (exc.__cause__, exc.__context__) if x is not None)
    return str(e)
