"""Writing the DHT: a store on a key's replicas, offers to its readers, and keeping records alive.

Theory of operation: a store signs the entry where it must (a signed subkey, or every entry in a run
with authors), checks it as a replica would (so a record nobody could hold is refused here, with the
reason), and sends it to the key's replicas (:class:`~p2ptrain.dht.replicas.Replicas`: remembered, or
looked up), and holds it here too where this node serves and is among them. A replica that fails or
refuses makes the next store look the replicas up again; one that fails leaves the routing table's
good graces and the small-swarm replica set. With ``offer_to``, the entry then goes straight to the
peers that read the key, except those among the replicas that took it (they hold it for their reads).

Records live only as long as their expiry: an owner that publishes with ``republish`` has this object
re-publish them every ``republish_interval`` until it unpublishes them (``republish``, from the
maintenance), and every record held here is pushed to the closest peers known now and then
(``replicate``), since peers closer to its key may have joined since it was stored.

:class:`Writer` owns what this node publishes; it is handed the client that sends stores and offers,
the reader that looks replicas up, and the store that holds this node's own share.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio

from ..errors import P2PError, passing
from ..identity import Identity, PeerID
from ..net.address import PeerAddress
from .client import Client
from .config import DHTConfig
from .contacts import Contacts
from .reachability import Reachability
from .reads import Reader
from .records import Authors, Entry, RecordRefused, RecordStore, check_entry, key_id, make_entry
from .replicas import Replicas
from .routing import Contact

log = logging.getLogger("p2ptrain.dht.service")  # (one logger for the DHT service: its lines as before)


PUSH_BATCH = 256  # entries per store call when records are pushed to new replicas


@dataclass
class _Published:
    value: bytes
    ttl: float
    subkey: bytes
    sign: bool
    next_at: float


class Writer:
    """Stores, offers, and the records this node keeps alive (see the module docstring)."""

    def __init__(
        self,
        client: Client,
        contacts: Contacts,
        replicas: Replicas,
        reader: Reader,
        records: RecordStore,
        me: Reachability,
        *,
        identity: Identity,
        config: DHTConfig,
        authors: Authors | None,
        clock: Callable[[], float],
    ) -> None:
        self._client = client
        self._contacts = contacts
        self._replicas = replicas
        self._reader = reader
        self._records = records
        self._me = me
        self._identity = identity
        self._config = config
        self._authors = authors
        self._clock = clock
        self._published: dict[tuple[bytes, bytes], _Published] = {}

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
        """``DHT.store``: the number of replicas that accepted the entry."""
        now, authors = self._clock(), self._authors
        signer = self._identity if sign or authors is not None else None  # (then every entry is signed)
        cert = (authors.certificate or b"") if authors is not None else b""
        entry = make_entry(key, value, now + ttl, subkey=subkey, signer=signer, cert=cert)
        check_entry(entry, now, self._config.limits)  # a record we could not store anywhere: say why now
        if republish:
            self._published[(key, subkey)] = _Published(
                value, ttl, subkey, sign, now + self._config.republish_interval
            )
        stored_at: set[PeerID] = set()
        accepted = await self.store_entries(key_id(key), [entry], stored_at)
        # A replica that took the store holds the entry for its reads (``held``): offered, it would get
        # it twice. The others (a refused or failed store included) are offered it.
        offer_to = [a for a in offer_to if a.peer_id not in stored_at]
        if offer_to:
            async with trio.open_nursery() as nursery:
                for addr in offer_to:
                    nursery.start_soon(self._client.offer, addr, entry)
        return accepted

    def republishes(self, key: bytes, subkey: bytes = b"") -> bool:
        """Whether what ``store(republish=True)`` published under ``(key, subkey)`` is re-published."""
        return (key, subkey) in self._published

    def unpublish(self, key: bytes, subkey: bytes = b"") -> None:
        """Stop re-publishing what ``store(republish=True)`` published under ``(key, subkey)``."""
        self._published.pop((key, subkey), None)

    async def store_entries(self, kid: bytes, entries: list[Entry], took: set[PeerID] | None = None) -> int:
        """Store ready-made ``entries`` (of the key id ``kid``) on the key's replicas, and here if among
        them; ``took`` collects the peers that did. Returns how many accepted them."""
        targets = await self.find_replicas(kid)
        accepted = 0
        if self._me.serving and self._among_closest(kid, targets):
            for e in entries:
                try:
                    self._records.put(e, self._clock(), None)
                except RecordRefused as refused:  # private runs: our own certificate has expired
                    log.warning("cannot store a record here: %s", refused.reason)
                    continue
                accepted += 1

        passed = 0  # replicas that failed passingly: live, holding their slots (``errors.passing``)

        async def push(contact: Contact) -> None:
            nonlocal accepted, passed
            took_any = await self.push(contact, entries)
            if took_any is None:
                passed += 1
            elif took_any:
                accepted += 1
                if took is not None:
                    took.add(contact.peer_id)

        async with trio.open_nursery() as nursery:
            for contact in targets:
                nursery.start_soon(push, contact)
        if accepted + passed < len(targets):
            self._replicas.drop(kid)  # a replica failed or refused: look them up again next time
        return accepted

    async def find_replicas(self, kid: bytes) -> list[Contact]:
        """The peers to store a key on: remembered, else from the swarm's last exhaustive lookup, else
        looked up (then remembered: reads of the key ask them directly, see ``Reader.get``)."""
        return await self._reader.replicas_of(kid)

    def _among_closest(self, kid: bytes, targets: list[Contact]) -> bool:
        if len(targets) < self._config.replication:
            return True
        t = int.from_bytes(kid, "big")
        mine = int.from_bytes(self._identity.peer_id.digest, "big") ^ t
        return mine < int.from_bytes(targets[-1].peer_id.digest, "big") ^ t

    async def push(self, contact: Contact, entries: list[Entry]) -> bool | None:
        """Store ``entries`` on ``contact``; whether it took any. A failure counts against it, unless it
        is passing (busy, or the connection closed under the store, as a live node's full table
        answers: ``errors.passing``): then None, and nothing counts against it."""
        try:
            resp = await self._client.store(contact, entries)
        except (P2PError, trio.TooSlowError) as e:
            log.debug("store on %s failed: %s", contact.peer_id.short(), e)
            if passing(e):
                return None
            self._contacts.failed(contact.peer_id)
            self._replicas.forget(contact.peer_id)
            return False
        if resp.refused:
            log.info(
                "%s refused %d record(s): %s", contact.peer_id.short(), len(resp.refused), resp.refused[0]
            )
        return resp.stored > 0

    async def republish(self, now: float) -> None:
        """Re-publish what is due of what this node published with ``republish``."""
        for (key, subkey), pub in list(self._published.items()):
            if now >= pub.next_at:
                pub.next_at = now + self._config.republish_interval
                try:
                    await self.store(key, pub.value, ttl=pub.ttl, subkey=subkey, sign=pub.sign)
                except RecordRefused as e:
                    log.warning("cannot re-publish %r: %s", key[:40], e.reason)

    async def replicate(self) -> None:
        """Push every record we hold to the closest peers we know (they may have joined since)."""
        batches: defaultdict[PeerID, list[Entry]] = defaultdict(list)
        contacts: dict[PeerID, Contact] = {}
        table = self._contacts.table
        for entry in self._records.all_entries(self._clock()):
            for c in table.closest(key_id(entry.key), self._config.replication):
                batches[c.peer_id].append(entry)
                contacts[c.peer_id] = c
        async with trio.open_nursery() as nursery:
            for peer, entries in batches.items():
                for i in range(0, len(entries), PUSH_BATCH):
                    nursery.start_soon(self.push, contacts[peer], entries[i : i + PUSH_BATCH])
