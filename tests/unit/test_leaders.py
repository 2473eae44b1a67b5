"""Who leads a group, and which leaders a peer stops following (pure: ``matchmaking``, ``leaders``).

What is proved here: the leader is the smallest lottery ticket among the announcements a peer may follow,
and nothing an announcement declares (its deadline, its bandwidth) changes who that is; an announcement
that declares a deadline past the run's window is not followed at all; whatever each peer has seen,
excluded and been refused by, every wait goes down one global order, so no chain of waits closes into a
cycle (randomized, hypothesis); and the book of failed leaders keeps a failed leader, and its subnet's
fresh keys, out for a long while that doubles on repeat, within bounded memory. Randomized against the
book: an attacker with fresh keys on m subnets stalls a peer at most SUSPICIONS x m x (1 + log2(1 +
T / SUSPECTED)) times in T seconds, and honest leaders of one LAN that a burst of too-small groups got
suspected before any of them delivered are followed again within minutes, not half an hour.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.averaging.leaders import (
    EXCLUSION,
    MAX_PEERS,
    MAX_SUBNETS,
    MEMORY,
    SUSPECTED,
    SUSPICIONS,
    LeaderBook,
    blames_subnet,
)
from p2ptrain.averaging.matchmaking import (
    DEADLINE_SLACK,
    LINGER,
    QUIET,
    Announcement,
    Gathering,
    Joiner,
    Quorum,
    cannot_join,
    choose_leader,
    place,
    ticket,
    why_not,
)
from p2ptrain.identity import PeerID

KEY = "sync-7"
WINDOW = 5.0


def pid(i: int) -> PeerID:
    return PeerID(bytes([i]) * 32)


def by_ticket(*ids: int, key: str = KEY) -> list[int]:
    return sorted(ids, key=lambda i: ticket(key, pid(i)))


def ann(i: int, deadline: float, addr: str = "x", schema: bytes = b"s", bw: float = 1.0) -> Announcement:
    return Announcement(pid(i), addr, deadline, bw, schema)


# ---- the lottery ----


def test_the_ticket_is_the_peer_and_the_key_alone_and_changes_with_the_key():
    assert ticket(KEY, pid(1)) == ticket(KEY, pid(1))
    assert ticket(KEY, pid(1)) != ticket(KEY, pid(2))
    # per step, another order: no id leads every step
    orders = {tuple(by_ticket(*range(1, 9), key=f"sync-{s}")) for s in range(20)}
    assert len(orders) > 10
    assert len({o[0] for o in orders}) > 3


def test_the_smallest_ticket_leads_whatever_deadline_it_declared():
    first, second, last = by_ticket(1, 2, 3)
    me = ann(last, 10.0)
    # the earliest declared deadline does not win: the ticket does
    seen = [ann(first, 9.0), ann(second, 0.5)]
    assert choose_leader(me, seen, 0.0, KEY) == seen[0]
    # the smallest ticket leads: nobody before it
    assert choose_leader(ann(first, 10.0), [ann(second, 1.0), ann(last, 0.2)], 0.0, KEY) is None


@pytest.mark.parametrize(
    ("case", "a", "now", "expected"),
    [
        ("ours", lambda lo, me: ann(me, 5.0), 0.0, "ourselves"),
        ("client-only", lambda lo, me: ann(lo, 5.0, addr=""), 0.0, "client-only"),
        ("schema", lambda lo, me: ann(lo, 5.0, schema=b"t"), 0.0, "another schema"),
        # (a leader may still be gathering up to LINGER past its deadline: see ``Gathering.closes_at``)
        ("lingering", lambda lo, me: ann(lo, 5.0), 5.0 + LINGER - 0.1, ""),
        ("closed", lambda lo, me: ann(lo, 5.0), 5.0 + LINGER, "closed"),
        (
            "far",
            lambda lo, me: ann(lo, WINDOW + DEADLINE_SLACK + 0.1),
            0.0,
            "further than the run's window allows",
        ),
        ("at the edge", lambda lo, me: ann(lo, WINDOW + DEADLINE_SLACK), 0.0, ""),
        ("after us", lambda lo, me: ann(me + 100, 5.0), 0.0, ""),
        ("before us", lambda lo, me: ann(lo, 5.0), 0.0, ""),
    ],
)
def test_why_not(case, a, now, expected):
    lo, hi = by_ticket(1, 2)
    me = ann(hi, WINDOW)
    other = a(lo, hi)
    if case == "after us":  # an id whose ticket is larger than ours
        other = ann(next(i for i in range(3, 60) if ticket(KEY, pid(i)) > ticket(KEY, pid(hi))), 5.0)
        expected = "after us"
    why = why_not(me, other, now, KEY)
    assert (expected in why and why) if expected else why == "", why


def test_refused_and_excluded_leaders_are_passed_over_for_the_next_ticket():
    first, second, last = by_ticket(1, 2, 3)
    me, a, b = ann(last, 5.0), ann(first, 5.0), ann(second, 5.0)
    assert choose_leader(me, [a, b], 0.0, KEY) == a
    assert choose_leader(me, [a, b], 0.0, KEY, declined={a}) == b
    assert choose_leader(me, [a, b], 0.0, KEY, excluded={a.peer}) == b
    # refused under one announcement: asked again once it announces anew
    assert choose_leader(me, [ann(first, 6.0), b], 0.0, KEY, declined={a}).peer == a.peer
    # a client-only peer follows any leader, whatever its ticket
    assert choose_leader(ann(first, 5.0, addr=""), [b], 0.0, KEY) == b


def test_a_redirect_passes_over_the_announcement_that_refused_us_not_its_peer():
    """A leader that refused this peer under one announcement (it found a smaller place at its deadline,
    or its group came out short) and looks again under a new one may be followed, through a redirect
    too (``GroupForming._passed_over``): passed over by its address, at 128 simulated peers a peer
    refused by the step's eventual leader declined every peer that redirected to it, one after another,
    and was out of the step's round. A leader the book excludes stays passed over."""
    from p2ptrain.averaging.grouping import GroupForming
    from p2ptrain.identity import Identity

    class Forming:  # (what ``_passed_over`` reads of the group forming)
        leaders = LeaderBook()

        def clock(self) -> float:
            return 50.0

    peer = Identity.generate().peer_id
    addr = f"/ip4/198.18.0.7/tcp/4000/p2p/{peer}"
    refused = Announcement(peer, addr, 10.0, 1.0, b"s")
    anew = Announcement(peer, addr, 14.0, 1.0, b"s")  # its next look
    forming = Forming()

    def passed(latest: dict[PeerID, Announcement]) -> str:
        return GroupForming._passed_over(forming, addr, {refused}, latest)  # type: ignore[arg-type]

    assert passed({peer: refused}) == "declined"  # (asked again shortly: a read may bring the new one)
    assert passed({}) == "declined"  # (nothing read of it but the refusal)
    assert passed({peer: anew}) == ""  # followed, as choose_leader would
    forming.leaders.failed(peer, "198.18.0.0/24", 40.0, "no manifest")
    assert passed({peer: anew}) == "excluded"


