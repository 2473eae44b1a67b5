"""Reading the DHT: the iterative lookup, a key's read (``get``), and what this node holds of a key.

Theory of operation: a lookup drives the pure :class:`~p2ptrain.dht.lookup.Lookup`: it asks ``alpha``
peers at a time, in a nursery of its own, and ends when the lookup says so (converged, or a value
lookup has what it needs). A peer's answer is hearsay: a contact it names is asked at the address the
routing table verified where there is one, and the contact recorded is the one the connection proved.

A read tells replicas what it holds already (``known``: entries it read or was offered lately, or holds
as a replica), so they prove they hold those instead of sending them again (:mod:`~p2ptrain.dht.known`).
A hot key, whose replicas this node stored on lately (:class:`~p2ptrain.dht.replicas.Replicas`), is
read from those replicas directly, no more of them than its quorum needs, instead of by a lookup. Every
entry a read brings is checked again here: it belongs under the key, its signature holds, and in a run
with authors its author is admitted. An author may also offer its new entry to the peers that read its
key; :meth:`Reader.offered` takes it only as a read would have. And a reader may first pull what it lacks
from a fellow reader of the key (:meth:`Reader.pull`), taken as offers are, before the replicas are
asked: the changed entries then come from the readers, not all from the key's closest replicas.

:class:`Reader` owns the read cache (what this node read last); it is handed the client that sends the
queries, the contacts that learn from the answers, the replicas it may read directly, and the records
this node holds itself.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

import trio

from ..errors import P2PError, passing
from ..identity import PeerID
from ..net.address import PeerAddress
from .client import Client
from .config import DHTConfig
from .contacts import Contacts
from .known import MAX_KNOWN, ReadCache, tag
from .lookup import Lookup
from .records import (
    Authors,
    Entry,
    RecordRefused,
    RecordStore,
    check_author,
    check_entry,
    key_id,
    merge,
    origin_of,
    owner_of,
    verify_entry,
)
from .replicas import MAX_TARGET_KEYS, Replicas
from .routing import Contact

log = logging.getLogger("p2ptrain.dht.service")  # (one logger for the DHT service: its lines as before)

RECENT_LOOKUPS = 1024  # lookups remembered in Reader.recent_lookups
# A direct read asks one more replica when none answered for this long
READ_HEDGE = 1.0
PROBE_WAIT = 2.0  # how long a peer heard of as closer to a key is waited for, at one address (``_probe``)
MAX_PROBE_HOPS = 3  # hops from the replica that named them (``Reader._probe``)
PULL_WAIT = 1.0  # how long a read waits for a fellow reader's pull before it asks the replicas
MAX_PULLED_KEYS = 128  # keys whose turn among the fellow readers is remembered (see ``Reader.pull``)
FIRST_SPREAD = 10
"""A direct read of a hot key asks first one of its ``FIRST_SPREAD`` closest replicas, chosen by a hash of
the reader's id and the key (see :func:`first_asked`)."""


def first_asked(replicas: list[Contact], reader: PeerID, kid: bytes) -> list[Contact]:
    """``replicas`` (closest first) in the order a read asks them: the first of them rotated among the
    ``FIRST_SPREAD`` closest by a hash of the reader's id and the key, the rest in order. The replica
    asked first sends a reader every entry it holds that the reader lacks, and the later ones are told
    what it sent, so a replica asked first by every reader sent the key's whole traffic (the busiest
    node of a simulated swarm, a hot key's closest replica, sent 16-21x the median node's control
    bytes at 64 peers, and the busiest one 50x at 128). A read of quorum 3 then asks the closest
    replicas after the first, in order, so every read still asks the two closest (or three) and merges
    what they hold: no read is staler than with one order for all (a spread of the *whole* order, each
    reader from a different replica on, made reads start and end at replicas the latest records had not
    reached yet). Spread over the three closest, the busiest node of the one-key workload on the DHT
    alone at 256 nodes, with pulls from partners, sent 30x the median's bytes; over the ten closest,
    11x. A reader's choice for a key is a hash, not a draw per read: the same replica answers it first
    every time."""
    spread = min(FIRST_SPREAD, len(replicas))
    if spread <= 1:
        return list(replicas)
    h = hashlib.blake2b(reader.digest + kid, digest_size=8, person=b"p2pt-first").digest()
    i = int.from_bytes(h, "big") % spread
    return [replicas[i], *replicas[:i], *replicas[i + 1 :]]


