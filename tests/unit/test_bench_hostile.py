"""The hostile-peers benchmark's pure parts: which runs it makes of a scenario, how it compares an attacked
run's honest validation loss with the no-attack run's, when an attack meets the issue's target, and the
rows it gives the suite's table. No process is started."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest

from p2ptrain.testing.adversary import ADVERSARIES
from simulations.benchmarks.hostile import (
    SCENARIOS,
    TOLERANCE,
    assess,
    attacker_costs,
    command,
    compare,
    cost_text,
    format_table,
    pace,
    parse_kinds,
    reanalyse_one,
    variant,
)
from simulations.benchmarks.suite import NAMES, hostile_rows, plan
from simulations.replay.scenario import SCENARIOS_DIR, load_scenario


def test_every_attack_runs_on_the_scenarios_hostile_peers_and_the_baseline_has_none() -> None:
    for peers, name in SCENARIOS.items():
        base = load_scenario(SCENARIOS_DIR / f"{name}.toml")
        hostile = sorted(base.adversaries)
        assert len(base.peers) == peers and len(hostile) == peers // 4
        assert variant(base, None).adversaries == {}
        nan = variant(base, "nan", duration=60.0)
        assert nan.adversaries == dict.fromkeys(hostile, "nan") and nan.duration == 60.0
        assert nan.written_duration == base.duration  # min_steps is scaled to the shorter run


def test_the_loss_is_compared_at_the_last_step_both_runs_evaluated() -> None:
    got = compare({5: 3.0, 10: 2.5, 15: 2.0}, {5: 3.1, 10: 2.6})
    assert got == {
        "how": "same step",
        "step": 10,
        "baseline_step": 10,
        "loss": 2.6,
        "baseline_loss": 2.5,
        "relative": 0.04,
        "within": True,
    }
    assert compare({10: 2.5}, {10: 2.7})["within"] is False  # +8%
    assert compare({10: 2.5}, {10: 2.0})["within"] is True  # lower is fine
    assert compare({10: 2.0}, {10: 2.0 * (1 + TOLERANCE)})["within"] is True  # the bound itself


def test_without_a_common_step_the_last_evaluations_are_compared_and_nan_fails() -> None:
    got = compare({5: 3.0, 10: 2.5}, {4: 2.9, 8: 2.6})
    assert (got["how"], got["step"], got["baseline_step"]) == ("last evaluations", 8, 10)
    assert got["relative"] == 0.04 and got["within"] is True
    bad = compare({10: 2.5}, {10: None})
    assert bad["within"] is False and bad["relative"] is None and "not finite" in bad["how"]
    assert compare({}, {10: 2.0})["within"] is None and "no-attack run" in compare({}, {10: 2.0})["how"]
    assert compare({10: 2.0}, {})["how"] == "no validation loss in this run"
    assert compare({10: None}, {10: 2.0})["within"] is None


def summary(
    points: list[list[Any]], named: bool | None, kept: bool, failed: tuple[str, ...] = ()
) -> dict[str, Any]:
    """A made-up summary.json: the honest peers' validation points; peer 3 named or not (None: no
    adversary); whether they kept training; the checks that failed."""
    offender = {"peer": 3, "peer_id": "ABCDEF..WXYZ", "named": named, "examples": []}
    offenders = [] if named is None else [offender]
    checks = [{"check": c, "passed": False} for c in failed] + [{"check": "no crashes", "passed": True}]
    return {
        "honest": {"val_points": points, "kept_training": kept, "final_step": 20},
        "offenders": offenders,
        "checks": checks,
        "passed": not failed,
    }


def test_an_attack_meets_the_target_only_with_the_loss_close_the_offender_named_and_training_kept() -> None:
    base = summary([[10, 2.5], [20, 2.0]], None, True)
    ok = assess("scale", summary([[10, 2.55], [20, 2.05]], True, True), base)
    assert ok["met"] is True and ok["comparison"]["step"] == 20 and ok["named"] is True
    assert ok["offenders"][0]["peer_id"] == "ABCDEF..WXYZ" and ok["baseline_final_step"] == 20
    assert assess("scale", summary([[20, 2.05]], False, True), base)["met"] is False  # not named
    assert assess("scale", summary([[20, 2.05]], True, False), base)["met"] is False  # training stopped
    far = assess("random", summary([[20, 2.5]], True, True, ("loss curve intact (honest peers)",)), base)
    assert far["met"] is False and far["checks_failed"] == ["loss curve intact (honest peers)"]
    nan = assess("nan", summary([[20, None]], True, True), base)
    assert nan["met"] is False and nan["comparison"]["within"] is False
    assert assess("nan", summary([], True, True), base)["met"] is None  # nothing to compare
    assert assess("nan", None, base)["met"] is None  # the run failed
    anonymous = assess("fake-progress", summary([[20, 2.05]], False, True), base)  # fresh keys' records:
    assert anonymous["met"] is True and anonymous["named"] == "anonymous"  # nothing ties them to peer 3


def test_the_table_has_a_row_per_attack() -> None:
    base = summary([[20, 2.0]], None, True)
    results = [
        {"kind": k, "status": "ok"} | assess(k, summary([[20, v]], True, True), base)
        for k, v in (("scale", 2.02), ("nan", math.nan))
    ]
    report = {
        "scenario": "hostile-4",
        "adversaries": [3],
        "aggregation": "trimmed_mean",
        "audit": True,
        "duration_s": 90.0,
        "tolerance": TOLERANCE,
        "workdir": "/tmp/x",
        "baseline": {"status": "ok", "final_step": 20},
        "results": results,
    }
    text = format_table(report)
    scale = next(line for line in text.splitlines() if line.startswith("scale"))
    assert "2.0200 (step 20)" in scale and "+1.0%" in scale and scale.rstrip().endswith("met")
    nan = next(line for line in text.splitlines() if line.startswith("nan"))
    assert nan.rstrip().endswith("NOT met") and "hostile-4 (sync): peers 3 hostile" in text


def test_an_attack_that_stalls_the_swarm_fails_even_with_the_loss_kept() -> None:
    """Global steps within half of the no-attack run's are part of the target: a leader that stalls every
    group leaves the loss where it was (nothing was trained worse), and must still fail."""
    base = summary([[10, 2.5], [20, 2.0]], None, True)
    stalled = summary([[10, 2.52]], True, True)
    stalled["honest"] = stalled["honest"] | {"final_step": 9}
    row = assess("silent-leader", stalled, base)
    assert row["comparison"]["within"] is True and row["kept_pace"] is False and row["met"] is False
    paced = summary([[10, 2.52]], True, True)
    paced["honest"] = paced["honest"] | {"final_step": 10}
    assert assess("silent-leader", paced, base)["met"] is True
    assert pace(None, 20) is None and pace(10, 20) is True and pace(9, 20) is False


def test_kinds_are_checked_and_the_command_reproduces_the_run() -> None:
    assert parse_kinds("nan, scale") == ("nan", "scale") and parse_kinds("all") == ADVERSARIES
    with pytest.raises(argparse.ArgumentTypeError, match="choose from nan, scale"):
        parse_kinds("nan,loud")
    quick = command(8, ("scale",), True, None)
    assert quick == "python -m simulations.bench_hostile --peers 8 --kinds scale --quick"
    assert command(4, ("nan", "inflate"), False, 60.0).endswith("--kinds nan,inflate --duration 60")
    assert command(4, ("mixed",), True, None, "diloco").endswith("--kinds mixed --mode diloco --quick")


@pytest.mark.timeout(30)
def test_the_suite_runs_the_benchmark_and_puts_a_row_per_attack_in_its_table(tmp_path: Path) -> None:
    assert "hostile" in NAMES
    steps = [s for s in plan(False, ("hostile",), tmp_path, tmp_path) if s.name == "hostile"]
    assert [s.argv[1:3] for s in steps] == [("--peers", "4"), ("--peers", "8")]
    assert {s.argv[0] for s in steps} == {"simulations.bench_hostile"}
    assert len(plan(True, ("hostile",), tmp_path, tmp_path)) == 1  # --quick: 4 peers only
    assert [r["metric"] for r in hostile_rows(tmp_path)] == ["not run", "not run"]

    base = summary([[20, 2.0]], None, True)
    result = {"kind": "scale", "status": "ok"} | assess("scale", summary([[20, 2.04]], True, True), base)
    data = {"quick": True, "tolerance": TOLERANCE, "baseline": {"status": "ok"}, "results": [result]}
    (tmp_path / "hostile.json").write_text(json.dumps(data))
    (row, missing) = hostile_rows(tmp_path)
    assert row["benchmark"] == "hostile peers (4)" and row["p2ptrain"] == "+2.0%" and row["met"] is True
    assert row["metric"].startswith("scale: honest val loss vs no attack (step 20, same step)")
    assert "offender named: yes" in row["metric"] and "kept training: yes" in row["metric"]
    assert row["command"] == "python -m simulations.bench_hostile --peers 4 --kinds scale --quick"
    assert missing["benchmark"] == "hostile peers (8)" and missing["metric"] == "not run"
    assert "global steps 20 (no attack: 20)" in row["metric"]  # what the attack cost the honest peers
    assert row["target"] == f"<= +{100 * TOLERANCE:g}%, offender named, kept training"
    flood = {"kind": "dht-flood", "status": "ok"} | assess(
        "dht-flood", summary([[20, 2.0]], False, True), base
    )
    (tmp_path / "hostile.json").write_text(json.dumps(data | {"results": [flood]}))
    row = hostile_rows(tmp_path)[0]  # records under fresh keys: naming the attacker is not asked
    assert row["met"] is True and row["target"] == f"<= +{100 * TOLERANCE:g}%, kept training"
    assert "offender named: anonymous" in row["metric"]


@pytest.mark.timeout(30)
def test_reanalysing_a_folder_without_a_run_says_so(tmp_path: Path) -> None:
    status, summary, seconds = reanalyse_one(tmp_path / "scale", "scale")
    assert status.startswith("no run in") and summary is None and seconds == 0.0


def test_what_the_attackers_spent_is_read_from_their_last_running_count(tmp_path: Path) -> None:
    """The issue asks the table to say what each attack cost the attacker (keys, connections, bytes):
    the hostile peers log a running count; the last one of each is summed."""
    for i, lines in (
        (
            6,
            [
                "5 keys, 10 records stored (2000 bytes sent), 0",
                "8 keys, 40 records stored (9000 bytes sent), 3",
            ],
        ),
        (7, ["8 keys, 32 records stored (6000 bytes sent), 600"]),
    ):
        folder = tmp_path / "nodes" / f"peer-{i}"
        folder.mkdir(parents=True)
        text = "".join(
            f"12:00:0{k} WARNING p2ptrain.testing.sybils: attack dht-flood so far: {x} connections\n"
            for k, x in enumerate(lines)
        )
        (folder / "node.log").write_text("other line\n" + text)
    cost = attacker_costs(tmp_path, [6, 7])
    assert cost == {"keys": 16, "stores": 72, "bytes": 15000, "connections": 603}
    assert cost_text(cost) == "16 keys, 72 records, 0.0 MB, 603 connections"
    assert attacker_costs(tmp_path, [3]) is None and cost_text(None) == "its own id"
