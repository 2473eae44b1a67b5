"""The DHT service: a Kademlia node on a Host, built from the parts that do its work.

Theory of operation: the pure pieces decide (the routing table, the lookup, the record store, the
delta-read cache: :mod:`~p2ptrain.dht.routing`, :mod:`~p2ptrain.dht.lookup`,
:mod:`~p2ptrain.dht.records`, :mod:`~p2ptrain.dht.known`); the trio parts around them move messages,
each owning its own state and handed the parts it uses when :class:`DHT` builds them:

- :class:`~p2ptrain.dht.reachability.Reachability`: whether peers can dial this node (dial-backs),
  and the contact it tells them;
- :class:`~p2ptrain.dht.client.Client`: the RPCs this node sends, one peer at a time;
- :class:`~p2ptrain.dht.contacts.Contacts`: the routing table, fed by calls and answers;
- :class:`~p2ptrain.dht.replicas.Replicas`: the replicas of the keys stored under lately;
- :class:`~p2ptrain.dht.reads.Reader`: lookups and reads, and what this node read last;
- :class:`~p2ptrain.dht.writes.Writer`: stores, offers, and the records this node keeps alive;
- :class:`~p2ptrain.dht.server.Server`: the answers to the RPCs peers send;
- :class:`~p2ptrain.dht.upkeep.Upkeep`: the bootstrap and the maintenance loop.

Each uses only those built before it, so a call runs down that list and never back up. :class:`DHT`
is the facade the rest of the package uses: it builds the parts, registers the server's handlers on
the host, runs the contacts' pings and the upkeep, and forwards its public methods.

Private runs (the host has a :class:`~p2ptrain.authority.Membership`): the handshake already keeps
non-members off every connection; for the records they might still author (relayed by a member), this
node signs every entry it writes and attaches its certificate, its store keeps and serves only entries
whose author's certificate is valid (see :mod:`p2ptrain.dht.records`), and reads drop any other.
Runs that price ids (``[run] id_work``) do the same with each author's work nonce (``records.IdWork``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

import trio

from ..identity import PeerID
from ..net.address import PeerAddress
from ..net.host import Host
from .client import Client
from .config import DHTConfig
from .contacts import Contacts
from .protocol import DIAL_BACK, FIND_NODE, FIND_VALUE, OFFER, PING, PULL, STORE
from .reachability import Reachability
from .reads import Reader
from .records import Authors, Entry, IdWork, RecordStore, key_id
from .replicas import Replicas
from .routing import Contact, RoutingTable
from .server import Server
from .upkeep import Upkeep
from .writes import Writer

__all__ = ["DHT", "DHTConfig"]


class DHT:
    """A Kademlia node on top of a :class:`~p2ptrain.net.host.Host`."""

    def __init__(
        self,
        host: Host,
        *,
        config: DHTConfig | None = None,
        clock: Callable[[], float] = time.time,
        seed: int | None = None,
        relayed_address: Callable[[], PeerAddress | None] | None = None,
        uplink: Callable[[], float] | None = None,
    ) -> None:
        """``relayed_address``: behind a NAT, the address others reach this node at when it may serve the
        DHT there anyway (its relayed address once hole punching works), else None (see
        :mod:`~p2ptrain.dht.reachability`). ``uplink``: this node's uplink in bytes a second as measured,
        0 while it is not (None: never measured), which sizes its replies in all (``server.reply_total``)."""
        self.host = host
        self.config = cfg = config or DHTConfig()
        self.clock = clock
        # Who may author records: a private run's members, or in a run that prices ids, ids with the work
        self.authors: Authors | None = host.membership
        if self.authors is None and host.config.id_work:
            self.authors = IdWork(host.config.id_work, host.work)
        self.records = RecordStore(cfg.limits, membership=self.authors)
        self.table = RoutingTable(host.peer_id, k=cfg.k, max_per_subnet=cfg.max_per_subnet)
        rng = random.Random(seed)  # (one stream for every part: nonces, backoff jitter, refresh ids)
        self.reachability = Reachability(host, cfg, clock=clock, relayed_address=relayed_address)
        self.client = Client(host, self.reachability, rpc_timeout=cfg.rpc_timeout, clock=clock, rng=rng)
        self.contacts = Contacts(self.table, host, self.client, clock=clock)
        self.replicas = Replicas(self.table, k=cfg.k, replication=cfg.replication, clock=clock)
        self.reader = Reader(
            self.client,
            self.contacts,
            self.replicas,
            self.records,
            config=cfg,
            authors=self.authors,
            clock=clock,
        )
        self.writer = Writer(
            self.client,
            self.contacts,
            self.replicas,
            self.reader,
            self.records,
            self.reachability,
            identity=host.identity,
            config=cfg,
            authors=self.authors,
            clock=clock,
        )
        self.server = Server(
            host,
            self.contacts,
            self.reachability,
            self.reader,
            self.records,
            config=cfg,
            clock=clock,
            uplink=uplink or (lambda: 0.0),
        )
        self.upkeep = Upkeep(
            self.client,
            self.contacts,
            self.reachability,
            self.reader,
            self.writer,
            self.records,
            config=cfg,
            clock=clock,
            rng=rng,
        )
        reg = host.registry
        reg.add_unary(PING, self.server.on_ping)
        reg.add_unary(FIND_NODE, self.server.on_find_node)
        reg.add_unary(FIND_VALUE, self.server.on_find_value)
        reg.add_unary(STORE, self.server.on_store)
        reg.add_unary(DIAL_BACK, self.server.on_dial_back)
        reg.add_unary(OFFER, self.server.on_offer)
        reg.add_unary(PULL, self.server.on_pull)

    # ---- who this node is to the swarm (see ``reachability``) ----

    @property
    def peer_id(self) -> PeerID:
        return self.host.peer_id

    def my_contact(self) -> Contact | None:
        return self.reachability.my_contact()

    def advertised_address(self) -> PeerAddress:
        return self.reachability.advertised_address()

    @property
    def serving(self) -> bool:
        """Whether this node holds records and answers as a routing-table contact (see
        :attr:`Reachability.serving <p2ptrain.dht.reachability.Reachability.serving>`)."""
        return self.reachability.serving

    @property
    def client_only(self) -> bool:
        """Whether this node runs client-only: it sends no contact and holds no records for others."""
        return self.reachability.client_only

    @client_only.setter
    def client_only(self, value: bool) -> None:
        self.reachability.client_only = value

    @property
    def reachable(self) -> bool | None:
        """Whether peers can dial this node at its advertised address (None: not checked yet)."""
        return self.reachability.reachable

    @property
    def reachability_checked(self) -> trio.Event:
        """Set once a peer was asked to dial this node back, whatever it found."""
        return self.reachability.checked

    @property
    def observed_host(self) -> str | None:
        """The address the last peer that answered a join ping saw this node at."""
        return self.reachability.observed_host

    @property
    def bootstrapped(self) -> trio.Event:
        """Set once this node has joined the swarm (at once for the swarm's first peer)."""
        return self.upkeep.bootstrapped

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
            await nursery.start(self.contacts.run)
            nursery.start_soon(self.reader.run)
            task_status.started(self)
            await self.upkeep.run(list(bootstrap or []))

    async def bootstrap(self, addresses: list[PeerAddress], *, attempts: int | None = 5) -> int:
        """Join through ``addresses``, retrying with capped backoff (``attempts=None``: until it works).

        Returns how many contacts we know. Until a peer has dialed us back, we stay client-only, so a
        node behind NAT never enters others' routing tables.
        """
        return await self.upkeep.bootstrap(addresses, attempts=attempts)

    def recent_contacts(self) -> list[PeerAddress]:
        """The addresses of the peers this node knows now and knew most recently (newest first), for a
        bootstrap."""
        return self.contacts.recent()

    def remember(self, addresses: list[PeerAddress]) -> None:
        """Take ``addresses`` (newest first: a saved :meth:`recent_contacts`) as peers known recently:
        whenever the routing table runs empty, the DHT bootstraps again from them and the join
        addresses. They go behind the peers this run has seen itself, in their order; an address that
        names no peer id, or this node's, is skipped."""
        self.contacts.remember(addresses)

    # ---- queries ----

    async def ping(self, contact: Contact) -> bool:
        return await self.client.ping(contact)

    async def find_node(self, target: bytes) -> list[Contact]:
        """The k closest live contacts to ``target`` found by an iterative lookup."""
        return await self.reader.find_node(target)

    async def find_peer(self, peer: PeerID) -> Contact | None:
        known = self.table.get(peer)
        if known:
            return known
        for c in await self.find_node(peer.digest):
            if c.peer_id == peer:
                return c
        return None

    async def get(
        self,
        key: bytes,
        *,
        quorum: int | None = None,
        via: Sequence[PeerAddress] = (),
        written: bool = False,
    ) -> dict[bytes, Entry]:
        """Read a key: ``subkey -> entry`` (plain values under ``b""``), merged from the replicas reached.

        Stops once replicas of ``quorum`` origins (default ``get_quorum``; an origin is a /24 or /64,
        so ids of one subnet count once) answered with entries, else after the lookup converges. Every
        entry's signature is checked again, and entries that are expired or claim an expiry beyond
        what any honest store accepts (which would let a liar's entry win every merge) are dropped.
        Replicas leave out the entries this node read before and still holds (``dht.known``), or holds
        as a replica itself: those are merged in again until they expire. ``via``: fellow readers of
        the key, one of which is asked first for the newer versions of what this node holds, so that
        the replicas send less; it changes no read's answer (see ``reads.Reader.pull``).
        ``written``: others write this key (a run's progress records), so even a first read asks its
        replicas directly, once they are looked up, rather than by a lookup of the value (which the
        closest replicas answer for every reader: see ``reads.Reader._read_replicas``); it changes no
        read's answer either. (See ``reads.Reader.get``.)
        """
        return await self.reader.get(key, quorum=quorum, via=via, written=written)

    async def pull(self, key: bytes, via: Sequence[PeerAddress]) -> int:
        """Pull from one of ``via``, fellow readers of ``key`` (each in turn), the newer versions of the
        entries this node holds, asking no replica; :meth:`held` then has them. Returns how many were
        taken (see ``reads.Reader.pull``)."""
        return await self.reader.pull(key_id(key), via)

    def held(self, key: bytes) -> dict[bytes, Entry]:
        """What a read of ``key`` would start from, without asking anyone: the entries held here as a
        replica, and those read or offered lately (see ``known``), verified, live, merged."""
        return self.reader.held(key)

    def watch(self, key: bytes, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever an entry under ``key`` arrives here (stored as a replica, or offered
        by its author), so that a reader of a hot key hears of a new record without polling."""
        self.server.watch(key, callback)

    def known_replicas(self, kid: bytes) -> list[Contact] | None:
        """The replicas a store under ``kid`` found lately, or None (see ``replicas.Replicas.known``)."""
        return self.replicas.known(kid)

    # ---- stores ----

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
        return await self.writer.store(
            key, value, ttl=ttl, subkey=subkey, sign=sign, republish=republish, offer_to=offer_to
        )

    def unpublish(self, key: bytes, subkey: bytes = b"") -> None:
        self.writer.unpublish(key, subkey)

    async def locate(self, key: bytes) -> int:
        """Find the replicas of ``key`` as a store would (remembered, or looked up), and remember them:
        a store under it then skips the lookup, and a read asks them directly. For a caller that stores
        under a new key in the background and reads it at once (``averaging.grouping``); the number of
        replicas found."""
        return len(await self.writer.find_replicas(key_id(key)))
