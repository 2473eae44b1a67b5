"""Hole punching: a relayed connection upgraded to a direct one where the NATs allow it.

Theory of operation. Home routers let in only what looks like an answer: a TCP SYN from (X, x) to the
router's (R, r) passes if a packet went out from r to (X, x) a moment before. Linux and most home
routers keep a connection's source port when they can (an *endpoint-independent* mapping), so a host
behind one is seen from everywhere at its router's address and its own port.

When a host dialed a peer through a relay (``relay``), it asks that peer, over the new end-to-end
encrypted connection, to ``punch.connect``, listing where it can be dialed directly: the address its
peers see it at with its listening port (the host's ``Location``; a dialer that joined through that very
circuit waits a little for its first direct peers to tell, ``Location.checked``). The peer answers with
its own such addresses. The dialer dials them from its listening port, then tells the peer (``punch.go``,
over the relay) to dial the dialer's addresses from its own listening port. The two dials meet in a TCP
*simultaneous open*, one connection both dials return. (An attempt abandoned early would not do: the
router tracks the SYN's sequence numbers, and a listener's answer from a new socket does not match them.)

Many home routers answer a SYN that no entry of theirs expects, addressed to the router itself, with a
TCP reset, and the reset closes, in the other router, the entry that the other side's own SYN had
opened (the SYNs would have to cross in flight, within one trip between the routers). So each dial's
first SYN goes out with a TTL of ``PRIME_TTL``: it opens the dialing host's own router's entry and dies
at the next hop, before the peer's router (``TcpTransport.connect_primed``; the socket lives on, and its
retransmissions, the first a second later, go the whole way). The dialer's first SYN is out before the
peer dials, so the peer's SYNs find the dialer's router open and the dialer's dial waiting; the peer's
own first SYN opens its router for the dialer's retransmission. A dial that a reset ends anyway is made
again, primed again, after ``REDIAL`` (jittered, so the two sides never stay in step), until
``PUNCH_TIMEOUT``; and a dialer asks up to ``ATTEMPTS`` times before it stays relayed. (A peer that
hears no "go", from an older dialer, dials after ``GO_WAIT``.)

Over the direct connection the dialer runs the handshake's initiator side and the peer the responder's,
as with any inbound connection, so each end checks the other's id: a wrong address reaches nobody who
can finish it. The newest connection to a peer is the one used, so calls move to the direct connection
at once; the relayed one is closed a little later. A dialer that is reachable itself (a public peer
dialing a NATed one through a relay) is dialed back directly instead (a *reversal*). A host that loses
the relayed connection to a peer it could not punch with says so at WARNING (which peer, why, what
would fix it).

A symmetric NAT maps each connection to a new port: the attempt and the dial then never meet, the
punch fails after ``PUNCH_TIMEOUT``, and the peers stay relayed. ``Puncher.works`` records whether a
punch with this host on either end succeeded: proof that its NAT maps ports as punching needs (the
averager then lets the host reduce a share, see ``averaging``).

What a peer says is bounded: at most ``MAX_ADDRESSES`` IP literals (never names), attempts only over
relayed connections, ``ATTEMPTS`` requests per peer per ``MIN_INTERVAL`` and ``MAX_RUNNING`` at a time;
the worst a liar gets is a few SYNs sent where it said.
"""

from __future__ import annotations

import errno
import logging
import random
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
PRIME_TTL = 2  # hops a dial's first SYN lives: out of this host's own router, dead at the next one
GO_AFTER = 0.05  # seconds the dialer's dials have before it tells the peer to dial (their SYNs first)
GO_WAIT = 2.0  # seconds the peer waits for the dialer's "go" before dialing anyway (an older dialer)
REDIAL = 0.5  # seconds between dials to one address that failed at once (a reset), +-50% jitter
ATTEMPTS = 3  # punches a dialer tries in a row before it stays relayed ...
ATTEMPT_PAUSE = 2.0  # ... seconds apart (+-50%)
MIN_INTERVAL = 30.0  # seconds in which a peer's punch requests are answered ``ATTEMPTS`` times at most
MAX_RUNNING = 8  # punches answered at once
RELAYED_GRACE = 30.0  # seconds a relayed connection lives on beside the direct one (calls in flight)
RETRY = 120.0  # seconds before ``reach`` tries a peer again
MAX_FAILED = 256  # peers whose failed punch a host remembers (to say why, should their relay go)
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


@dataclass(frozen=True)
class GoReq(Message):
    pass


@dataclass(frozen=True)
class GoResp(Message):
    ok: bool = False


