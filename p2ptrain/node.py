"""The node: a host, the DHT, built-in methods, join maintenance and the status file, in one nursery.

Theory of operation: ``Node.run`` starts the host (listeners and connections), the DHT (bootstrapped
from the join addresses), one task per join address that keeps a connection to it open (reconnecting
with capped exponential backoff and jitter), a task that announces this node in the run's peer list and
reads the list back (every ``members_interval`` seconds while it changes, up to ``MEMBERS_BACKOFF`` times
as long while it does not, and soon after a connection to a peer of its part of the list not on it
opens or one closes; a list of more than ``MEMBERS_PER_READ`` members, at most every
``n / MEMBERS_PER_READ`` intervals; where the run spreads the list over ``peer_list_buckets`` keys, its
own bucket's part only, see ``dht.peers``), a task
that rewrites the JSON status file atomically every ``status_interval`` seconds, and one that keeps the
peers known recently in ``peer_cache`` (read at the start: a restarted node finds its swarm again without
its join address).
Cancelling ``run`` closes every connection gracefully (peers hear ``shutting down``) and writes a final
status with ``state: "stopped"``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import trio

from . import peercache
from .averaging import Averager, AveragerConfig, RoundResult
from .config import RunConfig
from .dht.peers import Member, PeerRecord, announce, list_members, peer_list, withdraw
from .dht.service import DHT, DHTConfig
from .errors import HandshakeRefused, P2PError
from .identity import Identity, PeerID
from .idwork import find_work, work_bits
from .net.address import PeerAddress
from .net.connection import Connection
from .net.handshake import PROTOCOL_VERSION
from .net.host import Host, HostConfig
from .net.rpc import CallContext, Reply, RpcRegistry
from .net.transport import TcpTransport, Transport
from .nodebase import (
    INFO,
    PING,
    STATUS,
    InfoRequest,
    NodeInfo,
    PingRequest,
    PingResponse,
    StatusRequest,
    StatusResponse,
    member_json,
    public_status,
    validate_run_id,
)
from .version import __version__
from .web import serve_http

log = logging.getLogger(__name__)

MEMBERS_BACKOFF = 12  # a steady peer list is read this many times less often than ``members_interval``
# A list of more members than this is read less often, in proportion (see ``Node._members_loop``), and
# never staler than ``MEMBERS_BACKOFF`` intervals or a third of an announcement's life
MEMBERS_PER_READ = 64
T = TypeVar("T")


# relays a node nobody can dial keeps a reservation with: every reachable peer it knows, up to this many
# (each costs it a connection kept open and a renewal every few minutes), so losing one cuts nothing off
RELAYS = 4
RELAY_RETRY = 30.0  # seconds before a node that needs no relay looks again
RELAY_SOON = 5.0  # ... and one that needs a relay and has none
RELAY_BACKOFF = 300.0  # seconds before a peer that refused to relay (or failed to) is asked again
# Handshake refusals that retrying cannot change: another protocol or version, another run, another peer
# at that address, no membership of a private run. (``busy`` passes; id work is done on demand.)
LASTING_REFUSALS = frozenset({"protocol", "version", "run_id", "peer_id", "membership"})


def averaging_settings(run: RunConfig) -> AveragerConfig:
    """The averager's settings that a run file asks for."""
    a = run.averaging
    return AveragerConfig(
        target_size=a.max_group_size,
        min_size=1,
        matchmaking_time=a.matchmaking_time,
        bandwidth=a.bandwidth * 1e6,
        compression=a.compression,
        aggregation=a.aggregation,
        audit=a.audit,
    )


def id_work(identity: Identity, bits: int, data_dir: Path | None) -> bytes:
    """This id's work nonce for ``bits`` (see ``idwork``): read from ``data_dir/identity.work``, or found
    (about ``2**bits`` hashes) and kept there."""
    path = data_dir / "identity.work" if data_dir is not None else None
    if path is not None and path.exists():
        try:
            nonce = bytes.fromhex(path.read_text().strip())
        except (OSError, ValueError):
            nonce = b""
        if work_bits(identity.peer_id, nonce) >= bits:
            return nonce
    log.info("the run asks for %d bits of work on each peer id: finding them for ours (once)", bits)
    nonce = find_work(identity.peer_id, bits)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(nonce.hex() + "\n")
        except OSError as e:
            log.warning("cannot keep the id work in %s: %s", path, e)
    return nonce


