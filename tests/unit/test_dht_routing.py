"""The Kademlia routing table (pure, synchronous; time is a number)."""

from __future__ import annotations

import hashlib
import random

import pytest

from p2ptrain.dht.routing import ID_BITS, Contact, RoutingTable, distance, is_exempt, subnet_of
from p2ptrain.identity import PEER_ID_BYTES, PeerID
from p2ptrain.net.address import PeerAddress

LOCAL = PeerID(hashlib.blake2b(b"local", digest_size=PEER_ID_BYTES).digest())
LOCAL_INT = int.from_bytes(LOCAL.digest, "big")


def pid_at(index: int, low: int = 0, local: PeerID = LOCAL) -> PeerID:
    """A peer id in bucket ``index`` of ``local``'s table: distance ``2**index | low``."""
    assert 0 <= low < (1 << index) or (index == 0 and low == 0)
    d = (1 << index) | low
    return PeerID((int.from_bytes(local.digest, "big") ^ d).to_bytes(PEER_ID_BYTES, "big"))


def contact(peer: PeerID, host: str = "10.0.0.1", port: int = 4000) -> Contact:
    return Contact(peer, PeerAddress.for_host(host, port))


def entries(table: RoutingTable, index: int) -> list[PeerID]:
    """Bucket contents, least recently seen first."""
    return list(table.buckets[index].entries)


def replacements(table: RoutingTable, index: int) -> list[PeerID]:
    """Replacement cache, oldest first."""
    return list(table.buckets[index].replacements)


def check_invariants(table: RoutingTable) -> None:
    """Every bucket holds at most k contacts that belong in it; the flat views agree with the buckets."""
    in_buckets = {}
    for i, bucket in enumerate(table.buckets):
        assert len(bucket.entries) <= table.k
        assert len(bucket.replacements) <= table.k
        assert not set(bucket.entries) & set(bucket.replacements)
        for p, e in bucket.entries.items():
            assert table.bucket_index(p) == i and e.contact.peer_id == p
            in_buckets[p] = e.contact
        for p in bucket.replacements:
            assert table.bucket_index(p) == i
    assert len(table) == len(in_buckets)
    assert {c.peer_id: c for c in table.contacts()} == in_buckets
    assert {c.peer_id: c for c in table.closest(LOCAL.digest, len(in_buckets) + 1)} == in_buckets
    for p, c in in_buckets.items():
        assert p in table and table.get(p) == c


# ---- distance and buckets ------------------------------------------------------------------------


def test_distance_is_a_metric_with_xor_structure() -> None:
    rng = random.Random(1)
    ids = [rng.randbytes(PEER_ID_BYTES) for _ in range(50)]
    for a in ids:
        assert distance(a, a) == 0
        for b in ids:
            assert distance(a, b) == distance(b, a)
            assert (distance(a, b) == 0) == (a == b)
            for c in ids[:5]:
                # XOR: distances compose exactly, so the triangle inequality holds.
                assert distance(a, c) == distance(a, b) ^ distance(b, c)
                assert distance(a, c) <= distance(a, b) + distance(b, c)


def test_distance_is_unidirectional() -> None:
    """For a point and a distance there is exactly one other point: XOR it back."""
    rng = random.Random(2)
    for _ in range(50):
        a = rng.randbytes(PEER_ID_BYTES)
        d = rng.getrandbits(ID_BITS)
        b = (int.from_bytes(a, "big") ^ d).to_bytes(PEER_ID_BYTES, "big")
        assert distance(a, b) == d


@pytest.mark.parametrize("index", [0, 1, 2, 7, 8, 100, 254, 255])
@pytest.mark.parametrize("low", ["zero", "max", "random"])
def test_bucket_index_is_the_bit_length_of_the_distance(index: int, low: str) -> None:
    table = RoutingTable(LOCAL)
    lows = {"zero": 0, "max": (1 << index) - 1, "random": random.Random(index).getrandbits(index)}
    peer = pid_at(index, lows[low] if index else 0)
    d = distance(LOCAL.digest, peer.digest)
    assert 2**index <= d < 2 ** (index + 1)
    assert table.bucket_index(peer) == index


def test_bucket_index_of_random_peers_matches_the_definition() -> None:
    table = RoutingTable(LOCAL)
    rng = random.Random(3)
    for _ in range(500):
        peer = PeerID(rng.randbytes(PEER_ID_BYTES))
        assert table.bucket_index(peer) == (LOCAL_INT ^ int.from_bytes(peer.digest, "big")).bit_length() - 1


