"""The all-reduce benchmark's link bound: the shortest round any partition allows (pure)."""

from __future__ import annotations

import json

import pytest

from simulations.benchmarks.allreduce import SCENARIOS, Scenario, link_bound_s

S = 25e6  # bytes per peer


def test_on_equal_links_it_is_the_butterfly_bound():
    sc = SCENARIOS["netns"]
    assert link_bound_s(sc, S) == pytest.approx(2 * 3 / 4 * S / 12.5e6)


def test_a_very_slow_peer_bounds_the_round_by_its_own_vector():
    # 25 Mbit/s is 3.125 MB/s: with no share it still sends its 25 MB and receives the result
    assert link_bound_s(SCENARIOS["netns-uneven"], S) == pytest.approx(S / 3.125e6)


def test_moderately_uneven_links_share_out_so_that_every_member_finishes_together():
    sc = Scenario("x", 4, 25.0, 4.0, netns=True, rates=(100.0, 100.0, 80.0, 60.0))
    t = link_bound_s(sc, S)
    rates = [r * 1e6 / 8 for r in sc.rates or ()]
    shares = [(t * b / S - 1) / 2 for b in rates]  # each member's time (1 + 2 p) S / B equals t
    assert all(p > 0 for p in shares)
    assert sum(shares) == pytest.approx(1.0, rel=1e-9)
    assert t == pytest.approx(S * 6 / sum(rates), rel=1e-9)  # S (2N - 2) / sum(B) when nobody is left out


def test_the_summary_row_of_uneven_links_names_them_and_claims_no_equal_link_target(tmp_path):
    from simulations.benchmarks.suite import allreduce_rows

    sc = SCENARIOS["netns-uneven"]
    report = {
        "plan": {"rounds": 6},
        "scenarios": {
            sc.name: {"mb": sc.mb, "netns": True, "rates": list(sc.rates or ()), "compression": "none"}
        },
        "results": [
            {
                "scenario": sc.name,
                "system": "p2ptrain",
                "status": "ok",
                "median_s": 11.0,
                "link_bound_s": 8.0,
                "fraction_of_link_bound": 0.727,
                "shares_last_round": [0.306, 0.306, 0.31, 0.078],
            }
        ],
    }
    (tmp_path / "allreduce.json").write_text(json.dumps(report))
    (row,) = allreduce_rows(tmp_path)
    assert "links 100/100/100/25 Mbit/s" in row["metric"] and "73% of the bound 8" in row["metric"]
    assert "shares 0.31/0.31/0.31/0.08" in row["metric"]
    assert row["target"] == "-" and row["met"] is None
