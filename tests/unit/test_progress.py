"""Progress records and the swarm's view of a global step (pure, table-driven).

Every case builds this peer's record and the records it read from the DHT, calls :func:`swarm_view` at
a fixed ``now``, and checks the decisions: samples, peers, newest epoch, majority digest, donors,
readiness. Hostile decodes of :class:`ProgressRecord` must raise :class:`RemoteProtocolError` only.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import fields, replace
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.errors import RemoteProtocolError
from p2ptrain.identity import PeerID
from p2ptrain.idwork import find_work
from p2ptrain.training.optimizer.progress import (
    DIGEST_BYTES,
    READY_SLACK,
    SPREAD,
    PeerProgress,
    ProgressRecord,
    SwarmView,
    estimate,
    majority_digest,
    must_publish,
    sent_addr,
    spread_cap,
    swarm_view,
    upper_median,
    with_author,
)
from p2ptrain.wire.codec import pack, unpack

NOW = 1000.0
HORIZON = 2.0
TARGET = 100
RUN = b"run-fingerprint!"  # 16 bytes, the maximum
OTHER_RUN = b"another-run"
EPOCH = 5
A, B, C = b"\xaa" * 32, b"\xbb" * 32, b"\xcc" * 32  # state digests, A < B < C
ADDR = "/ip4/198.18.0.1/tcp/4001"


def pid(n: int) -> PeerID:
    return PeerID(bytes([n]) * 32)


ME = pid(0)


def rec(**fields: Any) -> ProgressRecord:
    """A record on EPOCH of RUN measured at NOW; ``fields`` override."""
    return replace(ProgressRecord(epoch=EPOCH, samples=0, rate=0.0, time=NOW, run=RUN), **fields)


def peer(n: int, **fields: Any) -> PeerProgress:
    return PeerProgress(pid(n), rec(**fields))


def view(
    mine: ProgressRecord,
    *others: PeerProgress,
    me: PeerID = ME,
    target: int = TARGET,
    now: float = NOW,
    horizon: float = HORIZON,
    trusted: set[PeerID] | None = None,
    min_work: int = 0,
    cohort: tuple[PeerID, ...] = (),
    met: set[PeerID] | None = None,
) -> SwarmView:
    return swarm_view(
        me,
        mine,
        others,
        now=now,
        target=target,
        horizon=horizon,
        trusted=trusted,
        min_work=min_work,
        cohort=cohort,
        met=met,
    )


# ---- estimate ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("record", "now", "horizon", "expected"),
    [
        pytest.param(rec(samples=10, rate=4.0), NOW, 2.0, 10.0, id="measured-now"),
        pytest.param(rec(samples=10, rate=4.0), NOW + 1.5, 2.0, 16.0, id="extrapolated"),
        pytest.param(rec(samples=10, rate=4.0), NOW + 2.0, 2.0, 18.0, id="at-horizon"),
        pytest.param(rec(samples=10, rate=4.0), NOW + 1e6, 2.0, 18.0, id="capped-by-horizon"),
        pytest.param(rec(samples=10, rate=4.0), NOW - 50.0, 2.0, 10.0, id="from-the-future"),
        pytest.param(rec(samples=10, rate=0.0), NOW + 1.0, 2.0, 10.0, id="no-rate"),
        pytest.param(rec(samples=10, rate=1e9), NOW + 1e6, 0.0, 10.0, id="zero-horizon"),
        pytest.param(rec(samples=0, rate=1e9, time=0.0), 1e11, 3.0, 3e9, id="hostile-rate-bounded"),
    ],
)
def test_estimate(record: ProgressRecord, now: float, horizon: float, expected: float) -> None:
    assert estimate(record, now, horizon) == expected


# ---- samples, rate, peers, others --------------------------------------------------------------

MINE = rec(samples=10, rate=5.0, time=NOW - 1.0)


@pytest.mark.parametrize(
    ("mine", "others", "samples", "rate", "peers", "n_others"),
    [
        pytest.param(MINE, [], 10.0, 5.0, 1, 0, id="alone"),
        pytest.param(
            rec(samples=10, rate=100.0, time=0.0), [], 10.0, 100.0, 1, 0, id="own-never-extrapolated"
        ),
        pytest.param(
            rec(samples=10, rate=100.0, time=NOW + 50.0),
            [],
            10.0,
            100.0,
            1,
            0,
            id="own-from-the-future",
        ),
        pytest.param(MINE, [peer(1, samples=20)], 30.0, 5.0, 2, 1, id="same-epoch-summed"),
        pytest.param(
            MINE,
            [peer(1, samples=20, rate=4.0, time=NOW - 1.5)],
            36.0,  # 10 + 20 + 4 * 1.5
            9.0,
            2,
            1,
            id="same-epoch-extrapolated",
        ),
        pytest.param(
            MINE,
            [peer(1, samples=20, rate=4.0, time=NOW - 100.0)],
            38.0,  # 10 + 20 + 4 * HORIZON
            9.0,
            2,
            1,
            id="extrapolation-capped-by-horizon",
        ),
        pytest.param(
            MINE,
            [peer(1, samples=20, rate=4.0, time=NOW + 50.0)],
            30.0,
            9.0,
            2,
            1,
            id="future-record-not-extrapolated-backwards",
        ),
        pytest.param(
            MINE,
            [
                peer(1, samples=20, rate=1.0),
                peer(2, samples=30, rate=2.0, time=NOW - 1.0),
                peer(3, samples=40, rate=3.0, time=NOW - 2.0),
            ],
            108.0,  # 10 + 20 + (30 + 2) + (40 + 6)
            11.0,
            4,
            3,
            id="several-summed",
        ),
        pytest.param(
            MINE, [peer(1, epoch=EPOCH + 1, samples=50, rate=9.0)], 10.0, 5.0, 1, 1, id="later-epoch"
        ),
        pytest.param(
            MINE,
            [peer(1, epoch=EPOCH - 1, samples=50, rate=9.0)],
            10.0,
            5.0,
            1,
            1,
            id="earlier-epoch-not-landing",
        ),
        pytest.param(
            MINE,
            [peer(1, epoch=EPOCH - 1, samples=50, rate=9.0, landing=True)],
            10.0,
            5.0,
            2,
            1,
            id="landing-counted-in-peers-not-samples",
        ),
        pytest.param(
            MINE,
            [peer(1, epoch=EPOCH - 2, samples=50, rate=9.0, landing=True)],
            10.0,
            5.0,
            1,
            1,
            id="landing-two-epochs-below",
        ),
        pytest.param(
            MINE,
            [peer(1, epoch=EPOCH + 1, samples=50, rate=9.0, landing=True)],
            10.0,
            5.0,
            1,
            1,
            id="landing-above",
        ),
        pytest.param(
            MINE,
            [peer(1, samples=20, rate=4.0, landing=True)],
            30.0,
            9.0,
            2,
            1,
            id="landing-on-my-epoch-counts-as-same",
        ),
        pytest.param(
            MINE,
            [peer(1, samples=50, rate=9.0, run=OTHER_RUN)],
            10.0,
            5.0,
            1,
            0,
            id="other-run-ignored",
        ),
        pytest.param(
            MINE,
            [peer(1, epoch=EPOCH - 1, samples=50, landing=True, run=OTHER_RUN)],
            10.0,
            5.0,
            1,
            0,
            id="other-run-landing-ignored",
        ),
        pytest.param(
            MINE,
            [PeerProgress(ME, rec(samples=50, rate=9.0))],
            10.0,
            5.0,
            1,
            0,
            id="own-record-read-back-ignored",
        ),
        pytest.param(
            MINE,
            [
                peer(1, samples=20, rate=1.0),
                peer(2, epoch=EPOCH - 1, landing=True, samples=99),
                peer(3, epoch=EPOCH - 1, samples=99),
                peer(4, epoch=EPOCH + 2, samples=99),
                peer(5, samples=99, run=OTHER_RUN),
            ],
            30.0,
            6.0,
            3,
            4,
            id="mixed",
        ),
    ],
)
def test_samples_rate_peers(
    mine: ProgressRecord,
    others: list[PeerProgress],
    samples: float,
    rate: float,
    peers: int,
    n_others: int,
) -> None:
    v = view(mine, *others)
    assert (v.epoch, v.samples, v.rate, v.peers, v.others, v.target) == (
        mine.epoch,
        samples,
        rate,
        peers,
        n_others,
        TARGET,
    )


def test_the_swarm_rate_counts_every_live_peer_on_any_epoch() -> None:
    """What the logs and metrics call the swarm's samples/s. (Before: the rate of the peers on this
    peer's own epoch, which in sync mode is this peer alone most of the time: the others are between
    two steps, their round landing, or a step behind.)"""
    others = [
        peer(1, rate=7.0),
        peer(2, epoch=EPOCH - 1, landing=True, rate=6.0),
        peer(3, epoch=EPOCH - 1, rate=4.0),
        peer(4, epoch=EPOCH + 1, rate=3.0),
        peer(5, rate=100.0, run=OTHER_RUN),  # another run's: not ours
        peer(6, rate=100.0, leaving=True),  # gone
    ]
    v = view(MINE, *others)
    assert v.swarm_rate == 5.0 + 7.0 + 6.0 + 4.0 + 3.0
    assert v.rate == 5.0 + 7.0  # (the epoch's own rate, which sizes its step, is unchanged)
    # untrusted records count for at most as much as this peer's and the trusted ones
    liar = peer(7, rate=1e9)
    assert view(MINE, peer(1, rate=7.0), liar, trusted={pid(1)}).swarm_rate == 2 * (5.0 + 7.0)


def test_accepts_any_iterable_of_others() -> None:
    """``others`` may be a generator: it is read once."""
    v = swarm_view(
        ME, MINE, (p for p in [peer(1, samples=20)]), now=NOW, target=TARGET, horizon=HORIZON, trusted=None
    )
    assert (v.samples, v.peers, v.others) == (30.0, 2, 1)


# ---- newest / behind ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("others", "newest", "behind"),
    [
        pytest.param([], EPOCH, False, id="alone"),
        pytest.param([peer(1)], EPOCH, False, id="same-epoch"),
        pytest.param([peer(1, epoch=EPOCH - 3)], EPOCH, False, id="others-behind"),
        pytest.param([peer(1, epoch=EPOCH + 3)], EPOCH + 3, True, id="ahead"),
        pytest.param(
            [peer(1, epoch=EPOCH + 1), peer(2, epoch=EPOCH + 3)], EPOCH + 1, True, id="median-ahead"
        ),
        pytest.param([peer(1), peer(2, epoch=EPOCH + 10**6)], EPOCH, False, id="one-far-ahead-outvoted"),
        pytest.param(
            [peer(1, epoch=EPOCH + 1), peer(2, epoch=EPOCH + 1), peer(3)], EPOCH + 1, True, id="half-ahead"
        ),
        pytest.param([peer(1, epoch=EPOCH + 9, run=OTHER_RUN)], EPOCH, False, id="other-run-ahead"),
        pytest.param([PeerProgress(ME, rec(epoch=EPOCH + 9))], EPOCH, False, id="own-record-ahead"),
    ],
)
def test_newest_and_behind(others: list[PeerProgress], newest: int, behind: bool) -> None:
    v = view(MINE, *others)
    assert (v.newest, v.behind) == (newest, behind)


# ---- majority digest and divergence ------------------------------------------------------------


@pytest.mark.parametrize(
    ("digests", "expected"),
    [
        pytest.param([], b"", id="none"),
        pytest.param([b"", b""], b"", id="only-empty"),
        pytest.param([A], A, id="one"),
        pytest.param([A, B, B], B, id="most"),
        pytest.param([B, A], A, id="tie-smaller"),
        pytest.param([A, B], A, id="tie-smaller-any-order"),
        pytest.param([C, C, B, B, A], B, id="tie-of-two-among-three"),
        pytest.param([b"", b"", b"", A], A, id="empty-ignored-even-if-most"),
        pytest.param([b"\x01", b"\x01\x00"], b"\x01", id="tie-prefix-is-smaller"),
    ],
)
def test_majority_digest(digests: list[bytes], expected: bytes) -> None:
    assert majority_digest(rec(digest=d) for d in digests) == expected


@pytest.mark.parametrize(
    ("mine", "others", "majority"),
    [
        pytest.param(rec(digest=A), [], A, id="alone"),
        pytest.param(rec(digest=B), [peer(1, digest=A)], A, id="two-tie-smaller-wins"),
        pytest.param(rec(digest=A), [peer(1, digest=B)], A, id="two-tie-mine-smaller"),
        pytest.param(rec(digest=A), [peer(1, digest=B), peer(2, digest=B)], B, id="outvoted"),
        pytest.param(
            rec(digest=A),
            [peer(1, digest=B), peer(2, digest=B, epoch=EPOCH + 1), peer(3, digest=B, epoch=EPOCH - 1)],
            A,
            id="other-epochs-do-not-vote",
        ),
        pytest.param(
            rec(digest=A),
            [
                peer(1, digest=B, epoch=EPOCH - 1, landing=True),
                peer(2, digest=B, epoch=EPOCH - 1, landing=True),
            ],
            A,
            id="landing-peers-do-not-vote",
        ),
        pytest.param(
            rec(digest=B),
            [peer(1, digest=A, run=OTHER_RUN), peer(2, digest=A, run=OTHER_RUN)],
            B,
            id="other-run-does-not-vote",
        ),
        pytest.param(rec(digest=b""), [peer(1, digest=b""), peer(2, digest=C)], C, id="empty-ignored"),
        pytest.param(rec(digest=b""), [peer(1, digest=b"")], b"", id="no-digest"),
    ],
)
def test_majority_in_view(mine: ProgressRecord, others: list[PeerProgress], majority: bytes) -> None:
    assert view(mine, *others).majority == majority


@pytest.mark.parametrize(
    ("mine", "others", "digest", "diverged"),
    [
        pytest.param(rec(digest=A), [peer(1, digest=B), peer(2, digest=B)], A, True, id="outvoted"),
        pytest.param(rec(digest=B), [peer(1, digest=A)], B, True, id="lost-tie"),
        pytest.param(rec(digest=A), [peer(1, digest=B)], A, False, id="won-tie"),
        pytest.param(rec(digest=B), [peer(1, digest=B), peer(2, digest=A)], B, False, id="majority"),
        pytest.param(rec(digest=b""), [peer(1, digest=A)], b"", False, id="own-digest-unknown"),
        pytest.param(rec(digest=b""), [peer(1, digest=b"")], A, False, id="no-majority"),
        pytest.param(rec(digest=A), [], C, True, id="asked-about-another-digest"),
    ],
)
def test_diverged(mine: ProgressRecord, others: list[PeerProgress], digest: bytes, diverged: bool) -> None:
    assert view(mine, *others).diverged(digest) is diverged


# ---- donors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mine", "others", "donors"),
    [
        pytest.param(MINE, [], set(), id="alone"),
        pytest.param(
            rec(digest=A), [peer(1, digest=A, addr=ADDR), peer(2, digest=A)], {1}, id="address-needed"
        ),
        pytest.param(
            MINE,
            [
                peer(1, epoch=EPOCH + 2, digest=B, addr=ADDR),
                peer(2, epoch=EPOCH + 1, digest=B, addr=ADDR),
                peer(3, digest=B, addr=ADDR),
            ],
            {2},
            id="median-epoch-only",
        ),
        pytest.param(
            MINE,
            [
                peer(1, epoch=EPOCH + 1, digest=B, addr=ADDR),
                peer(2, epoch=EPOCH + 1, digest=B, addr=ADDR),
                peer(3, epoch=EPOCH + 1, digest=C, addr=ADDR),
                peer(4, epoch=EPOCH + 1, digest=b"", addr=ADDR),
            ],
            {1, 2},
            id="majority-digest-at-newest-only",
        ),
        pytest.param(
            MINE,
            [
                peer(1, epoch=EPOCH + 1, digest=C, addr=ADDR),
                peer(2, epoch=EPOCH + 1, digest=B, addr=ADDR),
            ],
            {2},
            id="tie-at-newest-smaller-digest",
        ),
        pytest.param(
            MINE,
            [peer(1, epoch=EPOCH + 1, addr=ADDR), peer(2, epoch=EPOCH + 1, addr=ADDR)],
            set(),
            id="no-digest-at-newest-nothing-to-check-against",
        ),
        pytest.param(
            MINE,
            [
                peer(1, epoch=EPOCH + 1, digest=B, addr=ADDR),
                peer(2, epoch=EPOCH + 9, digest=B, addr=ADDR, run=OTHER_RUN),
            ],
            {1},
            id="other-run-never-a-donor",
        ),
        pytest.param(
            rec(digest=A),
            [peer(1, digest=B, addr=ADDR), peer(2, digest=B, addr=ADDR), peer(3, digest=A, addr=ADDR)],
            {1, 2},
            id="diverged-on-my-epoch-majority-holders",
        ),
        pytest.param(
            rec(digest=A),
            [peer(1, epoch=EPOCH - 1, digest=A, addr=ADDR, landing=True)],
            set(),
            id="landing-peer-not-a-donor",
        ),
        pytest.param(
            rec(digest=A, addr=ADDR),
            [PeerProgress(ME, rec(epoch=EPOCH + 1, digest=A, addr=ADDR))],
            set(),
            id="never-myself",
        ),
    ],
)
def test_donors(mine: ProgressRecord, others: list[PeerProgress], donors: set[int]) -> None:
    got = view(mine, *others).donors
    assert len(got) == len(donors)
    assert {d.peer for d in got} == {pid(n) for n in donors}
    assert all(d in others for d in got)  # the records themselves, unchanged


DONOR_POOL = [peer(n, epoch=EPOCH + 1, digest=B, addr=f"{ADDR}/{n}") for n in range(1, 9)]


def donor_order(me: PeerID, others: list[PeerProgress]) -> list[PeerID]:
    return [d.peer for d in view(rec(), *others, me=me).donors]


def test_donor_order_deterministic_for_the_same_peer() -> None:
    first = donor_order(ME, DONOR_POOL)
    assert sorted(first, key=lambda p: p.digest) == [p.peer for p in DONOR_POOL]
    assert donor_order(ME, DONOR_POOL) == first
    assert donor_order(ME, DONOR_POOL[::-1]) == first
    assert donor_order(ME, DONOR_POOL[3:] + DONOR_POOL[:3]) == first


def test_donor_order_spreads_load_over_peers() -> None:
    """Different peers download from different donors first, so one donor is not everybody's."""
    orders = {tuple(donor_order(pid(n), DONOR_POOL)) for n in range(100, 132)}
    firsts = {order[0] for order in orders}
    assert len(orders) > 1
    assert len(firsts) >= 4  # 32 peers over 8 donors