def test_own_id_has_no_bucket() -> None:
    table = RoutingTable(LOCAL)
    with pytest.raises(ValueError, match="own id"):
        table.bucket_index(LOCAL)
    assert LOCAL not in table
    assert table.get(LOCAL) is None


def test_contact_carries_its_peer_id_in_the_address() -> None:
    peer = pid_at(5)
    c = Contact(peer, PeerAddress.for_host("10.0.0.1", 1))
    assert c.address.peer_id == peer
    other = pid_at(6)
    # An address naming another peer is rewritten to the contact's id: dialing verifies that one.
    c2 = Contact(peer, PeerAddress.for_host("10.0.0.1", 1, other))
    assert c2.address.peer_id == peer


# ---- observe ------------------------------------------------------------------------------------


def test_observe_own_id_is_refused() -> None:
    table = RoutingTable(LOCAL)
    obs = table.observe(contact(LOCAL), now=1.0)
    assert (obs.outcome, obs.ping) == ("refused", None)
    assert "own id" in obs.reason
    assert len(table) == 0


def test_observe_adds_then_refreshes_and_moves_to_tail() -> None:
    table = RoutingTable(LOCAL, k=4)
    a, b, c = pid_at(10, 1), pid_at(10, 2), pid_at(10, 3)
    for t, p in enumerate([a, b, c]):
        obs = table.observe(contact(p), now=float(t))
        assert (obs.outcome, obs.reason, obs.ping) == ("added", "bucket has room", None)
    assert entries(table, 10) == [a, b, c]
    # Seen again with a new address: refreshed, moved to the tail, address updated.
    obs = table.observe(contact(a, "10.0.0.9", 5), now=7.0)
    assert (obs.outcome, obs.ping) == ("refreshed", None)
    assert "tail" in obs.reason
    assert entries(table, 10) == [b, c, a]
    assert table.get(a) == contact(a, "10.0.0.9", 5)
    assert table.closest(a.digest, 1) == [contact(a, "10.0.0.9", 5)]  # the flat index follows too
    assert table.buckets[10].entries[a].last_seen == 7.0
    assert len(table) == 3
    assert a in table and pid_at(10, 4) not in table
    check_invariants(table)


def test_full_bucket_caches_newcomer_and_pings_least_recently_seen() -> None:
    table = RoutingTable(LOCAL, k=2)
    a, b, c, d = (pid_at(20, i) for i in (1, 2, 3, 4))
    table.observe(contact(a), now=1.0)
    table.observe(contact(b), now=2.0)
    table.observe(contact(a), now=3.0)  # a refreshed: b is now the least recently seen
    assert entries(table, 20) == [b, a]

    obs = table.observe(contact(c), now=4.0)
    assert obs.outcome == "cached"
    assert obs.ping == contact(b)
    assert "ping the oldest" in obs.reason
    assert table.buckets[20].pinging == b

    # A second newcomer while that ping is in flight: cached, and no second ping is asked for.
    obs = table.observe(contact(d), now=5.0)
    assert (obs.outcome, obs.ping) == ("cached", None)
    assert "in flight" in obs.reason
    assert entries(table, 20) == [b, a]
    assert replacements(table, 20) == [c, d]
    assert c not in table and d not in table

    # A cached newcomer seen again moves to the newest end of the replacement cache.
    obs = table.observe(contact(c), now=6.0)
    assert (obs.outcome, obs.ping) == ("cached", None)
    assert replacements(table, 20) == [d, c]
    check_invariants(table)


def test_other_buckets_are_unaffected_by_a_full_one() -> None:
    table = RoutingTable(LOCAL, k=2)
    for i in (1, 2, 3):
        table.observe(contact(pid_at(30, i)), now=1.0)
    obs = table.observe(contact(pid_at(31, 1)), now=1.0)
    assert obs.outcome == "added"


def test_replacement_cache_is_bounded_by_k() -> None:
    table = RoutingTable(LOCAL, k=2)
    for i in range(1, 10):
        table.observe(contact(pid_at(40, i)), now=float(i))
    assert entries(table, 40) == [pid_at(40, 1), pid_at(40, 2)]
    assert replacements(table, 40) == [pid_at(40, 8), pid_at(40, 9)]
    check_invariants(table)


