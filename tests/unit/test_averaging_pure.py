"""Pure averaging logic: partitions, matchmaking order and gathering, the coordinator's decision.

Table-driven and synchronous: no event loop, no network.
"""

from __future__ import annotations

import random

import pytest
import torch

from p2ptrain.averaging.agreement import Coordinator, excluded_reasons
from p2ptrain.averaging.compression import DENSE, Compression, encode
from p2ptrain.averaging.matchmaking import Announcement, Gathering, Joiner, Quorum
from p2ptrain.averaging.partition import chunks, offsets, partition_sizes, wire_bytes
from p2ptrain.averaging.protocol import (
    Decision,
    Manifest,
    MemberMsg,
    SignedManifest,
    TensorSpec,
    open_decision,
    seal_decision,
)
from p2ptrain.averaging.reducer import PartitionReducer
from p2ptrain.errors import InvalidSignature, RemoteProtocolError
from p2ptrain.identity import Identity, PeerID
from p2ptrain.net.channel import MAX_CHUNK

# ---- partitions ----


@pytest.mark.parametrize(
    ("total", "bws", "reducers", "expected"),
    [
        (10, [1, 1], [True, True], [5, 5]),
        (10, [1, 1, 1], [True, True, True], [4, 3, 3]),
        (100, [1, 3], [True, True], [25, 75]),
        (7, [5, 5, 5], [True, False, True], [4, 0, 3]),
        (0, [1, 2], [True, True], [0, 0]),
        (1, [1, 1, 1, 1], [True, True, True, True], [1, 0, 0, 0]),
    ],
)
def test_partition_sizes_follow_bandwidth_and_skip_client_only(total, bws, reducers, expected):
    assert partition_sizes(total, bws, reducers) == expected


def test_partition_sizes_sum_and_stay_within_one_element_of_the_share():
    rng = random.Random(3)
    for _ in range(300):
        n = rng.randint(1, 12)
        bws = [rng.uniform(0.1, 1000) for _ in range(n)]
        red = [rng.random() < 0.8 for _ in range(n)]
        red[rng.randrange(n)] = True
        total = rng.randint(0, 10**7)
        sizes = partition_sizes(total, bws, red)
        assert sum(sizes) == total
        norm = sum(b for b, r in zip(bws, red, strict=True) if r)
        for s, b, r in zip(sizes, bws, red, strict=True):
            assert (s == 0) if not r else abs(s - total * b / norm) < 1.0 + 1e-6


@pytest.mark.parametrize(
    ("bws", "reducers", "match"),
    [
        ([1, 1], [False, False], "at least one"),
        ([0, 1], [True, True], "positive"),
        ([1], [True, True], "one"),
    ],
)
def test_partition_sizes_refuse_impossible_splits(bws, reducers, match):
    with pytest.raises(ValueError, match=match):
        partition_sizes(10, bws, reducers)


@pytest.mark.parametrize("mode", list(DENSE))
@pytest.mark.parametrize("size", [0, 1, 1000, 262_144, 262_145, 3_000_001])
def test_chunks_cover_the_partition_and_fit_one_frame(mode, size):
    spans = list(chunks(size, mode))
    assert [a for a, _ in spans] == [0] + [b for _, b in spans[:-1]] if spans else size == 0
    assert (spans[-1][1] if spans else 0) == size
    assert wire_bytes(size, mode) <= size * 4 + 4 * len(spans) * 4
    from p2ptrain.averaging.compression import encoded_size

    assert all(encoded_size(mode, b - a) <= MAX_CHUNK for a, b in spans)


def test_offsets():
    assert offsets([3, 0, 2]) == [0, 3, 3, 5]


# ---- matchmaking ----


def pid(i: int) -> PeerID:
    return PeerID(bytes([i]) * 32)


def ann(i: int, deadline: float, addr: str = "x", schema: bytes = b"s") -> Announcement:
    return Announcement(pid(i), addr, deadline, 1.0, schema)


# (whom to follow, the lottery and its no-deadlock property: tests/unit/test_leaders.py)