# ---- the randomized property: no cycles, nothing declared wins ----


@st.composite
def swarms(draw: st.DrawFn) -> tuple[list[Announcement], dict[PeerID, tuple[list, set, set]], float, str]:
    """Announcements with adversarial declared deadlines (past, now, near, at and beyond the window's
    edge, absurd), and per observer a random view, refusals and exclusions."""
    n = draw(st.integers(2, 12))
    now = 100.0
    deadlines = st.one_of(
        st.floats(now - 10, now + WINDOW + DEADLINE_SLACK + 5, allow_nan=False),
        st.sampled_from([now, now + 1e-9, now + WINDOW + DEADLINE_SLACK, 1e12, -1e12]),
    )
    anns = [
        Announcement(
            pid(i),
            draw(st.sampled_from(["x", "x", "x", ""])),
            draw(deadlines),
            draw(st.floats(0, 1e15)),
            draw(st.sampled_from([b"s", b"s", b"s", b"t"])),
            rank=draw(st.sampled_from([0, 0, 1, 2])),  # (declared by the announcer, as the rest)
        )
        for i in range(1, n + 1)
    ]
    views = {}
    for a in anns:
        seen = draw(st.lists(st.sampled_from(anns), max_size=n, unique=True))
        declined = set(draw(st.lists(st.sampled_from(anns), max_size=3, unique=True)))
        excluded = {x.peer for x in draw(st.lists(st.sampled_from(anns), max_size=3, unique=True))}
        views[a.peer] = (seen, declined, excluded)
    return anns, views, now, draw(st.sampled_from(["sync-1", "diloco-2", "sync/3-99"]))