def test_ping_alive_keeps_old_contact_and_newcomer_stays_cached() -> None:
    table = RoutingTable(LOCAL, k=2)
    a, b, c = pid_at(50, 1), pid_at(50, 2), pid_at(50, 3)
    table.observe(contact(a), now=1.0)
    table.observe(contact(b), now=2.0)
    assert table.observe(contact(c), now=3.0).ping == contact(a)

    reason = table.ping_result(a, alive=True, now=4.0)
    assert "kept" in reason
    assert entries(table, 50) == [b, a]  # a moved to the tail
    assert table.buckets[50].entries[a].last_seen == 4.0
    assert replacements(table, 50) == [c]
    assert c not in table
    assert table.buckets[50].pinging is None

    # The ping is over, so the next newcomer asks for a ping of the new oldest contact.
    d = pid_at(50, 4)
    obs = table.observe(contact(d), now=5.0)
    assert (obs.outcome, obs.ping) == ("cached", contact(b))
    check_invariants(table)


def test_ping_dead_evicts_and_promotes_newest_replacement() -> None:
    table = RoutingTable(LOCAL, k=2)
    a, b, c, d = (pid_at(60, i) for i in (1, 2, 3, 4))
    for t, p in enumerate([a, b, c, d]):
        table.observe(contact(p), now=float(t))
    assert replacements(table, 60) == [c, d]

    reason = table.ping_result(a, alive=False, now=9.0)
    assert "evicted" in reason and "did not answer" in reason and "promoted" in reason
    assert a not in table
    assert entries(table, 60) == [b, d]  # newest replacement promoted, at the tail
    assert replacements(table, 60) == [c]
    assert table.buckets[60].entries[d].last_seen == 9.0
    assert table.buckets[60].pinging is None
    check_invariants(table)


@pytest.mark.parametrize("alive", [True, False])
def test_ping_result_for_a_contact_already_gone(alive: bool) -> None:
    table = RoutingTable(LOCAL, k=2)
    a = pid_at(70, 1)
    assert table.ping_result(a, alive=alive, now=1.0) == "contact already gone"
    assert len(table) == 0


def test_failed_evicts_after_max_failures() -> None:
    table = RoutingTable(LOCAL, k=4, max_failures=3)
    a = pid_at(80, 1)
    table.observe(contact(a), now=0.0)
    assert table.failed(a, now=1.0) == "failure 1 of 3 noted"
    assert table.failed(a, now=2.0) == "failure 2 of 3 noted"
    assert a in table
    reason = table.failed(a, now=3.0)
    assert reason.startswith("evicted") and "failed 3 time(s)" in reason
    assert a not in table
    check_invariants(table)


def test_observe_resets_the_failure_count() -> None:
    table = RoutingTable(LOCAL, k=4, max_failures=2)
    a = pid_at(80, 1)
    table.observe(contact(a), now=0.0)
    assert table.failed(a, now=1.0) == "failure 1 of 2 noted"
    table.observe(contact(a), now=2.0)
    assert table.failed(a, now=3.0) == "failure 1 of 2 noted"
    assert a in table


def test_failed_evicts_at_once_when_a_replacement_waits() -> None:
    table = RoutingTable(LOCAL, k=2, max_failures=3)
    a, b, c = pid_at(90, 1), pid_at(90, 2), pid_at(90, 3)
    for t, p in enumerate([a, b, c]):
        table.observe(contact(p), now=float(t))
    reason = table.failed(b, now=5.0)
    assert "evicted" in reason and "failed 1 time(s)" in reason and "promoted" in reason
    assert entries(table, 90) == [a, c]
    assert replacements(table, 90) == []
    check_invariants(table)


@pytest.mark.parametrize(
    ("peer", "expected"),
    [(LOCAL, "own id"), (pid_at(100, 1), "not in the table")],
)
def test_failed_for_unknown_peers(peer: PeerID, expected: str) -> None:
    table = RoutingTable(LOCAL)
    assert table.failed(peer, now=1.0) == expected


def test_failed_for_a_cached_peer_drops_it_from_the_replacement_cache() -> None:
    table = RoutingTable(LOCAL, k=1)
    a, b = pid_at(110, 1), pid_at(110, 2)
    table.observe(contact(a), now=0.0)
    table.observe(contact(b), now=1.0)
    assert replacements(table, 110) == [b]
    assert table.failed(b, now=2.0) == "not in the table"
    assert replacements(table, 110) == []
    # With nothing cached, the next failure of a counts instead of evicting.
    assert table.failed(a, now=3.0) == "failure 1 of 3 noted"
    check_invariants(table)


