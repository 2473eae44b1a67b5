"""DHT records: ownership, signatures, bounds and the record store (pure; time is a number)."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from p2ptrain.dht import reads
from p2ptrain.dht.records import (
    OWNER_TAG,
    Entry,
    RecordLimits,
    RecordRefused,
    RecordStore,
    check_entry,
    key_id,
    make_entry,
    merge,
    origin_of,
    owned_subkey,
    owner_of,
    verify_entry,
)
from p2ptrain.errors import InvalidSignature, P2PError
from p2ptrain.identity import PEER_ID_BYTES, Identity, PeerID

ALICE = Identity.from_seed(bytes([1]) * 32)
BOB = Identity.from_seed(bytes([2]) * 32)
A, B = ALICE.peer_id, BOB.peer_id
P, Q = PeerID(bytes([0xAA]) * PEER_ID_BYTES), PeerID(bytes([0xBB]) * PEER_ID_BYTES)  # storing peers
NOW = 1_700_000_000.0
HOUR = 3600.0


def store(**limits: float) -> RecordStore:
    return RecordStore(RecordLimits(**limits))  # type: ignore[arg-type]


# ---- keys and ownership ---------------------------------------------------------------------------


def test_key_id_is_a_deterministic_32_byte_hash() -> None:
    assert key_id(b"run/peers") == key_id(b"run/peers")
    assert len(key_id(b"run/peers")) == PEER_ID_BYTES
    assert key_id(b"run/peers") != key_id(b"run/peerz")
    assert key_id(b"") != key_id(b"\0")
    ids = {key_id(str(i).encode()) for i in range(1000)}
    assert len(ids) == 1000


def test_owned_subkey_is_the_tag_and_the_digest() -> None:
    sub = owned_subkey(A)
    assert sub == OWNER_TAG + A.digest
    assert len(sub) == 1 + PEER_ID_BYTES
    assert owner_of(b"any key", sub) == A


OWNED_KEY = OWNER_TAG + A.digest + b"/profile"


@pytest.mark.parametrize(
    ("key", "subkey", "owner"),
    [
        (b"plain", b"", None),
        (b"plain", b"sub", None),
        (b"plain", owned_subkey(A), A),
        (b"plain", owned_subkey(B), B),
        # an owned key wins over an owned subkey
        (OWNED_KEY, owned_subkey(B), A),
        (OWNED_KEY, b"", A),
        (OWNER_TAG + A.digest, b"", A),  # exactly tag + digest
        (OWNER_TAG + A.digest[:-1], b"", None),  # one byte short: not owned
        (b"\x02" + A.digest, b"", None),  # another tag
        # wrong-length subkeys are not owned
        (b"plain", owned_subkey(A) + b"x", None),
        (b"plain", owned_subkey(A)[:-1], None),
        (b"plain", OWNER_TAG, None),
        (b"plain", b"\x02" + A.digest, None),
    ],
)
def test_owner_of(key: bytes, subkey: bytes, owner: PeerID | None) -> None:
    assert owner_of(key, subkey) == owner


# ---- signatures -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "subkey", "signer"),
    [
        (b"plain", owned_subkey(A), ALICE),
        (OWNED_KEY, b"", ALICE),
        (OWNED_KEY, owned_subkey(B), ALICE),  # the key's owner writes any subkey of it
        (b"plain", b"", None),  # not owned: no signature needed
        (b"plain", b"", BOB),  # not owned: anyone may sign, and it is checked
    ],
)
def test_verify_entry_accepts(key: bytes, subkey: bytes, signer: Identity | None) -> None:
    entry = make_entry(key, b"value", NOW + HOUR, subkey=subkey, signer=signer)
    verify_entry(entry)
    assert (entry.key, entry.subkey, entry.value, entry.expiry) == (key, subkey, b"value", NOW + HOUR)
    assert bool(entry.signature) == (signer is not None)
    # Signatures survive the wire.
    verify_entry(Entry.from_obj(entry.to_obj()))


SIGNED = make_entry(b"plain", b"value", NOW + HOUR, subkey=owned_subkey(A), signer=ALICE)


@pytest.mark.parametrize(
    ("entry", "reason"),
    [
        (make_entry(b"plain", b"v", NOW + HOUR, subkey=owned_subkey(A)), "is not signed"),
        (make_entry(OWNED_KEY, b"v", NOW + HOUR), "is not signed"),
        (make_entry(b"plain", b"v", NOW + HOUR, subkey=owned_subkey(A), signer=BOB), "expected"),
        (make_entry(OWNED_KEY, b"v", NOW + HOUR, subkey=owned_subkey(B), signer=BOB), "expected"),
        (dataclasses.replace(SIGNED, value=b"forged"), "does not verify"),
        (dataclasses.replace(SIGNED, expiry=SIGNED.expiry + 1), "does not verify"),
        (dataclasses.replace(SIGNED, key=b"other"), "does not verify"),
        (dataclasses.replace(SIGNED, signature=b""), "is not signed"),
        (dataclasses.replace(SIGNED, public_key=b""), "is not signed"),
        (dataclasses.replace(SIGNED, signature=bytes(64)), "does not verify"),
        (dataclasses.replace(SIGNED, signature=SIGNED.signature[:10]), "malformed"),
        (dataclasses.replace(SIGNED, public_key=BOB.public_key), "expected"),
        # moving a signed entry to another owner's subkey
        (dataclasses.replace(SIGNED, subkey=owned_subkey(B)), "expected"),
        # an unowned entry that carries a signature must carry a valid one
        (
            dataclasses.replace(make_entry(b"plain", b"v", NOW + HOUR, signer=BOB), value=b"x"),
            "does not verify",
        ),
        (
            dataclasses.replace(make_entry(b"plain", b"v", NOW + HOUR, signer=BOB), public_key=b""),
            "not signed",
        ),
    ],
)
def test_verify_entry_refuses(entry: Entry, reason: str) -> None:
    with pytest.raises(InvalidSignature, match=reason):
        verify_entry(entry)


def test_tampered_subkey_of_an_owned_key_does_not_verify() -> None:
    entry = make_entry(OWNED_KEY, b"v", NOW + HOUR, subkey=b"a", signer=ALICE)
    verify_entry(entry)
    with pytest.raises(InvalidSignature, match="does not verify"):
        verify_entry(dataclasses.replace(entry, subkey=b"b"))


# ---- check_entry ----------------------------------------------------------------------------------

LIMITS = RecordLimits()


@pytest.mark.parametrize(
    ("entry", "reason"),
    [
        (Entry(b"", b"", b"v", NOW + 1), "empty key"),
        (Entry(b"k" * 257, b"", b"v", NOW + 1), "key of 257 bytes exceeds 256"),
        (Entry(b"k", b"s" * 65, b"v", NOW + 1), "subkey of 65 bytes exceeds 64"),
        (Entry(b"k", b"", b"v" * (16 * 1024 + 1), NOW + 1), "value of 16385 bytes exceeds 16384"),
        (Entry(b"k", b"", b"v", NOW), "record already expired"),
        (Entry(b"k", b"", b"v", NOW - 1), "record already expired"),
        (Entry(b"k", b"", b"v", 0.0), "record already expired"),
        (Entry(b"k", b"", b"v", NOW + 24 * HOUR + 61), "86461 s ahead exceeds the 86400 s limit"),
        (Entry(b"k", b"", b"v", float("inf")), "expiry must be a finite time"),
        (Entry(b"k", b"", b"v", float("nan")), "expiry must be a finite time"),
        (Entry(b"k", owned_subkey(A), b"v", NOW + 1), "bad signature: .* is not signed"),
        (make_entry(b"k", b"v", NOW + 1, subkey=owned_subkey(A), signer=BOB), "bad signature: .*expected"),
    ],
)
def test_check_entry_refusals(entry: Entry, reason: str) -> None:
    with pytest.raises(RecordRefused, match=reason) as info:
        check_entry(entry, NOW, LIMITS)
    assert isinstance(info.value, P2PError)
    assert info.value.reason == str(info.value)


@pytest.mark.parametrize(
    "entry",
    [
        Entry(b"k" * 256, b"s" * 64, b"v" * (16 * 1024), NOW + 1),  # every size at its bound
        Entry(b"k", b"", b"", NOW + 24 * HOUR + 60),  # max ttl plus the allowed clock skew
        Entry(b"k", b"", b"v", NOW + 0.001),
        make_entry(b"k", b"v", NOW + 1, subkey=owned_subkey(A), signer=ALICE),
    ],
)
def test_check_entry_accepts_at_the_bounds(entry: Entry) -> None:
    check_entry(entry, NOW, LIMITS)


def test_check_entry_uses_the_given_limits() -> None:
    tight = RecordLimits(max_key=4, max_subkey=2, max_value=8, max_ttl=10.0, clock_skew=0.0)
    check_entry(Entry(b"kkkk", b"ss", b"v" * 8, NOW + 10), NOW, tight)
    for entry, reason in [
        (Entry(b"kkkkk", b"", b"v", NOW + 1), "key of 5 bytes exceeds 4"),
        (Entry(b"k", b"sss", b"v", NOW + 1), "subkey of 3 bytes exceeds 2"),
        (Entry(b"k", b"", b"v" * 9, NOW + 1), "value of 9 bytes exceeds 8"),
        (Entry(b"k", b"", b"v", NOW + 10.5), "exceeds the 10 s limit"),
    ]:
        with pytest.raises(RecordRefused, match=reason):
            check_entry(entry, NOW, tight)


# ---- RecordStore.put: versions --------------------------------------------------------------------


def test_put_and_get() -> None:
    s = store()
    e = make_entry(b"k", b"v", NOW + HOUR)
    assert s.put(e, NOW, stored_by=P) == "stored"
    assert s.get(key_id(b"k"), NOW) == [e]
    assert s.get(key_id(b"other"), NOW) == []
    assert len(s) == 1
    assert s.keys() == [key_id(b"k")]
    assert s.records_of(P) == 1


@pytest.mark.parametrize(
    ("first", "second", "outcome", "kept"),
    [
        ((b"v1", NOW + 100), (b"v2", NOW + 200), "replaced an older entry", "second"),  # later wins
        ((b"v1", NOW + 200), (b"v2", NOW + 100), "kept the existing entry (same or later expiry)", "first"),
        ((b"v1", NOW + 100), (b"v1", NOW + 100), "kept the existing entry (same or later expiry)", "first"),
        # equal expiry: the larger value wins, so every replica converges whatever the arrival order
        ((b"a", NOW + 100), (b"b", NOW + 100), "replaced an older entry", "second"),
        ((b"b", NOW + 100), (b"a", NOW + 100), "kept the existing entry (same or later expiry)", "first"),
    ],
)
def test_put_keeps_the_latest_version(
    first: tuple[bytes, float], second: tuple[bytes, float], outcome: str, kept: str
) -> None:
    s = store()
    e1, e2 = make_entry(b"k", *first), make_entry(b"k", *second)
    assert s.put(e1, NOW, stored_by=P) == "stored"
    assert s.put(e2, NOW + 1, stored_by=P) == outcome
    assert s.get(key_id(b"k"), NOW + 2) == [e1 if kept == "first" else e2]
    assert len(s) == 1
    assert s.records_of(P) == 1


def test_put_settles_signature_only_ties_like_merge() -> None:
    """Copies that differ only in their signer fields: the store keeps the one merge() would pick."""
    copies = [
        make_entry(b"k", b"v", NOW + 10),
        make_entry(b"k", b"v", NOW + 10, signer=ALICE),
        make_entry(b"k", b"v", NOW + 10, signer=BOB),
    ]
    expected = merge(copies)[b""]
    for order in itertools.permutations(copies):
        s = store()
        for e in order:
            s.put(e, NOW, stored_by=P)
        assert s.get(key_id(b"k"), NOW) == [expected]
        assert s.records_of(P) == 1


def test_put_merges_per_subkey() -> None:
    s = store()
    kid = key_id(b"peers")
    a = make_entry(b"peers", b"addr-a", NOW + 100, subkey=owned_subkey(A), signer=ALICE)
    b = make_entry(b"peers", b"addr-b", NOW + 200, subkey=owned_subkey(B), signer=BOB)
    assert s.put(a, NOW, stored_by=P) == "stored"
    assert s.put(b, NOW, stored_by=Q) == "stored"
    assert sorted(s.get(kid, NOW), key=lambda e: e.subkey) == sorted([a, b], key=lambda e: e.subkey)
    # A newer entry for one subkey leaves the other alone.
    a2 = make_entry(b"peers", b"addr-a2", NOW + 300, subkey=owned_subkey(A), signer=ALICE)
    assert s.put(a2, NOW, stored_by=P) == "replaced an older entry"
    assert {e.value for e in s.get(kid, NOW)} == {b"addr-a2", b"addr-b"}
    assert len(s) == 2 and s.keys() == [kid]


def test_put_refuses_what_check_entry_refuses_and_stores_nothing() -> None:
    s = store()
    with pytest.raises(RecordRefused, match="is not signed"):
        s.put(Entry(b"k", owned_subkey(A), b"v", NOW + 1), NOW, stored_by=P)
    with pytest.raises(RecordRefused, match="already expired"):
        s.put(Entry(b"k", b"", b"v", NOW), NOW, stored_by=P)
    assert len(s) == 0 and s.keys() == [] and s.records_of(P) == 0


# ---- RecordStore.put: bounds ----------------------------------------------------------------------


def test_max_subkeys() -> None:
    s = store(max_subkeys=3)
    for sub in (b"a", b"b", b"c"):
        assert s.put(make_entry(b"k", b"v", NOW + 10, subkey=sub), NOW, None) == "stored"
    with pytest.raises(RecordRefused, match="key already has 3 subkeys"):
        s.put(make_entry(b"k", b"v", NOW + 10, subkey=b"d"), NOW, None)
    # Updating an existing subkey is still fine, and other keys are unaffected.
    assert s.put(make_entry(b"k", b"v", NOW + 20, subkey=b"a"), NOW, None) == "replaced an older entry"
    assert s.put(make_entry(b"k2", b"v", NOW + 10, subkey=b"d"), NOW, None) == "stored"
    # Once a subkey expires, its slot is free again.
    s.put(make_entry(b"k", b"v", NOW + 30, subkey=b"b"), NOW, None)
    s.put(make_entry(b"k", b"v", NOW + 30, subkey=b"c"), NOW, None)
    assert s.put(make_entry(b"k", b"v", NOW + 40, subkey=b"d"), NOW + 25, None) == "stored"
    assert {e.subkey for e in s.get(key_id(b"k"), NOW + 25)} == {b"b", b"c", b"d"}


def test_max_key_bytes() -> None:
    # Each entry costs key + subkey + value + 112 bytes of overhead: here 1 + 1 + 300 + 112 = 414.
    s = store(max_key_bytes=1000)
    assert make_entry(b"k", b"v" * 300, NOW + 10, subkey=b"a").nbytes() == 414
    s.put(make_entry(b"k", b"v" * 300, NOW + 10, subkey=b"a"), NOW, None)
    s.put(make_entry(b"k", b"v" * 300, NOW + 10, subkey=b"b"), NOW, None)
    with pytest.raises(RecordRefused, match="key would exceed 1000 bytes"):
        s.put(make_entry(b"k", b"v" * 300, NOW + 10, subkey=b"c"), NOW, None)
    # A replacement is counted net of the entry it replaces: 828 - 414 + 564 fits, 828 - 414 + 614 not.
    with pytest.raises(RecordRefused, match="key would exceed 1000 bytes"):
        s.put(make_entry(b"k", b"v" * 500, NOW + 20, subkey=b"a"), NOW, None)
    assert s.put(make_entry(b"k", b"v" * 450, NOW + 20, subkey=b"a"), NOW, None) == "replaced an older entry"
    with pytest.raises(RecordRefused, match="key would exceed"):
        s.put(make_entry(b"k", b"", NOW + 10, subkey=b"c"), NOW, None)  # 978 + 114
    # The bound is per key.
    assert s.put(make_entry(b"k2", b"v" * 300, NOW + 10, subkey=b"c"), NOW, None) == "stored"


def test_max_keys() -> None:
    s = store(max_keys=2)
    s.put(make_entry(b"k1", b"v", NOW + 10), NOW, None)
    s.put(make_entry(b"k2", b"v", NOW + 100), NOW, None)
    with pytest.raises(RecordRefused, match="maximum number of keys"):
        s.put(make_entry(b"k3", b"v", NOW + 100), NOW, None)
    # Existing keys take new subkeys and versions.
    assert s.put(make_entry(b"k1", b"v", NOW + 10, subkey=b"x"), NOW, None) == "stored"
    assert s.put(make_entry(b"k2", b"w", NOW + 200), NOW, None) == "replaced an older entry"
    # Once k1 has expired and been dropped, a new key fits.
    assert s.expire(NOW + 10) == 2
    assert s.put(make_entry(b"k3", b"v", NOW + 100), NOW + 10, None) == "stored"
    assert sorted(s.keys()) == sorted([key_id(b"k2"), key_id(b"k3")])


def test_records_per_peer_quota() -> None:
    s = store(max_records_per_peer=2)
    s.put(make_entry(b"k1", b"v", NOW + 100), NOW, stored_by=P)
    s.put(make_entry(b"k2", b"v", NOW + 100), NOW, stored_by=P)
    assert s.records_of(P) == 2
    with pytest.raises(RecordRefused, match="peer already stores 2 records here"):
        s.put(make_entry(b"k3", b"v", NOW + 100), NOW, stored_by=P)
    # Overwriting its own entry costs P nothing.
    assert s.put(make_entry(b"k1", b"v", NOW + 200), NOW, stored_by=P) == "replaced an older entry"
    assert s.records_of(P) == 2
    # Q is counted on its own; P taking over Q's entry would gain P a record, so it is refused.
    s.put(make_entry(b"k4", b"v", NOW + 150), NOW, stored_by=Q)
    assert s.records_of(Q) == 1
    with pytest.raises(RecordRefused, match="peer already stores 2 records"):
        s.put(make_entry(b"k4", b"v", NOW + 200), NOW, stored_by=P)
    assert s.records_of(Q) == 1
    # Q taking over P's entry moves the record from P's count to Q's.
    assert s.put(make_entry(b"k1", b"v", NOW + 300), NOW, stored_by=Q) == "replaced an older entry"
    assert (s.records_of(P), s.records_of(Q)) == (1, 2)
    assert s.put(make_entry(b"k3", b"v", NOW + 100), NOW, stored_by=P) == "stored"
    assert (s.records_of(P), s.records_of(Q)) == (2, 2)
    # A "kept" store (not newer) changes nobody's count, even at the quota.
    assert s.put(make_entry(b"k3", b"v", NOW + 50), NOW, stored_by=Q).startswith("kept")
    assert (s.records_of(P), s.records_of(Q)) == (2, 2)
    # Our own stores (stored_by None) do not count, and taking over P's entry frees one of P's.
    assert s.put(make_entry(b"k3", b"v", NOW + 400), NOW, stored_by=None) == "replaced an older entry"
    assert (s.records_of(P), s.records_of(Q)) == (1, 2)
    # Expiry frees the quota.
    assert s.expire(NOW + 100) == 1  # k2 (P's)
    assert (s.records_of(P), s.records_of(Q)) == (0, 2)
    assert len(s) == 3


def test_stores_per_minute_is_a_sliding_window() -> None:
    s = store(max_stores_per_minute=3)

    def put(t: float, by: PeerID = P, key: bytes = b"k") -> str:
        return s.put(make_entry(key, b"v", NOW + t + 100), NOW + t, stored_by=by)

    put(0.0)
    put(10.0)
    put(20.0, key=b"other")
    with pytest.raises(RecordRefused, match="more than 3 stores per minute"):
        put(30.0)
    with pytest.raises(RecordRefused, match="more than 3 stores per minute"):
        put(59.9)
    put(30.0, by=Q)  # another peer has its own window
    # At t=60 the store of t=0 leaves the window; the refused ones never entered it.
    assert put(60.0) == "replaced an older entry"
    with pytest.raises(RecordRefused, match="per minute"):
        put(65.0)
    assert put(70.0) == "replaced an older entry"
    # A refused entry does not use up the window.
    with pytest.raises(RecordRefused, match="already expired"):
        s.put(make_entry(b"k", b"v", NOW), NOW + 200, stored_by=P)
    for t in (200.0, 201.0, 202.0):
        put(t)


def test_local_stores_are_not_rate_limited() -> None:
    s = store(max_stores_per_minute=1, max_records_per_peer=1)
    for i in range(10):
        assert s.put(make_entry(b"k%d" % i, b"v", NOW + 100), NOW, stored_by=None) == "stored"


# ---- expiry, get, merge ---------------------------------------------------------------------------


def test_get_drops_expired_entries() -> None:
    s = store()
    kid = key_id(b"k")
    s.put(make_entry(b"k", b"v", NOW + 10, subkey=b"a"), NOW, stored_by=P)
    s.put(make_entry(b"k", b"v", NOW + 20, subkey=b"b"), NOW, stored_by=P)
    assert len(s.get(kid, NOW + 9.9)) == 2
    assert [e.subkey for e in s.get(kid, NOW + 10)] == [b"b"]  # expiry is exclusive
    assert len(s) == 1 and s.records_of(P) == 1
    assert s.get(kid, NOW + 20) == []
    assert len(s) == 0 and s.keys() == [] and s.records_of(P) == 0


def test_expire_counts_dropped_entries() -> None:
    s = store()
    for i in range(10):
        s.put(make_entry(b"k%d" % (i % 3), b"v", NOW + 10 * (i + 1), subkey=b"%d" % i), NOW, stored_by=P)
    assert s.expire(NOW) == 0
    assert s.expire(NOW + 30) == 3
    assert s.expire(NOW + 30) == 0
    assert len(s) == 7 and s.records_of(P) == 7
    assert len(s.all_entries(NOW + 55)) == 5
    assert s.expire(NOW + 1000) == 5
    assert len(s) == 0 and s.keys() == [] and s.records_of(P) == 0


def test_merge_picks_the_latest_per_subkey() -> None:
    old_a = make_entry(b"k", b"old", NOW + 10, subkey=b"a")
    new_a = make_entry(b"k", b"new", NOW + 20, subkey=b"a")
    only_b = make_entry(b"k", b"b", NOW + 5, subkey=b"b")
    assert merge([old_a, new_a, only_b]) == {b"a": new_a, b"b": only_b}
    assert merge([new_a, only_b, old_a]) == {b"a": new_a, b"b": only_b}
    assert merge([]) == {}


def test_merge_is_deterministic_whatever_the_order() -> None:
    """Replicas that hold the same entries in any order agree on the merge, ties included."""
    unsigned = make_entry(b"k", b"same", NOW + 10, subkey=b"s")
    signed_alice = make_entry(b"k", b"same", NOW + 10, subkey=b"s", signer=ALICE)
    signed_bob = make_entry(b"k", b"same", NOW + 10, subkey=b"s", signer=BOB)
    smaller = make_entry(b"k", b"other", NOW + 10, subkey=b"s")
    older = make_entry(b"k", b"zzz", NOW + 9, subkey=b"s")
    pool = [unsigned, signed_alice, signed_bob, smaller, older]
    results = {tuple(merge(list(order)).items()) for order in itertools.permutations(pool)}
    assert len(results) == 1
    (winner,) = dict(results.pop()).values()
    assert (winner.value, winner.expiry) == (b"same", NOW + 10)  # equal expiry: larger value wins


def test_store_and_merge_agree_whatever_the_arrival_order() -> None:
    rng = random.Random(3)
    pool = [
        make_entry(
            b"k", bytes([rng.randrange(4)]), NOW + rng.randrange(1, 4), subkey=bytes([rng.randrange(3)])
        )
        for _ in range(20)
    ]
    expected = merge(pool)
    for _ in range(20):
        rng.shuffle(pool)
        s = store()
        for e in pool:
            s.put(e, NOW, stored_by=None)
        assert {e.subkey: e for e in s.get(key_id(b"k"), NOW)} == expected


# ---- fair shares of a full key (per origin) -------------------------------------------------------

FLOOD, HONEST, OTHER = "203.0.113.0/24", "198.51.100.0/24", "192.0.2.0/24"


def test_a_flooded_key_still_takes_an_honest_record() -> None:
    """One subnet filled the key with day-long entries; a record from another subnet evicts the
    flooder's earliest-expiring entry instead of being refused ("key would exceed", before)."""
    s = store(max_key_bytes=1000)
    for i, ttl in enumerate((5 * HOUR, 2 * HOUR)):
        s.put(make_entry(b"k", b"v" * 300, NOW + ttl, subkey=bytes([i])), NOW, P, FLOOD)
    got = s.put(make_entry(b"k", b"v" * 300, NOW + 10, subkey=b"h"), NOW, Q, HONEST)
    assert got.startswith("stored, evicting 1")
    assert {e.subkey for e in s.get(key_id(b"k"), NOW)} == {b"\x00", b"h"}  # the 2 h entry went
    assert s.records_of(P) == 1 and s.records_of(Q) == 1


