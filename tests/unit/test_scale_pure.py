"""Pure parts of the scale work: a lookup counts its hops; the simulator's churn schedule and fits."""

from __future__ import annotations

import math
import random

import pytest

from p2ptrain.dht.lookup import Lookup
from p2ptrain.dht.routing import Contact
from p2ptrain.identity import PEER_ID_BYTES, PeerID
from p2ptrain.net.address import PeerAddress
from simulations.scale.__main__ import finish_swarm, fits, region_layout
from simulations.scale.model import RTT_MS, Churn, World, churn_events


def contact(i: int, first: int) -> Contact:
    """A contact whose id starts with ``first`` (so its XOR distance to a target of zeros is ordered)."""
    raw = bytes([first]) + i.to_bytes(PEER_ID_BYTES - 1, "big")
    return Contact(PeerID(raw), PeerAddress.for_host(f"10.0.{i}.1", 4000))


def test_a_lookup_counts_the_chain_of_answers_to_the_closest_peer() -> None:
    target = bytes(PEER_ID_BYTES)
    far, mid, near = contact(1, 0x80), contact(2, 0x40), contact(3, 0x01)
    local = PeerID(bytes([0xFF]) * PEER_ID_BYTES)
    search = Lookup(target, [far], local=local, k=3, alpha=1)
    assert search.hops == 0  # nobody answered yet
    assert search.next_queries() == [far]
    search.on_response(far.peer_id, [mid])  # the routing table knew far: hop 1; mid: hop 2
    assert search.hops == 1
    assert search.next_queries() == [mid]
    search.on_response(mid.peer_id, [near])
    assert search.next_queries() == [near]
    search.on_response(near.peer_id, [])
    assert search.finished and search.hops == 3


def test_churn_is_seeded_and_at_its_rates() -> None:
    churn = Churn(join=60.0, leave=30.0, kill=0.0)
    a = churn_events(churn, 100, 0.0, 3600.0, random.Random(1))
    assert a == churn_events(churn, 100, 0.0, 3600.0, random.Random(1))
    kinds = [k for _, k in a]
    assert "kill" not in kinds
    assert abs(kinds.count("join") - 6000) < 400 and abs(kinds.count("leave") - 3000) < 300
    assert all(0.0 <= t < 3600.0 for t, _ in a) and a == sorted(a)


def test_world_latency_is_half_the_regions_rtt_and_the_seed_is_public() -> None:
    world = World(seed=3, nat_share=1.0)
    places = [world.place(i) for i in range(50)]
    assert not places[0].natted and all(p.natted for p in places[1:])
    a, b = places[0], places[1]
    assert world.latency(a.name, b.name) == RTT_MS[a.region][b.region] / 2000.0
    assert world.latency(a.name, b.name) == world.latency(b.name, a.name)


def test_fits_recover_a_logarithm_and_a_power() -> None:
    xs = [16.0, 64.0, 256.0, 1024.0]
    log_fit = fits(xs, [1000 + 500 * math.log2(x) for x in xs])
    assert log_fit["log_fit"] == "1000 + 500 * log2(N)"
    power = fits(xs, [3 * x**1.5 for x in xs])
    assert power["exponent"] == 1.5
    assert fits([16.0], [1.0]) == {"points": 1}


def test_a_region_size_keeps_every_region_that_size_as_the_swarm_grows() -> None:
    from p2ptrain.config import MAX_BUCKETS, ProgressSection

    assert region_layout(16, 32) == (1, 1)
    assert region_layout(32, 32) == (1, 1)
    for peers in (64, 128, 256, 1024):
        buckets, regions = region_layout(peers, 32)
        ProgressSection(buckets=buckets, regions=regions)  # (a layout the run file accepts)
        assert peers // regions == 32 and buckets == 2 * regions
    for peers in (2048, 4096, 10_000):  # (at most MAX_BUCKETS keys: the regions grow from there)
        buckets, regions = region_layout(peers, 32)
        ProgressSection(buckets=buckets, regions=regions)
        assert buckets == MAX_BUCKETS and regions < buckets
    for size in (0, 1, 48):
        with pytest.raises(ValueError, match="power of 2"):
            region_layout(64, size)