PUNCH = Method("punch.connect", PunchReq, PunchResp)
GO = Method("punch.go", GoReq, GoResp)  # the dialer primed its router and dials: the peer dials now


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
        self._asked: dict[PeerID, list[float]] = {}  # peer -> when its recent requests were answered
        self._running = 0
        self._awaiting: dict[PeerID, trio.Event] = {}  # peers whose direct dial this host waits for
        self._go: dict[PeerID, trio.Event] = {}  # peers this host answered and waits for the "go" of
        self._tried: dict[PeerID, float] = {}  # peer -> when ``reach`` last tried it
        self._failed: dict[PeerID, str] = {}  # peer -> why the last punch with it failed (until one works)
        host.registry.add_unary(PUNCH, self._on_punch)
        host.registry.add_unary(GO, self._on_go)
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
        """Try to replace ``relayed`` (an outbound connection through a relay) by a direct one, up to
        ``ATTEMPTS`` times; the direct connection, or None (the reason logged)."""
        if not self.enabled or not self.listen_port():
            return None
        with trio.move_on_after(LEARN_TIMEOUT):  # a node that joined through a circuit learns it soon
            await self.location.checked.wait()
        for attempt in range(1, ATTEMPTS + 1):
            direct, why = await self._attempt(relayed)
            if direct is not None:
                self._succeeded(relayed.peer, relayed, "dialed")
                return direct
            last = attempt == ATTEMPTS or relayed.closed or why.startswith("refused")
            log.info(
                "hole punch with %s failed (attempt %d of %d): %s%s",
                relayed.peer.short(),
                attempt,
                ATTEMPTS,
                why,
                ": staying relayed" if last else "; trying again",
            )
            if last:
                self._failure(relayed.peer, why)
                break
            await trio.sleep(ATTEMPT_PAUSE * random.uniform(0.5, 1.5))
        return None

    async def _attempt(self, relayed: Connection) -> tuple[Connection | None, str]:
        """One punch over ``relayed``: the direct connection, or None and why not."""
        peer, port = relayed.peer, self.listen_port()
        reachable = self.location.reachable
        mine = self.candidates()
        try:
            req = PunchReq(tuple(mine), bool(reachable), port)
            resp = await relayed.call(PUNCH, req, timeout=PUNCH_TIMEOUT)
        except P2PError as e:
            return None, f"refused: {e}"
        if not resp.ok:
            return None, f"refused: {resp.reason}"
        event = self._awaiting[peer] = trio.Event()  # (the peer's own dial may get through first)
        try:
            if reachable:  # it dials back (or cannot): wait for that connection
                with trio.move_on_after(PUNCH_TIMEOUT):
                    await event.wait()
            else:
                # Dial first (a low first SYN: it opens our router's mapping and dies before the
                # peer's), then tell the peer to dial: its SYN gets in here and meets our dial's.
                targets = _endpoints(peer, resp.addresses)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._send_go, relayed)
                    await self._dial_any(peer, targets, port, event)
                    nursery.cancel_scope.cancel()
        finally:
            if self._awaiting.get(peer) is event:
                del self._awaiting[peer]
        direct = self.host.connection(peer)
        if direct is None or direct.relayed:
            return None, f"no direct connection in {PUNCH_TIMEOUT:g} s"
        return direct, ""

    async def _send_go(self, relayed: Connection) -> None:
        await trio.sleep(GO_AFTER)  # (our first SYNs out)
        try:
            await relayed.call(GO, GoReq(), timeout=PUNCH_TIMEOUT)
        except P2PError as e:  # (an older peer: it dials after ``GO_WAIT`` by itself)
            log.debug("no punch go to %s: %s", relayed.peer.short(), e)

    async def _dial_any(
        self,
        peer: PeerID,
        endpoints: list[tuple[str, int]],
        port: int,
        done: trio.Event,
        *,
        initiate: bool = True,
    ) -> None:
        """Dial every endpoint at once from ``port`` (again after a reset, primed anew) until
        ``PUNCH_TIMEOUT`` or ``done`` (a direct connection with ``peer`` opened); the first stream wins
        and the other dials are cancelled. On it, the dialer (``initiate``) runs the handshake's initiator
        side; the peer serves it as an inbound connection."""
        deadline = trio.current_time() + PUNCH_TIMEOUT

        primed_dial = getattr(self.host.transport, "connect_primed", None)

        async def one(host: str, p: int) -> None:
            low = primed_dial is not None
            while True:
                try:
                    if low and primed_dial is not None:
                        stream = await primed_dial(host, p, local_port=port, ttl=PRIME_TTL)
                    else:
                        stream = await self.host.transport.connect(host, p, local_port=port)
                    break
                except OSError as e:
                    log.debug("punch dial to %s:%d failed: %s", host, p, e)
                    if low and e.errno == errno.EHOSTUNREACH:
                        low = False  # (a system that gave up on the low SYN: it opened the mapping)
                        continue
                    # a reset: the mapping on either side may be gone; dial anew, primed, a little later
                    low = primed_dial is not None
                    pause = REDIAL * random.uniform(0.5, 1.5)  # (two sides never stay in step)
                    await trio.sleep(min(pause, max(0.0, deadline - trio.current_time())))
            nursery.cancel_scope.cancel()  # (the other dials: this one is through)
            if not initiate:
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
        recent = [t for t in self._asked.get(ctx.peer, []) if now - t < MIN_INTERVAL]
        if len(recent) >= ATTEMPTS:
            return PunchResp(False, f"{ATTEMPTS} punches per {MIN_INTERVAL:g} s at most")
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
        self._asked = {p: ts for p, ts in self._asked.items() if any(now - t < MIN_INTERVAL for t in ts)}
        self._asked[ctx.peer] = [*recent, now]
        assert self.host.nursery is not None
        if req.reachable:  # a reversal: dial it back directly
            self.host.nursery.start_soon(self._dial_back, ctx.peer, targets, relayed)
            return PunchResp(True, "")
        go = self._go[ctx.peer] = trio.Event()
        event = self._awaiting[ctx.peer] = trio.Event()
        self._running += 1
        self.host.nursery.start_soon(self._answer, ctx.peer, targets, port, relayed, go, event)
        return PunchResp(True, "", tuple(self.candidates()))

    async def _on_go(self, ctx: CallContext, req: GoReq) -> GoResp:
        go = self._go.get(ctx.peer)
        if go is None or not ctx.relayed:
            return GoResp(False)
        go.set()
        return GoResp(True)

    async def _answer(
        self,
        peer: PeerID,
        targets: list[tuple[str, int]],
        port: int,
        relayed: Connection,
        go: trio.Event,
        event: trio.Event,
    ) -> None:
        """The peer's side of a punch: once the dialer primed its router (its "go", or ``GO_WAIT``),
        dial the dialer's addresses; serve what comes through (the dialer initiates)."""
        try:
            with trio.move_on_after(GO_WAIT):
                await go.wait()
            if not event.is_set():
                await self._dial_any(peer, targets, port, event, initiate=False)
            with trio.move_on_after(self.handshake_timeout):
                await event.wait()
        finally:
            self._running -= 1
            if self._awaiting.get(peer) is event:
                del self._awaiting[peer]
            if self._go.get(peer) is go:
                del self._go[peer]
        if event.is_set():
            self._succeeded(peer, relayed, "was dialed by")
        else:
            self._failure(peer, f"no direct connection in {PUNCH_TIMEOUT:g} s")

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
        if (
            not opened
            and conn.relayed
            and conn.peer in self._failed
            and self.host.connection(conn.peer) is None
        ):
            self._lost(conn)

    def failure(self, peer: PeerID) -> str:
        """Why the last punch with ``peer`` failed ("" if none did, or one worked since)."""
        return self._failed.get(peer, "")

    def _failure(self, peer: PeerID, why: str) -> None:
        self._failed.pop(peer, None)
        self._failed[peer] = why
        while len(self._failed) > MAX_FAILED:
            del self._failed[next(iter(self._failed))]

    def _lost(self, conn: Connection) -> None:
        """The relayed connection to a peer this host could not punch with closed, and no other one is
        left: say which peer, why, and what would fix it."""
        why = conn.close_reason or "closed"
        if why == "shutting down":
            return
        log.warning(
            "lost touch with peer %s: this node reached it only through the relay at %s, and that "
            "connection is gone (%s); a hole punch with it had failed (%s: the NATs in the way map each "
            "connection to a new port, or a firewall drops what punching sends). The two stay apart "
            "until a relay both can reach is back. To fix it for good: forward a port to one of them "
            "(and start it with --announce), or keep a public peer in the swarm",
            conn.peer.short(),
            conn.remote_host,
            why,
            self._failed[conn.peer],
        )

    def _succeeded(self, peer: PeerID, relayed: Connection, how: str) -> None:
        self.works = True
        self._failed.pop(peer, None)
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