def test_an_origin_claims_as_much_as_the_biggest_holder_keeps_and_no_more() -> None:
    s = store(max_key_bytes=1700)  # four entries of 414 bytes fit
    for i in range(4):
        s.put(make_entry(b"k", b"v" * 300, NOW + HOUR, subkey=bytes([i])), NOW, P, FLOOD)
    for sub in (b"h1", b"h2"):
        s.put(make_entry(b"k", b"v" * 300, NOW + 10, subkey=sub), NOW, Q, HONEST)
    # 2 and 2 now: a third honest entry would hold more than the flooder keeps
    with pytest.raises(RecordRefused, match="key would exceed"):
        s.put(make_entry(b"k", b"v" * 300, NOW + 10, subkey=b"h3"), NOW, Q, HONEST)
    # ... and the flooder cannot take back what it lost either (nobody holds more than it would)
    with pytest.raises(RecordRefused, match="key would exceed"):
        s.put(make_entry(b"k", b"v" * 300, NOW + HOUR, subkey=b"x"), NOW, P, FLOOD)
    # a third origin takes its share from the biggest holder (either, 2 each: the earliest expiry goes)
    s.put(make_entry(b"k", b"v" * 300, NOW + 10, subkey=b"o"), NOW, Q, OTHER)
    assert len(s.get(key_id(b"k"), NOW)) == 4