@settings(max_examples=400, deadline=None, derandomize=True)
@given(swarms())
def test_no_wait_chain_has_a_cycle_and_no_declared_field_changes_the_winner(swarm):
    anns, views, now, key = swarm
    by_peer = {a.peer: a for a in anns}
    follows: dict[PeerID, PeerID] = {}
    rng = random.Random(len(anns))
    for a in anns:
        seen, declined, excluded = views[a.peer]
        leader = choose_leader(a, seen, now, key, declined=declined, excluded=excluded)
        if leader is None:
            continue
        assert not why_not(a, leader, now, key, declined=declined, excluded=excluded)
        assert leader.peer not in excluded and leader not in declined and leader.can_lead
        # (a leader gathers until its deadline, or LINGER past it while the peers it counts still join)
        assert now < leader.deadline + LINGER and leader.deadline <= a.deadline + DEADLINE_SLACK
        if a.can_lead:  # every wait goes down the one order, whatever this observer excluded
            assert place(key, leader) < place(key, a)
            follows[a.peer] = leader.peer
        # a leader whose quorum leaves room goes first, a newcomer's last: none of a lower rank that
        # it may follow is passed over
        lower = [x for x in seen if x.rank < leader.rank]
        assert all(why_not(a, x, now, key, declined=declined, excluded=excluded) for x in lower)
        # Re-declare every other announcement's deadline (anywhere it stays followable) and bandwidth:
        # the same peer wins.
        redeclared = [
            x
            if x.peer == a.peer or why_not(a, x, now, key, declined=declined, excluded=excluded)
            else Announcement(
                x.peer,
                x.addr,
                rng.uniform(now - LINGER + 1e-6, a.deadline + DEADLINE_SLACK),
                rng.uniform(0, 1e9),
                x.schema,
                rank=x.rank,
            )
            for x in seen
        ]
        again = choose_leader(a, redeclared, now, key, declined=declined, excluded=excluded)
        assert again is not None and again.peer == leader.peer
    for start in follows:  # walk each chain of waits: it ends, at a leader
        node, steps = start, 0
        while node in follows:
            node, steps = follows[node], steps + 1
            assert steps <= len(anns), "a cycle of waits"
        assert by_peer[node].can_lead


# ---- the book of failed leaders ----


def test_a_failed_leader_is_not_followed_for_the_exclusion_then_again():
    book = LeaderBook()
    assert book.excluded(pid(1), "198.18.1.0/24", 0.0) == ""
    until = book.failed(pid(1), "198.18.1.0/24", 10.0, "no manifest")
    assert until == 10.0 + EXCLUSION
    assert "no manifest" in book.excluded(pid(1), "", 10.0 + EXCLUSION - 1)
    assert book.excluded_peers(20.0) == {pid(1)}
    assert book.excluded(pid(1), "198.18.1.0/24", until) == ""  # over


def test_its_subnet_is_excluded_too_except_leaders_that_delivered_before():
    book = LeaderBook()
    book.delivered(pid(3), 0.0)  # an honest neighbour that led us before
    book.failed(pid(1), "198.18.1.0/24", 10.0, "no manifest")
    fresh = book.excluded(pid(2), "198.18.1.0/24", 11.0)
    assert "subnet 198.18.1.0/24" in fresh
    assert book.excluded(pid(3), "198.18.1.0/24", 11.0) == ""
    assert book.excluded(pid(2), "198.18.2.0/24", 11.0) == ""  # another subnet
    assert book.excluded_peers(11.0) == {pid(1)}  # (a subnet's blame needs the address)


