"""Circuit relays: a peer that nobody can dial (behind a NAT) is still reached, encrypted end to end.

Theory of operation. Any host relays unless told not to (``RelayConfig.enabled``). A peer that learned
it cannot be dialed keeps a *reservation* with every relay it can reach, up to a few (the node decides
how many): ``relay.reserve`` over its own outbound connection, renewed before it runs out; a relay whose
connection closed is dropped at once (the last one with a warning), so losing one relay does not cut
the peer off while it holds others. Others then reach it at a *circuit address*::

    /ip4/RELAY_HOST/tcp/PORT/p2p/RELAY_ID/p2p-circuit/p2p/TARGET_ID

A dialer of such an address connects to the relay as to any peer and opens ``relay.connect`` naming the
target; the relay opens ``relay.incoming`` on the target's connection, answers the dialer with one byte,
and copies bytes both ways. Over that pipe the two ends run the usual handshake and secure channel, as
over TCP: the relay carries ciphertext it cannot read, and cannot pose as the target (the dialer checks
the target's id in the handshake, the target the dialer's). A target takes incoming circuits only from
relays it holds a reservation with.

Limits (a relay spends its own bandwidth on others): reservations in all and per subnet, circuits in
all and per target, and the bytes and seconds of each circuit; a circuit past its limit is cut. Refusals
say why. A relayed connection counts, for the target, as coming from the relay's address: what the relay
says about the dialer's address is not checked.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import trio

from ..errors import P2PError, PeerUnavailable, RemoteProtocolError
from ..identity import PEER_ID_BYTES, PeerID
from ..wire.schema import Message, bounded
from .address import PeerAddress
from .admission import subnet_of
from .connection import Connection
from .rpc import CallContext, Method, RpcRegistry
from .streams import RpcStream

log = logging.getLogger(__name__)

OPEN = b"\x01"  # the relay's first byte to a dialer: the target was asked; its handshake follows


@dataclass(frozen=True)
class RelayConfig:
    enabled: bool = True  # serve reservations and circuits for others
    max_reservations: int = 128
    max_reservations_per_subnet: int = 8  # (/24, /64): identities are free, subnets are not
    max_circuits: int = 256
    max_circuits_per_peer: int = 16  # circuits to one target at a time
    max_bytes: int = 1 << 30  # per circuit, both ways together; then it is cut
    max_seconds: float = 3600.0  # per circuit
    reservation_ttl: float = 600.0  # a reservation lapses unless renewed (it is, at half this)


@dataclass(frozen=True)
class ReserveReq(Message):
    pass


@dataclass(frozen=True)
class ReserveResp(Message):
    ok: bool = False
    reason: str = bounded("", max_len=300)
    ttl: float = bounded(0.0, ge=0.0, le=86400.0)


@dataclass(frozen=True)
class ConnectReq(Message):
    target: bytes = bounded(max_len=PEER_ID_BYTES)


@dataclass(frozen=True)
class IncomingReq(Message):
    source: bytes = bounded(max_len=PEER_ID_BYTES)
    source_host: str = bounded("", max_len=64)  # where the relay sees the dialer (for a hole punch)


@dataclass(frozen=True)
class CircuitResp(Message):
    ok: bool = False
    reason: str = bounded("", max_len=300)


RESERVE = Method("relay.reserve", ReserveReq, ReserveResp)
CONNECT = Method("relay.connect", ConnectReq, CircuitResp, streaming=True)
INCOMING = Method("relay.incoming", IncomingReq, CircuitResp, streaming=True)


class CircuitStream(trio.abc.HalfCloseableStream):
    """One end of a circuit as a byte stream (the RPC stream it travels in, under a trio interface)."""

    def __init__(self, rpc: RpcStream, leftover: bytes = b"") -> None:
        self._rpc = rpc
        self._pending = memoryview(leftover)  # the rest of the last chunk, not yet read
        self.closed = trio.Event()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self.closed.is_set():
            raise trio.ClosedResourceError("the circuit is closed")
        try:
            await self._rpc.send(memoryview(data))
        except P2PError as e:
            raise trio.BrokenResourceError(f"the circuit broke: {e}") from None

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def send_eof(self) -> None:
        with contextlib.suppress(P2PError):
            await self._rpc.send_eof()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self.closed.is_set():
            raise trio.ClosedResourceError("the circuit is closed")
        if not self._pending:
            try:
                self._pending = await self._rpc.receive_some()
            except P2PError as e:
                raise trio.BrokenResourceError(f"the circuit broke: {e}") from None
        n = len(self._pending) if max_bytes is None else min(max_bytes, len(self._pending))
        out, self._pending = self._pending[:n], self._pending[n:]  # (views: one copy, below)
        return bytes(out)

    async def aclose(self) -> None:
        if not self.closed.is_set():
            self.closed.set()
            with contextlib.suppress(P2PError, trio.BrokenResourceError, trio.ClosedResourceError):
                await self._rpc.send_eof()
        await trio.lowlevel.checkpoint()


class RelayHost(Protocol):
    """What a relay needs of the host it belongs to (its owner, :class:`~p2ptrain.net.host.Host`)."""

    peer_id: PeerID
    registry: RpcRegistry
    clock: Callable[[], float]

    def connection(self, peer: PeerID) -> Connection | None: ...

    def on_connection(self, observer: Callable[[Connection, bool], None]) -> None: ...

    async def connect(
        self, address: PeerAddress | str, *, timeout: float | None = None, direct: bool = False
    ) -> Connection: ...

    async def accept_relayed(self, stream: trio.abc.Stream, relay_host: str, seen_at: str = "") -> None: ...


class Relay:
    """A host's relay service (for others) and its reservations (with others)."""

    def __init__(self, host: RelayHost, config: RelayConfig) -> None:
        self.host = host
        self.config = config
        self.reserved: dict[PeerID, float] = {}  # peers holding a reservation here -> until when
        self.circuits: Counter[PeerID] = Counter()  # target -> circuits open through this relay
        self.relays: dict[PeerID, PeerAddress] = {}  # relays this host holds a reservation with
        self._last_circuit: PeerAddress | None = None  # (see ``known_circuit``)
        self.relayed_bytes = 0  # bytes copied for others (both ways)
        reg = host.registry
        reg.add_unary(RESERVE, self._on_reserve)
        reg.add_stream(CONNECT, self._on_connect)
        reg.add_stream(INCOMING, self._on_incoming)
        host.on_connection(self._on_connection)

    def _on_connection(self, conn: Connection, opened: bool) -> None:
        """A relay this host held a reservation with is gone once its connection is: say so (plainly if
        it was the last one) and stop listing it."""
        if opened or conn.relayed or conn.peer not in self.relays or self.host.connection(conn.peer):
            return
        del self.relays[conn.peer]
        why = conn.close_reason or "closed"
        if why == "shutting down":
            return
        if self.relays:
            log.info(
                "lost relay %s (%s); still reached through %d other relay(s): %s",
                conn.peer.short(),
                why,
                len(self.relays),
                ", ".join(p.short() for p in self.relays),
            )
        else:
            log.warning(
                "lost relay %s (%s), the last relay this node held a reservation with: until it finds "
                "another, peers that cannot dial it (behind a NAT) reach it only over connections already "
                "open or punched; it looks for another reachable peer to relay for it",
                conn.peer.short(),
                why,
            )

    # ---- the relay's side ----------------------------------------------------------------------------

    async def _on_reserve(self, ctx: CallContext, req: ReserveReq) -> ReserveResp:
        cfg, now = self.config, self.host.clock()
        self.reserved = {p: t for p, t in self.reserved.items() if t > now}
        if not cfg.enabled:
            return ReserveResp(False, "this host does not relay")
        if ctx.peer not in self.reserved:
            if len(self.reserved) >= cfg.max_reservations:
                return ReserveResp(False, "no reservation left here")
            subnet = subnet_of(ctx.remote_host)
            conns = (self.host.connection(p) for p in self.reserved)
            same = sum(1 for c in conns if c is not None and subnet_of(c.remote_host) == subnet)
            if same >= cfg.max_reservations_per_subnet:
                return ReserveResp(False, f"no reservation left here for {subnet}")
            log.info("%s reserved a relay slot here", ctx.peer.short())
        self.reserved[ctx.peer] = now + cfg.reservation_ttl
        conn = self.host.connection(ctx.peer)
        if conn is not None:  # its connection is how it is reached: never closed for idleness
            conn.keep_open = True
        return ReserveResp(True, "", cfg.reservation_ttl)

    def holds(self, peer: PeerID) -> bool:
        """Does ``peer`` hold a reservation here now (its connection is not evicted)?"""
        return self.reserved.get(peer, 0.0) > self.host.clock()

    def _refusal(self, target: PeerID) -> str:
        cfg = self.config
        if not cfg.enabled:
            return "this host does not relay"
        if not self.holds(target):
            return f"{target.short()} holds no reservation here"
        if sum(self.circuits.values()) >= cfg.max_circuits:
            return "too many circuits through this relay"
        if self.circuits[target] >= cfg.max_circuits_per_peer:
            return f"too many circuits to {target.short()}"
        return ""

    async def _on_connect(self, ctx: CallContext, req: ConnectReq, stream: RpcStream) -> CircuitResp:
        if len(req.target) != PEER_ID_BYTES:
            raise RemoteProtocolError("bad target peer id")
        target = PeerID(req.target)
        why = self._refusal(target)
        conn = self.host.connection(target)
        if not why and conn is None:
            why = f"{target.short()} is not connected to this relay"
        if why or conn is None:
            return CircuitResp(False, why)
        self.circuits[target] += 1
        try:
            with trio.move_on_after(self.config.max_seconds) as scope:
                async with conn.open_stream(
                    INCOMING,
                    IncomingReq(ctx.peer.digest, ctx.remote_host[:64]),
                    timeout=self.config.max_seconds + 60,
                ) as inner:
                    await stream.send(OPEN)
                    cut = await self._splice(stream, inner)
            if scope.cancelled_caught:
                cut = f"the circuit's {self.config.max_seconds:g} s are over"
        except P2PError as e:
            return CircuitResp(False, f"the circuit to {target.short()} broke: {e}")
        finally:
            self.circuits[target] -= 1
            self.circuits = +self.circuits
        return CircuitResp(not cut, cut)

    async def _splice(self, a: RpcStream, b: RpcStream) -> str:
        """Copy both ways until both ends sent EOF; "" then, or why the circuit was cut."""
        cut = ""
        moved = 0

        async def copy(src: RpcStream, dst: RpcStream) -> None:
            nonlocal cut, moved
            try:
                while chunk := await src.receive_some():
                    moved += len(chunk)
                    self.relayed_bytes += len(chunk)
                    if moved > self.config.max_bytes:
                        cut = f"the circuit's {self.config.max_bytes} bytes are used up"
                        nursery.cancel_scope.cancel()
                        return
                    await dst.send(chunk)
                await dst.send_eof()
            except P2PError as e:  # one end is gone: so is the circuit
                cut = cut or f"an end went away: {e}"
                nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(copy, a, b)
            nursery.start_soon(copy, b, a)
        return cut

    # ---- the target's side -------------------------------------------------------------------------

    async def _on_incoming(self, ctx: CallContext, req: IncomingReq, stream: RpcStream) -> CircuitResp:
        if ctx.peer not in self.relays:
            return CircuitResp(False, "this host holds no reservation with you")
        async with CircuitStream(stream) as pipe:
            await self.host.accept_relayed(pipe, ctx.remote_host, req.source_host)
        return CircuitResp(True, "")

    async def reserve(self, relay: PeerAddress, *, timeout: float = 10.0) -> float:
        """Ask ``relay`` for a reservation; its lifetime in seconds (PeerUnavailable if refused)."""
        if relay.peer_id is None:
            raise PeerUnavailable("a relay's address needs its peer id")
        conn = await self.host.connect(relay, timeout=timeout)
        if conn.relayed:
            raise PeerUnavailable(f"{relay.peer_id.short()} is reached through a relay itself")
        resp = await conn.call(RESERVE, ReserveReq(), timeout=timeout)
        if not resp.ok:
            raise PeerUnavailable(f"relay {relay.peer_id.short()} refused a reservation: {resp.reason}")
        conn.keep_open = True  # (between renewals it may carry nothing for longer than the idle timeout)
        self.relays[relay.peer_id] = relay
        self._last_circuit = relay.circuit_to(self.host.peer_id)
        return resp.ttl

    def circuit_addresses(self) -> list[PeerAddress]:
        """This host's addresses through the relays it holds a reservation with."""
        return [a.circuit_to(self.host.peer_id) for a in self.relays.values()]

    def known_circuit(self) -> PeerAddress | None:
        """Where others know this host behind a NAT: its first circuit address, else the last one it
        had (its relays are gone: peers connected to it directly still reach it by its id, and the
        address names it in their DHT tables and rounds), None if it never had one."""
        circuits = self.circuit_addresses()
        return circuits[0] if circuits else self._last_circuit

    # ---- the dialer's side -------------------------------------------------------------------------

    async def open_circuit(
        self, relay: Connection, target: PeerID, *, task_status: trio.TaskStatus[CircuitStream]
    ) -> None:
        """Open a circuit through ``relay`` to ``target`` and hand its stream over; return once the
        stream is closed (run it in a nursery that outlives the connection made over it)."""
        async with relay.open_stream(
            CONNECT, ConnectReq(target.digest), timeout=self.config.max_seconds + 60
        ) as stream:
            first = await stream.receive_some()
            if not first:
                resp = await stream.response()
                raise PeerUnavailable(f"relay {relay.peer.short()}: {resp.reason or 'no circuit'}")
            if first[:1] != OPEN:
                raise RemoteProtocolError(f"relay {relay.peer.short()} broke the circuit protocol")
            pipe = CircuitStream(stream, bytes(first[1:]))
            task_status.started(pipe)
            await pipe.closed.wait()