# ---- subnet limits ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hosts", "newcomer", "outcome", "subnet"),
    [
        # public IPv4: two per /24 in one bucket
        (["8.8.8.1", "8.8.8.2"], "8.8.8.3", "refused", "8.8.8.0/24"),
        (["8.8.8.1", "8.8.8.2"], "8.8.9.1", "added", None),
        (["8.8.8.1"], "8.8.8.200", "added", None),
        # public IPv6: two per /48
        (["2a00:1450:1::1", "2a00:1450:1:ffff::2"], "2a00:1450:1:1234::3", "refused", "2a00:1450:1::/48"),
        (["2a00:1450:1::1", "2a00:1450:1:ffff::2"], "2a00:1450:2::1", "added", None),
        # DNS names count as their own "subnet"
        (["node.example.org", "node.example.org"], "NODE.example.org", "refused", "dns:node.example.org"),
        # private, loopback, link-local and localhost are exempt
        (["10.1.2.1", "10.1.2.2", "10.1.2.3"], "10.1.2.4", "added", None),
        (["192.168.0.1", "192.168.0.2"], "192.168.0.3", "added", None),
        (["127.0.0.1", "127.0.0.1"], "127.0.0.1", "added", None),
        (["::1", "::1"], "::1", "added", None),
        (["fd00::1", "fd00::2"], "fd00::3", "added", None),
        (["169.254.0.1", "169.254.0.2"], "169.254.0.3", "added", None),
        (["localhost", "localhost"], "localhost", "added", None),
    ],
)
def test_subnet_limit_per_bucket(hosts: list[str], newcomer: str, outcome: str, subnet: str | None) -> None:
    table = RoutingTable(LOCAL, k=20, max_per_subnet=2)
    for i, host in enumerate(hosts, start=1):
        assert table.observe(contact(pid_at(120, i), host), now=0.0).outcome == "added"
    obs = table.observe(contact(pid_at(120, 100), newcomer), now=1.0)
    assert obs.outcome == outcome, obs.reason
    if subnet is not None:
        assert obs.reason == f"bucket already holds 2 contacts from {subnet}"
        assert pid_at(120, 100) not in table
        assert replacements(table, 120) == []  # a refused contact is not cached either
    check_invariants(table)


@pytest.mark.parametrize(
    ("host", "subnet"),
    [("10.1.2.3", "10.1.2.0/24"), ("127.0.0.1", "127.0.0.0/24"), ("fd00::1", "fd00::/48"), ("::1", "::/48")],
)
def test_private_addresses_are_limited_when_not_exempt(host: str, subnet: str) -> None:
    table = RoutingTable(LOCAL, k=20, max_per_subnet=2, exempt_private=False)
    for i in (1, 2):
        assert table.observe(contact(pid_at(130, i), host), now=0.0).outcome == "added"
    obs = table.observe(contact(pid_at(130, 3), host), now=1.0)
    assert obs.outcome == "refused"
    assert subnet in obs.reason


def test_subnet_limit_is_per_bucket() -> None:
    table = RoutingTable(LOCAL, k=20, max_per_subnet=1)
    assert table.observe(contact(pid_at(140, 1), "8.8.8.1"), now=0.0).outcome == "added"
    assert table.observe(contact(pid_at(140, 2), "8.8.8.2"), now=0.0).outcome == "refused"
    assert table.observe(contact(pid_at(141, 1), "8.8.8.2"), now=0.0).outcome == "added"


def test_refresh_of_a_known_contact_is_not_subnet_limited() -> None:
    table = RoutingTable(LOCAL, k=20, max_per_subnet=1)
    a = pid_at(150, 1)
    table.observe(contact(a, "8.8.8.1"), now=0.0)
    assert table.observe(contact(a, "8.8.8.1"), now=1.0).outcome == "refreshed"