def test_a_leader_that_fails_after_delivering_loses_its_good_name():
    book = LeaderBook()
    book.delivered(pid(3), 0.0)
    book.failed(pid(3), "198.18.1.0/24", 10.0, "its decision never came")
    assert book.excluded(pid(3), "198.18.1.0/24", 11.0)
    book.delivered(pid(3), 12.0)  # (a manifest while blamed: not a good name yet)
    book.failed(pid(1), "198.18.1.0/24", 10.0 + EXCLUSION + 1, "no manifest")
    assert book.excluded(pid(3), "198.18.1.0/24", 10.0 + EXCLUSION + 2)


def test_loopback_and_unknown_subnets_blame_nobody_else():
    assert not blames_subnet("") and not blames_subnet("127.0.0.1") and not blames_subnet("::1")
    assert blames_subnet("198.18.1.0/24") and blames_subnet("n4")
    book = LeaderBook()
    book.failed(pid(1), "127.0.0.1", 0.0, "no manifest")
    assert book.excluded(pid(2), "127.0.0.1", 1.0) == ""
    assert book.excluded(pid(1), "127.0.0.1", 1.0)


def test_the_exclusion_doubles_on_each_repeat():
    book = LeaderBook()
    t = 0.0
    for n in range(4):
        until = book.failed(pid(1), "10.0.0.0/24", t, "no manifest")
        assert until - t == EXCLUSION * 2**n
        assert book.excluded(pid(9), "10.0.0.0/24", until - 1)  # the subnet's fresh keys too
        t = until + 1
    # a failure while still excluded (a round it coordinated, after its manifest) does not double
    book.failed(pid(2), "", t, "a")
    assert book.failed(pid(2), "", t + 1, "b") == t + 1 + EXCLUSION


def test_the_book_is_bounded_and_a_flood_of_failures_pushes_out_what_ends_soonest():
    book = LeaderBook()
    book.failed(pid(1), "198.18.1.0/24", 0.0, "the first")
    book.failed(pid(1), "198.18.1.0/24", EXCLUSION + 1, "again")  # (2 x EXCLUSION: ends last)
    for i in range(2 * MAX_PEERS):
        book.failed(PeerID(i.to_bytes(32, "big")), f"n{i}", EXCLUSION + 2, "fresh")
    assert len(book) <= MAX_PEERS + MAX_SUBNETS
    assert book.excluded(pid(1), "", EXCLUSION + 3)


# ---- whom a leader waits for ----


def test_a_leader_does_not_wait_for_known_peers_that_never_join_it():
    """A known peer that may lead and holds a smaller ticket leads, or follows a smaller one: never this
    leader. Counted in the target, it would keep the group from being full until the deadline."""
    first, second, third, fourth = by_ticket(1, 2, 3, 4)  # (9: a stranger)
    me = ann(second, 5.0)
    seen = [ann(first, 5.0), ann(third, 5.0), ann(fourth, 5.0, addr=""), ann(9, 5.0)]
    known = {pid(i) for i in (1, 2, 3, 4)}
    away = cannot_join(me, seen, KEY, known)
    assert away == {pid(first)}
    assert cannot_join(ann(first, 5.0), seen, KEY, known) == set()  # nobody before the first
    assert cannot_join(me, [ann(first, 5.0, addr="")], KEY, known) == set()  # client-only: may follow us
    assert cannot_join(me, seen, KEY, set()) == set()  # strangers are not in the target

    g = Gathering(Joiner(pid(second), "l", 1.0), b"s", target_size=4, min_size=2)
    g.offer(Joiner(pid(third), "a", 1.0), b"s")
    g.offer(Joiner(pid(fourth), "b", 1.0), b"s")
    assert not g.full() and not g.ready()
    g.away = frozenset({pid(first)})
    assert g.full() and g.ready()
    g.away = frozenset({pid(i) for i in range(10, 20)})  # never below the smallest group
    assert Gathering(Joiner(pid(second), "l", 1.0), b"s", 4, 2, away=g.away).full() is False