def test_each_setting_run_at_three_sizes_is_fitted_on_its_own() -> None:
    def run(peers: int, settings: str, per_step: float) -> dict[str, object]:
        return {
            "peers": peers,
            "settings": settings,
            "control_bytes_sent_per_peer_per_step": per_step,
            "global_steps": 10,
            "virtual_s": 100.0,
        }

    sizes = [64, 256, 1024]
    report = {
        "runs": [run(n, "region-size=32", 1000 + 500 * math.log2(n)) for n in sizes]
        + [run(n, "two", 5.0) for n in sizes[:2]]
    }
    fitted = finish_swarm(report)["fits"]
    assert list(fitted) == ["region-size=32"]  # ("two": two sizes, no fit)
    assert fitted["region-size=32"]["per_step"]["log_fit"] == "1000 + 500 * log2(N)"
    assert fitted["region-size=32"]["peers"] == sizes


def test_two_groups_of_one_region_are_a_fork_only_where_a_trust_link_joins_them() -> None:
    """The simulator's fork count for a split swarm (``trust_linked``): two groups that left one region
    of a step with different states (in the order they landed) are a fork when a member of the later
    trusted a member of the earlier as it landed its round (or trusted every peer: none recorded), and a
    region split otherwise; the earlier group's trust in the later one's members says nothing the later
    group could have known. Checked over random groups and trust sets against the definition read
    literally."""
    from types import SimpleNamespace

    from simulations.scale.swarm import trust_linked

    rng = random.Random(5)
    ids = [PeerID(bytes([i]) * PEER_ID_BYTES) for i in range(12)]
    seen = {True: 0, False: 0}
    for _ in range(300):
        order = rng.sample(range(12), rng.randint(2, 12))
        cut = rng.randint(1, len(order) - 1)
        sides = [order[:cut], order[cut:]]
        trusted: dict[int, frozenset[PeerID] | None] = {}
        for i in order:
            pick = rng.random()
            if pick < 0.05:
                trusted[i] = None  # trusts every peer
            else:  # mostly its own side, now and then one of the other's
                own = next(s for s in sides if i in s)
                mine = {ids[j] for j in own if rng.random() < 0.6}
                if pick > 0.85:
                    other = next(s for s in sides if i not in s)
                    mine.add(ids[rng.choice(other)])
                trusted[i] = frozenset(mine)
        peers = {
            i: SimpleNamespace(node=SimpleNamespace(peer_id=ids[i]), trusted_at={7: trusted[i]})
            for i in order
        }
        groups = [[peers[i] for i in side] for side in sides]
        earlier, later = sides
        expected = any(
            trusted[b] is None or ids[a] in trusted[b]  # type: ignore[operator]
            for a in earlier
            for b in later
        )
        got = trust_linked(groups, 7)  # type: ignore[arg-type]
        assert got == expected, (sides, trusted)
        seen[got] += 1
    assert seen[True] and seen[False]  # both kinds drawn
    # a step nobody recorded its trust on: every peer trusted (the strict count)
    lone = [[SimpleNamespace(node=SimpleNamespace(peer_id=ids[i]), trusted_at={})] for i in (0, 1)]
    assert trust_linked(lone, 3)  # type: ignore[arg-type]


def test_step_periods_run_from_commit_to_commit_inside_the_window() -> None:
    from simulations.scale.swarm import step_periods

    committed = {3: 40.0, 4: 52.0, 5: 63.5, 7: 90.0}  # (step 6 committed nowhere: no period across it)
    assert step_periods(committed, 45.0) == [11.5]
    assert step_periods(committed, 0.0) == [12.0, 11.5]
    assert step_periods({}, 0.0) == []