@dataclass(frozen=True)
class NodeConfig:
    """What a node needs to start. ``listen`` is [(host, port)], ``join`` peer addresses."""

    run_id: str = "default"
    listen: tuple[tuple[str, int], ...] = (("0.0.0.0", 31337),)
    announce_host: str | None = None
    announce_port: int | None = None
    source_address: str | None = None  # outgoing connections leave from this local address
    join: tuple[PeerAddress, ...] = ()
    status_file: Path | None = None
    status_interval: float = 1.0
    peer_cache: Path | None = None  # where the peers known recently are kept across restarts (peercache)
    metrics: tuple[str, int] | None = None  # (host, port) of the HTTP /metrics and /healthz server
    host: HostConfig = field(default_factory=HostConfig)
    dht: DHTConfig = field(default_factory=DHTConfig)
    averaging: AveragerConfig = field(default_factory=AveragerConfig)
    reconnect_max_delay: float = 8.0  # a join peer back from a restart is found this soon (a SYN a try)
    announce_ttl: float = 180.0
    members_interval: float = 5.0  # seconds between reads of the peer list while it changes
    # keys the run's peer list spreads over (a power of 2; the run's ``progress.buckets``): this node
    # writes and reads its own bucket's, so ``Node.members`` is its part of the list (``dht.peers``)
    peer_list_buckets: int = 1
    authority: bytes | None = None  # a private run: the swarm authority's public key (None: open swarm)
    certificate: bytes | None = None  # this node's membership certificate (private runs)
    relay: bool = True  # relay for peers nobody can dial (``net.relay``; its limits: host.relay)


