"""Inbound admission (``net.admission``), table-driven: who gets a slot when slots run short.

What is proved here: addresses group into /24 and /64 subnets; a newcomer to a full table takes the slot
of the oldest connection still in its handshake, from the most crowded subnet; an authenticated
connection is evicted only when it has been idle long enough and is not a peer this node trained with;
a subnet or an address at its limit loses only its own connections; the reserve admits, on probation,
only a newcomer from an address a protected peer was seen at; otherwise the answer is "refuse". An
expected round member, over the total, takes any idle slot that is not protected (random tables). A
full table turns over to a newcomer nothing else admits the least recently used slot idle a moment,
never a protected or busy one, at most a rate's worth a second (random tables and arrivals).
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from p2ptrain.net.admission import Arrivals, Limits, Slot, Tally, Turnover, admit, subnet_of

LIMITS = Limits(total=4, per_ip=3, per_subnet=3, reserve=1, idle_after=30.0)
NOW = 100.0


def slot(key: int, ip: str, since: float, **kw: bool) -> Slot:
    return Slot(key, ip, subnet_of(ip), since, **kw)


@pytest.mark.parametrize(
    ("host", "subnet"),
    [
        ("198.18.0.7", "198.18.0.0/24"),
        ("198.18.1.7", "198.18.1.0/24"),
        ("2001:db8:1:2::7", "2001:db8:1:2::/64"),
        ("::ffff:198.18.0.9", "198.18.0.0/24"),
        ("fe80::1%eth0", "fe80::/64"),
        ("h3", "h3"),
        # processes of one machine (a lab's peers on 127.0.0.10, .11, ...): each address alone. As one
        # /24, two flooders on 127.0.0.16 and .17 evicted the honest peers' own connections (8 peers)
        ("127.0.0.16", "127.0.0.16"),
        ("::1", "::1"),
    ],
)
def test_addresses_are_counted_by_subnet(host: str, subnet: str) -> None:
    assert subnet_of(host) == subnet


def test_room_left_is_accepted() -> None:
    assert admit([slot(1, "198.18.0.1", 1.0)], "198.18.1.1", NOW, LIMITS).verdict == "accept"


def test_a_full_table_gives_up_its_oldest_handshake_from_the_most_crowded_subnet() -> None:
    slots = [
        slot(1, "198.18.5.1", 1.0),  # the oldest, but its subnet holds one slot
        slot(2, "198.18.7.1", 2.0),
        slot(3, "198.18.7.2", 3.0),
        slot(4, "198.18.1.1", 0.5, authenticated=True),  # idle for long, but handshakes go first
    ]
    got = admit(slots, "198.18.9.9", NOW, LIMITS)
    assert got.verdict == "evict" and got.victim is not None and got.victim.key == 2, got


@pytest.mark.parametrize(
    ("kw", "since", "evicted"),
    [
        ({}, NOW - 31.0, True),  # idle past idle_after, nobody we trained with
        ({}, NOW - 5.0, False),  # used a moment ago
        ({"busy": True}, NOW - 31.0, False),  # a call in flight
        ({"protected": True}, NOW - 300.0, False),  # a peer we trained with
    ],
    ids=["idle", "recent", "busy", "protected"],
)
def test_an_authenticated_connection_is_evicted_only_when_idle_and_unprotected(
    kw: dict[str, bool], since: float, evicted: bool
) -> None:
    slots = [slot(1, "198.18.0.1", since, authenticated=True, **kw)]
    slots += [slot(k, f"198.18.{k}.1", NOW - 1.0, authenticated=True) for k in (2, 3, 4)]
    got = admit(slots, "198.18.9.9", NOW, LIMITS)
    if evicted:
        assert got.verdict == "evict" and got.victim is not None and got.victim.key == 1
    else:
        assert got.verdict == "refuse" and "too many connections" in got.reason


def test_a_subnet_at_its_limit_loses_only_its_own() -> None:
    slots = [slot(k, f"198.18.7.{k}", float(k)) for k in (1, 2, 3)]
    got = admit(slots, "198.18.7.9", NOW, LIMITS)
    assert got.verdict == "evict" and got.victim is not None and got.victim.key == 1
    assert "198.18.7.0/24" in got.reason
    others = [slot(k, f"198.18.7.{k}", NOW, authenticated=True) for k in (1, 2, 3)]
    assert admit(others, "198.18.7.9", NOW, LIMITS).verdict == "refuse"
    assert admit(others, "198.18.8.1", NOW, LIMITS).verdict == "accept"  # another subnet: room left


def test_an_address_at_its_limit_loses_only_its_own() -> None:
    mine = [slot(k, "198.18.7.1", float(k)) for k in (1, 2, 3)]
    got = admit(mine, "198.18.7.1", NOW, Limits(total=9, per_ip=3, per_subnet=9))
    assert got.verdict == "evict" and got.victim is not None and got.victim.key == 1


def test_the_reserve_admits_only_where_a_peer_we_trained_with_was_seen() -> None:
    full = [slot(k, f"198.18.{k}.1", NOW, authenticated=True, busy=True) for k in (1, 2, 3, 4)]
    assert admit(full, "198.18.9.9", NOW, LIMITS).verdict == "refuse"
    assert admit(full, "198.18.9.9", NOW, LIMITS, reserve=True).verdict == "probation"
    over = [*full, slot(5, "198.18.5.1", NOW, authenticated=True, busy=True)]
    assert admit(over, "198.18.9.9", NOW, LIMITS, reserve=True).verdict == "refuse"


def test_a_flood_of_decisions_about_one_address_is_one_log_line_a_minute() -> None:
    tally = Tally(every=60.0, size=2)
    assert tally.note("198.18.0.9", 0.0) == 1  # the first: said at once
    assert [tally.note("198.18.0.9", t) for t in (1.0, 2.0, 59.0)] == [0, 0, 0]
    assert tally.note("198.18.0.7", 3.0) == 1  # another address is not kept quiet by the first
    assert tally.note("198.18.0.9", 60.0) == 4  # a minute later: this one and the three kept quiet
    assert tally.note("198.18.0.9", 61.0) == 0
    tally.note("198.18.0.5", 62.0)  # a third address: the least recent (198.18.0.7) is forgotten
    assert tally.note("198.18.0.7", 63.0) == 1 and tally.note("198.18.0.5", 64.0) == 0


def test_new_connections_from_an_address_are_bounded_by_a_token_bucket() -> None:
    arrivals = Arrivals(per_ip=2.0, ip_burst=4, per_subnet=100.0, subnet_burst=100)
    assert all(arrivals.allow("198.18.7.1", 0.0) for _ in range(4))
    assert not arrivals.allow("198.18.7.1", 0.0)  # the burst is spent
    assert not arrivals.allow("198.18.7.1", 0.4)  # 0.8 of a token back: not yet
    assert arrivals.allow("198.18.7.1", 0.5)  # a refused attempt took nothing
    assert not arrivals.allow("198.18.7.1", 0.5)
    assert arrivals.allow("198.18.7.2", 0.5)  # another address has its own bucket
    assert all(arrivals.allow("198.18.7.1", 100.0) for _ in range(4))  # refills to the burst, no more
    assert not arrivals.allow("198.18.7.1", 100.0)


def test_the_addresses_of_one_subnet_share_its_bucket_and_loopback_addresses_do_not() -> None:
    arrivals = Arrivals(per_ip=100.0, ip_burst=100, per_subnet=1.0, subnet_burst=3)
    assert [arrivals.allow(f"198.18.7.{k}", 0.0) for k in range(1, 6)] == [True] * 3 + [False] * 2
    assert arrivals.allow("198.18.8.1", 0.0)
    assert all(arrivals.allow(f"127.0.0.{k}", 0.0) for k in range(1, 6))


def test_arrivals_remember_a_bounded_number_of_addresses() -> None:
    arrivals = Arrivals(per_ip=0.0, ip_burst=1, per_subnet=0.0, subnet_burst=1, size=8)
    assert all(arrivals.allow(f"127.0.0.{k}", 0.0) for k in range(1, 100))
    assert len(arrivals._buckets) == 8


def test_an_inbound_table_admits_from_its_counts_as_admit_does_from_every_slot() -> None:
    """``Inbound._admit`` answers from counts kept as slots come, go and are evicted; over random tables
    (slots held, evicted, released, from a few addresses of a few subnets) its verdict is ``admit``'s over
    a view of every slot, and its counts are the views'."""
    import random
    from collections import Counter

    import trio

    from p2ptrain.net.inbound import Inbound, InboundLimits, _Inbound

    limits = InboundLimits(
        Limits(total=8, per_ip=3, per_subnet=5, reserve=2),
        inbound_rate=1.0,
        refused_hold=0.0,
        handshake_timeout=1.0,
    )
    hosts = [f"198.18.{s}.{h}" for s in range(3) for h in range(1, 4)]

    async def main() -> None:
        for seed in range(20):
            rng = random.Random(seed)
            inbound = Inbound(
                limits,
                responder=lambda: None,  # type: ignore[arg-type,return-value]
                make_connection=lambda *a: None,  # type: ignore[arg-type,return-value]
                run_connection=lambda *a: None,  # type: ignore[arg-type,return-value]
                connections_of=lambda p: [],
                reserved=lambda p: False,
                nursery=lambda: None,
                clock=trio.current_time,
            )
            held: list[_Inbound] = []
            for i in range(200):
                move = rng.random()
                if move < 0.5 or not held:
                    ip = rng.choice(hosts)
                    entry = _Inbound(i, ip, subnet_of(ip), trio.current_time())
                    inbound._hold(entry)
                    held.append(entry)
                elif move < 0.75:
                    live = [e for e in held if not e.evicted]
                    if live:
                        inbound._evict(rng.choice(live).key, "a test")
                else:
                    inbound._release(held.pop(rng.randrange(len(held))))
                views = inbound._slot_views()
                assert inbound._held == len(views)
                assert inbound._by_ip == Counter(v.ip for v in views)
                assert inbound._by_subnet == Counter(v.subnet for v in views)
                ip, reserve = rng.choice(hosts), rng.random() < 0.3
                fast = inbound._admit(ip, reserve)
                assert fast == admit(views, ip, trio.current_time(), limits.limits, reserve=reserve)

    trio.run(main)


