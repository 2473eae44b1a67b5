"""The Kademlia routing table (pure: no trio, no sockets; time is passed in).

Theory of operation: node ids are peer ids (the hash of a public key, so nobody chooses where they sit).
Contacts live in 256 k-buckets indexed by the length of the XOR distance to our id; bucket ``i`` holds
contacts at distance in ``[2**i, 2**(i+1))``. Each bucket keeps its contacts least-recently-seen first
and a replacement cache of recently seen contacts that did not fit.

When a contact is seen and its bucket is full, the newcomer goes into the replacement cache and the
table asks its driver to ping the least-recently-seen contact (``ping_before_evict``): if that contact
answers it moves to the tail (old, proven contacts are preferred, as published); if it does not, it is
evicted and the newest replacement takes its place. A contact that fails RPCs repeatedly is evicted the
same way.

Sybil bound: a bucket holds at most ``max_per_subnet`` contacts from one IPv4 /24 or IPv6 /48 (private
and loopback ranges are exempt by default, so local swarms and test beds work).

Every decision returns a human-readable reason beside its outcome.
"""

from __future__ import annotations

import functools
import heapq
import ipaddress
import random
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..identity import PEER_ID_BYTES, PeerID
from ..net.address import PeerAddress

ID_BITS = PEER_ID_BYTES * 8


def distance(a: bytes, b: bytes) -> int:
    return int.from_bytes(a, "big") ^ int.from_bytes(b, "big")


@dataclass(frozen=True)
class Contact:
    """A peer we can dial: its id and an address carrying that id."""

    peer_id: PeerID
    address: PeerAddress

    def __post_init__(self) -> None:
        if self.address.peer_id != self.peer_id:
            object.__setattr__(self, "address", self.address.with_peer(self.peer_id))


def subnet_of(address: PeerAddress) -> str | None:
    """The /24 (IPv4) or /48 (IPv6) of an address; None for names and exempt (private) ranges."""
    return _subnet_of_host(address.host)


def is_exempt(address: PeerAddress) -> bool:
    return _exempt_host(address.host)


# (per host, once: a table checks a bucket's subnets at every contact it sees)
@functools.lru_cache(maxsize=1 << 16)
def _subnet_of_host(host: str) -> str:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"dns:{host.lower()}"
    if ip.version == 4:
        return str(ipaddress.ip_network(f"{ip}/24", strict=False))
    return str(ipaddress.ip_network(f"{ip}/48", strict=False))