def test_promotion_respects_the_subnet_limit() -> None:
    table = RoutingTable(LOCAL, k=2, max_per_subnet=1)
    a, b, c, d = (pid_at(160, i) for i in (1, 2, 3, 4))
    table.observe(contact(a, "8.8.8.1"), now=0.0)
    table.observe(contact(b, "9.9.9.1"), now=1.0)
    table.observe(contact(c, "1.1.1.1"), now=2.0)  # cached
    table.observe(contact(d, "1.1.1.2"), now=3.0)  # cached: the limit counts bucket entries only
    assert replacements(table, 160) == [c, d]
    assert "promoted" in table.ping_result(a, alive=False, now=4.0)
    assert entries(table, 160) == [b, d]
    # c shares d's /24 now: evicting b must not promote it past the limit.
    reason = table.ping_result(b, alive=False, now=5.0)
    assert reason == "evicted (did not answer the eviction ping)"
    assert entries(table, 160) == [d]
    assert c not in table
    check_invariants(table)


@pytest.mark.parametrize(
    ("host", "subnet", "exempt"),
    [
        ("8.8.8.8", "8.8.8.0/24", False),
        ("10.0.0.1", "10.0.0.0/24", True),
        ("2a00:1450:4001:81c::200e", "2a00:1450:4001::/48", False),
        ("fe80::1", "fe80::/48", True),
        ("Example.ORG", "dns:example.org", False),
        ("localhost", "dns:localhost", True),
    ],
)
def test_subnet_of_and_is_exempt(host: str, subnet: str, exempt: bool) -> None:
    addr = PeerAddress.for_host(host, 1)
    assert subnet_of(addr) == subnet
    assert is_exempt(addr) is exempt


# ---- queries ------------------------------------------------------------------------------------


def random_table(n: int, seed: int, k: int = 20) -> tuple[RoutingTable, list[PeerID]]:
    rng = random.Random(seed)
    table = RoutingTable(LOCAL, k=k)
    peers = [PeerID(rng.randbytes(PEER_ID_BYTES)) for _ in range(n)]
    for i, p in enumerate(peers):
        table.observe(contact(p, f"10.{i // 250}.{i % 250}.1"), now=float(i))
    return table, peers


def test_closest_is_sorted_by_xor_distance_and_honours_count_and_exclude() -> None:
    table, _ = random_table(400, seed=4)
    known = [c.peer_id for c in table.contacts()]
    assert len(known) == len(table)
    rng = random.Random(5)
    for _ in range(30):
        target = rng.randbytes(PEER_ID_BYTES)
        by_distance = sorted(known, key=lambda p: distance(p.digest, target))
        assert [c.peer_id for c in table.closest(target)] == by_distance[: table.k]
        assert [c.peer_id for c in table.closest(target, 5)] == by_distance[:5]
        assert [c.peer_id for c in table.closest(target, 10_000)] == by_distance
        skip = set(by_distance[:3]) | {by_distance[7]}
        expected = [p for p in by_distance if p not in skip][:8]
        assert [c.peer_id for c in table.closest(target, 8, exclude=skip)] == expected


def test_closest_of_a_known_id_starts_with_that_contact() -> None:
    table, _ = random_table(100, seed=6)
    for c in table.contacts()[:20]:
        assert table.closest(c.peer_id.digest, 1) == [c]
        assert c not in table.closest(c.peer_id.digest, 5, exclude={c.peer_id})


def test_closest_with_count_zero_is_empty() -> None:
    table, _ = random_table(50, seed=7)
    assert table.closest(LOCAL.digest, 0) == []


def test_closest_of_an_empty_table() -> None:
    assert RoutingTable(LOCAL).closest(LOCAL.digest) == []


def test_a_thousand_random_peers_fill_at_most_k_per_bucket() -> None:
    k = 20
    table, peers = random_table(1000, seed=8, k=k)
    per_bucket: dict[int, int] = {}
    for p in peers:
        i = table.bucket_index(p)
        per_bucket[i] = per_bucket.get(i, 0) + 1
    for i, bucket in enumerate(table.buckets):
        assert len(bucket.entries) == min(k, per_bucket.get(i, 0))
        assert len(bucket.replacements) <= k
        assert not set(bucket.entries) & set(bucket.replacements)
        for p in bucket.entries:
            assert table.bucket_index(p) == i
    assert len(table) == sum(min(k, n) for n in per_bucket.values())
    # The far half of the id space is one bucket; it is full and the rest waited in its cache.
    assert len(table.buckets[ID_BITS - 1].entries) == k
    assert len(table.buckets[ID_BITS - 1].replacements) == k
    check_invariants(table)


