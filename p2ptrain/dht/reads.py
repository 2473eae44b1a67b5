"""Reading the DHT: a query to one peer, the iterative lookup, and ``get`` (a key's entries, merged).

Functions of a :class:`~p2ptrain.dht.service.DHT` (its ``_query``, ``_lookup`` and ``get`` call them).
A read tells replicas what it holds already (``known``: entries it read or was offered lately, or holds
as a replica), so they prove they hold those instead of sending them again. A hot key, whose replicas
this node stored on lately, is read from those replicas directly, no more of them than its quorum needs
(``read_replicas``), instead of by a lookup. Every entry a read brings is checked again here:
it belongs under the key, its signature holds, and in a run with authors its author is admitted.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

import trio

from ..errors import P2PError
from ..identity import PeerID
from ..net.address import PeerAddress
from ..net.connection import Connection
from ..wire.codec import pack
from .known import MAX_KNOWN, NONCE_BYTES, held_entries, tag
from .lookup import Lookup
from .protocol import (
    FIND_NODE,
    FIND_VALUE,
    FindNodeReq,
    FindValueReq,
    decode_entries,
    parse_contacts,
)
from .records import Authors, Entry, RecordRefused, check_author, key_id, merge, origin_of, verify_entry
from .routing import Contact

if TYPE_CHECKING:
    from .service import DHT

log = logging.getLogger("p2ptrain.dht.service")  # (one logger for the DHT service: its lines as before)

# A direct read asks one more replica when none answered for this long
READ_HEDGE = 1.0


async def query(
    dht: DHT,
    contact: Contact,
    target: bytes,
    value: bool,
    known: list[Entry],
    tags: bytes,
    nearest: bool = True,
) -> tuple[list[Contact], list[Entry], bool, Contact | None, str]:
    """Ask ``contact``; returns its contacts, the entries it sent, whether it proved it holds some
    of ``known`` (those it was told to leave out, by their ``tags``), the contact the connection
    proved, and the address the connection runs to (whatever the contact claimed). ``nearest``:
    whether a value query asks for the nearest contacts too."""
    held = False
    with trio.fail_after(dht.config.rpc_timeout):
        conn = await dht.host.connect(contact.address)
        sender = dht._sender_for(conn.peer)
        if value:
            nonce = dht.rng.randbytes(NONCE_BYTES) if known else b""
            reply = await conn.call_with_body(
                FIND_VALUE,
                FindValueReq(target, sender, tags, nonce, nearest),
                timeout=dht.config.rpc_timeout,
            )
            entries = decode_entries(reply.body)
            contacts = parse_contacts(reply.message.contacts)
            held = bool(held_entries(known, reply.message.held, reply.message.proof, nonce))
        else:
            req = FindNodeReq(target, sender)
            resp = await conn.call(FIND_NODE, req, timeout=dht.config.rpc_timeout)
            entries, contacts = [], parse_contacts(resp.contacts)
    dht._told_to(conn.peer, sender)
    return contacts, entries, held, proven_contact(conn), conn.remote_host


async def lookup(
    dht: DHT, target: bytes, *, value: bool = False, quorum: int = 0, cached: list[Entry] | None = None
) -> tuple[list[Contact], list[Entry]]:
    """Run an iterative lookup: the k closest peers that answered (at proven addresses where we
    have them), and the verified entries found on the way (value lookups; replicas leave out the
    ``cached`` entries, and count toward ``quorum`` when they prove they hold some)."""
    search = Lookup(
        target,
        dht.table.closest(target, dht.config.k),
        local=dht.peer_id,
        k=dht.config.k,
        alpha=dht.config.alpha,
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
        known = dht.table.get(contact.peer_id)
        try:
            contacts, entries, held, proven, remote = await dht._query(
                known or contact, target, value, cached, tags
            )
        except (P2PError, trio.TooSlowError) as e:
            log.debug("lookup query to %s failed: %s", contact.peer_id.short(), e)
            search.on_failure(contact.peer_id)
            if known is not None:
                dht.table.failed(contact.peer_id, dht.clock())
        else:
            # The query may have reused a connection dialed elsewhere: record the address the
            # connection proved, never the one we were told.
            if proven is not None:
                dht._observe(proven)
            if (verified := proven or known) is not None:
                reached[contact.peer_id] = verified
            good = verified_entries(entries, target, dht.authors, dht.clock())
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
    return [reached.get(c.peer_id, c) for c in search.closest()], found


async def get(dht: DHT, key: bytes, *, quorum: int | None = None) -> dict[bytes, Entry]:
    """``DHT.get``: the replicas this node stored on lately, else a lookup; then what it knows."""
    kid = key_id(key)
    local = dht.records.get(kid, dht.clock())
    q = max((dht.config.get_quorum if quorum is None else quorum) - (1 if local else 0), 1)
    known = dht._read.known(kid, dht.clock())
    named = {tag(e) for e in known}  # and what it holds as a replica (stored here, not offered):
    known = (known + [e for e in local if tag(e) not in named])[:MAX_KNOWN]
    found = await read_replicas(dht, kid, q, known)
    if found is None:
        _, found = await dht._lookup(kid, value=True, quorum=q, cached=known)
    now, limits = dht.clock(), dht.config.limits
    latest = now + limits.max_ttl + limits.clock_skew
    good = verified_entries(local + found, kid, dht.authors, now)
    known = dht._read.known(kid, now)  # (again: with what was offered during the read)
    if dht.authors is not None:  # (a certificate may have expired since: check the authors again)
        known = verified_entries(known, kid, dht.authors, now)
    merged = merge([e for e in good + known if now < e.expiry <= latest])
    dht._read.update(kid, list(merged.values()))
    return merged


async def read_replicas(dht: DHT, kid: bytes, quorum: int, known: list[Entry]) -> list[Entry] | None:
    """A hot key's read (announcements polled while a group forms, records read every few seconds):
    where this node stored under it lately (``replicas.known``: a converged lookup at most
    ``TARGETS_TTL`` old), it asks those replicas directly, and without their nearest contacts
    (a reply's largest part when it brings no new entry). It asks no more of them than the quorum
    needs: one first, then as many as holders are missing, one more for each that answered without
    holding anything, failed, or is ``READ_HEDGE`` late (asking every replica at once cost a request
    and most of an answer from each of up to ``replication`` peers, per read). A later replica is told
    what the earlier ones sent, as held. None, to look the key up instead, when no such replicas are
    known or fewer than ``quorum`` origins among them answered with entries."""
    cached = dht.known_replicas(kid)
    if not cached:
        return None
    found: list[Entry] = []
    holders: set[str] = set()

    async def ask(contact: Contact, known: list[Entry], done: trio.CancelScope) -> None:
        tags = b"".join(tag(e) for e in known)
        try:
            _, entries, held, _, remote = await dht._query(contact, kid, True, known, tags, False)
        except (P2PError, trio.TooSlowError) as e:
            log.debug("read of a known replica %s failed: %s", contact.peer_id.short(), e)
            dht._targets.pop(kid, None)  # the next read and store look the replicas up again
            return
        good = verified_entries(entries, kid, dht.authors, dht.clock())
        found.extend(good)
        if good or held:
            holders.add(origin_of(remote))
            if len(holders) >= quorum:  # as a lookup does: a silent replica does not hold it up
                done.cancel()

    replicas = list(cached)
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
                if first and cached and cached[0] == replicas[0]:
                    cached.append(cached.pop(0))  # a slow replica goes last next time
                start(1)  # a hedge beside the late one
            first = False
            start(quorum - len(holders) - running)
    if len(holders) < quorum:
        dht._targets.pop(kid, None)  # look them up again: the next store too
        return None
    return found


def proven_contact(conn: Connection) -> Contact | None:
    """The contact a connection proves: the address we dialed, where the handshake found that peer.

    An accepted connection proves no address the peer can be dialed at.
    """
    if not conn.outbound:
        return None
    return Contact(conn.peer, PeerAddress.for_host(conn.remote_host, conn.remote_port, conn.peer))


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
    digest = hashlib.blake2b(pack(entry.to_obj()), digest_size=32).digest()
    if digest in _verified:
        _verified.move_to_end(digest)
        return
    verify_entry(entry)
    _verified[digest] = None
    if len(_verified) > VERIFIED_KEPT:
        _verified.popitem(last=False)