# ---- readiness ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mine", "others", "target", "ready", "eta"),
    [
        pytest.param(rec(samples=100), [], 100, True, 0.0, id="reached-exactly"),
        pytest.param(rec(samples=150, rate=10.0), [], 100, True, 0.0, id="past"),
        pytest.param(rec(samples=0), [], 0, True, 0.0, id="zero-target"),
        pytest.param(rec(samples=40, rate=20.0), [], 100, False, 3.0, id="eta-at-rate"),
        pytest.param(rec(samples=40), [], 100, False, math.inf, id="no-rate"),
        pytest.param(
            rec(samples=40, rate=5.0),
            [peer(1, samples=20, rate=15.0)],
            100,
            False,
            2.0,
            id="swarm-rate",
        ),
        pytest.param(
            rec(samples=40, rate=5.0),
            [peer(1, samples=50, rate=5.0, time=NOW - 2.0)],
            100,
            True,
            0.0,
            id="reached-by-extrapolation",
        ),
        pytest.param(
            rec(samples=40, rate=5.0),
            [peer(1, samples=50, rate=5.0, time=NOW - 2.0)],
            101,
            False,
            0.1,
            id="one-short-after-extrapolation",
        ),
        pytest.param(
            rec(samples=40),
            [peer(1, epoch=EPOCH + 1, samples=500, rate=50.0)],
            100,
            False,
            math.inf,
            id="other-epoch-does-not-help",
        ),
    ],
)
def test_ready_and_eta(
    mine: ProgressRecord, others: list[PeerProgress], target: int, ready: bool, eta: float
) -> None:
    v = view(mine, *others, target=target)
    assert v.ready is ready
    assert v.eta == pytest.approx(eta)