class Reader:
    """Lookups and reads, and the cache of what this node read last (see the module docstring)."""

    def __init__(
        self,
        client: Client,
        contacts: Contacts,
        replicas: Replicas,
        records: RecordStore,
        *,
        config: DHTConfig,
        authors: Authors | None,
        clock: Callable[[], float],
    ) -> None:
        self._client = client
        self._contacts = contacts
        self._replicas = replicas
        self._records = records
        self._config = config
        self._authors = authors
        self._clock = clock
        self._cache = ReadCache()  # what this node read last: replicas leave those entries out
        self._pull_turns: OrderedDict[bytes, int] = OrderedDict()  # key id -> pulls made (see ``pull``)
        self._finding: dict[bytes, trio.Event] = {}  # key id -> its replicas' lookup under way
        # The last lookups' (hops, queries): how far a lookup goes in this swarm (simulations read it).
        self.recent_lookups: deque[tuple[int, int]] = deque(maxlen=RECENT_LOOKUPS)
        # (key id, peers a replica named as closer to it): asked by ``run``
        probes = trio.open_memory_channel[tuple[bytes, list[Contact]]](MAX_TARGET_KEYS)
        self._probes, self._probes_due = probes

    def reads(self, kid: bytes) -> bool:
        """Whether this node read the key ``kid`` lately (only such keys take offered entries)."""
        return self._cache.reads(kid)

    def known(self, kid: bytes, now: float) -> list[Entry]:
        """The live entries of ``kid`` this node read or was offered lately (unchecked since)."""
        return self._cache.known(kid, now)

    async def find_node(self, target: bytes) -> list[Contact]:
        """The k closest live contacts to ``target`` found by an iterative lookup."""
        closest, _ = await self.lookup(target)
        return closest

    async def replicas_of(self, kid: bytes) -> list[Contact]:
        """The peers that hold ``kid``: remembered (``Replicas.cached``), else found by one node lookup
        however many reads and stores of the key ask at once (then remembered). Each looked the key up
        itself before, so a read and a store started together (a board publishes beside its reads,
        matchmaking reads beside both) were two lookups of one key, ``k`` queries of ``k`` contacts
        each. A caller whose lookup was cancelled leaves those waiting on it to look the key up
        themselves."""
        while True:
            now = self._clock()
            replicas = self._replicas.cached(kid, now)
            if replicas is not None:
                return replicas
            waiting = self._finding.get(kid)
            if waiting is not None:
                await waiting.wait()
                continue  # (found and remembered; or cancelled: this one looks it up)
            done = self._finding[kid] = trio.Event()
            try:
                return self._replicas.found(kid, await self.find_node(kid), now)
            finally:
                del self._finding[kid]
                done.set()

    async def lookup(
        self, target: bytes, *, value: bool = False, quorum: int = 0, cached: list[Entry] | None = None
    ) -> tuple[list[Contact], list[Entry]]:
        """Run an iterative lookup: the k closest peers that answered (at proven addresses where we
        have them), and the verified entries found on the way (value lookups; replicas leave out the
        ``cached`` entries, and count toward ``quorum`` when they prove they hold some)."""
        table = self._contacts.table
        search = Lookup(
            target,
            table.closest(target, self._config.k),
            local=table.local,
            k=self._config.k,
            alpha=self._config.alpha,
        )
        found: list[Entry] = []
        cached = cached or []
        tags = b"".join(tag(e) for e in cached)  # once per lookup, not per query
        # Who answered with entries, by origin (/24, /64; a loopback address alone): ids are free, so
        # three ids of one subnet next to a key are one answer, not a quorum that ends the lookup on
        # what they chose to show (they cannot forge signed entries, but they can leave some out).
        holders: set[str] = set()
        reached: dict[PeerID, Contact] = {}
        changed = trio.Event()

        async def ask(contact: Contact) -> None:
            nonlocal changed
            # Peers' answers are hearsay: a liar can give true ids at false addresses. An address we
            # verified ourselves (the routing table's) wins, and only a failure at that address counts
            # against the peer in the table.
            known = table.get(contact.peer_id)
            try:
                contacts, entries, held, proven, remote = await self._client.query(
                    known or contact, target, value, cached, tags
                )
            except (P2PError, trio.TooSlowError) as e:
                log.debug("lookup query to %s failed: %s", contact.peer_id.short(), e)
                search.on_failure(contact.peer_id)
                # (a passing failure, busy or the connection closed under the call, is a live node's:
                # a full table's answer, this origin's share spent; it fails nothing in the table)
                if known is not None and not passing(e):
                    self._contacts.failed(contact.peer_id)
            else:
                # The query may have reused a connection dialed elsewhere: record the address the
                # connection proved, never the one we were told.
                if proven is not None:
                    self._contacts.observe(proven)
                if (verified := proven or known) is not None:
                    reached[contact.peer_id] = verified
                good = verified_entries(entries, target, self._authors, self._clock())
                found.extend(good)
                if good or held:
                    holders.add(origin_of(remote))
                    if quorum and len(holders) >= quorum:
                        search.stop()
                search.on_response(contact.peer_id, contacts)
            changed.set()

        async with trio.open_nursery() as nursery:
            while True:
                for contact in search.next_queries():
                    nursery.start_soon(ask, contact)
                if search.finished or search.stopped:
                    break
                await changed.wait()
                changed = trio.Event()
            # Converged (or has what it needs): queries still in flight cannot change the answer.
            nursery.cancel_scope.cancel()
        self.recent_lookups.append((search.hops, search.queries))
        return [reached.get(c.peer_id, c) for c in search.closest()], found

    async def get(
        self,
        key: bytes,
        *,
        quorum: int | None = None,
        via: Sequence[PeerAddress] = (),
        written: bool = False,
    ) -> dict[bytes, Entry]:
        """``DHT.get``: first a pull from one of ``via`` (see :meth:`pull`), then the replicas this node
        stored on lately (or, for a key others write, ``written``, looked up), else a lookup of the
        value; then what it knows."""
        kid = key_id(key)
        if via:
            await self.pull(kid, via)
        local = self._records.get(kid, self._clock())
        q = max((self._config.get_quorum if quorum is None else quorum) - (1 if local else 0), 1)
        known = self._cache.known(kid, self._clock())
        named = {tag(e) for e in known}  # and what it holds as a replica (stored here, not offered):
        known = (known + [e for e in local if tag(e) not in named])[:MAX_KNOWN]
        found = await self._read_replicas(kid, q, known, written)
        if found is None:
            _, found = await self.lookup(kid, value=True, quorum=q, cached=known)
        now, limits = self._clock(), self._config.limits
        latest = now + limits.max_ttl + limits.clock_skew
        good = verified_entries(local + found, kid, self._authors, now)
        known = self._cache.known(kid, now)  # (again: with what was offered during the read)
        if self._authors is not None:  # (a certificate may have expired since: check the authors again)
            known = verified_entries(known, kid, self._authors, now)
        merged = merge([e for e in good + known if now < e.expiry <= latest])
        self._cache.update(kid, list(merged.values()))
        return merged

    async def _read_replicas(
        self, kid: bytes, quorum: int, known: list[Entry], written: bool = False
    ) -> list[Entry] | None:
        """A hot key's read (announcements polled while a group forms, records read every few seconds):
        where this node stored under it lately (``Replicas.known``: a converged lookup at most
        ``TARGETS_TTL`` old), it asks those replicas directly, and without their nearest contacts
        (a reply's largest part when it brings no new entry). It asks no more of them than the quorum
        needs: one first, then as many as holders are missing, one more for each that answered without
        holding anything, failed, or is ``READ_HEDGE`` late (asking every replica at once cost a request
        and most of an answer from each of up to ``replication`` peers, per read). A later replica is
        told what the earlier ones sent, as held. None, to look the key up instead, when no such
        replicas are known or fewer than ``quorum`` origins among them answered with entries.

        A key this node reads again without storing under it (its last read brought entries: a
        large run's progress records under other peers' bucket keys, see ``optimizer.buckets``) has
        its replicas looked up as a store's are, once, and read directly from then on: a lookup of the
        value at each read drew the entries from every hop that held them, three times the bytes of
        the direct reads of the keys it stored under. (A key nobody wrote is still looked up.)

        ``written``: the caller knows that others write the key (a run's progress records), so even its
        first read looks the replicas up and asks them directly. The first read of a run's keys was a
        lookup of the value, and a value lookup ends at the key's closest replicas, which each sent the
        whole value to every reader starting at once: the start of a run was its busiest moment for
        them (the busiest node at 7.8x the median at 256 nodes over 4 keys, against 4.2x once every
        node had read each key once). A direct read's first ask is spread over the replicas
        (:func:`first_asked`) and the later ones are told what it sent."""
        replicas = self._replicas.known(kid)
        if not replicas and (known or written):
            replicas = await self.replicas_of(kid)
        if not replicas:
            return None
        found: list[Entry] = []
        holders: set[str] = set()
        replicas = first_asked(list(replicas), self._contacts.table.local, kid)
        # (now and then the first replica names its nearest contacts: peers that joined closer to the
        # key since the replicas were looked up, see ``replicas``)
        nearest_from = replicas[0] if self._replicas.ask_nearest(kid) else None
        heard: list[Contact] = []  # peers it named as closer than the replicas, to ask ourselves
        passed, lasting = 0, False  # replicas that failed passingly (``errors.passing``), or otherwise

        async def ask(contact: Contact, known: list[Entry], done: trio.CancelScope) -> None:
            nonlocal passed, lasting
            tags = b"".join(tag(e) for e in known)
            nearest = contact is nearest_from
            try:
                contacts, entries, held, _, remote = await self._client.query(
                    contact, kid, True, known, tags, nearest
                )
            except (P2PError, trio.TooSlowError) as e:
                log.debug("read of a known replica %s failed: %s", contact.peer_id.short(), e)
                # Busy, or the connection closed under the read (a full table turned it over, see
                # ``net.admission``): it is there, and holds what it held; another is asked. A lookup
                # for it finds the same replicas (at 128 simulated peers with 48 slots a node, taken
                # for failures, such reads were most of the node lookups).
                if passing(e):
                    passed += 1
                else:
                    lasting = True
                    self._replicas.drop(kid)  # the next read and store look the replicas up again
                return
            if nearest:
                heard.extend(self._replicas.heard(kid, contacts))
            good = verified_entries(entries, kid, self._authors, self._clock())
            found.extend(good)
            if good or held:
                holders.add(origin_of(remote))
                if len(holders) >= quorum:  # as a lookup does: a silent replica does not hold it up
                    done.cancel()

        waiting = iter(replicas)
        answered_send, answered = trio.open_memory_channel[None](len(replicas))
        running = 0
        async with trio.open_nursery() as nursery:

            async def ask_one(contact: Contact, known: list[Entry]) -> None:
                try:
                    await ask(contact, known, nursery.cancel_scope)
                finally:
                    answered_send.send_nowait(None)

            def start(n: int) -> None:
                nonlocal running
                named = {tag(e) for e in known}
                more = (known + [e for e in found if tag(e) not in named])[:MAX_KNOWN]
                for contact in itertools.islice(waiting, max(n, 0)):
                    nursery.start_soon(ask_one, contact, more)
                    running += 1

            start(1)
            first = True
            while running:
                with trio.move_on_after(READ_HEDGE) as late:
                    await answered.receive()
                    running -= 1
                if late.cancelled_caught:
                    if first:
                        self._replicas.demote(kid, replicas[0], FIRST_SPREAD)  # (slow: last next time)
                    start(1)  # a hedge beside the late one
                first = False
                start(quorum - len(holders) - running)
        if len(holders) < quorum:
            if lasting or len(holders) + passed < quorum:
                self._replicas.drop(kid)  # look them up again: the next store too
            return None
        if heard:  # (in the background: this read does not wait for them)
            try:
                self._probes.send_nowait((kid, heard))
            except trio.WouldBlock:  # (probes due for every key remembered: heard of again later)
                pass
        return found

    async def run(self) -> None:
        """Ask, until cancelled, the peers heard of as closer to a key than its replicas (see
        :meth:`_probe`), one key at a time."""
        async for kid, heard in self._probes_due:
            await self._probe(kid, heard)

    async def _probe(self, kid: bytes, heard: list[Contact]) -> None:
        """Ask the peers a replica named as closer to ``kid`` than the replicas (``Replicas.heard``)
        for their nearest contacts, ``PROBE_WAIT`` at most at each address: those that answer become
        replicas (:meth:`Replicas.probed`), at the address their connection proved where it did, and
        those they name as closer still are asked next, ``MAX_PROBE_HOPS`` hops at most (a lookup
        seeded with the replicas, that asks only the peers closer than they are). A peer's answer is its
        own, not the hearsay of the replica that named it: a liar's ids that do not answer cost one wait
        and are not asked there again."""
        table = self._contacts.table

        async def ask(contacts: list[Contact], answered: dict[PeerID, Contact], named: list[Contact]) -> None:
            # (one id's addresses in turn: dials of one id share their outcome, so a false address
            # asked beside the true one would fail both)
            known = table.get(contacts[0].peer_id)
            for contact in [known] if known is not None else contacts:  # (a verified address: that one)
                try:
                    with trio.fail_after(PROBE_WAIT):
                        replied, _, _, proven, _ = await self._client.query(contact, kid, False, [], b"")
                except (P2PError, trio.TooSlowError) as e:
                    log.debug("a peer heard of as near a key did not answer: %s", e)
                    continue
                if proven is not None:
                    self._contacts.observe(proven)
                # (it answered as that id; at the address its connection proved where it did, as a
                # lookup records it: a connection it opened to us proves none)
                answered[contact.peer_id] = proven or contact
                named.extend(replied)
                return

        for _ in range(MAX_PROBE_HOPS):
            answered: dict[PeerID, Contact] = {}
            named: list[Contact] = []
            by_id: dict[PeerID, list[Contact]] = {}
            for c in heard:
                by_id.setdefault(c.peer_id, []).append(c)
            async with trio.open_nursery() as nursery:
                for contacts in by_id.values():
                    nursery.start_soon(ask, contacts, answered, named)
            silent = [c for c in heard if c.peer_id not in answered]
            self._replicas.probed(kid, list(answered.values()), silent)
            log.debug("%d of %d peers heard of as near a key answered", len(answered), len(by_id))
            heard = self._replicas.heard(kid, named)
            if not heard:
                return

    async def pull(self, kid: bytes, via: Sequence[PeerAddress]) -> int:
        """Ask one of ``via``, fellow readers of the key ``kid`` (a training peer's partners), each in turn
        from one pull to the next, for the entries it holds that this node lacks; this node names what
        it holds, as a read does. What comes is taken only as offers are (:meth:`ReadCache.offer`:
        newer versions of the subkeys a read brought), and only entries their owners signed, live and
        within the records' limits (an unowned entry is anyone's to write: only replicas speak for it).
        A fellow reader thus changes what the next read of the replicas sends (they leave out what this
        node then names), never what a read returns: it cannot add a subkey, hide one or bring back an
        old version, and a pull that fails or takes ``PULL_WAIT`` is given up. Returns how many entries
        were taken. Nothing is pulled for a key this node has not read (no subkeys to refresh)."""
        if not via or not self._cache.reads(kid):
            return 0
        turn = self._pull_turns.pop(kid, 0)
        self._pull_turns[kid] = turn + 1
        while len(self._pull_turns) > MAX_PULLED_KEYS:
            self._pull_turns.popitem(last=False)
        addr = via[turn % len(via)]
        tags = b"".join(tag(e) for e in self._cache.known(kid, self._clock()))
        entries: list[Entry] = []
        with trio.move_on_after(PULL_WAIT):
            try:
                entries = await self._client.pull(addr, kid, tags)
            except (P2PError, trio.TooSlowError) as e:
                log.debug("pull from %s failed: %s", addr, e)
        return self._take(kid, entries, self._clock())

    def _take(self, kid: bytes, entries: list[Entry], now: float, owner: PeerID | None = None) -> int:
        """Take ``entries`` of ``kid`` as offered ones (:meth:`ReadCache.offer`): those the cache would
        take (newer versions of the subkeys the last read brought), owned (by ``owner`` where given),
        within the records' limits, signed (and admitted, in a run with authors). The signatures are
        checked last, on those alone: a partner answering a pull with thousands of entries nobody asked
        for costs no Ed25519 check. Returns how many were taken."""
        good = []
        for entry in self._cache.wanted(kid, entries, now):
            who = owner_of(entry.key, entry.subkey)
            if who is None or (owner is not None and who != owner):
                continue  # (an unowned entry is anyone's to write: only replicas speak for it)
            try:
                check_entry(entry, now, self._config.limits)
            except RecordRefused:
                continue
            good.append(entry)
        return self._cache.offer(kid, verified_entries(good, kid, self._authors, now), now)

    def serving(self, kid: bytes, now: float) -> list[Entry]:
        """What this node gives a fellow reader's pull of ``kid``: the live entries it holds as a replica
        and those it read or was offered lately (all checked when they came), merged."""
        held = self._records.get(kid, now)
        if not held and not self._cache.reads(kid):
            return []
        return list(merge(held + self._cache.known(kid, now)).values())

    def held(self, key: bytes) -> dict[bytes, Entry]:
        """``DHT.held``: the entries held here as a replica, and those read or offered lately, verified,
        live, merged, without asking anyone."""
        kid, now = key_id(key), self._clock()
        entries = verified_entries(self._records.get(kid, now), kid, self._authors, now)
        known = self._cache.known(kid, now)
        if self._authors is not None:
            known = verified_entries(known, kid, self._authors, now)
        latest = now + self._config.limits.max_ttl + self._config.limits.clock_skew
        return merge([e for e in entries + known if now < e.expiry <= latest])

    def offered(self, peer: PeerID, entries: list[Entry], now: float) -> list[bytes]:
        """Entries ``peer`` pushed to this node (see ``DHT.store(offer_to=...)``): taken only for a key
        this node reads, from the owner of their subkey, signed by it (and admitted, in a run with
        authors), as newer versions of what a read brought (see ``known``). Returns the key id of each
        entry taken."""
        took: list[bytes] = []
        for entry in entries:
            kid = key_id(entry.key)
            if self._take(kid, [entry], now, owner=peer):
                took.append(kid)
        return took