def test_announcement_round_trip_and_malformed():
    a = ann(3, 12.5)
    assert Announcement.from_bytes(a.peer, a.to_bytes()) == a
    for bad in [b"\x90", b"\xc1", b"nonsense"]:
        with pytest.raises(RemoteProtocolError):
            Announcement.from_bytes(a.peer, bad)


@pytest.mark.parametrize("seed", range(40))
def test_an_announcement_naming_its_group_key_round_trips_and_says_it_once(seed: int) -> None:
    """Under the run's spread keys an announcement names its group key (``group_tag``), with or without
    the optional fields before it, and keeps it when closed; a name that is empty, too long or not bytes
    is refused, and so is a follower's field without its name in the canonical place."""
    from p2ptrain.averaging.matchmaking import GROUP_TAG_BYTES, group_tag
    from p2ptrain.wire.codec import pack

    rng = random.Random(seed)
    tag = group_tag(f"sync-{rng.randrange(10**6)}")
    assert len(tag) == GROUP_TAG_BYTES and tag != group_tag("sync-x")
    a = Announcement(
        pid(seed),
        rng.choice(["", "x"]),
        rng.uniform(0, 1e4),
        rng.uniform(0, 1e9),
        b"s",
        rng.random() < 0.5,
        rng.choice([0, 1]),
        tag,
    )
    assert Announcement.from_bytes(a.peer, a.to_bytes()) == a
    assert Announcement.from_bytes(a.peer, a.closed().to_bytes()).group == tag
    head = [a.addr, a.deadline, a.bandwidth, a.schema]
    for bad in (
        [*head, a.leads, a.rank, b""],
        [*head, a.leads, a.rank, bytes(GROUP_TAG_BYTES + 1)],
        [*head, a.leads, a.rank, "text"],
        [*head, False, a.rank],
        [*head, a.leads, a.rank, tag, 0],
    ):
        with pytest.raises(RemoteProtocolError):
            Announcement.from_bytes(a.peer, pack(bad))


def test_gathering_admits_until_full_and_orders_members():
    g = Gathering(Joiner(pid(9), "l", 1.0), b"s", target_size=3, min_size=2)
    assert g.offer(Joiner(pid(5), "a", 1.0), b"t").startswith("schema mismatch")
    assert g.offer(Joiner(pid(5), "a", 1.0), b"s") is None
    assert g.offer(Joiner(pid(5), "a", 1.0), b"s") == "already in this group"
    assert g.offer(Joiner(pid(2), "", 1.0), b"s") is None
    assert g.full()
    assert g.offer(Joiner(pid(3), "c", 1.0), b"s") == "the group is full"
    members = g.form()
    assert [m.peer for m in members] == [pid(9), pid(2), pid(5)]
    assert g.offer(Joiner(pid(4), "d", 1.0), b"s") == "the group is already formed"


@pytest.mark.parametrize("seed", range(300))
def test_a_gathering_is_full_only_once_each_peer_counted_in_its_target_is_in_or_away(seed: int) -> None:
    """A leader forms before its deadline once it is full: every peer its target counts joined, or never
    will (``away``: announced a smaller ticket, may lead). A peer counted away may join after all (its
    look ended, and its next one followed), and was then counted twice: the group formed a peer short,
    before the one it waited for (a DiLoCo joiner whose replay was landing) could ask. Random targets,
    minimums, away sets and joiners, in random order, some of them away peers: full means at least
    ``min_size`` members and the target's peers all accounted for, each peer once."""
    rng = random.Random(seed)
    leader = pid(99)
    target = rng.randint(2, 8)
    minimum = rng.randint(1, target)
    peers = [pid(i) for i in range(1, 12)]
    g = Gathering(Joiner(leader, "l", 1.0), b"s", target_size=target, min_size=minimum)
    g.away = frozenset(rng.sample(peers, rng.randint(0, target - 1)))
    for p in rng.sample(peers, rng.randint(0, len(peers))):
        full_before = g.full()
        assert g.offer(Joiner(p, "x", 1.0), b"s") in (None, "the group is full")
        members = {leader, *(j.peer for j in g.joiners)}
        accounted = len(members | g.away)
        assert g.full() == (len(members) >= minimum and accounted >= target), (target, minimum, g.away)
        assert full_before <= g.full()  # (a joiner never makes it less full)


