"""Hole punching: a relayed connection upgraded to a direct one where the NATs allow it.

Theory of operation. Home routers let in only what looks like an answer: a TCP SYN from (X, x) to the
router's (R, r) passes if a packet went out from r to (X, x) a moment before. Linux and most home
routers keep a connection's source port when they can (an *endpoint-independent* mapping), so a host
behind one is seen from everywhere at its router's address and its own port.

When a host dialed a peer through a relay (``relay``), it asks that peer, over the new end-to-end
encrypted connection, to ``punch.connect``, listing where it can be dialed directly: the address its
peers see it at with its listening port (``Puncher.where``). The peer answers with its own such
addresses, but first sends one connection attempt from its listening port to each of the dialer's,
abandoned at once (``Transport.open_mapping``): it dies at the dialer's router, and leaves in the
peer's router the entry that lets the dialer's SYN in. The dialer, on the answer, dials those addresses
from its own listening port, so its router maps it where the peer's attempt was aimed; the peer's
listener accepts it like any inbound connection and the handshake runs as usual (so each end checks the
other's id: a wrong address reaches nobody who can finish it). The newest connection to a peer is the
one used, so calls move to the direct connection at once; the relayed one is closed a little later.
A dialer that is reachable itself (a public peer dialing a NATed one through a relay) is dialed back
directly instead (a *reversal*).

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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from ..errors import P2PError
from ..wire.schema import Message, bounded
from .rpc import CallContext, Method

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..identity import PeerID
    from .address import PeerAddress
    from .connection import Connection
    from .host import Host

log = logging.getLogger(__name__)

MAX_ADDRESSES = 4
PUNCH_TIMEOUT = 10.0  # seconds a punch's dials have (SYNs retransmit at 1, 3, 7 s)
MIN_INTERVAL = 30.0  # seconds between two punch requests a peer is answered
MAX_RUNNING = 8  # punches answered at once
RELAYED_GRACE = 30.0  # seconds a relayed connection lives on beside the direct one (calls in flight)
RETRY = 120.0  # seconds before ``reach`` tries a peer again


@dataclass(frozen=True)
class PunchReq(Message):
    addresses: tuple[str, ...] = bounded((), max_len=MAX_ADDRESSES)  # "host:port", IP literals
    reachable: bool = False  # the dialer can be dialed at them as they are: dial it back


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


def endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Puncher:
    """A host's hole punching: the dialer's side (``upgrade``) and the answering side (``punch.connect``)."""

    def __init__(self, host: Host, *, enabled: bool = True) -> None:
        self.host = host
        self.enabled = enabled
        # (public host as peers observe it, reachable?) for this host: set by whoever learns them (the DHT)
        self.where: Callable[[], tuple[str | None, bool | None]] = lambda: (None, None)
        self.works = False  # a punch with this host on one end succeeded
        self.punched = 0  # direct connections made by punching (either end)
        self._asked: dict[PeerID, float] = {}  # peer -> when its last request was answered
        self._running = 0
        self._awaiting: dict[PeerID, trio.Event] = {}  # peers whose direct dial this host waits for
        self._tried: dict[PeerID, float] = {}  # peer -> when ``reach`` last tried it
        host.registry.add_unary(PUNCH, self._on_punch)
        host.on_connection(self._on_connection)

    def candidates(self) -> list[str]:
        """Where this host may be dialed directly: its observed public address at its listening port,
        and its concrete listening addresses (peers on the same network)."""
        public, _ = self.where()
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
        connection this host dialed before. A peer is tried once per ``RETRY`` seconds; failures are
        logged, not raised."""
        peer, now = address.peer_id, trio.current_time()
        if peer is None or not self.enabled or now - self._tried.get(peer, -RETRY) < RETRY:
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
        _, reachable = self.where()
        mine = self.candidates()
        try:
            resp = await relayed.call(PUNCH, PunchReq(tuple(mine), bool(reachable)), timeout=PUNCH_TIMEOUT)
        except P2PError as e:
            log.info("no hole punch with %s: %s", peer.short(), e)
            return None
        if not resp.ok:
            log.info("no hole punch with %s: %s", peer.short(), resp.reason)
            return None
        if reachable:  # it dials back (or cannot): wait for that connection
            direct = await self._wait_direct(peer)
        else:
            direct = await self._dial_any(peer, resp.addresses, port)
        if direct is None:
            log.info("hole punch with %s failed: staying relayed", peer.short())
            return None
        self._succeeded(peer, relayed, "dialed")
        return direct

    async def _dial_any(self, peer: PeerID, addresses: tuple[str, ...], port: int) -> Connection | None:
        """Dial every address at once from ``port``; the first connection that finishes the handshake
        with ``peer`` wins, the rest are cancelled."""
        won: Connection | None = None
        endpoints = []
        for a in addresses[:MAX_ADDRESSES]:
            try:
                endpoints.append(parse_endpoint(a))
            except ValueError:
                log.debug("%s gave a bad address to punch to: %r", peer.short(), a)

        async def one(host: str, p: int) -> None:
            nonlocal won
            try:
                stream = await self.host.transport.connect(host, p, local_port=port)
            except OSError as e:
                log.debug("punch dial to %s:%d failed: %s", host, p, e)
                return
            try:
                conn = await self.host.establish(stream, host, p, peer)
            except P2PError as e:
                log.debug("punch dial to %s:%d: %s", host, p, e)
                return
            if won is None:
                won = conn
                nursery.cancel_scope.cancel()
            else:
                await conn.aclose("a direct connection exists already")

        with trio.move_on_after(PUNCH_TIMEOUT):
            async with trio.open_nursery() as nursery:
                for host, p in endpoints:
                    nursery.start_soon(one, host, p)
        return won

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
        self._asked = {p: t for p, t in self._asked.items() if now - t < MIN_INTERVAL}
        self._asked[ctx.peer] = now
        targets = []
        for a in req.addresses[:MAX_ADDRESSES]:
            try:
                targets.append(parse_endpoint(a))
            except ValueError as e:
                return PunchResp(False, f"bad address: {e}")
        assert self.host.nursery is not None
        if req.reachable:  # a reversal: dial it back directly
            self.host.nursery.start_soon(self._dial_back, ctx.peer, targets, relayed)
            return PunchResp(True, "")
        self._awaiting[ctx.peer] = trio.Event()
        self.host.nursery.start_soon(self._await_dial, ctx.peer, relayed)
        self._running += 1
        try:
            with trio.move_on_after(1.0):  # (a slow attempt must not hold the answer)
                async with trio.open_nursery() as nursery:
                    for host, p in targets:
                        nursery.start_soon(self._open, host, p, port)
        finally:
            self._running -= 1
        return PunchResp(True, "", tuple(self.candidates()))

    async def _open(self, host: str, port: int, local_port: int) -> None:
        try:
            await self.host.transport.open_mapping(host, port, local_port)
        except OSError as e:
            log.debug("could not open a mapping towards %s:%d: %s", host, port, e)

    async def _await_dial(self, peer: PeerID, relayed: Connection) -> None:
        event = self._awaiting[peer]
        with trio.move_on_after(PUNCH_TIMEOUT + 5.0):
            await event.wait()
        if self._awaiting.get(peer) is event:
            del self._awaiting[peer]
        if event.is_set():
            self._succeeded(peer, relayed, "was dialed by")

    async def _dial_back(self, peer: PeerID, targets: list[tuple[str, int]], relayed: Connection) -> None:
        from .address import PeerAddress

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

    async def _wait_direct(self, peer: PeerID) -> Connection | None:
        self._awaiting[peer] = event = trio.Event()
        with trio.move_on_after(PUNCH_TIMEOUT):
            await event.wait()
        if self._awaiting.get(peer) is event:
            del self._awaiting[peer]
        conn = self.host.connection(peer)
        return conn if event.is_set() and conn is not None and not conn.relayed else None

    def _succeeded(self, peer: PeerID, relayed: Connection, how: str) -> None:
        self.works = True
        self.punched += 1
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
