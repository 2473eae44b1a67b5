"""Hole punching: a relayed connection upgraded to a direct one where the NATs allow it.

Theory of operation. Home routers let in only what looks like an answer: a TCP SYN from (X, x) to the
router's (R, r) passes if a packet went out from r to (X, x) a moment before. Linux and most home
routers keep a connection's source port when they can (an *endpoint-independent* mapping), so a host
behind one is seen from everywhere at its router's address and its own port.

When a host dialed a peer through a relay (``relay``), it asks that peer, over the new end-to-end
encrypted connection, to ``punch.connect``, listing where it can be dialed directly: the address its
peers see it at with its listening port (the host's ``Location``; a dialer that joined through that very
circuit waits a little for its first direct peers to tell, ``Location.checked``). The peer starts dialing
each of those from its own listening port, then answers with its own such addresses; the dialer, on the
answer, dials them from its listening port. The peer's first SYN dies at the dialer's router but leaves
in the peer's own router the entry that lets the dialer's SYN in (and the dialer's SYN leaves the entry
for the peer's retransmitted one): the two dials meet in a TCP *simultaneous open*, one connection both
dials return. (An attempt abandoned early would not do: the router tracks the SYN's sequence numbers,
and a listener's answer from a new socket does not match them.) Over it the dialer runs the handshake's
initiator side and the peer the responder's, as with any inbound connection, so each end checks the
other's id: a wrong address reaches nobody who can finish it. The newest connection to a peer is the one
used, so calls move to the direct connection at once; the relayed one is closed a little later. A dialer
that is reachable itself (a public peer dialing a NATed one through a relay) is dialed back directly
instead (a *reversal*).

A symmetric NAT maps each connection to a new port: the attempt and the dial then never meet, the
punch fails after ``PUNCH_TIMEOUT``, and the peers stay relayed. ``Puncher.works`` records whether a
punch with this host on either end succeeded: proof that its NAT maps ports as punching needs (the
averager then lets the host reduce a share, see ``averaging``).

What a peer says is bounded: at most ``MAX_ADDRESSES`` IP literals (never names), attempts only over
relayed connections, one request per peer per ``MIN_INTERVAL`` and ``MAX_RUNNING`` at a time; the
worst a liar gets is a few SYNs sent where it said.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import trio

from ..errors import P2PError
from ..identity import PeerID
from ..wire.schema import Message, bounded
from .address import PeerAddress
from .connection import Connection
from .location import Location
from .rpc import CallContext, Method, RpcRegistry
from .transport import Transport

log = logging.getLogger(__name__)

MAX_ADDRESSES = 4
PUNCH_TIMEOUT = 10.0  # seconds a punch's dials have (SYNs retransmit at 1, 3, 7 s)
HEAD_START = 0.05  # seconds the peer's dials have before its answer leaves (their SYNs first)
REDIAL = 0.5  # seconds between dials to one address that failed at once (a reset)
MIN_INTERVAL = 30.0  # seconds between two punch requests a peer is answered
MAX_RUNNING = 8  # punches answered at once
RELAYED_GRACE = 30.0  # seconds a relayed connection lives on beside the direct one (calls in flight)
RETRY = 120.0  # seconds before ``reach`` tries a peer again
LEARN_TIMEOUT = 30.0  # seconds a dialer waits to learn its public address and reachability first


@dataclass(frozen=True)
class PunchReq(Message):
    addresses: tuple[str, ...] = bounded((), max_len=MAX_ADDRESSES)  # "host:port", IP literals
    reachable: bool = False  # the dialer can be dialed at them as they are: dial it back
    port: int = bounded(0, ge=0, le=65535)  # the dialer's listening port (with where the relay saw it)


@dataclass(frozen=True)
class PunchResp(Message):
    ok: bool = False
    reason: str = bounded("", max_len=200)
    addresses: tuple[str, ...] = bounded((), max_len=MAX_ADDRESSES)


PUNCH = Method("punch.connect", PunchReq, PunchResp)


def parse_endpoint(text: str) -> tuple[str, int]:
    """("host", port) from "host:port" or "[v6]:port"; ValueError otherwise. (A TCP transport dials IP
    literals only: no name a peer gives is resolved.)"""
    if len(text) > 64 or not text.isprintable() or " " in text:
        raise ValueError("not an address")
    host, sep, port_text = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    port = int(port_text) if sep and port_text.isdigit() else 0
    if not host or not 0 < port < 65536:
        raise ValueError(f"bad address {text!r}")
    return host, port


def _endpoints(peer: PeerID, addresses: tuple[str, ...]) -> list[tuple[str, int]]:
    out = []
    for a in addresses[:MAX_ADDRESSES]:
        try:
            out.append(parse_endpoint(a))
        except ValueError:
            log.debug("%s gave a bad address to punch to: %r", peer.short(), a)
    return out


def endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class PunchHost(Protocol):
    """What hole punching needs of the host it belongs to (its owner, :class:`~p2ptrain.net.host.Host`)."""

    registry: RpcRegistry
    transport: Transport
    listen_addresses: list[PeerAddress]

    @property
    def nursery(self) -> trio.Nursery | None: ...

    def on_connection(self, observer: Callable[[Connection, bool], None]) -> None: ...

    def connection(self, peer: PeerID) -> Connection | None: ...

    async def connect(
        self, address: PeerAddress | str, *, timeout: float | None = None, direct: bool = False
    ) -> Connection: ...

    async def establish(
        self, stream: trio.abc.Stream, host: str, port: int, expected: PeerID | None, *, relayed: bool = False
    ) -> Connection: ...

    async def accept_stream(self, stream: trio.abc.Stream, remote_host: str, remote_port: int) -> None: ...


class Puncher:
    """A host's hole punching: the dialer's side (``upgrade``) and the answering side (``punch.connect``)."""

    def __init__(
        self, host: PunchHost, location: Location, *, enabled: bool = True, handshake_timeout: float = 10.0
    ) -> None:
        """``location``: what the host knows of the address peers see it at (see ``location``)."""
        self.host = host
        self.location = location
        self.enabled = enabled
        self.handshake_timeout = handshake_timeout
        self.works = False  # a punch with this host on one end succeeded
        self._asked: dict[PeerID, float] = {}  # peer -> when its last request was answered
        self._running = 0
        self._awaiting: dict[PeerID, trio.Event] = {}  # peers whose direct dial this host waits for
        self._tried: dict[PeerID, float] = {}  # peer -> when ``reach`` last tried it
        host.registry.add_unary(PUNCH, self._on_punch)
        host.on_connection(self._on_connection)

    def candidates(self) -> list[str]:
        """Where this host may be dialed directly: its observed public address at its listening port,
        and its concrete listening addresses (peers on the same network)."""
        public = self.location.observed_host
        port = self.listen_port()
        out = []
        if public and port:
            out.append(endpoint(public, port))
        for a in self.host.listen_addresses:
            if a.host not in ("0.0.0.0", "::") and (e := endpoint(a.host, a.port)) not in out:
                out.append(e)
        return out[:MAX_ADDRESSES]

    def listen_port(self) -> int:
        return self.host.listen_addresses[0].port if self.host.listen_addresses else 0

    # ---- the dialer's side ---------------------------------------------------------------------------

    async def reach(self, address: PeerAddress) -> None:
        """Get a direct connection to the peer at ``address`` (a circuit address) before a round needs
        it: dial it through its relay (the upgrade follows by itself), or punch over a relayed
        connection this host dialed before. Only through a relay this host is directly connected to;
        a peer is tried once per ``RETRY`` seconds; failures are logged, not raised."""
        peer, now = address.peer_id, trio.current_time()
        if peer is None or not self.enabled or now - self._tried.get(peer, -RETRY) < RETRY:
            return
        relay = None if address.relay is None else self.host.connection(address.relay)
        if relay is None or relay.relayed:
            # Only through a peer this host is directly connected to: a circuit address in a record
            # can name any host as its relay, and fresh ids must not make this node dial third parties.
            log.debug("not reaching %s: its relay is not a connected peer", peer.short())
            return
        existing = self.host.connection(peer)
        if existing is not None and not existing.relayed:
            return
        self._tried = {p: t for p, t in self._tried.items() if now - t < RETRY}
        self._tried[peer] = now
        if existing is not None:
            if existing.outbound:  # (an inbound one: the dialer punches)
                await self.upgrade(existing)
            return
        try:
            await self.host.connect(address)
        except P2PError as e:
            log.info("could not reach %s through its relay: %s", peer.short(), e)

    async def upgrade(self, relayed: Connection) -> Connection | None:
        """Try to replace ``relayed`` (an outbound connection through a relay) by a direct one; the
        direct connection, or None (the reason logged)."""
        peer, port = relayed.peer, self.listen_port()
        if not self.enabled or not port:
            return None
        with trio.move_on_after(LEARN_TIMEOUT):  # a node that joined through a circuit learns it soon
            await self.location.checked.wait()
        reachable = self.location.reachable
        mine = self.candidates()
        try:
            req = PunchReq(tuple(mine), bool(reachable), port)
            resp = await relayed.call(PUNCH, req, timeout=PUNCH_TIMEOUT)
        except P2PError as e:
            log.info("no hole punch with %s: %s", peer.short(), e)
            return None
        if not resp.ok:
            log.info("no hole punch with %s: %s", peer.short(), resp.reason)
            return None
        event = self._awaiting[peer] = trio.Event()  # (the peer's own dial may get through first)
        try:
            if reachable:  # it dials back (or cannot): wait for that connection
                with trio.move_on_after(PUNCH_TIMEOUT):
                    await event.wait()
            else:
                await self._dial_any(peer, _endpoints(peer, resp.addresses), port, event)
        finally:
            if self._awaiting.get(peer) is event:
                del self._awaiting[peer]
        direct = self.host.connection(peer)
        if direct is None or direct.relayed:
            log.info("hole punch with %s failed: staying relayed", peer.short())
            return None
        self._succeeded(peer, relayed, "dialed")
        return direct

    async def _dial_any(
        self,
        peer: PeerID,
        endpoints: list[tuple[str, int]],
        port: int,
        done: trio.Event,
        answered: trio.Event | None = None,
    ) -> None:
        """Dial every endpoint at once from ``port`` (again after a reset) until ``PUNCH_TIMEOUT`` or
        ``done`` (a direct connection with ``peer`` opened); the first stream wins and the other dials
        are cancelled. On it, the dialer (``answered`` None) runs the handshake's initiator side. The
        peer serves it as an inbound connection, unless it came before ``answered``: before the dialer
        even knew where to dial, so it reached the dialer's listener (no NAT in the way), and the peer
        initiates."""
        deadline = trio.current_time() + PUNCH_TIMEOUT

        async def one(host: str, p: int) -> None:
            while True:
                try:
                    stream = await self.host.transport.connect(host, p, local_port=port)
                    break
                except OSError as e:
                    log.debug("punch dial to %s:%d failed: %s", host, p, e)
                    await trio.sleep(min(REDIAL, max(0.0, deadline - trio.current_time())))
            nursery.cancel_scope.cancel()  # (the other dials: this one is through)
            if answered is not None and answered.is_set():
                assert self.host.nursery is not None
                self.host.nursery.start_soon(self.host.accept_stream, stream, host, p)
                return
            try:
                with trio.CancelScope(shield=True):
                    await self.host.establish(stream, host, p, peer)
            except P2PError as e:
                log.debug("punch dial to %s:%d: %s", host, p, e)

        async def until_done() -> None:
            await done.wait()
            nursery.cancel_scope.cancel()

        with trio.move_on_at(deadline):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(until_done)
                for host, p in endpoints:
                    nursery.start_soon(one, host, p)

    # ---- the answering side --------------------------------------------------------------------------

    async def _on_punch(self, ctx: CallContext, req: PunchReq) -> PunchResp:
        now = trio.current_time()
        relayed = self.host.connection(ctx.peer)
        if not self.enabled:
            return PunchResp(False, "this host does not punch holes")
        if relayed is None or not relayed.relayed or not ctx.relayed:
            return PunchResp(False, "only over a relayed connection")
        if now - self._asked.get(ctx.peer, -MIN_INTERVAL) < MIN_INTERVAL:
            return PunchResp(False, f"one punch per {MIN_INTERVAL:g} s")
        if self._running >= MAX_RUNNING:
            return PunchResp(False, "too many punches at once; try later")
        port = self.listen_port()
        if not port:
            return PunchResp(False, "this host does not listen")
        targets = []
        for a in req.addresses[:MAX_ADDRESSES]:
            try:
                targets.append(parse_endpoint(a))
            except ValueError as e:
                return PunchResp(False, f"bad address: {e}")
        if relayed.relayed_from and req.port and (relayed.relayed_from, req.port) not in targets:
            targets.append((relayed.relayed_from, req.port))  # (where its relay saw it, its port)
        self._asked = {p: t for p, t in self._asked.items() if now - t < MIN_INTERVAL}
        self._asked[ctx.peer] = now
        assert self.host.nursery is not None
        if req.reachable:  # a reversal: dial it back directly
            self.host.nursery.start_soon(self._dial_back, ctx.peer, targets, relayed)
            return PunchResp(True, "")
        answered = trio.Event()
        self.host.nursery.start_soon(self._answer, ctx.peer, targets, port, relayed, answered)
        await trio.sleep(HEAD_START)
        answered.set()
        return PunchResp(True, "", tuple(self.candidates()))

    async def _answer(
        self,
        peer: PeerID,
        targets: list[tuple[str, int]],
        port: int,
        relayed: Connection,
        answered: trio.Event,
    ) -> None:
        """The peer's side of a punch: dial the dialer's addresses, serve what comes through."""
        self._running += 1
        event = self._awaiting[peer] = trio.Event()
        try:
            await self._dial_any(peer, targets, port, event, answered)
            with trio.move_on_after(self.handshake_timeout):
                await event.wait()
        finally:
            self._running -= 1
            if self._awaiting.get(peer) is event:
                del self._awaiting[peer]
        if event.is_set():
            self._succeeded(peer, relayed, "was dialed by")

    async def _dial_back(self, peer: PeerID, targets: list[tuple[str, int]], relayed: Connection) -> None:
        for host, port in targets:
            try:
                await self.host.connect(PeerAddress.for_host(host, port, peer), direct=True)
            except P2PError as e:
                log.debug("could not dial %s back at %s:%d: %s", peer.short(), host, port, e)
                continue
            self._succeeded(peer, relayed, "dialed back")
            return

    def _on_connection(self, conn: Connection, opened: bool) -> None:
        if opened and not conn.relayed and (event := self._awaiting.get(conn.peer)) is not None:
            event.set()

    def _succeeded(self, peer: PeerID, relayed: Connection, how: str) -> None:
        self.works = True
        direct = self.host.connection(peer)
        if direct is not None and not direct.relayed:
            direct.keep_open = True  # (its NAT entries are not made again without another punch)
        log.info("%s %s directly: hole punched, the relay is left", how, peer.short())
        assert self.host.nursery is not None
        self.host.nursery.start_soon(self._retire, relayed)

    async def _retire(self, relayed: Connection) -> None:
        await trio.sleep(RELAYED_GRACE)
        if not relayed.closed:
            await relayed.aclose("upgraded to a direct connection")