def test_a_leader_waits_for_a_smaller_peer_it_may_follow_and_goes_to_it():
    """A smaller known peer the leader may follow is not away: the group is not full without it, so the
    leader redirects to it. Before, it counted as away: a leader two peers reached before the smallest
    formed a group of two, and the smallest (it never follows a larger ticket) led a group of one and
    fell a step behind (streaming DiLoCo with overlap)."""
    first, second, third = by_ticket(1, 2, 3)
    me = ann(second, 5.0)
    seen = [ann(first, 5.0), ann(third, 5.0)]
    known = {pid(i) for i in (1, 2, 3)}
    assert cannot_join(me, seen, KEY, known, followable={pid(first)}) == set()
    assert cannot_join(me, seen, KEY, known, followable={pid(third)}) == {pid(first)}
    g = Gathering(Joiner(pid(second), "l", 1.0), b"s", target_size=3, min_size=2)
    g.offer(Joiner(pid(third), "a", 1.0), b"s")
    g.away = cannot_join(me, seen, KEY, known, followable={pid(first)})
    assert not g.full()  # (the leader redirects to the first instead of forming without it)


def test_failures_an_honest_leader_also_shows_count_only_when_they_repeat_without_a_manifest():
    """A group too small, a late refusal, a round that failed on it: honest leaders do that too. The
    ``SUSPICIONS``-th such failure without a manifest between excludes the leader; a manifest it
    delivers wipes its suspicions. A subnet is suspected for its keys together (fresh keys do not
    start afresh), and no good manifest of one key wipes the subnet's."""
    book = LeaderBook()
    for n in range(SUSPICIONS - 1):
        assert book.suspect(pid(1), "198.18.1.0/24", float(n), "too small") is None
    book.delivered(pid(1), 5.0)  # a good round: its suspicions are forgotten
    for n in range(SUSPICIONS - 1):
        assert book.suspect(pid(1), "", 10.0 + n, "too small") is None
    assert book.suspect(pid(1), "", 20.0, "too small") == 20.0 + SUSPECTED
    assert "too small" in book.excluded(pid(1), "", 21.0)
    # fresh keys of one subnet, each suspected once: the subnet's count reaches it
    results = [book.suspect(pid(10 + k), "198.18.9.0/24", 30.0 + k, "too small") for k in range(SUSPICIONS)]
    assert results[:-1] == [None] * (SUSPICIONS - 1) and results[-1] is not None
    assert book.excluded(pid(99), "198.18.9.0/24", 40.0)
    # suspicions older than the exclusion are forgotten
    book2 = LeaderBook()
    book2.suspect(pid(2), "", 0.0, "late")
    book2.suspect(pid(2), "", 1.0, "late")
    assert book2.suspect(pid(2), "", 2.0 + 2 * EXCLUSION, "late") is None


# ---- what suspicions cost an attacker, and an honest LAN ----


@pytest.mark.parametrize("seed", range(12))
def test_fresh_keys_on_m_subnets_stall_a_peer_a_logarithmic_number_of_times(seed: int) -> None:
    """Whatever an attacker with free keys on m subnets does, each matchmaking it wins with a leader the
    peer still follows is one stall; in T seconds there are at most SUSPICIONS x m x (1 + log2(1 + T /
    SUSPECTED)) of them, plus SUSPICIONS for each good manifest one of its keys delivered (a real round
    led for the peer). Its choices, random: which subnet, a fresh key or one already used, a stall an
    honest leader also causes (a suspicion) or a sure failure, and now and then a good round."""
    rng = random.Random(seed)
    m = rng.randint(1, 4)
    subnets = [f"198.18.{40 + i}.0/24" for i in range(m)]
    book = LeaderBook()
    keys: list[tuple[PeerID, str]] = []
    stalls = delivered = 0
    t, horizon = 0.0, rng.uniform(600.0, MEMORY / 4)
    while t < horizon:
        t += rng.uniform(1.0, 30.0)  # the next matchmaking the attacker wins
        if keys and rng.random() < 0.5:
            who, subnet = rng.choice(keys)
        else:
            who, subnet = PeerID(rng.randbytes(32)), rng.choice(subnets)
            keys.append((who, subnet))
        if book.excluded(who, subnet, t):
            continue  # passed over: no stall
        if rng.random() < 0.05:
            book.delivered(who, t)  # a good round: it led the peer's group honestly
            delivered += 1
            continue
        stalls += 1
        if rng.random() < 0.2:
            book.failed(who, subnet, t, "held to the end of its wait")
        else:
            book.suspect(who, subnet, t, "too small")
        bound = SUSPICIONS * m * (1 + math.log2(1 + t / SUSPECTED)) + SUSPICIONS * delivered
        assert stalls <= bound, (seed, t, stalls, bound)
    assert stalls > 0