class Node:
    """A running member of a swarm. Use :meth:`run` under a nursery (``await nursery.start(node.run)``)."""

    def __init__(
        self,
        identity: Identity,
        config: NodeConfig,
        *,
        transport: Transport | None = None,
        clock: Callable[[], float] = time.time,
    ):
        """``clock`` is the wall clock for record expiry (tests pass ``trio.current_time``)."""
        self.identity = identity
        self.config = config
        validate_run_id(config.run_id)
        self._peer_list = peer_list(config.run_id, config.peer_list_buckets)  # (a power of 2, checked)
        self.registry = RpcRegistry()
        self.registry.add_unary(PING, self._on_ping)
        self.registry.add_unary(INFO, self._on_info)
        self.registry.add_unary(STATUS, self._on_status)
        host_config = config.host
        if config.announce_host:
            host_config = dataclasses.replace(host_config, announce_host=config.announce_host)
        if config.announce_port:
            host_config = dataclasses.replace(host_config, announce_port=config.announce_port)
        if config.authority is not None or config.certificate is not None:
            host_config = dataclasses.replace(
                host_config, authority=config.authority, certificate=config.certificate
            )
        if not config.relay:
            host_config = dataclasses.replace(
                host_config, relay=dataclasses.replace(host_config.relay, enabled=False)
            )
        if transport is None:
            transport = TcpTransport(config.source_address)
        self.host = Host(
            identity,
            config.run_id,
            transport=transport,
            registry=self.registry,
            config=host_config,
            clock=clock,
        )
        self.host.on_connection(self._on_connection)
        self.dht = DHT(
            self.host,
            config=config.dht,
            clock=clock,
            relayed_address=self._relayed_address,
            uplink=lambda: self.averager.bandwidth,  # (as its rounds measure it: sizes its replies in all)
        )
        self.averager = Averager(self.host, self.dht, config.averaging, clock=clock)
        self.members: list[Member] = []
        self._members_changed = trio.Event()  # a connection suggests the peer list changed: read it
        self.state = "starting"
        self.clock = clock
        self._started = clock()
        self._joined: set[str] = set()
        self._refused_joins: dict[str, str] = {}  # join address -> why it refused this node for good
        # Set when every join address refused this node for good (another run, another peer, no
        # membership) before any let it in: it cannot join the swarm it was pointed at (``join_refusal``
        # says why). The node itself goes on; the command line stops.
        self.join_refused = trio.Event()
        self.join_refusal = ""
        # What the peer list says this node processes per second (its trainer reports its samples/s).
        self._throughput = 0.0
        self._announced = -math.inf  # when this node last announced itself in the peer list
        self._relayed = trio.Event()  # set once this node holds a relay reservation
        # The peers the user told this node to join through (named in the address, or met there).
        self.join_peers: set[PeerID] = {a.peer_id for a in config.join if a.peer_id is not None}
        self.status_sections: dict[str, Callable[[], Any]] = {}  # more sections of the status file
        self.metrics_port: int | None = None

    @property
    def peer_id(self) -> PeerID:
        return self.identity.peer_id

    @property
    def addresses(self) -> list[PeerAddress]:
        """Addresses others can dial."""
        return self.host.advertised_addresses()

    def _relayed_address(self) -> PeerAddress | None:
        """Behind a NAT where hole punching works: the relayed address it serves the DHT at."""
        circuit = self.host.relay.known_circuit()  # (kept when the relays leave: punched peers stay)
        return circuit if self.host.punch.works and self.dht.client_only else None

    async def dialable_addresses(self, wait: float = 30.0) -> list[PeerAddress]:
        """The addresses others can join through: the advertised ones, once a peer dialed this node
        back there (a node with join addresses waits up to ``wait`` seconds for that check at its
        bootstrap); when no peer could (behind a NAT: the DHT said why), its addresses through the
        relays it holds a reservation with (waiting up to ``wait`` seconds more for one), else none.
        The swarm's first peer has nobody to ask yet: its addresses come unchecked, and it asks the
        first peers it meets."""
        if self.config.join:
            with trio.move_on_after(wait):
                await self.dht.reachability_checked.wait()
        if self.dht.reachable is not False:
            return self.addresses
        with trio.move_on_after(wait):
            await self._relayed.wait()
        return self.host.relay.circuit_addresses()

    async def run(self, *, task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.host.run, list(self.config.listen))
                for addr in self.config.join:
                    nursery.start_soon(self._keep_joined, addr)
                nursery.start_soon(self._keep_relayed)
                if self.config.peer_cache is not None:
                    self.dht.remember(peercache.load(self.config.peer_cache))
                    nursery.start_soon(self._cache_loop, self.config.peer_cache)
                await nursery.start(self.dht.run, list(self.config.join))
                await nursery.start(self.averager.run)
                nursery.start_soon(self._members_loop)
                if self.config.status_file:
                    nursery.start_soon(self._status_loop)
                if self.config.metrics is not None:
                    self.metrics_port = await nursery.start(serve_http, *self.config.metrics, self.status)
                self.state = "running"
                task_status.started(self)
        finally:
            self.state = "stopped"
            if self.config.status_file:
                self.write_status()
            if self.config.peer_cache is not None and (known := self.dht.recent_contacts()):
                peercache.save(self.config.peer_cache, known)

    async def average(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        weight: float = 1.0,
        timeout: float = 60.0,
        group_key: str = "default",
        compression: str | None = None,
    ) -> RoundResult:
        """Average ``tensors`` in place with a group of this run's peers.

        ``weight`` is this peer's share of the mean (for gradients, its sample count). Returns a
        :class:`~p2ptrain.averaging.RoundResult` (contributors, total weight, who was left out and why).
        Raises :class:`GroupTooSmall`, :class:`SchemaMismatch` or :class:`GroupFormationFailed` when no
        group formed, :class:`RoundAborted` (or :class:`RoundTimedOut`) when the round failed; then the
        tensors are unchanged.
        """
        return await self.averager.average(
            tensors, weight=weight, timeout=timeout, group_key=group_key, compression=compression
        )

    # ---- joining ----

    async def _keep_joined(self, addr: PeerAddress) -> None:
        """Keep a connection to a join address open, reconnecting with backoff."""
        delay = 1.0
        while True:
            try:
                conn = await self.host.connect(addr)
            except HandshakeRefused as e:
                if e.code in LASTING_REFUSALS:
                    log.error(
                        "join %s refused: %s (not retried: check the address and the run's settings)", addr, e
                    )
                    self._refused_joins[str(addr)] = str(e)
                    joins = {str(a) for a in self.config.join}
                    if not self._joined and joins <= set(self._refused_joins):
                        self.join_refusal = f"join {addr} refused: {e}"
                        self.join_refused.set()
                    return
                log.error("join %s refused: %s", addr, e)
            except P2PError as e:
                log.warning("cannot join %s yet: %s (retrying in %.0f s)", addr, e, delay)
            else:
                delay = 1.0
                conn.keep_open = True
                self.join_peers.add(conn.peer)
                if str(addr) not in self._joined:
                    self._joined.add(str(addr))
                    log.info("joined the swarm through %s", addr)
                await conn.wait_closed()
                log.info("lost the connection to join peer %s; reconnecting", conn.peer.short())
            await trio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(delay * 2, self.config.reconnect_max_delay)

    async def _keep_relayed(self) -> None:
        """Behind a NAT (no peer could dial this node back): hold reservations with every reachable peer
        it knows, up to ``RELAYS``, the join peers first, so that others reach this node through them
        (``relay``); renewed at half their lifetime; while it holds fewer, it looks for more (a relay
        that left, a public peer that came) every ``RELAY_RETRY`` seconds."""
        await self.dht.reachability_checked.wait()
        relays = self.host.relay.relays
        due: dict[PeerID, float] = {}  # relay -> when its reservation is renewed
        failed: dict[PeerID, float] = {}  # peer -> when it last refused or failed (asked again later)
        while True:
            now = self.clock()
            if self.dht.reachable is False:
                joins = [a.relay_address or a for a in self.config.join]  # (a circuit's relay is public)
                asked = set()
                for addr in [*relays.values(), *joins, *self.dht.recent_contacts()]:
                    peer = addr.peer_id
                    if peer is None or addr.relay is not None or peer == self.peer_id or peer in asked:
                        continue
                    if peer in relays and due.get(peer, 0.0) > now:
                        continue  # (held, not due yet)
                    backoff = relays and now - failed.get(peer, -RELAY_BACKOFF) < RELAY_BACKOFF  # (none: all)
                    if peer not in relays and (len(relays) >= RELAYS or backoff):
                        continue
                    asked.add(peer)
                    try:
                        got = await self.host.relay.reserve(addr)
                    except P2PError as e:
                        relays.pop(peer, None)
                        failed[peer] = self.clock()
                        log.info("no relay reservation with %s: %s", peer.short(), e)
                        continue
                    due[peer] = self.clock() + got / 2
                    if not self._relayed.is_set():
                        log.info("others reach this node through relay %s", peer.short())
                        self._relayed.set()
            held = [due[p] for p in relays if p in due]
            if not relays:
                wait = RELAY_RETRY if self.dht.reachable else RELAY_SOON
            else:
                wait = max(0.0, min(held, default=now + RELAY_RETRY) - self.clock())
                wait = wait if len(relays) >= RELAYS else min(wait, RELAY_RETRY)
            await trio.sleep(max(wait, 1.0))

    # ---- membership ----

    def report_throughput(self, samples_per_s: float) -> None:
        """What this node processes now, for its entry in the peer list (a trainer reports its samples/s
        after each batch; a node that trains nothing says 0)."""
        self._throughput = max(0.0, min(float(samples_per_s), 1e12))

    def peer_record(self) -> PeerRecord:
        return PeerRecord(
            addresses=tuple(str(a) for a in self.addresses[:8]),
            reachable=not self.dht.client_only,
            throughput=self._throughput,
            version=__version__,
            published=self.clock(),
        )

    def members_view(self) -> list[Member]:
        """The run's members as the peer list says, but this node as it is now. The list holds the record
        this node announced last, renewed every ``announce_ttl / 3``: the first one from before it
        computed anything (throughput 0). That is what the others see of it, not what it knows of itself."""
        me = self.peer_record()
        return [Member(m.peer_id, me, m.expiry) if m.peer_id == self.peer_id else m for m in self.members]

    async def leave(self, timeout: float = 5.0) -> None:
        """Tell the swarm this node stops (its entry in the peer list says it left): a clean stop's
        last word, before ``run`` is cancelled. Bounded by ``timeout``; failures are logged."""
        with trio.move_on_after(timeout):
            try:
                await withdraw(
                    self.dht,
                    self.config.run_id,
                    now=self.clock(),
                    ttl=self.config.announce_ttl + 60.0,
                    buckets=self.config.peer_list_buckets,
                )
            except P2PError as e:
                log.info("could not tell the swarm we leave: %s", e)

    async def _members_loop(self) -> None:
        """Announce ourselves (again every third of the entry's lifetime, with what is true now), and
        keep our view of the run's members fresh."""
        await self.dht.bootstrapped.wait()
        known = -1
        interval = wait = self.config.members_interval
        shape: frozenset[tuple[PeerID, tuple[str, ...], bool]] = frozenset()
        while True:
            if self.clock() - self._announced >= self.config.announce_ttl / 3:
                self._announced = self.clock()
                await announce(
                    self.dht,
                    self.config.run_id,
                    self.peer_record(),
                    ttl=self.config.announce_ttl,
                    buckets=self.config.peer_list_buckets,
                )
            self._members_changed = trio.Event()
            try:
                self.members = await list_members(
                    self.dht, self.config.run_id, buckets=self.config.peer_list_buckets, near=self.peer_id
                )
            except P2PError as e:
                log.warning("cannot read the peer list: %s", e)
            now = frozenset((m.peer_id, m.record.addresses, m.record.reachable) for m in self.members)
            # A steady list is read less and less often (its records change on their own every
            # announce_ttl / 3 at most); a change brings the reads back to ``interval``, a hint of one
            # (a connection) the next read forward. Our own announcement still goes out on time.
            # A long list is read less often, whatever the hints: each read names every entry held
            # (8 bytes each, to each of three replicas) and brings every one changed since, so a peer of
            # a swarm of n paid n / 64 times a small swarm's bytes a read, and connections that close
            # (hints) brought a read every ``interval``: O(n) bytes a second for each of n peers. Spaced
            # by n / 64 intervals, a read costs a peer about the same bytes a second at any size up to
            # the backoff's bound (1,024 peers: every 60 s, as a steady list), and a list is never
            # staler than that bound at any size. (The list is for people and tools: training reads
            # the run's progress records.)
            spread = len(self.members) / MEMBERS_PER_READ
            spacing = max(
                interval, min(spread * interval, MEMBERS_BACKOFF * interval, self.config.announce_ttl / 3)
            )
            wait = spacing if now != shape else min(2 * wait, max(spacing, MEMBERS_BACKOFF * interval))
            wait = max(wait, spacing)
            shape = now
            if len(self.members) != known:
                known = len(self.members)
                part = f" (its part of {len(self._peer_list.keys)})" if len(self._peer_list.keys) > 1 else ""
                log.info("swarm: %d peer(s) known in run %r%s", known, self.config.run_id, part)
            announce_in = self._announced + self.config.announce_ttl / 3 - self.clock()
            await trio.sleep(spacing)  # never more often than this, whatever the hints
            with trio.move_on_after(min(wait, max(spacing, announce_in)) - spacing):
                await self._members_changed.wait()

    def _on_connection(self, conn: Connection, opened: bool) -> None:
        mine = self._peer_list.key_of(conn.peer) == self._peer_list.key_of(self.peer_id)
        if mine and (not opened or all(m.peer_id != conn.peer for m in self.members)):
            self._members_changed.set()  # a newcomer, or maybe a peer that left: read the list soon
        if opened:
            log.info(
                "peer %s connected (%s)", conn.peer.short(), "we dialed" if conn.outbound else "it dialed"
            )

    # ---- built-in handlers ----

    async def _on_ping(self, ctx: CallContext, req: PingRequest) -> PingResponse:
        return PingResponse(req.payload)

    async def _on_info(self, ctx: CallContext, req: InfoRequest) -> NodeInfo:
        return NodeInfo(
            peer_id=str(self.peer_id),
            run_id=self.config.run_id,
            version=__version__,
            protocol=PROTOCOL_VERSION,
            addresses=tuple(str(a) for a in self.addresses[:16]),
            connected_peers=len(self.host.connected_peers()),
            uptime=self.clock() - self._started,
        )

    async def _on_status(self, ctx: CallContext, req: StatusRequest) -> Reply[StatusResponse]:
        return Reply(StatusResponse(), public_status(self.status()))

    # ---- status ----

    def status(self) -> dict[str, Any]:
        now = trio.current_time()
        conns = [
            {
                "peer_id": str(c.peer),
                "direction": "outbound" if c.outbound else "inbound",
                "remote": f"{c.remote_host}:{c.remote_port}",
                "connected_for_s": round(now - c.opened_at, 3),
                "bytes_sent": c.bytes_sent,
                "bytes_received": c.bytes_received,
            }
            for c in self.host.connections()
        ]
        return {
            "peer_id": str(self.peer_id),
            "run_id": self.config.run_id,
            "state": self.state,
            "pid": os.getpid(),
            "version": __version__,
            "addresses": [str(a) for a in self.addresses],
            "listening": [str(a) for a in self.host.listen_addresses],  # differs behind --announce
            "connected_peers": sorted({c["peer_id"] for c in conns}),
            "connections": conns,
            "reachable": not self.dht.client_only,
            "metrics_port": self.metrics_port,
            "traffic": dict(zip(("bytes_sent", "bytes_received"), self.host.traffic(), strict=True))
            | {"sent_by_method": self.host.sent_by_method()},  # what the bytes went to (RPC methods)
            "bandwidth": self.averager.bandwidth,  # bytes/s it announces (0: not measured yet)
            "measured": dataclasses.asdict(self.averager.measured.best()),  # bytes/s each way, or None
            "dht": {"contacts": len(self.dht.table), "records": len(self.dht.records)},
            "members": [member_json(m) for m in self.members_view()],
            "started_at": self._started,
            "updated_at": self.clock(),
        } | {name: section() for name, section in self.status_sections.items()}

    def write_status(self) -> None:
        """Write the status file atomically (temp file in the same folder, then rename)."""
        path = self.config.status_file
        assert path is not None
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(self.status(), indent=2) + "\n")
            os.replace(tmp, path)
        except OSError as e:
            log.warning("cannot write status file %s: %s", path, e)

    async def _cache_loop(self, path: Path) -> None:
        while True:
            await trio.sleep(peercache.SAVE_EVERY)
            if known := self.dht.recent_contacts():  # (never an empty list over a useful cache)
                peercache.save(path, known)

    async def _status_loop(self) -> None:
        while True:
            self.write_status()
            await trio.sleep(self.config.status_interval)