# ---- reason ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("others", "fragments"),
    [
        pytest.param([], ["1 peer(s) on step 5", "10 of 100 samples", "5.0/s"], id="alone"),
        pytest.param(
            [peer(1, samples=20, rate=4.0, time=NOW - 1.5), peer(2, epoch=EPOCH - 1, landing=True)],
            ["3 peer(s) on step 5", "36 of 100 samples", "9.0/s"],
            id="working",
        ),
        pytest.param(
            [peer(1, epoch=EPOCH + 2), peer(2, epoch=EPOCH + 2), peer(3, epoch=EPOCH + 1)],
            ["behind", "2 trusted peer(s) are on step 7", "this one on 5"],
            id="behind",
        ),
    ],
)
def test_reason_names_the_numbers(others: list[PeerProgress], fragments: list[str]) -> None:
    reason = view(MINE, *others).reason
    for fragment in fragments:
        assert fragment in reason


# ---- the wire ----------------------------------------------------------------------------------

FULL = ProgressRecord(
    epoch=7,
    samples=1234,
    rate=56.5,
    time=1.7e9,
    digest=A,
    addr=ADDR,
    run=RUN,
    landing=True,
)
EDGES = ProgressRecord(
    epoch=2**53,
    samples=2**53,
    rate=1e9,
    time=1e11,
    digest=b"\x00" * DIGEST_BYTES,
    addr="x" * 300,
    run=b"\xff" * 16,
    landing=False,
)