def test_gathering_too_small_and_withdrawal():
    g = Gathering(Joiner(pid(9), "l", 1.0), b"s", target_size=4, min_size=3)
    g.offer(Joiner(pid(1), "a", 1.0), b"s")
    g.offer(Joiner(pid(2), "b", 1.0), b"s")
    g.withdraw(pid(2))
    assert "only 2 of at least 3" in g.form()


def test_robust_gathering_counts_origins_so_one_subnets_keys_cannot_fill_it():
    """Eight fresh keys of one subnet ask first; each peer of another subnet that asks later takes the
    place of the newest of them, and the group may not form early while one origin holds over half."""
    g = Gathering(Joiner(pid(99), "l", 1.0, "leader"), b"s", target_size=4, min_size=2, by_origin=True)
    sybils = [Joiner(pid(10 + i), "", 1.0, "198.18.9.0/24") for i in range(8)]
    assert [g.offer(j, b"s") for j in sybils[:3]] == [None] * 3
    assert g.full() and g.dominated() and not g.ready()  # 3 of 4 places: waits for its deadline
    assert g.offer(sybils[3], b"s") == "the group is full"  # (same origin: no place changes hands)
    assert g.offer(Joiner(pid(1), "a", 1.0, "198.18.1.0/24"), b"s") is None
    assert "less represented subnet" in g.bumped[sybils[2].peer]
    assert g.ready()  # 2 of 4 from one origin: no longer over half
    assert g.offer(Joiner(pid(2), "b", 1.0, "198.18.2.0/24"), b"s") is None  # takes sybils[1]'s place
    members = g.form()
    assert {m.peer for m in members} == {pid(99), pid(1), pid(2), sybils[0].peer}
    assert g.origins(members) == (0, 1, 2, 3)
    assert set(g.bumped) == {sybils[1].peer, sybils[2].peer}


def test_gathering_origins_name_the_first_member_sharing_one():
    g = Gathering(Joiner(pid(99), "l", 1.0, "198.18.1.0/24"), b"s", target_size=4, min_size=2, by_origin=True)
    for i, origin in ((3, "198.18.2.0/24"), (4, "198.18.1.0/24"), (5, "198.18.2.0/24")):
        assert g.offer(Joiner(pid(i), "x", 1.0, origin), b"s") is None
    members = g.form()
    assert [m.peer for m in members] == [pid(99), pid(3), pid(4), pid(5)]
    assert g.origins(members) == (0, 1, 0, 1)


def test_a_plain_mean_gathering_admits_first_come_whatever_the_origin():
    g = Gathering(Joiner(pid(99), "l", 1.0, "leader"), b"s", target_size=3, min_size=2)
    for i in range(2):
        assert g.offer(Joiner(pid(10 + i), "", 1.0, "198.18.9.0/24"), b"s") is None
    assert g.ready()
    assert g.offer(Joiner(pid(1), "a", 1.0, "198.18.1.0/24"), b"s") == "the group is full"
    assert g.origins(g.form()) == ()