class BackgroundNode:
    """A :class:`Node` running in a thread of its own, for synchronous code such as a training loop.

    ::

        with BackgroundNode(identity, config) as node:      # starts the node, returns once it listens
            print(node.addresses[0])
            for batch in data:
                loss = step(batch)
                node.average([p.grad for p in params], weight=len(batch), timeout=30)

    :meth:`average` blocks the calling thread until the round ends and raises what :meth:`Node.average`
    raises; leaving the ``with`` block (or :meth:`close`) stops the node gracefully.
    """

    def __init__(self, identity: Identity, config: NodeConfig, **node_kwargs: Any) -> None:
        self.node = Node(identity, config, **node_kwargs)
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._nursery: trio.Nursery | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._at_close: list[Callable[[], Awaitable[object]]] = []
        self._after_close: list[Callable[[], object]] = []
        self._thread = threading.Thread(
            target=self._main, name=f"p2ptrain-{identity.peer_id.short()}", daemon=True
        )

    def start(self, timeout: float = 60.0) -> BackgroundNode:
        """Start the node's thread; returns once the node runs, raises why it could not start. A node
        already started is returned as it is (``with join_swarm(...) as node``)."""
        if self._thread.ident is None:
            self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the node did not start within {timeout:g} s")
        if self._error is not None:
            raise self._error
        return self

    @property
    def addresses(self) -> list[PeerAddress]:
        return self.node.addresses

    def average(self, tensors: Sequence[torch.Tensor], **kwargs: Any) -> RoundResult:
        """:meth:`Node.average`, from synchronous code (the same keyword arguments)."""
        return self.call(lambda: self.node.average(tensors, **kwargs))

    def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``await fn()`` in the node's thread and return its result (blocks the calling thread)."""
        if self._token is None or not self._thread.is_alive():
            raise RuntimeError("the node is not running: call start() (or use it as a context manager)")
        return trio.from_thread.run(fn, trio_token=self._token)

    def start_service(self, service: Callable[..., Awaitable[object]]) -> None:
        """Start ``service`` (an async function taking ``task_status``) beside the node, in its nursery;
        returns once it reports that it started. It stops with the node."""

        async def start() -> None:
            assert self._nursery is not None
            await self._nursery.start(service)

        self.call(start)

    def at_close(self, fn: Callable[[], Awaitable[object]]) -> None:
        """Run ``await fn()`` in the node's thread when it is closed, before it stops (say, to tell the
        swarm that this peer leaves); an error there is logged and the node stops all the same."""
        self._at_close.append(fn)

    def after_close(self, fn: Callable[[], object]) -> None:
        """Call ``fn()`` once the node's thread has ended (by :meth:`close`, or a start that failed)."""
        self._after_close.append(fn)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the node (peers are told) and wait for its thread."""
        while self._at_close and self._token is not None and self._thread.is_alive():
            fn = self._at_close.pop()
            try:
                self.call(fn)
            except Exception as e:  # (the node stops all the same)
                log.warning("while closing the node: %s", e)
        if self._token is not None and self._thread.is_alive() and self._stop is not None:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(timeout)
        self._finish()

    def _finish(self) -> None:
        if self._thread.is_alive():
            return  # (still stopping: what waits for its end runs when the thread ends)
        while self._after_close:
            self._after_close.pop()()

    def __enter__(self) -> BackgroundNode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as e:  # reported to the thread that called start()
            while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
                e = e.exceptions[0]  # trio's nurseries wrap errors: the caller wants the one that happened
            self._error = e
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            await nursery.start(self.node.run)
            self._nursery = nursery
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()