MINIMAL = ProgressRecord(epoch=0, samples=0, rate=0.0, time=0.0)


@pytest.mark.parametrize("record", [FULL, EDGES, MINIMAL], ids=["full", "at-bounds", "minimal"])
def test_wire_round_trip(record: ProgressRecord) -> None:
    back = ProgressRecord.from_obj(unpack(pack(record.to_obj())))
    assert back == record
    assert type(back.rate) is float and type(back.time) is float


def as_map(record: ProgressRecord) -> dict[str, Any]:
    """The record as a map of its fields (how peers of an older version encode it)."""
    return {f.name: getattr(record, f.name) for f in fields(record)}


def as_array(obj: dict[str, Any]) -> list[Any]:
    """A map of a record's fields as the array a record is sent as (fields in declaration order)."""
    names = [f.name for f in fields(ProgressRecord)]
    assert set(obj) <= set(names)
    return [obj[n] for n in names if n in obj]


def test_records_travel_as_arrays_without_their_trailing_defaults() -> None:
    assert isinstance(FULL.to_obj(), list)
    assert len(MINIMAL.to_obj()) == 4  # (epoch, samples, rate, time: the rest hold their defaults)
    assert len(pack(FULL.to_obj())) < len(pack(as_map(FULL))) * 0.75


def test_a_record_sent_as_a_map_by_an_older_peer_is_read() -> None:
    assert ProgressRecord.from_obj(unpack(pack(as_map(FULL)))) == FULL


def test_a_record_carries_its_author_s_address_without_the_id_its_subkey_proves() -> None:
    author, other = pid(3), pid(4)
    mine = f"{ADDR}/p2p/{author}"
    sent = sent_addr(mine, author)
    assert sent == ADDR
    record = replace(FULL, addr=sent)
    assert len(pack(record.to_obj())) <= len(pack(replace(FULL, addr=mine).to_obj())) - 49
    assert with_author(record, author).addr == mine  # read back: dialed with the author's id checked
    # Kept as they are: another peer's id, a circuit (the relay's id, then the author's), a bad address.
    theirs = f"{ADDR}/p2p/{other}"
    circuit = f"{ADDR}/p2p/{other}/p2p-circuit/p2p/{author}"
    for addr in (theirs, circuit, "not an address", ""):
        assert sent_addr(addr, author) == addr
        assert with_author(replace(FULL, addr=addr), author).addr == addr


def test_wire_integers_accepted_for_float_fields() -> None:
    back = ProgressRecord.from_obj(unpack(pack(as_map(FULL) | {"rate": 3, "time": 17})))
    assert (back.rate, back.time) == (3.0, 17.0)
    assert type(back.rate) is float and type(back.time) is float


def test_wire_unknown_fields_ignored() -> None:
    """Newer peers may add optional fields."""
    assert ProgressRecord.from_obj(unpack(pack(as_map(FULL) | {"future": [1, 2]}))) == FULL
    assert ProgressRecord.from_obj(unpack(pack([*as_array(as_map(FULL)), [1, 2]]))) == FULL


def hostile(**changed: Any) -> dict[str, Any]:
    return as_map(FULL) | changed


@pytest.mark.parametrize(
    "obj",
    [
        pytest.param([1, 2, 3], id="list"),
        pytest.param(None, id="nil"),
        pytest.param(7, id="int"),
        pytest.param(b"\x00" * 8, id="bytes"),
        pytest.param(hostile(epoch="7"), id="epoch-str"),
        pytest.param(hostile(epoch=7.0), id="epoch-float"),
        pytest.param(hostile(epoch=True), id="epoch-bool"),
        pytest.param(hostile(epoch=None), id="epoch-nil"),
        pytest.param(hostile(epoch=-1), id="epoch-negative"),
        pytest.param(hostile(epoch=2**53 + 1), id="epoch-too-big"),
        pytest.param(hostile(epoch=2**64 - 1), id="epoch-uint64"),
        pytest.param(hostile(samples=-1), id="samples-negative"),
        pytest.param(hostile(samples=1.5), id="samples-float"),
        pytest.param(hostile(samples=[1]), id="samples-list"),
        pytest.param(hostile(samples=2**53 + 1), id="samples-too-big"),
        pytest.param(hostile(rate=math.nan), id="rate-nan"),
        pytest.param(hostile(rate=math.inf), id="rate-inf"),
        pytest.param(hostile(rate=-math.inf), id="rate-minus-inf"),
        pytest.param(hostile(rate=-0.5), id="rate-negative"),
        pytest.param(hostile(rate=2e9), id="rate-too-big"),
        pytest.param(hostile(rate="fast"), id="rate-str"),
        pytest.param(hostile(rate=False), id="rate-bool"),
        pytest.param(hostile(time=-1.0), id="time-negative"),
        pytest.param(hostile(time=1e12), id="time-too-far"),
        pytest.param(hostile(time=math.nan), id="time-nan"),
        pytest.param(hostile(digest=b"\x00" * (DIGEST_BYTES + 1)), id="digest-oversized"),
        pytest.param(hostile(digest="aa" * 16), id="digest-str"),
        pytest.param(hostile(digest=[1] * 32), id="digest-list"),
        pytest.param(hostile(addr="x" * 301), id="addr-oversized"),
        pytest.param(hostile(addr=ADDR.encode()), id="addr-bytes"),
        pytest.param(hostile(run=b"\x00" * 17), id="run-oversized"),
        pytest.param(hostile(run="run"), id="run-str"),
        pytest.param(hostile(landing=1), id="landing-int"),
        pytest.param(hostile(landing="yes"), id="landing-str"),
        pytest.param(hostile(landing=None), id="landing-nil"),
    ],
)
def test_wire_hostile_decode(obj: Any) -> None:
    with pytest.raises(RemoteProtocolError):
        ProgressRecord.from_obj(unpack(pack(obj)))
    if isinstance(obj, dict):  # the same, as the array records travel as
        with pytest.raises(RemoteProtocolError):
            ProgressRecord.from_obj(unpack(pack(as_array(obj))))