@pytest.mark.parametrize("seed", range(12))
def test_honest_leaders_of_one_lan_suspected_in_a_burst_are_followed_again_within_minutes(seed: int) -> None:
    """Peers of one /24 (a LAN, one provider's subnet) whose first groups came out too small under load:
    before any of them delivered a manifest, a burst of suspicions of their leaders excludes the subnet.
    Invariants: each is followed again within 5 minutes of the burst (the old book: EXCLUSION, half an
    hour, in which no group formed); one that then delivers is never again excluded by its subnet's
    blame, only by SUSPICIONS suspicions of its own in a row."""
    rng = random.Random(seed)
    lan = "198.18.0.0/24"
    honest = [pid(i) for i in range(1, rng.randint(3, 8))]
    book = LeaderBook()
    t = 0.0
    for _ in range(rng.randint(SUSPICIONS, 2 * SUSPICIONS)):  # the burst: a minute of short groups
        t += rng.uniform(0.5, 60.0 / (2 * SUSPICIONS))
        book.suspect(rng.choice(honest), lan, t, "only 2 of at least 3 peers joined in time")
    back = t + 300.0
    left = [book.excluded(p, lan, back) for p in honest]
    assert left == [""] * len(honest), left
    good = rng.choice(honest)
    book.delivered(good, back)
    for _ in range(50):  # more short groups, of the others, for a long while
        t = max(t, back) + rng.uniform(1.0, 60.0)
        book.suspect(rng.choice([p for p in honest if p != good] or honest), lan, t, "too small")
        if good not in book.excluded_peers(t):
            assert book.excluded(good, lan, t) == "", book.excluded(good, lan, t)