def test_a_gathering_with_a_quorum_forms_only_with_enough_known_peers():
    """Ids the leader does not know fill every place first: the group waits (two such groups could both
    reach the step's majority, and strangers hold no place of a known peer), and each known peer that
    asks takes the newest stranger's place; the group is full once every known peer is in."""
    known = Quorum(frozenset({pid(99), pid(1), pid(2)}), 2)
    g = Gathering(Joiner(pid(99), "l", 1.0), b"s", target_size=4, min_size=3, quorum=known)
    strangers = [Joiner(pid(10 + i), "", 1.0) for i in range(3)]
    assert [g.offer(j, b"s") for j in strangers] == [None] * 3
    assert g.size() == g.places() and not g.full() and g.counted() == 1 and not g.ready()
    assert g.offer(Joiner(pid(11 + 5), "", 1.0), b"s") == "the group is full"
    assert g.offer(Joiner(pid(1), "a", 1.0), b"s") is None
    assert "the leader knows" in g.bumped[strangers[2].peer]
    assert g.quorate() and not g.ready()  # (it may form at its closing, without pid(2))
    assert g.offer(Joiner(pid(2), "b", 1.0), b"s") is None
    assert g.ready()
    assert {m.peer for m in g.form()} == {pid(99), pid(1), pid(2), pid(10)}

    alone = Gathering(Joiner(pid(99), "l", 1.0), b"s", target_size=4, min_size=2, quorum=known)
    for j in strangers:
        alone.offer(j, b"s")
    assert alone.form() == "only 1 of the at least 2 peers it knows joined in time"


# ---- manifests and decisions ----


def manifest(leader: Identity, others: list[Identity], total: int = 10) -> Manifest:
    members = [leader, *others]
    sizes = partition_sizes(total, [1.0] * len(members), [True] * len(members))
    return Manifest(
        round_id=b"r" * 16,
        group_key="g",
        members=tuple(MemberMsg(m.peer_id.digest, f"addr{i}", 1.0) for i, m in enumerate(members)),
        sizes=tuple(sizes),
        schema=(TensorSpec((2, 5), "float32"),),
    )


def test_signed_manifest_verifies_and_refuses_tampering_and_impostors():
    leader, a, b = (Identity.from_seed(bytes([i]) * 32) for i in (1, 2, 3))
    signed = SignedManifest.sign(leader, manifest(leader, [a, b]))
    got = SignedManifest.verify(signed.envelope, leader.peer_id)
    assert got.manifest == signed.manifest and got.digest == signed.digest
    with pytest.raises(InvalidSignature):
        SignedManifest.verify(signed.envelope, a.peer_id)
    tampered = bytearray(signed.envelope)
    tampered[-70] ^= 1
    with pytest.raises(RemoteProtocolError):
        SignedManifest.verify(bytes(tampered))
    forged = SignedManifest.sign(a, manifest(leader, [a, b]))  # signed by someone not listed first
    with pytest.raises(RemoteProtocolError, match="first member"):
        SignedManifest.verify(forged.envelope)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"sizes": (5, 5, 1)}, "add up"),
        ({"sizes": (5, 5)}, "one partition size"),
        ({"compression": "zip"}, "zip"),
        ({"schema": (TensorSpec((2, 5), "int64"),)}, "bad tensor spec"),
        ({"round_id": b"short"}, "round id"),
    ],
)
def test_manifest_check_refuses_inconsistent_manifests(change, match):
    leader, a, b = (Identity.from_seed(bytes([i]) * 32) for i in (1, 2, 3))
    m = manifest(leader, [a, b])
    bad = Manifest(**{**{f: getattr(m, f) for f in m.__dataclass_fields__}, **change})
    with pytest.raises(RemoteProtocolError, match=match):
        bad.check()


def test_decision_signed_by_the_coordinator_only():
    coord, other = Identity.from_seed(b"\x01" * 32), Identity.from_seed(b"\x02" * 32)
    d = Decision(b"d" * 16, contributors=(0, 2), weights=(1.0, 2.0))
    assert open_decision(seal_decision(coord, d), coord.peer_id, b"d" * 16, 3) == d
    with pytest.raises(InvalidSignature):
        open_decision(seal_decision(other, d), coord.peer_id, b"d" * 16, 3)
    with pytest.raises(RemoteProtocolError, match="another round"):
        open_decision(seal_decision(coord, d), coord.peer_id, b"e" * 16, 3)
    with pytest.raises(RemoteProtocolError, match="outside"):
        open_decision(seal_decision(coord, d), coord.peer_id, b"d" * 16, 2)


# ---- the coordinator ----


def test_decision_with_every_report_keeps_everyone():
    c = Coordinator(b"r", [3, 3, 4])
    for r in range(3):
        assert c.report(r, {0: 1.0, 1: 2.0, 2: 1.0}) is None
    assert c.ready()
    d = c.decide()
    assert (d.contributors, d.weights, d.failed, d.abort) == ((0, 1, 2), (1.0, 2.0, 1.0), (), "")