def test_wire_extension_type_refused() -> None:
    data = msgpack.packb({"epoch": msgpack.ExtType(1, b"x")}, use_bin_type=True)
    with pytest.raises(RemoteProtocolError):
        ProgressRecord.from_obj(unpack(data))


@pytest.mark.parametrize("missing", ["epoch", "samples", "rate", "time"])
def test_wire_missing_measurement_field_refused(missing: str) -> None:
    obj = as_map(FULL)
    del obj[missing]
    with pytest.raises(RemoteProtocolError):
        ProgressRecord.from_obj(unpack(pack(obj)))
    cut = as_array(as_map(FULL))[: list(as_map(FULL)).index(missing)]  # an array that ends before it
    with pytest.raises(RemoteProtocolError):
        ProgressRecord.from_obj(unpack(pack(cut)))


# ---- properties --------------------------------------------------------------------------------

peer_ids = st.integers(min_value=0, max_value=12).map(pid)  # pid(0) is ME: a record read back
records = st.builds(
    ProgressRecord,
    epoch=st.integers(min_value=EPOCH - 2, max_value=EPOCH + 2),
    samples=st.integers(min_value=0, max_value=2**53),
    rate=st.floats(min_value=0.0, max_value=1e9),
    time=st.floats(min_value=0.0, max_value=1e11),
    digest=st.sampled_from([b"", A, B, C]),
    addr=st.sampled_from(["", ADDR]),
    run=st.sampled_from([RUN, OTHER_RUN]),
    landing=st.booleans(),
)
# Dyadic rates and times keep every sum exact, so reordering cannot change them by rounding.
exact_records = records.map(
    lambda r: replace(
        r, samples=r.samples % 2**20, rate=round(r.rate % 1024 * 4) / 4, time=round(r.time % 2048 * 4) / 4
    )
)


def swarm(rec_strategy: st.SearchStrategy[ProgressRecord]) -> st.SearchStrategy[list[PeerProgress]]:
    """One record per peer, as the DHT's owned subkeys give them."""
    return st.dictionaries(peer_ids, rec_strategy, max_size=10).map(
        lambda d: [PeerProgress(p, r) for p, r in d.items()]
    )


PROPS = settings(max_examples=200, deadline=None)


@PROPS
@given(
    mine=records.map(lambda r: replace(r, run=RUN)),
    others=swarm(records),
    now=st.floats(min_value=0.0, max_value=1e11),
    target=st.integers(min_value=0, max_value=2**53),
    horizon=st.floats(min_value=0.0, max_value=60.0),
)
def test_view_invariants(
    mine: ProgressRecord, others: list[PeerProgress], now: float, target: int, horizon: float
) -> None:
    v = swarm_view(ME, mine, others, now=now, target=target, horizon=horizon, trusted=None)
    live = [o for o in others if o.peer != ME and o.record.run == RUN]
    assert v.samples >= mine.samples
    assert v.rate >= mine.rate
    assert v.others == len(live)
    assert 1 <= v.peers <= 1 + v.others
    lagging = sum(o.record.epoch + 1 == mine.epoch and not o.record.landing for o in live)
    ahead = sum(o.record.epoch > mine.epoch for o in live)
    assert v.quorum == (v.peers + lagging + ahead) // 2 + 1  # every record vouched for: a majority of all
    assert v.newest >= v.epoch == mine.epoch
    assert v.behind == (upper_median([mine.epoch, *(o.record.epoch for o in live)]) > mine.epoch)
    assert v.eta >= 0.0 and (v.eta == 0.0) == v.ready
    assert all(d in live and d.record.epoch == v.newest and d.record.addr for d in v.donors)
    assert len({d.peer for d in v.donors}) == len(v.donors)
    assert v.majority in {b"", mine.digest, *(o.record.digest for o in live)}


@PROPS
@given(
    mine=exact_records.map(lambda r: replace(r, run=RUN)),
    others=swarm(exact_records),
    order=st.randoms(use_true_random=False),
)
def test_view_independent_of_record_order(
    mine: ProgressRecord, others: list[PeerProgress], order: Any
) -> None:
    shuffled = list(others)
    order.shuffle(shuffled)
    assert view(mine, *shuffled, now=2048.0) == view(mine, *others, now=2048.0)


def test_ready_independent_of_record_order_with_inexact_rates() -> None:
    """0.18 + 0.35 + 0.47 is 1.0 in some summation orders and 0.9999999999999999 in others. (Rates
    within ``SPREAD`` of each other: 0.1, 0.2 and 0.7 had the fastest capped, see test_spread_*.)"""
    mine = rec(samples=0, rate=0.0)
    others = [peer(n, rate=r, time=NOW - 1.0) for n, r in [(1, 0.18), (2, 0.35), (3, 0.47)]]
    readiness = {view(mine, *order, target=1).ready for order in itertools.permutations(others)}
    assert readiness == {True}


@PROPS
@given(
    obj=st.dictionaries(
        st.sampled_from(["epoch", "samples", "rate", "time", "digest", "addr", "run", "landing", "x"]),
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(min_value=-(2**63), max_value=2**64 - 1),
            st.floats(),
            st.text(max_size=400),
            st.binary(max_size=40),
        ),
    )
)
def test_decode_either_valid_or_remote_protocol_error(obj: dict[str, Any]) -> None:
    try:
        r = ProgressRecord.from_obj(unpack(pack(obj)))
    except RemoteProtocolError:
        return
    assert 0 <= r.epoch <= 2**53 and 0 <= r.samples <= 2**53
    assert 0.0 <= r.rate <= 1e9 and 0.0 <= r.time <= 1e11
    assert len(r.digest) <= DIGEST_BYTES and len(r.addr) <= 300 and len(r.run) <= 16
    assert type(r.landing) is bool


def test_a_leaving_peer_counts_for_nothing_on_this_step_but_is_caught_up_with() -> None:
    """A peer that published it is shutting down is not waited for, not a donor, not a vote on this
    peer's step. Ahead of it, it is where the swarm went, and it serves its state until it stops: a
    peer left behind downloads it rather than step on alone (a second lineage under the same step
    numbers: a 3-node simulate run ended with two parameter sets when the two fast nodes finished)."""
    leaving = peer(1, samples=50, rate=10.0, digest=B, addr=ADDR, leaving=True)
    staying = peer(2, samples=5, rate=1.0, digest=A, addr=ADDR)
    v = view(rec(digest=A), leaving, staying)
    assert (v.peers, v.others, v.samples) == (2, 1, 5.0)
    assert [d.peer for d in v.donors] == [pid(2)] and v.majority == A
    ahead = view(rec(), peer(3, epoch=EPOCH + 5, digest=B, leaving=True, addr=ADDR))
    assert ahead.behind and ahead.newest == EPOCH + 5 and [d.peer for d in ahead.donors] == [pid(3)]
    untrusted = view(rec(), peer(3, epoch=EPOCH + 5, digest=B, leaving=True, addr=ADDR), trusted=set())
    assert not untrusted.behind and untrusted.donors == ()  # (a fresh key's claim moves nobody)


