"""The DHT service: Kademlia RPCs, iterative lookups, store/get, and maintenance, on a Host.

Theory of operation: the pure pieces (routing table, lookup, record store) decide; this module only
moves messages. Lookups run their ``alpha`` parallel queries in a nursery of their own and end when the
pure lookup says so. Every RPC is bounded by ``rpc_timeout``; a peer that fails is reported to the
routing table (which evicts it after repeated failures). A maintenance task expires records, refreshes
stale buckets with lookups of random ids in them, makes owners re-publish what they published, and
re-replicates held records to the closest peers known.

Reachability: a node that joined through others asks one of them to dial its advertised address back.
If nobody can, it runs client-only: it sends no contact in its requests (so nobody adds it to a routing
table) and stores nothing for others, but it can still look up, store and read through the swarm.

Private runs (the host has a :class:`~p2ptrain.authority.Membership`): the handshake already keeps
non-members off every connection; for the records they might still author (relayed by a member), this
node signs every entry it writes and attaches its certificate, its store keeps and serves only entries
whose author's certificate is valid (see :mod:`p2ptrain.dht.records`), and reads drop any other.
Runs that price ids (``[run] id_work``) do the same with each author's work nonce (``records.IdWork``).
"""

from __future__ import annotations

import logging
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import trio

from ..errors import P2PError, RemoteProtocolError
from ..identity import PeerID
from ..net.address import PeerAddress
from ..net.host import Host
from ..net.rpc import CallContext, Reply
from . import reads, replicas, upkeep
from .known import ReadCache, answer
from .protocol import (
    DIAL_BACK,
    FIND_NODE,
    FIND_VALUE,
    MAX_OFFERED,
    OFFER,
    PING,
    STORE,
    ContactMsg,
    DialBackReq,
    DialBackResp,
    FindNodeReq,
    FindValueReq,
    NodesResp,
    OfferReq,
    OfferResp,
    PingReq,
    PingResp,
    StoreReq,
    StoreResp,
    ValueResp,
    decode_entries,
    encode_entries,
)
from .reads import verified_entries
from .records import (
    Authors,
    Entry,
    IdWork,
    RecordLimits,
    RecordRefused,
    RecordStore,
    check_entry,
    key_id,
    make_entry,
    merge,
    origin_of,
    owner_of,
)
from .routing import Contact, RoutingTable
from .upkeep import MAX_SEEN

log = logging.getLogger(__name__)

OFFERS_PER_MINUTE = 120  # offers taken from one peer (the rest are answered 0: reads find them)
MAX_OFFERING_PEERS = 1024
# A node tells a peer its contact (id and address, about 150 bytes) on its first call, then again once
# this long has passed or its address changed: in between, a call from a known peer refreshes it as is.
SENDER_REFRESH = 60.0
MAX_TOLD = 4096


@dataclass(frozen=True)
class DHTConfig:
    """Kademlia parameters and timers (seconds)."""

    k: int = 20
    alpha: int = 3
    replication: int = 20
    rpc_timeout: float = 5.0
    get_quorum: int = 1  # replicas with entries a get waits for; reads of merged peer lists ask for more
    refresh_interval: float = 600.0
    republish_interval: float = 60.0
    replicate_interval: float = 600.0
    maintenance_interval: float = 10.0
    max_per_subnet: int = 2
    client_only: bool | None = None  # None: find out with a dial-back at bootstrap
    limits: RecordLimits = field(default_factory=RecordLimits)


@dataclass
class _Published:
    value: bytes
    ttl: float
    subkey: bytes
    sign: bool
    next_at: float