def test_partial_sender_is_left_out_everywhere():
    c = Coordinator(b"r", [3, 3, 4])
    c.report(0, {0: 1.0, 1: 1.0, 2: 1.0})
    c.report(1, {0: 1.0, 1: 1.0})  # member 2 died before finishing its slice for reducer 1
    c.report(2, {0: 1.0, 1: 1.0, 2: 1.0})
    d = c.decide()
    assert d.contributors == (0, 1)
    assert "did not deliver" in excluded_reasons(d, 3, ["a", "b", "c"])[2]


def test_silent_reducer_is_replaced_by_the_least_loaded_and_is_no_contributor():
    c = Coordinator(b"r", [3, 5, 0, 4])
    c.report(0, {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0})
    c.report(3, {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0})
    assert not c.ready()
    d = c.decide()
    assert d.failed == (1,) and d.replacements == (0,)  # reducer 0 has 3 elements, reducer 3 has 4
    assert d.contributors == (0, 2, 3)


def test_inconsistent_weights_exclude_the_sender():
    c = Coordinator(b"r", [2, 2])
    c.report(0, {0: 1.0, 1: 5.0})
    c.report(1, {0: 1.0, 1: 6.0})
    assert c.decide().contributors == (0,)


@pytest.mark.parametrize(
    ("reports", "match"),
    [({}, "no reducer reported"), ({0: {0: 1.0}, 1: {1: 1.0}}, "no member delivered")],
)
def test_abort_when_nothing_can_be_agreed(reports, match):
    c = Coordinator(b"r", [2, 2])
    for r, rep in reports.items():
        c.report(r, rep)
    assert match in c.decide().abort


def test_reports_are_validated_and_the_decision_is_final():
    c = Coordinator(b"r", [2, 0])
    assert "reduces nothing" in c.report(1, {0: 1.0})
    assert "invalid" in c.report(0, {7: 1.0})
    assert "invalid" in c.report(0, {0: float("nan")})
    assert c.report(0, {0: 1.0, 1: 1.0}) is None
    assert "already reported" in c.report(0, {0: 1.0})
    first = c.decide()
    assert c.abort("late") is first
    assert "already decided" in c.report(0, {0: 1.0})


def test_unreachable_reducer_lets_the_coordinator_decide_early():
    c = Coordinator(b"r", [2, 2])
    c.report(0, {0: 1.0, 1: 1.0})
    c.unreachable.add(1)
    assert c.ready()
    assert c.decide().failed == (1,)


# ---- the reducer ----