# ---- trust: which records may move this peer to another state ------------------------------------


def test_a_fresh_key_far_ahead_moves_nobody() -> None:
    """One key's record of step 1,000,000 with its own digest: not behind, nobody to download from."""
    liar = peer(9, epoch=10**6, digest=C, addr=ADDR)
    v = view(rec(digest=A), peer(1, digest=A, addr=ADDR), liar, trusted={pid(1)})
    assert (v.newest, v.behind) == (EPOCH, False)
    assert [d.peer for d in v.donors] == [pid(1)]  # of this step's trusted state; never the liar
    # ... while trusting every record (the old rule, a private swarm's) it would have moved everyone
    assert view(rec(digest=A), liar, trusted=None).behind


def test_many_fresh_keys_on_my_step_do_not_outvote_the_trusted() -> None:
    sybils = [peer(n, digest=C, addr=ADDR) for n in range(10, 20)]
    v = view(rec(digest=A), peer(1, digest=A), *sybils, trusted={pid(1)})
    assert v.majority == A and not v.diverged(A)
    assert v.peers == 12  # still counted toward the group and the samples (bounded by the weight caps)


def test_the_trusted_peers_state_may_come_from_any_donor() -> None:
    """The trusted record names the state (its digest); who serves it does not matter: chunks are checked."""
    v = view(
        rec(digest=A),
        peer(1, epoch=EPOCH + 1, digest=B),  # trusted, client-only: serves nothing
        peer(2, epoch=EPOCH + 1, digest=B, addr=ADDR),  # untrusted holder of the same state
        peer(3, epoch=EPOCH + 1, digest=C, addr=ADDR),  # untrusted holder of another state
        trusted={pid(1)},
    )
    assert v.behind and v.newest == EPOCH + 1
    assert [d.peer for d in v.donors] == [pid(2)]


def test_one_trusted_liar_is_outvoted_by_the_other_trusted() -> None:
    liar = peer(1, epoch=10**6, digest=C, addr=ADDR)
    honest = peer(2, digest=A, addr=ADDR)
    assert not view(rec(digest=A), liar, honest, trusted={pid(1), pid(2)}).behind
    # the only trusted peer decides: the one the user named, or the only one this peer trained with
    assert view(rec(digest=A), liar, honest, trusted={pid(1)}).behind


def test_the_members_of_the_round_just_committed_outvote_a_trusted_peer_that_stepped_apart() -> None:
    """Three peers commit step 5 together (digest B); their records still show step 4. A trusted partner
    that stepped alone (or lied) publishes step 5 with the smaller digest A. Counting records alone, it
    tied with this peer and won the tie: every honest peer downloaded its state. The members of the
    round this peer committed hold its digest until a record of theirs on the step says otherwise."""
    lagging = [peer(n, epoch=EPOCH - 1, digest=C, addr=ADDR) for n in (1, 2)]
    apart = peer(3, digest=A, addr=ADDR)
    trusted = {pid(1), pid(2), pid(3)}
    assert view(rec(digest=B), *lagging, apart, trusted=trusted).diverged(B)  # (without the cohort)
    v = view(rec(digest=B), *lagging, apart, trusted=trusted, cohort=(pid(1), pid(2)))
    assert v.majority == B and not v.diverged(B)
    # a member's own record of the step speaks for it (it may have moved to another state since) ...
    moved = [peer(n, digest=A, addr=ADDR) for n in (1, 2)]
    assert view(rec(digest=B), *moved, apart, trusted=trusted, cohort=(pid(1), pid(2))).diverged(B)
    # ... and an untrusted member vouches for nothing (in a private swarm, trusted=None, everyone counts)
    assert view(rec(digest=B), *lagging, apart, trusted={pid(3)}, cohort=(pid(1), pid(2))).diverged(B)
    assert not view(rec(digest=B), *lagging, apart, cohort=(pid(1), pid(2))).diverged(B)


def test_a_trusted_majority_that_moved_on_is_followed() -> None:
    """A peer that missed a round follows the trusted peers that took it."""
    ahead = [peer(n, epoch=EPOCH + 1, digest=B, addr=ADDR) for n in (1, 2)]
    v = view(rec(digest=A), *ahead, peer(3, digest=A), trusted={pid(1), pid(2), pid(3)})
    assert v.behind and v.newest == EPOCH + 1 and {d.peer for d in v.donors} == {pid(1), pid(2)}


def test_fresh_keys_claiming_huge_progress_at_most_double_what_counts() -> None:
    """A record of 2**53 samples at 1e9/s made the swarm ready at once (an honest peer with 10 of 100
    samples matchmade); untrusted claims now add at most what this peer and the trusted have done."""
    liar = peer(9, samples=2**53, rate=1e9)
    mine = rec(samples=10, rate=5.0)
    v = view(mine, peer(1, samples=20, rate=5.0), liar, trusted={pid(1)})
    assert (v.samples, v.rate, v.ready) == (60.0, 20.0, False)
    honest_newcomer = peer(2, samples=5, rate=1.0)  # counted in full while within the bound
    assert view(mine, peer(1, samples=20, rate=5.0), honest_newcomer, trusted={pid(1)}).samples == 35.0
    assert view(mine, liar, trusted=None).ready  # a private swarm's members are believed


def test_a_trusted_peer_whose_view_reached_the_target_makes_this_one_look_for_a_group() -> None:
    """Eight peers, a joiner that trusts its join peer only: the six others count for at most as much
    as the two, so it saw 4 peers' samples and looked for a group when the others' had formed without it
    (8-peer runs: 3 peers left out of every round, downloading the state each time). Its join peer's
    record saying that its own view reached the target now makes it look too; a stranger's does not."""
    mine = rec(samples=15, rate=5.0)
    others = [peer(n, samples=15, rate=5.0) for n in range(2, 8)]
    join_peer = peer(1, samples=15, rate=5.0)
    alone = view(mine, join_peer, *others, trusted={pid(1)})
    assert (alone.samples, alone.ready) == (60.0, False)  # 120 done: the target (100) is reached
    told = view(mine, peer(1, samples=15, rate=5.0, ready=True), *others, trusted={pid(1)})
    assert told.ready and told.samples == TARGET and "trusted peer's view" in told.reason
    stranger = view(mine, join_peer, peer(9, samples=15, rate=5.0, ready=True), *others, trusted={pid(1)})
    assert not stranger.ready  # an untrusted record's word counts for nothing
    on_another_step = view(mine, peer(1, epoch=EPOCH - 1, samples=15, ready=True), *others, trusted={pid(1)})
    assert not on_another_step.ready