def test_fair_shares_of_the_subkey_count() -> None:
    s = store(max_subkeys=4)
    for i in range(4):
        s.put(make_entry(b"k", b"", NOW + HOUR, subkey=bytes([i])), NOW, P, FLOOD)
    assert s.put(make_entry(b"k", b"", NOW + 10, subkey=b"h"), NOW, Q, HONEST).startswith("stored, evicting")
    assert len(s.get(key_id(b"k"), NOW)) == 4


def test_this_nodes_own_entries_evict_nobody() -> None:
    s = store(max_key_bytes=1000)
    for i in range(2):
        s.put(make_entry(b"k", b"v" * 300, NOW + HOUR, subkey=bytes([i])), NOW, P, FLOOD)
    with pytest.raises(RecordRefused, match="key would exceed"):
        s.put(make_entry(b"k", b"v" * 300, NOW + 10, subkey=b"mine"), NOW, None)


@pytest.mark.parametrize(
    ("host", "origin"),
    [
        ("203.0.113.77", "203.0.113.0/24"),
        ("2001:db8:1:2:3::9", "2001:db8:1:2::/64"),
        ("127.0.0.12", "127.0.0.12"),  # peers on one machine are told apart by address
        ("::1", "::1"),
        ("t3", "t3"),  # the in-memory network's names
    ],
)
def test_origin_of(host: str, origin: str) -> None:
    assert origin_of(host) == origin


# ---- read-back verification, remembered ------------------------------------------------------------


def test_an_entry_read_back_again_is_not_verified_again_and_a_changed_one_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every record that arrives wakes a read of what the peer holds, which checked every held entry's
    signature again: a key of a hundred free ids' records cost hundreds of checks a wake-up."""
    checked: list[Entry] = []

    def counted(entry: Entry) -> None:
        checked.append(entry)
        verify_entry(entry)

    monkeypatch.setattr(reads, "verify_entry", counted)
    key = b"held-again"
    kid = key_id(key)
    mine = make_entry(key, b"v1", NOW + HOUR, subkey=owned_subkey(A), signer=ALICE)
    for _ in range(3):
        assert reads.verified_entries([mine], kid, None, NOW) == [mine]
    assert checked == [mine]  # once
    # The same signature over other bytes is another entry: checked, and refused.
    forged = dataclasses.replace(mine, value=b"v2")
    assert reads.verified_entries([forged], kid, None, NOW) == []
    assert reads.verified_entries([forged], kid, None, NOW) == []
    assert checked == [mine, forged, forged]  # (a bad one is never remembered)