@pytest.mark.parametrize("spill", [False, True], ids=["kept in memory", "spilled"])
def test_reducer_recomputes_without_a_partial_sender_bit_for_bit(spill):
    mode = Compression.NONE
    size = 300_000  # two chunks
    xs = [torch.randn(size, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    red = PartitionReducer(size, mode, spill=spill)
    red.add_local(0, xs[0], 1.0)
    spans = red.spans
    for sender in (1, 2):
        for index, (a, b) in enumerate(spans):
            if sender == 2 and index == 1:
                break  # sender 2 died after its first chunk
            frame = bytearray(xs[sender][a:b].numpy().tobytes())
            red.add_chunk(sender, index, memoryview(frame), 2.0)
            if spill:  # a spilling reducer keeps no view of the frame: its buffer is reused at once
                frame[:] = bytes(len(frame))
        if sender == 1:
            red.complete(1, 2.0)
    got = red.finalize([0, 1], [1.0, 2.0])
    clean = PartitionReducer(size, mode)
    clean.add_local(0, xs[0], 1.0)
    for index, (a, b) in enumerate(spans):
        clean.add_chunk(1, index, memoryview(bytearray(xs[1][a:b].numpy().tobytes())), 2.0)
    clean.complete(1, 2.0)
    assert torch.equal(got, clean.finalize([0, 1], [1.0, 2.0]))
    torch.testing.assert_close(got, (xs[0] + 2 * xs[1]) / 3)


def test_reducer_refuses_malformed_chunks_without_touching_the_sum():
    red = PartitionReducer(10, Compression.NONE)
    with pytest.raises(RemoteProtocolError):
        red.add_chunk(1, 0, memoryview(bytearray(12)), 1.0)
    with pytest.raises(RemoteProtocolError):
        red.add_chunk(1, 5, memoryview(bytearray(40)), 1.0)
    nan = memoryview(bytearray(torch.full((10,), float("nan")).numpy().tobytes()))
    with pytest.raises(RemoteProtocolError):
        red.add_chunk(1, 0, nan, 1.0)
    assert not red.touched and torch.equal(red.acc, torch.zeros(10))


@pytest.mark.parametrize("first", ["own slice", "a received slice"])
def test_a_reused_buffer_holding_anything_is_overwritten_by_the_first_slice(first):
    # a reused accumulator is not cleared up front: the first slice must overwrite whatever it holds
    size = 1000
    xs = [torch.randn(size, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    red = PartitionReducer(size, Compression.NONE, buffer=torch.full((size,), float("nan")))
    chunk = memoryview(bytearray(xs[1].numpy().tobytes()))
    if first == "own slice":
        red.add_local(0, xs[0], 1.0)
        red.add_chunk(1, 0, chunk, 3.0)
    else:
        red.add_chunk(1, 0, chunk, 3.0)
        red.add_local(0, xs[0], 1.0)
    red.complete(1, 3.0)
    torch.testing.assert_close(red.finalize([0, 1], [1.0, 3.0]), (xs[0] + 3 * xs[1]) / 4)


def _feed(red: PartitionReducer, sender: int, x: torch.Tensor, w: float, upto: int | None = None) -> None:
    """Add ``sender``'s slice ``x`` chunk by chunk (the first ``upto`` chunks only, if given)."""
    for index, (a, b) in enumerate(red.spans[:upto]):
        red.add_chunk(sender, index, memoryview(bytearray(encode(x[a:b].contiguous(), red.mode))), w)
    if upto is None:
        red.complete(sender, w)


@pytest.mark.parametrize("mode", [Compression.NONE, Compression.FP16, Compression.INT8])
def test_reducer_publishes_each_chunk_once_every_member_sent_it_and_that_is_the_result(mode):
    size = 2 * MAX_CHUNK + 12_345  # three chunks at least, in every mode
    xs = [torch.randn(size, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    red, plain = PartitionReducer(size, mode), PartitionReducer(size, mode)
    red.expect([0, 1, 2])
    assert len(red.spans) >= 3 and red.ready == 0
    for r in (red, plain):
        r.add_local(0, xs[0], 1.0)
        _feed(r, 1, xs[1], 2.0)
    assert red.ready == 0  # member 2 sent nothing yet
    _feed(red, 2, xs[2], 3.0, upto=1)
    assert red.ready == 1 and red.early is not None
    _feed(plain, 2, xs[2], 3.0)
    for index, (a, b) in enumerate(red.spans[1:], start=1):
        red.add_chunk(2, index, memoryview(bytearray(encode(xs[2][a:b].contiguous(), mode))), 3.0)
        assert red.ready == index + 1
    red.complete(2, 3.0)
    got = red.finalize([0, 1, 2], [1.0, 2.0, 3.0])
    want = plain.finalize([0, 1, 2], [1.0, 2.0, 3.0])
    assert red.early_final is True
    assert torch.equal(got, want)  # the same bits as reducing after the decision
    assert [bytes(e) for e in red.encoded or []] == [bytes(e) for e in plain.encoded or []]
    torch.testing.assert_close(got, (xs[0] + 2 * xs[1] + 3 * xs[2]) / 6, atol=0.05, rtol=0.05)


@pytest.mark.parametrize(
    ("contributors", "weights"),
    [([0, 1], [1.0, 2.0]), ([0, 1, 2], [1.0, 2.0, 2.5])],
    ids=["a member left out", "a weight capped"],
)
@pytest.mark.parametrize("spill", [False, True], ids=["kept in memory", "spilled"])
def test_early_chunks_are_void_when_the_decision_differs_and_the_mean_is_recomputed(
    contributors, weights, spill
):
    size = MAX_CHUNK // 4 + 1000  # two chunks
    xs = [torch.randn(size, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    red = PartitionReducer(size, Compression.NONE, spill=spill)
    red.expect([0, 1, 2])
    red.add_local(0, xs[0], 1.0)
    _feed(red, 1, xs[1], 2.0)
    _feed(red, 2, xs[2], 3.0)
    assert red.ready == len(red.spans)  # everything was published early, divided in place
    got = red.finalize(contributors, weights)
    assert red.early_final is False
    clean = PartitionReducer(size, Compression.NONE)
    for i, w in zip(contributors, weights, strict=True):
        if i == 0:
            clean.add_local(0, xs[0], w)
        else:
            _feed(clean, i, xs[i], w)
    assert torch.equal(got, clean.finalize(contributors, weights))
    want = sum(w * xs[i] for i, w in zip(contributors, weights, strict=True)) / sum(weights)
    torch.testing.assert_close(got, want)


def test_reducer_refuses_a_chunk_out_of_order():
    red = PartitionReducer(MAX_CHUNK // 4 + 10, Compression.NONE)
    red.expect([0, 1])
    with pytest.raises(RemoteProtocolError, match="out of order"):
        red.add_chunk(1, 1, memoryview(bytearray(40)), 1.0)
    assert not red.touched and red.ready == 0


@pytest.mark.parametrize("mode", [Compression.NONE, Compression.FP16])
def test_a_spilling_reducer_gives_robust_rules_the_same_rows(mode):
    # robust rules stack every contributor's whole slice: read back from the spill file, bit for bit
    size = MAX_CHUNK // 2 + 777  # two chunks at least
    xs = [torch.randn(size, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    results = []
    for spill in (False, True):
        red = PartitionReducer(size, mode, aggregation="trimmed_mean", spill=spill)
        red.add_local(0, xs[0], 1.0)
        for sender in (1, 2, 3):
            _feed(red, sender, xs[sender] * (100.0 if sender == 3 else 1.0), 1.0)
        results.append(red.finalize([0, 1, 2, 3], [1.0] * 4).clone())
        red.drop()
    assert torch.equal(results[0], results[1])
    assert float(results[1].abs().max()) < 50  # the outlier's slice was trimmed


def test_a_robust_leader_refuses_a_joiner_listed_in_another_subnet_than_it_calls_from():
    """Members refuse a manifest that splits one listed subnet over several origins (or merges two): a
    joiner whose offered address lies elsewhere than its call came from would have made every member
    refuse the honest leader's group. The leader turns it away; circuits and client-only joiners say
    nothing of their subnet, and a plain mean does not count origins."""
    g = Gathering(Joiner(pid(99), "l", 1.0, "198.18.1.0/24"), b"s", target_size=4, min_size=2, by_origin=True)
    liar = Joiner(pid(1), "/ip4/198.18.7.7/tcp/1", 1.0, "198.18.2.0/24")
    assert (
        g.offer(liar, b"s") == "the address offered is in 198.18.7.0/24, but the call came from 198.18.2.0/24"
    )
    assert g.offer(Joiner(pid(2), "/ip4/198.18.2.9/tcp/1", 1.0, "198.18.2.0/24"), b"s") is None
    circuit = f"/ip4/198.18.5.1/tcp/1/p2p/{pid(50)}/p2p-circuit/p2p/{pid(3)}"
    assert g.offer(Joiner(pid(3), circuit, 1.0, "198.18.3.0/24"), b"s") is None
    assert g.offer(Joiner(pid(4), "", 1.0, "198.18.4.0/24"), b"s") is None
    mean = Gathering(Joiner(pid(99), "l", 1.0, "198.18.1.0/24"), b"s", target_size=4, min_size=2)
    assert mean.offer(liar, b"s") is None