def test_records_of_ids_without_the_runs_work_count_for_nothing() -> None:
    """In a run that prices ids, a fresh key's record is not a peer, nor samples, nor a vote."""
    priced = pid(1)
    work = find_work(priced, 8)
    paid = PeerProgress(priced, rec(samples=20, digest=B, work=work))
    free = [peer(n, samples=50, digest=B) for n in range(2, 6)]
    v = view(rec(samples=10, digest=A), paid, *free, trusted=None, min_work=8)
    assert (v.peers, v.others, v.samples) == (2, 1, 30.0)
    assert view(rec(samples=10, digest=A), paid, *free, trusted=None).peers == 6  # free ids count: no price


def test_trusted_peers_that_left_ahead_forbid_a_step_alone() -> None:
    """The swarm shuts down while this peer catches up: the others' records say they leave, on a later
    step. Nobody to wait for; a step alone now would be a second lineage under the swarm's step numbers
    (the kill-restart scenario's last step). They serve their state until they stop: download it."""
    gone = [peer(n, epoch=EPOCH + 50, digest=B, addr=ADDR, leaving=True) for n in (1, 2)]
    v = view(rec(digest=A), *gone, trusted={pid(1), pid(2)})
    assert (v.behind, v.peers, v.overtaken) == (True, 1, True)
    assert {d.peer for d in v.donors} == {pid(1), pid(2)}
    assert not view(rec(digest=A), *gone, trusted={pid(9)}).overtaken  # strangers leaving: no matter
    behind = view(rec(digest=A), peer(1, epoch=EPOCH + 1, digest=B), trusted={pid(1)})
    assert behind.behind and behind.overtaken


def test_fresh_keys_that_never_average_cannot_raise_the_quorum_past_the_trusted() -> None:
    """Records of ids that never join a group made the majority a group needs unreachable for the
    honest peers (2 honest + 3 such ids: a group of 3 needed); they now count toward it for at most as
    many as the trusted, while the group waited for still counts everyone."""
    idle = [peer(n) for n in range(5, 8)]
    v = view(rec(), peer(1), *idle, trusted={pid(1)})
    assert (v.peers, v.quorum) == (5, 2)
    assert view(rec(), *idle, trusted={pid(1)}).quorum == 1  # alone among strangers: a group of one will do
    many = [peer(n) for n in (1, 2, 3)]
    idle.append(peer(9))
    assert view(rec(), *many, *idle, trusted={pid(1), pid(2), pid(3)}).quorum == 4  # of 4 vouched + 3 of 4
    assert view(rec(), *many, *idle, trusted=None).quorum == 5  # a private swarm: a majority of all 8


def test_records_of_ids_never_connected_do_not_raise_the_quorum() -> None:
    """The 8-peer sybil-majority run: the swarm's first peer trusted the 7 peers connected to it, two of
    them an attacker's nodes that never join a group, and 16 fresh keys wrote records of its step. They
    raised the majority a group needs to all 8 trusted peers: the 6 honest ones never formed a group
    (no step in 150 s). Records of ids that never connected to this peer now count for nothing there."""
    trusted = {pid(n) for n in range(1, 8)}
    sybils = [peer(n) for n in range(10, 26)]
    v = view(rec(), *[peer(n) for n in range(1, 8)], *sybils, trusted=trusted, met=trusted)
    assert v.quorum == 8 // 2 + 1 and v.vouched_here == 8
    assert view(rec(), *[peer(n) for n in range(1, 8)], *sybils, trusted=trusted).quorum == 8  # before
    # an untrusted peer that did connect (an honest joiner) still counts
    joiner = view(rec(), peer(1), peer(10), trusted={pid(1)}, met={pid(1), pid(10)})
    assert joiner.quorum == (2 + 1) // 2 + 1


