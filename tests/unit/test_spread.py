"""Keys spread over buckets of peers (``dht.spread``): the rule every reader of a spread key keeps.

An entry counts only under an owned subkey of its owner's bucket's key: so each owner counts once
whatever it writes where, entries under other buckets' keys or under subkeys nobody owns count for
nothing, and with one bucket the key is the key as it was. Randomized over ids, bits and placements.
"""

from __future__ import annotations

import random

import pytest

from p2ptrain.dht.records import Entry, owned_subkey
from p2ptrain.dht.spread import SpreadKey, bucket_of
from p2ptrain.identity import Identity


def entry(i: int, key: bytes) -> Entry:
    """Owner ``i``'s entry under ``key``: a different value under each key."""
    return Entry(key=key, value=i.to_bytes(4, "big") + key, expiry=1.0)


@pytest.mark.parametrize("seed", range(20))
def test_an_entry_counts_once_and_only_under_its_owners_bucket(seed: int) -> None:
    rng = random.Random(seed)
    bits = rng.randint(0, 4)
    spread = SpreadKey.of(f"run/{seed}/thing", bits)
    assert len(set(spread.keys)) == 1 << bits
    ids = [Identity.generate().peer_id for _ in range(rng.randint(1, 30))]
    read: dict[bytes, dict[bytes, Entry]] = {k: {} for k in spread.keys}
    expected = {}
    for n, peer in enumerate(ids):
        placed = rng.sample(list(spread.keys), rng.randint(1, len(spread.keys)))
        for key in placed:
            read[key][owned_subkey(peer)] = entry(n, key)
        if spread.keys[bucket_of(peer.digest, bits)] in placed:
            expected[owned_subkey(peer)] = (peer, read[spread.key_of(peer)][owned_subkey(peer)])
        # a bare subkey (anyone may write there) names nobody, under any key
        bare = rng.choice(spread.keys)
        read[bare][peer.digest] = entry(n, bare)
    read[b"another key"] = {owned_subkey(ids[0]): entry(0, b"another key")}  # a key not of this spread
    assert spread.owned(read) == expected


def test_one_bucket_is_the_key_as_it_was() -> None:
    spread = SpreadKey.of("p2ptrain/run/bans", 0)
    assert spread.keys == (b"p2ptrain/run/bans",)
    peer = Identity.generate().peer_id
    assert spread.key_of(peer) == b"p2ptrain/run/bans"
    assert SpreadKey.of("p2ptrain/run/bans", 2).keys[3] == b"p2ptrain/run/bans/2/3"