def test_stale_buckets() -> None:
    table = RoutingTable(LOCAL)
    assert table.stale_buckets(now=1000.0, interval=60.0) == []
    table.observe(contact(pid_at(250, 1)), now=0.0)
    table.observe(contact(pid_at(200, 1)), now=50.0)
    # From the nearest used bucket outwards; untouched buckets count as stale.
    assert table.stale_buckets(now=59.0, interval=60.0) == []
    assert table.stale_buckets(now=60.0, interval=60.0) == [i for i in range(201, ID_BITS)]
    assert table.stale_buckets(now=110.0, interval=60.0) == list(range(200, ID_BITS))
    # Touching a bucket (even by a refused or cached observation) makes it fresh.
    table.observe(contact(LOCAL), now=110.0)  # own id: refused before any bucket is touched
    table.observe(contact(pid_at(230, 1)), now=110.0)
    assert 230 not in table.stale_buckets(now=169.0, interval=60.0)
    assert 230 in table.stale_buckets(now=170.0, interval=60.0)


@pytest.mark.parametrize("index", [*range(0, 20), 63, 64, 127, 128, *range(240, ID_BITS)])
def test_random_id_in_bucket_lands_in_that_bucket(index: int) -> None:
    table = RoutingTable(LOCAL)
    rng = random.Random(index)
    ids = {table.random_id_in_bucket(index, rng) for _ in range(20)}
    for raw in ids:
        assert len(raw) == PEER_ID_BYTES
        assert table.bucket_index(PeerID(raw)) == index
    if index >= 5:
        assert len(ids) > 1  # random, not a fixed point


def test_random_id_in_every_bucket() -> None:
    table = RoutingTable(LOCAL)
    rng = random.Random(9)
    for index in range(ID_BITS):
        assert table.bucket_index(PeerID(table.random_id_in_bucket(index, rng))) == index


@pytest.mark.parametrize("seed", range(5))
def test_random_churn_keeps_the_table_consistent(seed: int) -> None:
    """Observations, failures and ping results in random order never break the table's invariants."""
    rng = random.Random(seed)
    table = RoutingTable(LOCAL, k=3, max_per_subnet=2, max_failures=2)
    peers = [pid_at(rng.choice([200, 201, 202]), rng.getrandbits(200)) for _ in range(40)]
    hosts = ["8.8.8.1", "8.8.8.2", "9.9.9.1", "10.0.0.1", "2a00:1450:1::1"]
    for step in range(600):
        now = float(step)
        op = rng.random()
        p = rng.choice(peers)
        if op < 0.5:
            obs = table.observe(contact(p, rng.choice(hosts)), now)
            assert obs.outcome in ("added", "refreshed", "cached", "refused"), obs
            if obs.ping is not None:
                assert obs.outcome == "cached"
                assert entries(table, table.bucket_index(obs.ping.peer_id))[0] == obs.ping.peer_id
                table.ping_result(obs.ping.peer_id, alive=rng.random() < 0.5, now=now)
        elif op < 0.8:
            table.failed(p, now)
        else:
            table.ping_result(p, alive=rng.random() < 0.5, now=now)
        check_invariants(table)
    assert len(table) > 0


def test_buckets_are_made_when_first_written_and_reads_make_none() -> None:
    table = RoutingTable(LOCAL)
    a, b = pid_at(30), pid_at(31)
    assert a not in table and table.get(a) is None
    assert (
        table.failed(a, 1.0) == "not in the table"
        and table.ping_result(a, True, 1.0) == "contact already gone"
    )
    assert table.stale_buckets(1.0, 10.0) == [] and table.answering() == []
    assert table.buckets.used() == []  # nothing above made a bucket
    table.observe(contact(a), 5.0)
    assert [i for i, _ in table.buckets.used()] == [30]
    assert a in table and b not in table and [i for i, _ in table.buckets.used()] == [30]
    # Stale buckets are counted as before: an untouched one (never made) is stale from the first used one.
    assert table.stale_buckets(12.0, 10.0) == list(range(31, ID_BITS))
    assert table.stale_buckets(20.0, 10.0) == list(range(30, ID_BITS))
    assert len(table.buckets) == ID_BITS and table.buckets[-1] is table.buckets[ID_BITS - 1]
    with pytest.raises(IndexError):
        table.buckets[ID_BITS]