def verified_entries(entries: list[Entry], kid: bytes, authors: Authors | None, now: float) -> list[Entry]:
    """Entries that belong under ``kid`` and whose signatures check out (read-back verification); with
    ``authors``, only those written by an author they admit (a private run's members, ids with work)."""
    out = []
    for e in entries:
        if key_id(e.key) != kid:
            continue
        try:
            _verify_once(e)
        except P2PError:
            log.warning("dropping a record with a bad signature under %s", kid.hex()[:12])
            continue
        if authors is not None:
            try:
                check_author(e, authors, now)
            except RecordRefused as refused:
                log.warning("dropping a record under %s: %s", kid.hex()[:12], refused.reason)
                continue
        out.append(e)
    return out


# Signatures already checked, by the digest of the whole entry: a peer reads what it holds on every
# record that arrives (``DHT.held``), and each read checked every entry's signature again (~60 us each):
# with a key filled by a hundred free ids, hundreds of checks a wake-up, several wake-ups a second.
VERIFIED_KEPT = 8192
_verified: OrderedDict[bytes, None] = OrderedDict()


def _verify_once(entry: Entry) -> None:
    """``verify_entry``, remembered for the entries whose signatures held (the same bytes, exactly: by a
    256-bit digest, not ``known.tag``'s 64 bits, whose collisions a writer could find for a forged entry
    beside its own good one)."""
    digest = hashlib.blake2b(entry.packed, digest_size=32).digest()
    if digest in _verified:
        _verified.move_to_end(digest)
        return
    verify_entry(entry)
    _verified[digest] = None
    if len(_verified) > VERIFIED_KEPT:
        _verified.popitem(last=False)