@pytest.mark.parametrize("seed", range(40))
def test_an_expected_round_member_takes_an_idle_slot_and_never_a_protected_or_busy_one(seed: int) -> None:
    """The invariant of ``expected`` (a member of a round this node takes part in): over the total, it is
    admitted whenever some slot is in its handshake or is an idle (not busy) connection that is not
    protected, however recently it was used; the victim is always such a slot. Where none is, it may use
    the reserve, on probation, as a peer this node trained with may; the reserve full, it is refused. A
    newcomer not expected gets what it got before: only connections idle for ``idle_after`` may give way
    to it."""
    rng = random.Random(seed)
    limits = Limits(total=8, per_ip=8, per_subnet=8, reserve=2, idle_after=30.0)
    slots = []
    for key in range(limits.total):
        authenticated = rng.random() < 0.85
        slots.append(
            slot(
                key,
                f"198.18.{rng.randrange(4)}.{key + 1}",
                NOW - rng.uniform(0.0, 60.0),
                authenticated=authenticated,
                protected=rng.random() < 0.4,  # (a handshake: an expected round member's)
                busy=authenticated and rng.random() < 0.4,
            )
        )
    ip = f"198.18.9.{seed + 1}"
    yielding = [s for s in slots if not s.protected and not (s.authenticated and s.busy)]
    got = admit(slots, ip, NOW, limits, expected=True)
    if yielding:
        assert got.verdict == "evict" and got.victim in yielding, got
    else:  # nothing may give way: the reserve, on probation (kept only if its handshake shows a member)
        assert got.verdict == "probation", got
        reserve = [slot(100 + k, f"198.18.5.{k + 1}", NOW, protected=True) for k in range(limits.reserve)]
        assert admit(slots + reserve, ip, NOW, limits, expected=True).verdict == "refuse"
    before = admit(slots, ip, NOW, limits)
    if before.victim is not None:
        assert not before.victim.protected
        assert not before.victim.authenticated or NOW - before.victim.since >= limits.idle_after
    if any(
        s.authenticated and not (s.protected or s.busy) and NOW - s.since < 30.0 for s in yielding
    ) and not any(not s.authenticated or NOW - s.since >= 30.0 for s in yielding):
        assert before.verdict == "refuse"  # what the round member heard before: "busy"


