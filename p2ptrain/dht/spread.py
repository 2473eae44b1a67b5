"""Keys that every peer of a swarm writes, spread over buckets of peers.

A key that every peer of a swarm writes and reads (a run's progress records, a step's matchmaking
announcements) puts the whole swarm on the key's few closest nodes: each reader gets every entry from
them, O(N^2) bytes at those nodes per round of reads, and one key holds at most ``MAX_VALUE_BYTES``.
Spread over ``2^bits`` keys, one per *bucket* of peers (the top ``bits`` bits of a hash of the peer
id, :func:`bucket_of`), each peer writes under its own bucket's key only and a reader reads them all:
each key's replicas serve ``1/2^bits`` of the entries.

The invariant every reader keeps (:meth:`SpreadKey.owned`): an entry counts only under an owned subkey
(the DHT checked that its owner signed it) of its owner's bucket's key. So a peer counts once whatever
it writes where, and filling one bucket's key takes ids whose hash falls in it (2^bits tries an id).
With ``bits`` 0 the one key is the key as it always was.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from ..identity import PeerID
from .records import Entry, subkey_owner


@functools.lru_cache(maxsize=1 << 16)  # (a split swarm's views place every record they count)
def bucket_of(peer: bytes, bits: int) -> int:
    """The bucket of a peer id at ``bits`` bits: the top bits of a hash of it (not of the id itself, so
    the buckets do not follow the DHT's own neighbourhoods)."""
    if bits <= 0:
        return 0
    h = int.from_bytes(hashlib.blake2b(peer, digest_size=8, person=b"p2pt-bucket").digest(), "big")
    return h >> (64 - bits)


@dataclass(frozen=True)
class SpreadKey:
    """A key spread over ``2^bits`` bucket keys: ``keys[b]`` is bucket ``b``'s (``keys[0]`` alone, the
    key itself, with ``bits`` 0)."""

    keys: tuple[bytes, ...]
    bits: int

    @classmethod
    def of(cls, base: str, bits: int) -> SpreadKey:
        """``base``'s bucket keys: ``base`` itself with ``bits`` 0, else ``base/bits/bucket``."""
        if bits <= 0:
            return cls((base.encode(),), 0)
        return cls(tuple(f"{base}/{bits}/{b}".encode() for b in range(1 << bits)), bits)

    def key_of(self, peer: PeerID) -> bytes:
        """The key ``peer`` writes under: its bucket's."""
        return self.keys[bucket_of(peer.digest, self.bits)]

    def owned(self, read: Mapping[bytes, Mapping[bytes, Entry]]) -> dict[bytes, tuple[PeerID, Entry]]:
        """The entries of ``read`` (key -> subkey -> entry) that count: each under an owned subkey of its
        owner's bucket's key, by subkey, with its owner. Entries under other keys, and subkeys nobody
        owns, are left out."""
        out: dict[bytes, tuple[PeerID, Entry]] = {}
        for key, held in read.items():
            for subkey, entry in held.items():
                peer = subkey_owner(subkey)
                if peer is not None and self.key_of(peer) == key:
                    out[subkey] = (peer, entry)
        return out
