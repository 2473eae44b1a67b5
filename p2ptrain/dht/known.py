"""Delta reads: a reader names the entries of a key it already holds, and replicas send only the others.

Theory of operation: the swarm's progress records are read every second or so from several replicas,
and most of them have not changed since the last read; sending them again cost most of a training
peer's background traffic (every record, from every replica, every read: O(peers) bytes a second per
peer). So a reader keeps the verified entries of its last reads (:class:`ReadCache`) and sends each
replica a short tag per entry it holds (``FindValueReq.known``). The replica leaves those out and says
which of them it holds (a bitmask) with a proof that it does: a keyed hash, under the reader's fresh
nonce, of the held entries' bytes, which a replica that does not hold them cannot compute. A replica
thus still counts toward a read's quorum only when it holds an entry of the key, as when it had to
send one.

The reader merges what it holds with what arrived: an entry it verified stays valid until its expiry
whichever replica still has it, and a newer entry of the same subkey wins the merge as before. A tag
is a hash of the whole entry (signature included), so an entry the reader lacks is never left out
unless it collides with one it holds in 64 bits.

Pulls: a reader may also ask a fellow reader of the key (a training peer's partners) for the entries
it lacks before it asks the replicas, naming what it holds as a read does. It takes what comes only as it
takes offers (newer versions of subkeys a read brought, each checked), and asks the replicas after, as
always: a fellow reader changes what the replicas send, never what the read returns. The replicas'
answers were the key's hot spot (every reader's changed records from the key's closest nodes); pulled
from partners, those bytes spread over the readers.

Offers: an author may also push its new entry straight to the peers that read the key (a training
peer's partners, see ``DHT.store(offer_to=...)``). A peer takes an offered entry only for a key it
reads, only from the owner of its subkey and signed by it, and only as a newer version of a subkey a
read brought; it merges it here as if a read had returned it, so the next read names it too; readers
then read the replicas far less often (``DHT.held`` answers between).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from .records import Entry

TAG_BYTES = 8
NONCE_BYTES = 16
PROOF_BYTES = 16
MAX_KNOWN = 1024  # entries a read names (the rest travel again)
# keys whose last read is kept: a large run's progress records alone are read under up to 64 keys
# (``progress.buckets``), besides its matchmaking and ban keys
MAX_CACHED_KEYS = 128
MAX_CACHED_BYTES = 16 * 1024 * 1024


def tag(entry: Entry) -> bytes:
    return hashlib.blake2b(entry.packed, digest_size=TAG_BYTES).digest()


def proof(nonce: bytes, held: Sequence[Entry]) -> bytes:
    """What a replica that holds ``held`` (in the order the reader named them) answers to ``nonce``."""
    h = hashlib.blake2b(key=nonce, digest_size=PROOF_BYTES)
    for e in held:
        h.update(e.packed)
    return h.digest()


def split_known(known: bytes) -> list[bytes]:
    """The tags of a request (its length is checked by the message's bound; a ragged tail is dropped)."""
    return [known[i : i + TAG_BYTES] for i in range(0, len(known) - TAG_BYTES + 1, TAG_BYTES)]


def answer(entries: list[Entry], known: bytes, nonce: bytes) -> tuple[list[Entry], bytes, bytes]:
    """A replica's reply to a delta read: the entries to send, the bitmask of the named ones it holds,
    and the proof that it holds them (empty when it holds none)."""
    if not known:
        return entries, b"", b""
    mine = {tag(e): e for e in entries}
    tags = split_known(known)
    mask = bytearray((len(tags) + 7) // 8)
    held = []
    for i, t in enumerate(tags):
        e = mine.pop(t, None)
        if e is not None:
            mask[i // 8] |= 1 << (i % 8)
            held.append(e)
    return list(mine.values()), bytes(mask), proof(nonce, held) if held else b""


def lacking(entries: Sequence[Entry], known: bytes, budget: int) -> list[Entry]:
    """A pull's answer (see ``Reader.pull``): the entries whose tags are not among ``known``, newest
    first, no more than ``budget`` bytes of them. No proof: a fellow reader counts toward no quorum."""
    named = set(split_known(known))
    out, size = [], 0
    for e in sorted(entries, key=lambda e: -e.expiry):
        if tag(e) in named:
            continue
        size += e.nbytes()
        if size > budget:
            break
        out.append(e)
    return out


def held_entries(known: Sequence[Entry], mask: bytes, given: bytes, nonce: bytes) -> list[Entry]:
    """The entries a replica says it holds of those the reader named, if its proof checks out (else
    none: it held nothing it could show)."""
    held = [e for i, e in enumerate(known) if i // 8 < len(mask) and mask[i // 8] >> (i % 8) & 1]
    if not held or given != proof(nonce, held):
        return []
    return held


class ReadCache:
    """The verified entries of the keys this node read last (bounded in keys and bytes), and the subkeys
    each key's last read brought (those an offer or a pull may refresh)."""

    def __init__(self) -> None:
        self._keys: OrderedDict[bytes, list[Entry]] = OrderedDict()
        self._read: dict[bytes, frozenset[bytes]] = {}  # key id -> the subkeys its last read brought
        self._bytes = 0

    def known(self, kid: bytes, now: float) -> list[Entry]:
        entries = [e for e in self._keys.get(kid, ()) if e.expiry > now]
        return entries[:MAX_KNOWN]

    def update(self, kid: bytes, entries: list[Entry]) -> None:
        """What a read of ``kid`` returned: its entries, and the subkeys offers may refresh until the
        next read."""
        self._store(kid, entries)
        if kid in self._keys:
            self._read[kid] = frozenset(e.subkey for e in entries)

    def _store(self, kid: bytes, entries: list[Entry]) -> None:
        self._drop(kid)
        size = sum(e.nbytes() for e in entries)
        if not entries or size > MAX_CACHED_BYTES // 4:
            self._read.pop(kid, None)
            return
        self._keys[kid] = sorted(entries, key=lambda e: e.subkey)
        self._bytes += size
        while self._keys and (len(self._keys) > MAX_CACHED_KEYS or self._bytes > MAX_CACHED_BYTES):
            self._drop(next(iter(self._keys)), forget=True)

    def reads(self, kid: bytes) -> bool:
        """Whether this node read ``kid`` lately (only such keys take offered entries)."""
        return kid in self._keys

    def wanted(self, kid: bytes, entries: Sequence[Entry], now: float) -> list[Entry]:
        """The ``entries`` :meth:`offer` would take, were they checked: live, of a subkey the last read
        brought, newer than the one held (a cheap test, before any signature is checked)."""
        held = self._keys.get(kid)
        if held is None:
            return []
        read = self._read.get(kid, frozenset())
        by_subkey = {e.subkey: e for e in held if e.expiry > now}
        out = []
        for e in entries:
            old = by_subkey.get(e.subkey)
            if e.subkey in read and e.expiry > now and (old is None or e.sort_key() > old.sort_key()):
                out.append(e)
        return out

    def offer(self, kid: bytes, entries: Sequence[Entry], now: float) -> int:
        """Merge verified ``entries`` of a key this node reads (pushed to it by their authors, see
        ``DHT.store(offer_to=...)``, or pulled from a fellow reader): a newer entry replaces the
        subkey's. Only the subkeys the last read brought are refreshed, even where their entry here
        expired since (a record whose next version was late here is not lost until the next read): a
        new subkey comes through the replicas, which share a key fairly between origins (offers from a
        hundred fresh keys would otherwise fill this cache past those shares). Returns how many were
        taken."""
        wanted = self.wanted(kid, entries, now)
        if not wanted:
            return 0
        by_subkey = {e.subkey: e for e in self._keys[kid] if e.expiry > now}
        taken = 0
        for e in wanted:  # (two versions of one subkey in a batch: the later one wins, as it arrives)
            old = by_subkey.get(e.subkey)
            if old is None or e.sort_key() > old.sort_key():
                by_subkey[e.subkey] = e
                taken += 1
        if taken:
            self._store(kid, list(by_subkey.values()))
        return taken

    def _drop(self, kid: bytes, *, forget: bool = False) -> None:
        old = self._keys.pop(kid, None)
        if old is not None:
            self._bytes -= sum(e.nbytes() for e in old)
        if forget:
            self._read.pop(kid, None)