def test_an_expected_member_over_its_address_cap_still_loses_only_its_own() -> None:
    """``expected`` widens the victims over the total alone: an address at its own cap still gives way
    only to itself."""
    limits = Limits(total=8, per_ip=2, per_subnet=8, reserve=0, idle_after=30.0)
    slots = [slot(1, "198.18.1.1", NOW - 1.0, authenticated=True, busy=True)]
    slots += [slot(2, "198.18.1.1", NOW - 1.0, authenticated=True, busy=True)]
    slots += [slot(3, "198.18.2.1", NOW - 1.0, authenticated=True)]
    assert admit(slots, "198.18.1.1", NOW, limits, expected=True).verdict == "refuse"


@pytest.mark.parametrize("seed", range(60))
def test_a_full_table_turns_over_the_least_recently_used_idle_slot_and_never_a_protected_or_busy_one(
    seed: int,
) -> None:
    """The invariant of ``turnover`` (the node's ``Turnover`` holds a token): over random full tables, a
    newcomer that nothing else admits (no slot idle ``idle_after``, no reserve of its own) takes the slot
    of a connection that is neither protected nor busy and was idle ``turnover_idle`` at least, from the
    most crowded subnet, the least recently used there, whenever one is; otherwise it is refused. Every
    other verdict is the one without a token, and none ever names a protected or busy victim. On the
    code before, every such newcomer was refused: at 128 simulated peers with 48 slots a node, 11 joiners
    heard "busy" from every join peer for a minute, and never joined."""
    rng = random.Random(seed)
    limits = Limits(total=8, per_ip=8, per_subnet=8, reserve=2, idle_after=30.0, turnover_idle=1.0)
    slots = []
    for key in range(limits.total):
        authenticated = rng.random() < 0.97
        slots.append(
            slot(
                key,
                f"198.18.{rng.randrange(3)}.{key + 1}",
                # most used within ``idle_after`` (a large swarm's DHT), some within ``turnover_idle``
                NOW - rng.choice([rng.uniform(0.0, 1.0), rng.uniform(0.0, 30.0), rng.uniform(0.0, 30.0)])
                if rng.random() < 0.97
                else NOW - rng.uniform(30.0, 60.0),
                authenticated=authenticated,
                protected=rng.random() < 0.3,
                busy=authenticated and rng.random() < 0.3,
            )
        )
    ip = f"198.18.9.{seed + 1}"
    reserve, expected = rng.random() < 0.2, rng.random() < 0.2
    without = admit(slots, ip, NOW, limits, reserve=reserve, expected=expected)
    got = admit(slots, ip, NOW, limits, reserve=reserve, expected=expected, turnover=True)
    for verdict in (without, got):
        assert verdict.victim is None or not (verdict.victim.protected or verdict.victim.busy), verdict
    if without.verdict != "refuse":
        assert got == without  # (a token is spent only where nothing else admits)
        return
    yielding = [
        s for s in slots if not s.protected and not (s.authenticated and (s.busy or NOW - s.since < 1.0))
    ]
    if not yielding:
        assert got.verdict == "refuse" and not got.turnover, got
        return
    assert got.verdict == "evict" and got.turnover and got.victim in yielding, got
    crowded = Counter(s.subnet for s in slots)
    most = max(crowded[s.subnet] for s in yielding)
    assert crowded[got.victim.subnet] == most
    assert got.victim.since == min(s.since for s in yielding if crowded[s.subnet] == most)


@pytest.mark.parametrize("seed", range(20))
def test_slots_turned_over_are_bounded_by_the_rate_in_every_window(seed: int) -> None:
    """However newcomers arrive (bursts, a steady flood, long pauses), a ``Turnover`` of ``rate`` a
    second and bursts of ``burst`` grants at most ``burst + rate * span`` turnovers in any span of time,
    and grants one whenever a token is back; a rate of 0 grants none."""
    rng = random.Random(seed)
    rate, burst = rng.choice([0.5, 1.0, 2.0]), rng.choice([1.0, 4.0])
    turnover = Turnover(rate, burst)
    now, granted = 0.0, []
    for _ in range(400):
        now += rng.choice([0.0, 0.01, rng.expovariate(rate * 4), rng.uniform(0.0, 10.0)])
        if turnover.ready(now):
            turnover.spend(now)
            granted.append(now)
    assert granted, "no turnover granted in 400 arrivals"
    for i, start in enumerate(granted):
        for j in range(i, len(granted)):
            assert j - i + 1 <= burst + rate * (granted[j] - start) + 1e-9
    assert not Turnover(0.0, 4.0).ready(0.0)
