"""Delta reads (``p2ptrain.dht.known``): replicas leave out what a reader holds, and prove they hold it."""

from __future__ import annotations

from p2ptrain.dht.known import (
    MAX_CACHED_KEYS,
    MAX_KNOWN,
    ReadCache,
    answer,
    held_entries,
    split_known,
    tag,
)
from p2ptrain.dht.records import Entry, make_entry, owned_subkey
from p2ptrain.identity import Identity

NONCE = b"n" * 16


def entries(n: int, expiry: float = 100.0, value: bytes = b"v") -> list[Entry]:
    out = []
    for i in range(n):
        who = Identity.from_seed(bytes([i + 1]) * 32)
        out.append(make_entry(b"key", value, expiry, subkey=owned_subkey(who.peer_id), signer=who))
    return out


def test_a_replica_sends_only_what_the_reader_lacks_and_proves_it_holds_the_rest():
    held = entries(5)
    signer = Identity.from_seed(b"\x03" * 32)
    newer = make_entry(b"key", b"newer", 200.0, subkey=held[2].subkey, signer=signer)
    replica = [*held[:2], newer, *held[3:]]
    known = b"".join(tag(e) for e in held)
    send, mask, proof = answer(replica, known, NONCE)
    assert send == [newer]
    assert held_entries(held, mask, proof, NONCE) == [held[0], held[1], held[3], held[4]]


def test_without_known_entries_everything_travels_and_nothing_counts_as_held():
    replica = entries(3)
    assert answer(replica, b"", b"") == (replica, b"", b"")
    assert held_entries([], b"", b"", NONCE) == []


def test_a_replica_that_does_not_hold_the_entries_cannot_prove_it():
    held = entries(4)
    known = b"".join(tag(e) for e in held)
    # It claims to hold them all, but computes the proof over what it has (other values) or guesses.
    mask = b"\x0f"
    forged = answer([make_entry(e.key, b"other", e.expiry, subkey=e.subkey) for e in held], known, NONCE)[2]
    for proof in (b"", b"\x00" * 16, forged):
        assert held_entries(held, mask, proof, NONCE) == []
    # A proof is bound to the reader's nonce: one answered to another reader does not replay.
    _, mask, proof = answer(held, known, NONCE)
    assert held_entries(held, mask, proof, b"m" * 16) == []
    assert held_entries(held, mask, proof, NONCE) == held


def test_a_tag_covers_the_whole_entry():
    a = entries(1)[0]
    b = make_entry(a.key, a.value, a.expiry + 1, subkey=a.subkey)
    assert tag(a) != tag(b) and len(tag(a)) == 8
    assert split_known(tag(a) + tag(b) + b"ragged") == [tag(a), tag(b)]


def test_the_read_cache_drops_expired_entries_and_stays_bounded():
    cache = ReadCache()
    old, fresh = entries(2, expiry=10.0), entries(3, expiry=100.0, value=b"w")
    cache.update(b"k", [*old, *fresh])
    assert {e.value for e in cache.known(b"k", now=50.0)} == {b"w"}
    assert len(cache.known(b"k", now=5.0)) == 5
    assert cache.known(b"other", now=0.0) == []
    cache.update(b"k", [])  # a read that found nothing forgets the key
    assert cache.known(b"k", now=0.0) == []
    for i in range(MAX_CACHED_KEYS + 5):
        cache.update(bytes([i]), fresh)
    assert cache.known(bytes([0]), now=0.0) == []  # the oldest keys went first
    assert len(cache.known(bytes([MAX_CACHED_KEYS + 4]), now=0.0)) == 3
    many = entries(1) * (MAX_KNOWN + 10)
    cache.update(b"many", many)
    assert len(cache.known(b"many", now=0.0)) == MAX_KNOWN


def test_offered_entries_merge_only_into_keys_this_node_reads():
    cache = ReadCache()
    first = entries(2, expiry=100.0)
    assert cache.offer(b"k" * 32, first, now=0.0) == 0  # a key this node never read takes nothing
    assert not cache.reads(b"k" * 32)
    cache.update(b"k" * 32, first)
    newer = entries(1, expiry=150.0, value=b"newer")
    older = entries(2, expiry=50.0, value=b"older")[1:]
    assert cache.offer(b"k" * 32, [*newer, *older], now=0.0) == 1  # the newer one replaces; the older not
    held = {e.subkey: e for e in cache.known(b"k" * 32, now=0.0)}
    assert held[newer[0].subkey] == newer[0] and held[first[1].subkey] == first[1]
    assert cache.offer(b"k" * 32, entries(3, expiry=10.0)[2:], now=20.0) == 0  # expired on arrival
    assert len(cache.known(b"k" * 32, now=120.0)) == 1  # the others expired meanwhile