def test_peers_one_step_behind_count_toward_the_majority_a_group_needs() -> None:
    """8 peers: the 3 whose round committed first reached step 20 while 5 still publish step 19. A group
    of 2 of the 3 held a majority of the peers *then on step 20* and committed it; the 5 arriving next
    committed step 20 again (two lineages: the 8-peer group-capture run's divergent steps). Those one
    step behind now count toward the majority, so the 3 here wait for them; peers two steps behind catch
    up by download and do not count; nor do untrusted ones for more than the trusted."""
    here = [peer(n) for n in (1, 2)]
    behind = [peer(n, epoch=EPOCH - 1) for n in range(3, 8)]
    v = view(rec(), *here, *behind, trusted=None)
    assert (v.peers, v.quorum) == (3, 5)  # was (3, 2)
    assert view(rec(), *here, *behind, trusted={pid(1), pid(2)}).quorum == 3  # strangers: capped
    far = [peer(n, epoch=EPOCH - 2) for n in range(3, 8)]
    assert view(rec(), *here, *far, trusted=None).quorum == 2
    landing = [peer(n, epoch=EPOCH - 1, landing=True) for n in range(3, 8)]
    assert view(rec(), *here, *landing, trusted=None).quorum == (8 // 2 + 1)  # already counted in peers


def test_peers_past_the_step_count_toward_the_majority_a_group_needs() -> None:
    """8 peers on a loaded machine: 5 committed step 19 and moved on, and 3 left behind had read the
    new step of only some of them (records travel for seconds). They saw the others' stale records of
    step 19 and themselves: a majority of those on the step, not of the step's peers. A group of the 3
    formed and committed step 19 a second time (a lineage of its own). Peers past the step now count
    toward the majority too, trusted or, up to as many, connected strangers: the 3 wait, and download
    the state once the new records arrive."""
    moved = [peer(n, epoch=EPOCH + 1) for n in (1, 2, 3)]
    stale = [peer(n) for n in (4, 5)]
    left = [peer(n) for n in (6, 7)]
    v = view(rec(), *left, *stale, *moved, trusted=None)
    assert not v.behind and v.peers == 5  # (the upper median of the epochs it read is still its own)
    assert v.quorum == 8 // 2 + 1  # was 5 // 2 + 1 = 3: the 3 left behind made a "majority"
    far = [peer(n, epoch=EPOCH + 4) for n in (1, 2, 3)]
    assert view(rec(), *left, *stale, *far, trusted=None).quorum == 8 // 2 + 1
    # strangers past the step count for no more than the trusted, and only if connected
    trusted = {pid(6), pid(7)}
    assert view(rec(), *left, *moved, trusted=trusted, met=None).quorum == (3 + 2) // 2 + 1
    assert view(rec(), *left, *moved, trusted=trusted, met=trusted).quorum == 3 // 2 + 1


def test_a_group_waits_for_the_peers_one_step_behind() -> None:
    """A joiner that downloads a step's state lands it about when the swarm's group for that step forms:
    the group now waits for peers one step behind (trusted or not: a joiner is trusted by nobody yet)
    until its leader's deadline, not for those further behind or whose round is landing."""
    here = [peer(1), peer(2)]
    v = view(rec(), *here, peer(3, epoch=EPOCH - 1), peer(4, epoch=EPOCH - 1), trusted={pid(1), pid(2)})
    assert (v.peers, v.arriving) == (3, 2)
    far = view(rec(), *here, peer(3, epoch=EPOCH - 2), peer(4, epoch=EPOCH - 1, landing=True), trusted=None)
    assert (far.peers, far.arriving) == (4, 0)


# ---- when a record must go out -------------------------------------------------------------------


def test_a_steady_peer_publishes_on_changes_and_heartbeats_not_every_second():
    last = ProgressRecord(
        epoch=3, samples=100, rate=10.0, time=NOW, digest=b"d" * 32, run=RUN, since=NOW - 10
    )

    def at(dt: float, **changes: Any) -> ProgressRecord:
        # The count a steady peer reaches: what ``last`` extrapolates to.
        return replace(last, **({"time": NOW + dt, "samples": round(100 + 10 * dt)} | changes))

    assert must_publish(None, last, heartbeat=3.0, tolerance=5)
    for dt in (0.5, 1.0, 2.0, 2.9):
        assert not must_publish(last, at(dt), heartbeat=3.0, tolerance=5), dt
    assert must_publish(last, at(3.0), heartbeat=3.0, tolerance=5)  # the heartbeat
    # Whatever others cannot extrapolate goes out at once.
    for change in (
        {"epoch": 4, "samples": 0},
        {"digest": b"e" * 32},
        {"landing": True},
        {"leaving": True},
        {"addr": "/ip4/198.18.0.1/tcp/1/p2p/x"},
        {"since": NOW + 1},
    ):
        assert must_publish(last, at(1.0, **change), heartbeat=3.0, tolerance=5), change
    assert must_publish(last, at(1.0, rate=13.0), heartbeat=3.0, tolerance=5)  # the rate moved by 30%
    assert not must_publish(last, at(1.0, rate=12.0), heartbeat=3.0, tolerance=5)
    # A count that strayed from the extrapolation (the peer stalled, or raced ahead).
    assert must_publish(last, replace(at(1.0), samples=100), heartbeat=3.0, tolerance=5)
    assert must_publish(last, replace(at(1.0), samples=120), heartbeat=3.0, tolerance=5)
    assert not must_publish(last, replace(at(1.0), samples=114), heartbeat=3.0, tolerance=5)
    # A first rate after none is a change too.
    assert must_publish(replace(last, rate=0.0), at(0.5, rate=1.0), heartbeat=3.0, tolerance=5)


# ---- a trusted peer's claims are bounded (issue: open swarms, part 2) --------------------------------


def test_spread_cap_is_spread_times_the_lower_median() -> None:
    assert spread_cap([1.0, 2.0, 3.0, 1e9]) == SPREAD * 2.0
    assert spread_cap([5.0]) == SPREAD * 5.0
    assert spread_cap([]) == math.inf and spread_cap([1.0], math.inf) == math.inf


def test_a_trusted_liar_saying_ready_does_not_make_the_honest_view_ready() -> None:
    """Before: one trusted record with ``ready`` and 2**40 samples made this peer's view reach the target
    at once (``ready_said = any(...)``), with 10 of 100 samples done by the honest peers."""
    liar = peer(9, samples=2**40, rate=1e9, ready=True)
    mine = rec(samples=4, rate=5.0)
    honest = [peer(1, samples=3, rate=5.0), peer(2, samples=3, rate=5.0)]
    v = view(mine, *honest, liar, trusted={pid(1), pid(2), pid(9)})
    assert not v.ready
    assert v.samples == 10.0 + SPREAD * 3.0  # (the lower median of 4, 3, 3, 2**40 is 3)
    assert v.rate == 15.0 + SPREAD * 5.0
    # half of the trusted peers on the step saying it is enough (an honest one reached the target)
    said = replace(honest[0].record, ready=True)
    assert view(mine, PeerProgress(pid(1), said), honest[1], liar, trusted={pid(1), pid(2), pid(9)}).ready
    # a single trusted peer decides alone, as before (a joiner's join peer)
    assert view(mine, liar, trusted={pid(9)}).ready


@given(
    honest=st.lists(st.integers(0, 200), min_size=1, max_size=8),
    mine=st.integers(0, 200),
    lie=st.integers(0, 2**53),
)
@settings(max_examples=300, deadline=None)
def test_one_trusted_liar_counts_for_at_most_spread_times_the_median(
    honest: list[int], mine: int, lie: int
) -> None:
    records = [peer(i + 1, samples=s, rate=0.0) for i, s in enumerate(honest)]
    liar = peer(99, samples=lie, rate=1e9, ready=True)
    trusted = {r.peer for r in records} | {pid(99)}
    v = view(rec(samples=mine, rate=0.0), *records, liar, trusted=trusted)
    ordered = sorted([mine, *honest, lie])
    cap = SPREAD * ordered[(len(ordered) - 1) // 2]
    expected = mine + sum(min(s, cap) for s in honest) + min(lie, cap)
    if len(honest) >= 2:  # its "ready" alone is not half of the trusted peers on the step
        assert v.samples == expected and v.ready == (expected >= TARGET)
    else:  # one trusted peer beside it: half of them, as a single trusted peer decides alone
        assert v.ready


@given(
    trusted_ready=st.lists(st.booleans(), min_size=1, max_size=6),
    strangers_ready=st.lists(st.booleans(), max_size=6),
    samples=st.lists(st.integers(0, 30), min_size=12, max_size=12),
)
@settings(max_examples=300, deadline=None)
def test_one_trusted_peer_ready_on_the_step_makes_this_one_follow_and_only_half_of_them_make_it_lead(
    trusted_ready: list[bool], strangers_ready: list[bool], samples: list[int]
) -> None:
    """What every record says (``heard``: it times a follower's look) reaches the target as soon as one
    trusted peer on the step says its view did, once it is within ``READY_SLACK`` of it (a trusted liar
    that leads cannot make every follower look at once); this peer's own view (``samples``: whether it
    may lead) only once half of them say so. Strangers' ``ready`` moves neither: a follower's look is
    timed by their capped claims alone. Counted by half of the trusted peers, a peer whose own view
    lagged looked as its region's group formed and was left out (64 simulated peers)."""
    mine = rec(samples=samples[0], rate=1.0)
    trusted = [peer(i + 1, samples=samples[i + 1], rate=1.0, ready=r) for i, r in enumerate(trusted_ready)]
    strangers = [
        peer(50 + i, samples=samples[6 + i], rate=1.0, ready=r) for i, r in enumerate(strangers_ready)
    ]
    v = view(mine, *trusted, *strangers, trusted={r.peer for r in trusted})
    plain = view(
        mine,
        *(PeerProgress(r.peer, replace(r.record, ready=False)) for r in (*trusted, *strangers)),
        trusted={r.peer for r in trusted},
    )
    said = sum(trusted_ready)
    led = 2 * said >= len(trusted_ready) and said > 0
    close = plain.heard >= (1 - READY_SLACK) * TARGET
    assert (v.heard >= TARGET) == ((said > 0 and close) or led or plain.heard >= TARGET)
    assert v.ready == (led or plain.ready)
    if not any(trusted_ready):  # (strangers' word alone changes nothing)
        assert (v.heard, v.samples) == (plain.heard, plain.samples)