class DHT:
    """A Kademlia node on top of a :class:`~p2ptrain.net.host.Host`."""

    def __init__(
        self,
        host: Host,
        *,
        config: DHTConfig | None = None,
        clock: Callable[[], float] = time.time,
        seed: int | None = None,
    ) -> None:
        self.host = host
        self.config = config or DHTConfig()
        self.clock = clock
        self.table = RoutingTable(host.peer_id, k=self.config.k, max_per_subnet=self.config.max_per_subnet)
        # Who may author records: a private run's members, or in a run that prices ids, ids with the work
        self.authors: Authors | None = host.membership
        if self.authors is None and host.config.id_work:
            self.authors = IdWork(host.config.id_work, host.work)
        self.records = RecordStore(self.config.limits, membership=self.authors)
        self.client_only = bool(self.config.client_only)
        self.rng = random.Random(seed)
        self._published: dict[tuple[bytes, bytes], _Published] = {}
        self._read = ReadCache()  # what this node read last: replicas leave those entries out
        self._offers: OrderedDict[PeerID, deque[float]] = OrderedDict()  # when each peer last offered
        self._told: OrderedDict[PeerID, tuple[str, float]] = OrderedDict()  # our contact, as last sent
        self._targets: dict[bytes, tuple[float, list[Contact]]] = {}  # key id -> (until, its replicas)
        self._swarm: tuple[float, dict[PeerID, Contact]] | None = None  # (until, every peer): see replicas
        self._watch: dict[bytes, Callable[[], None]] = {}  # key id -> called when an entry arrives (watch)
        self._pinging: set[PeerID] = set()
        self._nursery: trio.Nursery | None = None
        self.bootstrapped = trio.Event()
        # Whether peers can dial this node at its advertised address: None until a peer was asked to
        # dial it back (at the bootstrap, or for the swarm's first peer once it knows a contact).
        self.reachable: bool | None = None
        self.reachability_checked = trio.Event()
        self.observed_host: str | None = None  # the address the last peer that answered a ping saw us at
        self._recheck_at = 0.0  # (the clock's) when to ask peers to dial us back again
        self._join: list[PeerAddress] = []  # the join addresses, to bootstrap again from
        self._seen: OrderedDict[PeerID, PeerAddress] = OrderedDict()  # recently known contacts, newest last
        # Behind a NAT: the address others reach this node at when it may serve the DHT there anyway
        # (its relayed address once hole punching works: see ``serving``), else None.
        self.relayed_address: Callable[[], PeerAddress | None] = lambda: None
        reg = host.registry
        reg.add_unary(PING, self._on_ping)
        reg.add_unary(FIND_NODE, self._on_find_node)
        reg.add_unary(FIND_VALUE, self._on_find_value)
        reg.add_unary(STORE, self._on_store)
        reg.add_unary(DIAL_BACK, self._on_dial_back)
        reg.add_unary(OFFER, self._on_offer)

    @property
    def peer_id(self) -> PeerID:
        return self.host.peer_id

    def my_contact(self) -> Contact | None:
        if not self.host.listen_addresses:
            return None
        if self.client_only:
            relayed = self.relayed_address()
            return None if relayed is None else Contact(self.peer_id, relayed)
        return Contact(self.peer_id, self.advertised_address())

    @property
    def serving(self) -> bool:
        """Whether this node holds records and answers as a routing-table contact: a reachable one, or
        one behind a NAT that can serve through its relayed address (``relayed_address``): peers reach
        it there through the relay, and directly once they punched a hole to it. Without those, the
        peers behind NATs would keep no record among themselves, and could not go on as one swarm
        when the public peers leave."""
        return not self.client_only or self.relayed_address() is not None

    def advertised_address(self) -> PeerAddress:
        return self.host.advertised_addresses()[0]

    def _sender(self) -> ContactMsg | None:
        me = self.my_contact()
        return ContactMsg.of(me) if me else None

    def _sender_for(self, peer: PeerID) -> ContactMsg | None:
        """Our contact for a call to ``peer``, or None where it has it: it answered a call that carried
        this very contact less than ``SENDER_REFRESH`` ago (see ``_told_to``)."""
        sender = self._sender()
        told = self._told.get(peer)
        if sender is None or told is None or told[0] != sender.addr:
            return sender
        return None if self.clock() - told[1] < SENDER_REFRESH else sender

    def _told_to(self, peer: PeerID, sender: ContactMsg | None) -> None:
        """``peer`` answered a call that carried ``sender``."""
        if sender is not None:
            self._told.pop(peer, None)
            self._told[peer] = (sender.addr, self.clock())
            while len(self._told) > MAX_TOLD:
                self._told.popitem(last=False)

    # ---- lifecycle ----

    async def run(
        self,
        bootstrap: list[PeerAddress] | None = None,
        *,
        task_status: trio.TaskStatus[DHT] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve and maintain the DHT until cancelled; join through ``bootstrap`` in the background.

        Reports readiness at once (a node whose join peers are down still starts, and keeps trying to
        join with capped backoff); :attr:`bootstrapped` is set once it has joined.
        """
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                task_status.started(self)
                self._join = list(bootstrap or [])
                if bootstrap:  # (with the peers remembered from an earlier run: the join peers may be gone)
                    await self.bootstrap([*bootstrap, *self.recent_contacts()], attempts=None)
                else:  # the swarm's first peer; one with remembered peers finds them in maintenance
                    self.bootstrapped.set()
                await upkeep.maintain(self)
            finally:
                # The host may still serve calls, and they must not spawn into a closing nursery: trio
                # closes it when its last child ends, and other tasks run before this one resumes.
                self._nursery = None

    async def bootstrap(self, addresses: list[PeerAddress], *, attempts: int | None = 5) -> int:
        """Join through ``addresses``, retrying with capped backoff (``attempts=None``: until it works).

        Returns how many contacts we know. Until a peer has dialed us back, we stay client-only, so a
        node behind NAT never enters others' routing tables (see ``upkeep``).
        """
        return await upkeep.bootstrap(self, addresses, attempts=attempts)

    # ---- RPC handlers ----

    def _heard_from(self, ctx: CallContext, sender: ContactMsg | None) -> None:
        if sender is None:  # (it told us its contact lately: refreshed as we know it)
            if (known := self.table.get(ctx.peer)) is not None:
                self._observe(known)
            return
        if sender.peer != ctx.peer.digest:
            return
        try:
            contact = sender.to_contact()
        except ValueError:
            return
        relay = contact.address.relay
        # A circuit to the caller through a peer this node is connected to (so a real peer, not a third
        # party an attacker names for others to dial) is taken unchecked: that relay passes nothing on
        # to a peer without a reservation there.
        circuit = (
            relay is not None
            and contact.address.peer_id == ctx.peer
            # (the relay itself takes a circuit through it from a peer holding a reservation there)
            and (self.host.connection(relay) or (relay == self.peer_id and self.host.relay.holds(ctx.peer)))
        )
        if contact.address.host != ctx.remote_host and contact.address.kind in ("ip4", "ip6") and not circuit:
            return  # claimed address is not where the call came from: not verified, not added
        self._observe(contact)

    def _observe(self, contact: Contact) -> None:
        obs = self.table.observe(contact, self.clock())
        if obs.ping is not None and self._nursery is not None and obs.ping.peer_id not in self._pinging:
            self._pinging.add(obs.ping.peer_id)
            self._nursery.start_soon(self._ping_before_evict, obs.ping)

    async def _ping_before_evict(self, contact: Contact) -> None:
        try:
            alive = await self.ping(contact)
        finally:
            self._pinging.discard(contact.peer_id)
        self.table.ping_result(contact.peer_id, alive, self.clock())

    async def _on_ping(self, ctx: CallContext, req: PingReq) -> PingResp:
        self._heard_from(ctx, req.sender)
        return PingResp("" if ctx.relayed else ctx.remote_host[:64])  # (through a relay: the relay's)

    async def _on_find_node(self, ctx: CallContext, req: FindNodeReq) -> NodesResp:
        self._heard_from(ctx, req.sender)
        return self._nodes_near(req.target, ctx.peer)

    def _nodes_near(self, target: bytes, asker: PeerID) -> NodesResp:
        if len(target) != 32:
            raise RemoteProtocolError("target must be 32 bytes")
        close = self.table.closest(target, self.config.k, exclude={asker})
        return NodesResp(tuple(ContactMsg.of(c) for c in close))

    async def _on_find_value(self, ctx: CallContext, req: FindValueReq) -> Reply[ValueResp]:
        self._heard_from(ctx, req.sender)
        entries = self.records.get(req.key_id, self.clock())
        send, held, proof = answer(entries, req.known, req.nonce)
        near = self._nodes_near(req.key_id, ctx.peer).contacts if req.contacts else ()
        return Reply(ValueResp(near, held, proof), encode_entries(send))

    async def _on_store(self, ctx: CallContext, req: StoreReq) -> StoreResp:
        self._heard_from(ctx, req.sender)
        if not self.serving:
            return StoreResp(0, ("this peer is client-only and holds no records",))
        now, stored, refused, keys = self.clock(), 0, [], set()
        for entry in decode_entries(ctx.body):
            try:
                self.records.put(entry, now, ctx.peer, origin_of(ctx.remote_host))
                stored += 1
                keys.add(key_id(entry.key))
            except RecordRefused as e:
                refused.append(e.reason[:200])
        self._arrived(keys)
        if refused:
            log.info("refused %d record(s) from %s: %s", len(refused), ctx.peer.short(), refused[0])
        return StoreResp(stored, tuple(refused[:64]))

    async def _on_offer(self, ctx: CallContext, req: OfferReq) -> OfferResp:
        """Entries of a key this node reads, pushed by their authors (see ``store(offer_to=...)``):
        taken only from the owner of their subkey, signed by it (and admitted, in a run with authors),
        as newer versions of what a read brought (see ``known``)."""
        now = self.clock()
        recent = self._offers.pop(ctx.peer, None) or deque()
        while recent and recent[0] <= now - 60.0:
            recent.popleft()
        self._offers[ctx.peer] = recent
        while len(self._offers) > MAX_OFFERING_PEERS:
            self._offers.popitem(last=False)
        if len(recent) >= OFFERS_PER_MINUTE:
            return OfferResp(0)
        recent.append(now)
        entries = decode_entries(ctx.body)
        if len(entries) > MAX_OFFERED:
            raise RemoteProtocolError(f"an offer carries at most {MAX_OFFERED} entries")
        taken = 0
        for entry in entries:
            kid = key_id(entry.key)
            if owner_of(entry.key, entry.subkey) != ctx.peer or not self._read.reads(kid):
                continue  # (an unowned entry is anyone's to write: only replicas speak for it)
            try:
                check_entry(entry, now, self.config.limits)
            except RecordRefused:
                continue
            took = self._read.offer(kid, verified_entries([entry], kid, self.authors, now), now)
            taken += took
            if took:
                self._arrived({kid})
        return OfferResp(taken)

    def watch(self, key: bytes, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever an entry under ``key`` arrives here (stored as a replica, or offered
        by its author), so that a reader of a hot key hears of a new record without polling."""
        self._watch[key_id(key)] = callback

    def _arrived(self, kids: set[bytes]) -> None:
        for kid in kids:
            if (callback := self._watch.get(kid)) is not None:
                callback()

    async def _on_dial_back(self, ctx: CallContext, req: DialBackReq) -> DialBackResp:
        try:
            addr = PeerAddress.parse(req.addr)
        except ValueError as e:
            return DialBackResp(False, f"bad address: {e}")
        if addr.peer_id != ctx.peer:
            return DialBackResp(False, "the address must carry the asker's own peer id")
        if addr.kind in ("ip4", "ip6") and addr.host != ctx.remote_host:
            return DialBackResp(False, "dial-back only to the host the request came from")
        try:
            await self.host.probe(addr, timeout=self.config.rpc_timeout)
        except P2PError as e:
            return DialBackResp(False, str(e)[:500])
        return DialBackResp(True, "reachable")

    # ---- queries ----

    async def ping(self, contact: Contact) -> bool:
        try:
            with trio.fail_after(self.config.rpc_timeout):
                conn = await self.host.connect(contact.address)
                await conn.call(PING, PingReq(self._sender()), timeout=self.config.rpc_timeout)
        except (P2PError, trio.TooSlowError):
            return False
        return True

    async def _query(
        self,
        contact: Contact,
        target: bytes,
        value: bool,
        known: list[Entry],
        tags: bytes,
        nearest: bool = True,
    ) -> tuple[list[Contact], list[Entry], bool, Contact | None, str]:
        """One query to ``contact`` (see ``reads.query``)."""
        return await reads.query(self, contact, target, value, known, tags, nearest)

    async def _lookup(
        self, target: bytes, *, value: bool = False, quorum: int = 0, cached: list[Entry] | None = None
    ) -> tuple[list[Contact], list[Entry]]:
        """An iterative lookup (see ``reads.lookup``)."""
        return await reads.lookup(self, target, value=value, quorum=quorum, cached=cached)

    async def find_node(self, target: bytes) -> list[Contact]:
        """The k closest live contacts to ``target`` found by an iterative lookup."""
        closest, _ = await self._lookup(target)
        return closest

    async def find_peer(self, peer: PeerID) -> Contact | None:
        known = self.table.get(peer)
        if known:
            return known
        for c in await self.find_node(peer.digest):
            if c.peer_id == peer:
                return c
        return None

    async def store(
        self,
        key: bytes,
        value: bytes,
        *,
        ttl: float,
        subkey: bytes = b"",
        sign: bool = False,
        republish: bool = False,
        offer_to: Sequence[PeerAddress] = (),
    ) -> int:
        """Store on the ``replication`` closest peers (and here, if we are among them).

        Returns how many replicas accepted it. With ``republish`` this node re-publishes the value
        every ``republish_interval`` until :meth:`unpublish`. ``offer_to``: peers that read the key,
        sent the (signed, owned) entry once the replicas took it, so that they need not read it (see
        ``known``); those among the replicas that took the store are not sent it twice.
        """
        now, authors = self.clock(), self.authors
        signer = self.host.identity if sign or authors is not None else None  # (then every entry is signed)
        cert = (authors.certificate or b"") if authors is not None else b""
        entry = make_entry(key, value, now + ttl, subkey=subkey, signer=signer, cert=cert)
        check_entry(entry, now, self.config.limits)  # a record we could not store anywhere: say why now
        if republish:
            self._published[(key, subkey)] = _Published(
                value, ttl, subkey, sign, now + self.config.republish_interval
            )
        stored_at: set[PeerID] = set()
        accepted = await self._store_entries(key_id(key), [entry], stored_at)
        # A replica that took the store holds the entry for its reads (``held``): offered, it would get
        # it twice. The others (a refused or failed store included) are offered it.
        offer_to = [a for a in offer_to if a.peer_id not in stored_at]
        if offer_to:
            async with trio.open_nursery() as nursery:
                for addr in offer_to:
                    nursery.start_soon(self._offer, addr, entry)
        return accepted

    async def _offer(self, addr: PeerAddress, entry: Entry) -> None:
        try:
            with trio.fail_after(self.config.rpc_timeout):
                conn = await self.host.connect(addr)
                body = encode_entries([entry])
                await conn.call(OFFER, OfferReq(), body=body, timeout=self.config.rpc_timeout)
        except (P2PError, trio.TooSlowError) as e:
            log.debug("offer to %s failed: %s", addr, e)

    def held(self, key: bytes) -> dict[bytes, Entry]:
        """What a read of ``key`` would start from, without asking anyone: the entries held here as a
        replica, and those read or offered lately (see ``known``), verified, live, merged."""
        kid, now = key_id(key), self.clock()
        entries = verified_entries(self.records.get(kid, now), kid, self.authors, now)
        known = self._read.known(kid, now)
        if self.authors is not None:
            known = verified_entries(known, kid, self.authors, now)
        latest = now + self.config.limits.max_ttl + self.config.limits.clock_skew
        return merge([e for e in entries + known if now < e.expiry <= latest])

    def unpublish(self, key: bytes, subkey: bytes = b"") -> None:
        self._published.pop((key, subkey), None)

    async def _store_entries(self, kid: bytes, entries: list[Entry], took: set[PeerID] | None = None) -> int:
        """Store on the key's replicas (and here, if among them); ``took`` collects those that did."""
        targets = await self._replicas(kid)
        accepted = 0
        if self.serving and self._among_closest(kid, targets):
            for e in entries:
                try:
                    self.records.put(e, self.clock(), None)
                except RecordRefused as refused:  # private runs: our own certificate has expired
                    log.warning("cannot store a record here: %s", refused.reason)
                    continue
                accepted += 1

        async def push(contact: Contact) -> None:
            nonlocal accepted
            if await self._push(contact, entries):
                accepted += 1
                if took is not None:
                    took.add(contact.peer_id)

        async with trio.open_nursery() as nursery:
            for contact in targets:
                nursery.start_soon(push, contact)
        if accepted < len(targets):
            self._targets.pop(kid, None)  # a replica failed or refused: look them up again next time
        return accepted

    async def _replicas(self, kid: bytes) -> list[Contact]:
        """The peers to store a key on (see ``replicas.find``)."""
        return await replicas.find(self, kid)

    def known_replicas(self, kid: bytes) -> list[Contact] | None:
        """The replicas a store under ``kid`` found lately, or None (see ``replicas.known``)."""
        return replicas.known(self, kid)

    def _among_closest(self, kid: bytes, targets: list[Contact]) -> bool:
        if len(targets) < self.config.replication:
            return True
        t = int.from_bytes(kid, "big")
        mine = int.from_bytes(self.peer_id.digest, "big") ^ t
        return mine < int.from_bytes(targets[-1].peer_id.digest, "big") ^ t

    async def _push(self, contact: Contact, entries: list[Entry]) -> bool:
        try:
            with trio.fail_after(self.config.rpc_timeout):
                conn = await self.host.connect(contact.address)
                sender = self._sender_for(conn.peer)
                resp = await conn.call(
                    STORE, StoreReq(sender), body=encode_entries(entries), timeout=self.config.rpc_timeout
                )
                self._told_to(conn.peer, sender)
        except (P2PError, trio.TooSlowError) as e:
            log.debug("store on %s failed: %s", contact.peer_id.short(), e)
            self.table.failed(contact.peer_id, self.clock())
            replicas.forget(self, contact.peer_id)
            return False
        if resp.refused:
            log.info(
                "%s refused %d record(s): %s", contact.peer_id.short(), len(resp.refused), resp.refused[0]
            )
        return resp.stored > 0

    async def get(self, key: bytes, *, quorum: int | None = None) -> dict[bytes, Entry]:
        """Read a key: ``subkey -> entry`` (plain values under ``b""``), merged from the replicas reached.

        Stops once replicas of ``quorum`` origins (default ``get_quorum``; an origin is a /24 or /64,
        so ids of one subnet count once) answered with entries, else after the lookup converges. Every
        entry's signature is checked again, and entries that are expired or claim an expiry beyond
        what any honest store accepts (which would let a liar's entry win every merge) are dropped.
        Replicas leave out the entries this node read before and still holds (``dht.known``), or holds
        as a replica itself: those are merged in again until they expire. (See ``reads.get``.)
        """
        return await reads.get(self, key, quorum=quorum)

    # ---- maintenance ----

    def recent_contacts(self) -> list[PeerAddress]:
        """The addresses of the peers this node knows now and knew most recently (newest first; at most
        ``MAX_SEEN``), for a bootstrap."""
        now = {c.peer_id: c.address for c in self.table.contacts()}
        before = [a for p, a in reversed(self._seen.items()) if p not in now]
        return [*now.values(), *before][:MAX_SEEN]

    def remember(self, addresses: list[PeerAddress]) -> None:
        """Take ``addresses`` (newest first: a saved :meth:`recent_contacts`) as peers known recently:
        whenever the routing table runs empty, the DHT bootstraps again from them and the join
        addresses. They go behind the peers this run has seen itself, in their order; an address that
        names no peer id, or this node's, is skipped."""
        for addr in addresses[:MAX_SEEN]:
            if addr.peer_id is not None and addr.peer_id != self.peer_id and addr.peer_id not in self._seen:
                self._seen[addr.peer_id] = addr
                self._seen.move_to_end(addr.peer_id, last=False)  # behind what this run has seen
        while len(self._seen) > MAX_SEEN:
            self._seen.popitem(last=False)