@functools.lru_cache(maxsize=1 << 16)
def _exempt_host(host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host == "localhost"
    return ip.is_private or ip.is_loopback or ip.is_link_local


@dataclass
class _Entry:
    contact: Contact
    last_seen: float
    failures: int = 0


@dataclass
class Bucket:
    entries: OrderedDict[PeerID, _Entry] = field(default_factory=OrderedDict)  # LRU first
    replacements: OrderedDict[PeerID, Contact] = field(default_factory=OrderedDict)  # newest last
    last_touched: float = 0.0
    pinging: PeerID | None = None


class Buckets:
    """The table's ``ID_BITS`` buckets, each made when first written: a node of a swarm of N uses about
    log2(N) of them, and 256 empty ones cost some 90 KB per node (a simulated swarm of 10,000 holds a
    table per node). Indexing makes the bucket (a read that must not: :meth:`made`)."""

    __slots__ = ("_made",)

    def __init__(self) -> None:
        self._made: dict[int, Bucket] = {}

    def __len__(self) -> int:
        return ID_BITS

    def __getitem__(self, index: int) -> Bucket:
        if not -ID_BITS <= index < ID_BITS:
            raise IndexError(index)
        index %= ID_BITS
        bucket = self._made.get(index)
        if bucket is None:
            bucket = self._made[index] = Bucket()
        return bucket

    def __iter__(self) -> Iterator[Bucket]:
        return (self[i] for i in range(ID_BITS))

    def made(self, index: int) -> Bucket | None:
        """The bucket at ``index`` if it was ever written (None: it is empty and untouched)."""
        return self._made.get(index)

    def used(self) -> list[tuple[int, Bucket]]:
        """The buckets made so far, by index."""
        return sorted(self._made.items())


@dataclass(frozen=True)
class Observation:
    """What :meth:`RoutingTable.observe` did. ``ping`` names a contact to check before evicting it."""

    outcome: str  # "added" | "refreshed" | "cached" | "refused"
    reason: str
    ping: Contact | None = None


class RoutingTable:
    def __init__(
        self,
        local: PeerID,
        *,
        k: int = 20,
        max_per_subnet: int = 2,
        exempt_private: bool = True,
        max_failures: int = 3,
    ) -> None:
        self.local = local
        self.k = k
        self.max_per_subnet = max_per_subnet
        self.exempt_private = exempt_private
        self.max_failures = max_failures
        self.buckets = Buckets()
        self._index: dict[PeerID, Contact] = {}  # every contact in any bucket, for fast scans

    def bucket_index(self, peer: PeerID) -> int:
        d = distance(self.local.digest, peer.digest)
        if d == 0:
            raise ValueError("our own id has no bucket")
        return d.bit_length() - 1

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, peer: PeerID) -> bool:
        if peer == self.local:
            return False
        bucket = self.buckets.made(self.bucket_index(peer))
        return bucket is not None and peer in bucket.entries

    def contacts(self) -> list[Contact]:
        return list(self._index.values())

    def answering(self) -> list[Contact]:
        """The contacts whose last call did not fail (a failure is forgotten once they answer again)."""
        return [e.contact for _, b in self.buckets.used() for e in b.entries.values() if not e.failures]

    def get(self, peer: PeerID) -> Contact | None:
        if peer == self.local:
            return None
        bucket = self.buckets.made(self.bucket_index(peer))
        entry = bucket.entries.get(peer) if bucket is not None else None
        return entry.contact if entry else None

    # ---- updates ----

    def observe(self, contact: Contact, now: float) -> Observation:
        """We heard from ``contact`` (it answered us, or called us and is reachable)."""
        if contact.peer_id == self.local:
            return Observation("refused", "that is our own id")
        bucket = self.buckets[self.bucket_index(contact.peer_id)]
        bucket.last_touched = now
        entry = bucket.entries.get(contact.peer_id)
        if entry is not None:
            entry.contact, entry.last_seen, entry.failures = contact, now, 0
            self._index[contact.peer_id] = contact
            bucket.entries.move_to_end(contact.peer_id)
            return Observation("refreshed", "known contact moved to the tail")
        if reason := self._subnet_refusal(bucket, contact):
            return Observation("refused", reason)
        if len(bucket.entries) < self.k:
            bucket.entries[contact.peer_id] = _Entry(contact, now)
            self._index[contact.peer_id] = contact
            bucket.replacements.pop(contact.peer_id, None)
            return Observation("added", "bucket has room")
        bucket.replacements[contact.peer_id] = contact
        bucket.replacements.move_to_end(contact.peer_id)
        while len(bucket.replacements) > self.k:
            bucket.replacements.popitem(last=False)
        if bucket.pinging is None:
            oldest = next(iter(bucket.entries.values())).contact
            bucket.pinging = oldest.peer_id
            return Observation("cached", "bucket full: ping the oldest before evicting it", ping=oldest)
        return Observation("cached", "bucket full: a ping of its oldest contact is in flight")

    def _subnet_refusal(self, bucket: Bucket, contact: Contact) -> str | None:
        if self.exempt_private and is_exempt(contact.address):
            return None
        net = subnet_of(contact.address)
        same = sum(1 for e in bucket.entries.values() if subnet_of(e.contact.address) == net)
        if same >= self.max_per_subnet:
            return f"bucket already holds {same} contacts from {net}"
        return None

    def ping_result(self, peer: PeerID, alive: bool, now: float) -> str:
        """Outcome of a ping-before-evict; returns what happened."""
        bucket = self.buckets.made(self.bucket_index(peer))
        if bucket is None:
            return "contact already gone"
        if bucket.pinging == peer:
            bucket.pinging = None
        if peer not in bucket.entries:
            return "contact already gone"
        if alive:
            entry = bucket.entries[peer]
            entry.last_seen, entry.failures = now, 0
            bucket.entries.move_to_end(peer)
            return "oldest contact answered: kept, newcomer stays in the replacement cache"
        return self._evict(bucket, peer, now, "did not answer the eviction ping")

    def failed(self, peer: PeerID, now: float) -> str:
        """An RPC to ``peer`` failed; evict after ``max_failures`` (or at once if a replacement waits)."""
        if peer == self.local:
            return "own id"
        bucket = self.buckets.made(self.bucket_index(peer))
        entry = bucket.entries.get(peer) if bucket is not None else None
        if bucket is None or entry is None:
            if bucket is not None:
                bucket.replacements.pop(peer, None)
            return "not in the table"
        entry.failures += 1
        if entry.failures >= self.max_failures or bucket.replacements:
            return self._evict(bucket, peer, now, f"failed {entry.failures} time(s)")
        return f"failure {entry.failures} of {self.max_failures} noted"

    def _evict(self, bucket: Bucket, peer: PeerID, now: float, why: str) -> str:
        del bucket.entries[peer]
        del self._index[peer]
        while bucket.replacements:
            _, newest = bucket.replacements.popitem(last=True)
            if self._subnet_refusal(bucket, newest) is None:
                bucket.entries[newest.peer_id] = _Entry(newest, now)
                self._index[newest.peer_id] = newest
                return f"evicted ({why}); promoted {newest.peer_id.short()} from the replacement cache"
        return f"evicted ({why})"

    # ---- queries ----

    def closest(
        self, target: bytes, count: int | None = None, exclude: set[PeerID] | None = None
    ) -> list[Contact]:
        """The ``count`` (default k) known contacts closest to ``target`` by XOR distance."""
        t = int.from_bytes(target, "big")
        skip = exclude or set()
        found = (c for p, c in self._index.items() if p not in skip)
        return heapq.nsmallest(self.k if count is None else count, found, key=lambda c: c.peer_id.as_int ^ t)

    def stale_buckets(self, now: float, interval: float) -> list[int]:
        """Indexes of buckets untouched for ``interval``, from the nearest used one outwards."""
        used = [i for i, b in self.buckets.used() if b.entries]
        if not used:
            return []

        def touched(i: int) -> float:
            bucket = self.buckets.made(i)
            return bucket.last_touched if bucket is not None else 0.0

        return [i for i in range(min(used), ID_BITS) if now - touched(i) >= interval]

    def random_id_in_bucket(self, index: int, rng: random.Random) -> bytes:
        """A random id whose XOR distance to ours has bit length ``index + 1`` (for bucket refresh)."""
        d = (1 << index) | rng.getrandbits(index) if index else 1
        return (int.from_bytes(self.local.digest, "big") ^ d).to_bytes(PEER_ID_BYTES, "big")