# ---- the group's closing: only counted joiners keep a group open, and never past LINGER ----


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(st.booleans(), st.floats(-20.0, 20.0, allow_nan=False)),  # (counted?, when it joins)
        max_size=24,
    ),
    st.floats(-10.0, 10.0, allow_nan=False),
    st.integers(1, 64),
)
def test_a_group_closes_within_linger_and_only_counted_joiners_keep_it_open(joins, deadline, target):
    counted = frozenset(pid(100 + i) for i, (c, _) in enumerate(joins) if c)
    quorum = Quorum(counted | {pid(1)}, 1)

    def gathering() -> Gathering:
        return Gathering(Joiner(pid(1), "a", 1.0), b"s", target_size=target, min_size=1, quorum=quorum)

    g, strangers_only, alone = gathering(), gathering(), gathering()
    for i, (c, at) in enumerate(joins):
        assert g.offer(Joiner(pid(100 + i), "a", 1.0), b"s", at) in (None, "the group is full")
        if not c:  # the same ids that are not counted, alone: they never hold the group open longer
            why = strangers_only.offer(Joiner(pid(100 + i), "a", 1.0), b"s", at)
            assert why in (None, "the group is full")
    closes = g.closes_at(deadline)
    assert deadline <= closes <= deadline + LINGER
    # strangers close it at its deadline, or at the end of its linger where its leader counts nobody
    # else and it held no majority of its places by then; joining, they never close it later than it
    # closes without them
    held = strangers_only.counts_others() or strangers_only.holds_most(deadline)
    assert strangers_only.closes_at(deadline) == (deadline if held else deadline + LINGER)
    assert strangers_only.closes_at(deadline) <= alone.closes_at(deadline)
    members = {j.peer for j in g.joiners}
    for i, (c, at) in enumerate(joins):
        if c and pid(100 + i) in members:  # a counted joiner keeps it open QUIET past it (within LINGER)
            assert closes >= min(at + QUIET, deadline + LINGER)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    st.lists(st.tuples(st.booleans(), st.floats(-20.0, 20.0, allow_nan=False)), max_size=12),
    st.integers(1, 14),
    st.floats(-10.0, 10.0, allow_nan=False),
    st.integers(1, 30),
)
def test_a_group_short_of_its_quorum_closes_at_the_end_of_its_linger(joins, need, deadline, target):
    """A group held to a quorum it does not hold, or whose leader counts nobody but itself and that held
    no majority of the places it gathers for (the peers its leader sees on the step) at its deadline,
    gathers until ``LINGER`` past it, whenever its joiners came (closed sooner, it could only fail, or
    leave most of the step's peers to a second group); otherwise it closes as before (a leader that
    counts others lingers only for them: records of free ids swell its places); a group held to no
    quorum closes as before."""
    joins = joins[: target - 1]  # (not full: a full group forms at once)
    counted = frozenset(pid(100 + i) for i, (c, _) in enumerate(joins) if c)
    quorum = Quorum(counted | {pid(1)}, need)
    g = Gathering(Joiner(pid(1), "a", 1.0), b"s", target_size=target, min_size=1, quorum=quorum)
    plain = Gathering(Joiner(pid(1), "a", 1.0), b"s", target_size=target, min_size=1)
    for i, (_, at) in enumerate(joins):
        assert g.offer(Joiner(pid(100 + i), "a", 1.0), b"s", at) is None
        assert plain.offer(Joiner(pid(100 + i), "a", 1.0), b"s", at) is None
    latest = max((at for _, at in joins), default=-math.inf)
    if 1 + len(counted) < need or (
        not counted and 2 * (1 + sum(at <= deadline for _, at in joins)) <= target
    ):
        assert g.closes_at(deadline) == deadline + LINGER
    else:
        last = max((at for c, at in joins if c), default=-math.inf)
        assert g.closes_at(deadline) == min(deadline + LINGER, max(deadline, last + QUIET))
    assert plain.closes_at(deadline) == min(deadline + LINGER, max(deadline, latest + QUIET))


@settings(max_examples=300, deadline=None)
@given(
    counted=st.integers(2, 12),
    strangers=st.integers(0, 12),
    extra=st.integers(0, 4),
    order=st.randoms(use_true_random=False),
)
def test_a_stranger_never_takes_the_place_of_a_counted_peer_that_asks(counted, strangers, extra, order):
    """A leader gathers for the peers it counts (and ``extra`` it sees but does not count); strangers
    (ids it does not count: newcomers catching up, or free ids) ask in any order with them. Whenever
    the group is ready to form, no stranger holds a place while a counted peer is still outside it; and
    every counted peer that asks gets in. Counted full by places alone, a group formed the moment a
    stranger filled it, and the counted peer that asked next downloaded the step."""
    peers = [pid(i) for i in range(1, counted + 1)]
    quorum = Quorum(frozenset(peers), counted // 2 + 1)
    g = Gathering(Joiner(peers[0], "a", 1.0), b"s", target_size=counted + extra, min_size=1, quorum=quorum)
    askers = [Joiner(p, f"c{i}", 1.0) for i, p in enumerate(peers[1:])]
    askers += [Joiner(pid(100 + i), f"s{i}", 1.0) for i in range(strangers)]
    order.shuffle(askers)
    for j in askers:
        if g.ready():
            break
        g.offer(j, b"s")
    members = {g.leader.peer, *(j.peer for j in g.joiners)}
    if g.ready():
        outside = quorum.peers - members
        assert not outside or all(j.peer in quorum.peers for j in g.joiners), (outside, members)
    asked = {j.peer for j in askers if j.peer in quorum.peers}
    assert asked <= members or g.ready(), "a counted peer that asked is outside a group still gathering"
