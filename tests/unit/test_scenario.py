"""Scenario files: the shipped ones are valid, defaults and overrides merge, events come out in order,
every mistake is refused with the key named; and the report's pure analysis (divergence, recoveries,
catch-ups, memory) judges hand-made timelines as it should. Hostile peers: the adversary key, the
runner's command line for them, which log lines accuse a peer, and the checks judged over honest peers."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import tomllib
from pathlib import Path
from typing import Any

import pytest

from p2ptrain.config import parse_config
from p2ptrain.identity import PeerID
from simulations.replay.report import (
    accuses,
    analyse,
    catch_ups,
    digest_lines,
    divergence,
    evaluate_checks,
    load_run,
    recoveries,
    rss_growth,
    scan_log,
)
from simulations.replay.runner import Backend, PeerProc, Runner, RunOptions
from simulations.replay.scenario import (
    SCENARIOS_DIR,
    Checks,
    ScenarioError,
    load_scenario,
    merged_run,
    parse_scenario,
    read_run_file,
    to_toml,
)

SHIPPED = sorted(SCENARIOS_DIR.glob("*.toml"))
MINIMAL = """
[scenario]
duration = 100
[defaults]
count = 3
"""


def parse(text: str) -> Any:
    return parse_scenario(tomllib.loads(text), default_name="t")


# ---- the shipped scenarios -------------------------------------------------------------------------


def test_the_issue_scenarios_ship() -> None:
    names = {p.stem for p in SHIPPED}
    assert {"lan-4", "wan-continents", "churn", "hetero", "late-joiners", "hostile-4", "hostile-8"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_scenario_is_valid_and_its_merged_run_file_round_trips(path: Path) -> None:
    s = load_scenario(path)
    assert s.name == path.stem and s.description and s.emulation in ("userspace", "hosts")
    merged = merged_run(s, read_run_file(s.run_path()))
    text = to_toml(merged)
    assert parse_config(tomllib.loads(text)) == parse_config(merged)
    assert tomllib.loads(text)["task"]["options"]["n_embd"] <= 64  # small enough for 8 processes on 2 cores


def test_shipped_scenarios_say_what_the_issue_asks() -> None:
    wan = load_scenario(SCENARIOS_DIR / "wan-continents.toml")
    assert len(wan.peers) == 8 and wan.mode == "diloco" and wan.duration == 300
    paths = [a.latency_ms + b.latency_ms for a in wan.peers for b in wan.peers if a is not b]
    assert min(paths) >= 20 and max(paths) <= 150
    assert {p.up_mbit for p in wan.peers} >= {50.0, 1000.0}
    assert any(p.up_mbit < p.down_mbit for p in wan.peers)  # asymmetric
    assert wan.checks.utilization_min == 0.9 and wan.checks.utilization_modes == ("diloco",)

    churn = load_scenario(SCENARIOS_DIR / "churn.toml")
    kills = [e for e in churn.events if e.action == "kill"]
    assert len(churn.peers) == 8 and churn.duration == 600
    assert [b.at - a.at for a, b in itertools.pairwise(kills)] == [15.0] * (len(kills) - 1)
    assert churn.checks.rss_growth_max == 0.2 and churn.checks.identical and churn.checks.continues

    hetero = load_scenario(SCENARIOS_DIR / "hetero.toml")
    assert [p.slowdown for p in hetero.peers] == [2.0, 2.0, 4.0, 8.0]

    late = load_scenario(SCENARIOS_DIR / "late-joiners.toml")
    assert late.initial_peers == [0, 1, 2]
    assert [(e.at, e.action, e.peer) for e in late.events] == [(60.0, "start", 3), (120.0, "start", 4)]
    assert load_scenario(SCENARIOS_DIR / "lan-4.toml").wait_peers == 4


def test_hostile_scenarios_one_of_four_and_two_of_eight_attack_with_robust_aggregation_on() -> None:
    for name, peers, hostile in (("hostile-4", 4, {3: "scale"}), ("hostile-8", 8, {6: "scale", 7: "scale"})):
        s = load_scenario(SCENARIOS_DIR / f"{name}.toml")
        assert len(s.peers) == peers and s.adversaries == hostile
        assert s.duration <= 150 and s.checks.offenders_named and s.checks.identical
        averaging = parse_config(merged_run(s, read_run_file(s.run_path()))).averaging
        assert averaging.aggregation != "mean" and averaging.audit


# ---- merging ---------------------------------------------------------------------------------------


def test_defaults_apply_to_every_peer_and_peers_override_them() -> None:
    s = parse(
        """
        [scenario]
        duration = 60
        [defaults]
        count = 4
        up_mbit = 100
        latency_ms = 10
        [[peers]]
        name = "slow"
        slowdown = 4
        [[peers]]
        name = "home"
        count = 2
        up_mbit = 10
        down_mbit = 50
        """
    )
    assert [p.name for p in s.peers] == ["slow", "home-0", "home-1", "peer-3"]
    assert [p.slowdown for p in s.peers] == [4.0, 1.0, 1.0, 1.0]
    assert [p.up_mbit for p in s.peers] == [100.0, 10.0, 10.0, 100.0]
    assert [p.down_mbit for p in s.peers] == [math.inf, 50.0, 50.0, math.inf]
    assert {p.latency_ms for p in s.peers} == {10.0}
    assert s.wait_peers == 4 and s.emulation == "userspace" and s.run == "configs/tiny-gpt.toml"


def test_run_overrides_merge_key_by_key_and_mode_and_seed_go_into_the_run_file() -> None:
    s = parse(
        MINIMAL
        + """
        [run_overrides.training]
        target_batch_size = 64
        [run_overrides.task.options]
        n_layer = 1
        """
    )
    s = dataclasses.replace(s.with_changes(mode="diloco"), seed=7)
    base = {"task": {"name": "tiny-gpt", "options": {"n_layer": 4, "n_embd": 128}}, "training": {"lr": 0.01}}
    merged = merged_run(s, base)
    assert merged["task"]["options"] == {"n_layer": 1, "n_embd": 128}
    assert merged["training"] == {"lr": 0.01, "target_batch_size": 64, "mode": "diloco"}
    assert merged["run"]["seed"] == 7
    assert base["task"]["options"]["n_layer"] == 4  # not changed in place


def test_override_values_are_checked_with_the_run_files_other_values() -> None:
    s = parse(MINIMAL + "[run_overrides.progress]\ninterval = 20.0\n[run_overrides.training]\nlr = 0.1\n")
    merged = merged_run(s, {"progress": {"ttl": 60.0}})  # valid beside this run file's ttl
    assert merged["progress"] == {"ttl": 60.0, "interval": 20.0}
    with pytest.raises(ScenarioError, match=r"progress\.ttl must be longer than progress\.interval"):
        merged_run(s, {})
    bad = parse(MINIMAL + "[run_overrides.training]\nlr = 'high'\n")
    with pytest.raises(
        ScenarioError, match=r"the run file with run_overrides: training\.lr must be a number"
    ):
        merged_run(bad, {})


def test_events_are_ordered_by_time_then_as_written_and_churn_expands() -> None:
    s = parse(
        """
        [scenario]
        duration = 100
        [defaults]
        count = 4
        [[events]]
        at = 50
        action = "cut"
        peer = 1
        [[events]]
        at = 20
        action = "partition"
        peer = 0
        seconds = 5
        [[events]]
        at = 50
        action = "link"
        peer = 1
        up_mbit = 5
        [churn]
        every = 30
        restart_after = 10
        peers = [2, 3]
        """
    )
    got = [(e.at, e.action, e.peer) for e in s.events]
    assert got == [
        (20.0, "partition", 0),
        (30.0, "kill", 2),
        (40.0, "restart", 2),
        (50.0, "cut", 1),
        (50.0, "link", 1),
        (60.0, "kill", 3),
        (70.0, "restart", 3),
        (90.0, "kill", 2),
    ]  # churn.stop defaults to duration - restart_after; the kill at 90 s is restarted at 100: too late
    assert s.events[0].seconds == 5.0 and dict(s.events[4].link) == {"up_mbit": 5.0}


def test_late_starts_come_from_start_at_or_from_start_events() -> None:
    s = parse(
        """
        [scenario]
        duration = 100
        [defaults]
        count = 3
        [[peers]]
        [[peers]]
        start_at = 40
        [[events]]
        at = 10
        action = "start"
        peer = 2
        """
    )
    assert s.initial_peers == [0]
    assert [p.start_at for p in s.peers] == [0.0, None, None]
    assert [(e.at, e.action, e.peer, e.origin) for e in s.events] == [
        (10.0, "start", 2, "events[0]"),
        (40.0, "start", 1, "peers[1].start_at"),
    ]
    assert s.wait_peers == 1


def test_a_shorter_duration_drops_the_later_events_and_checks_the_emulation_again() -> None:
    s = load_scenario(SCENARIOS_DIR / "churn.toml").with_changes(duration=100)
    assert s.duration == 100 and all(e.at < 100 for e in s.events)
    assert s.checks.min_steps == 20 and s.min_steps() == 4 and s.written_duration == 600  # scaled down
    assert s.with_changes(duration=50).written_duration == 600
    assert len(s.events) + len(s.dropped_events) == len(load_scenario(SCENARIOS_DIR / "churn.toml").events)
    with pytest.raises(ScenarioError, match="--mode"):
        s.with_changes(mode="fast")
    cutting = parse(MINIMAL + '[[events]]\nat = 1\naction = "cut"\npeer = 0\n')
    with pytest.raises(
        ScenarioError, match=r"events\[0\]\.action 'cut' needs scenario\.emulation = 'userspace'"
    ):
        cutting.with_changes(emulation="netns")
    assert parse(MINIMAL).with_changes(emulation="netns").emulation == "netns"


def test_what_an_emulation_cannot_do_is_said() -> None:
    lossy = parse(MINIMAL + "latency_ms = 20\ncuts_per_min = 2\n")
    assert any("connection cuts" in n for n in lossy.not_emulated())
    netns = lossy.with_changes(emulation="netns").not_emulated()
    assert any("latency" in n for n in netns) and any("cuts_per_min" in n for n in netns)
    assert any("plain loopback" in n for n in lossy.with_changes(emulation="none").not_emulated())
    assert any("plain loopback" in n for n in lossy.with_changes(emulation="hosts").not_emulated())
    assert parse(MINIMAL).not_emulated() == []


def test_to_toml_writes_scalars_nested_tables_and_strings_safely() -> None:
    data = {
        "run": {"id": 'a "quoted"\nid', "seed": 3},
        "task": {"name": "x", "options": {"k": 1.5, "on": True}},
    }
    assert tomllib.loads(to_toml(data)) == data


def test_an_adversary_key_makes_a_peer_hostile_and_with_changes_swaps_or_removes_the_attack() -> None:
    s = parse(
        """
        [scenario]
        duration = 60
        [defaults]
        count = 5
        [[peers]]
        name = "good"
        [[peers]]
        name = "bad"
        count = 2
        adversary = "nan"
        """
    )
    assert [p.adversary for p in s.peers] == [None, "nan", "nan", None, None]
    assert s.adversaries == {1: "nan", 2: "nan"}
    swapped = s.with_changes(adversaries=[None, "inflate", "garbage-reducer", None, None])
    assert swapped.adversaries == {1: "inflate", 2: "garbage-reducer"}
    assert s.adversaries == {1: "nan", 2: "nan"}  # unchanged
    assert s.with_changes(adversaries=[None] * 5).adversaries == {}
    with pytest.raises(ScenarioError, match=r"adversaries must give one kind .* per peer: 5, not 2"):
        s.with_changes(adversaries=[None, "nan"])
    with pytest.raises(ScenarioError, match=r"peers\[1\]\.adversary must be one of nan, scale"):
        s.with_changes(adversaries=[None, "loud", None, None, None])
    with pytest.raises(ScenarioError, match="leave no honest peer"):
        s.with_changes(adversaries=["scale"] * 5)


# ---- errors ----------------------------------------------------------------------------------------

# (scenario text, what the error says); the text starts with one of these:
TWO = "[scenario]\nduration = 10\n[defaults]\ncount = 2\n"  # a valid two-peer scenario ...
TEN = "[scenario]\nduration = 10\n"  # ... and its first lines
ERRORS = [
    ("", r"\[scenario\] is required"),
    ("[scenario]\n[defaults]\ncount = 2", "scenario.duration is required"),
    ("[scenario]\nduration = -1\n[defaults]\ncount = 2", r"scenario.duration must be in \(0"),
    (TWO + "[extra]", r"unknown table \[extra\]"),
    (TEN + "foo = 1\n[defaults]\ncount = 2", "unknown key scenario.foo; known:"),
    (TEN + "emulation = 'tc'\n[defaults]\ncount = 2", "scenario.emulation must be one of"),
    (TEN + "mode = 'fast'\n[defaults]\ncount = 2", "scenario.mode must be one of"),
    (TEN + "run = 'x.yaml'\n[defaults]\ncount = 2", "scenario.run must name a .toml"),
    (TEN + "seed = 1.5\n[defaults]\ncount = 2", "scenario.seed must be an integer"),
    (TEN + "wait_peers = 3\n[defaults]\ncount = 2", "scenario.wait_peers must be between"),
    (TEN + "name = 'a b'\n[defaults]\ncount = 2", "scenario.name must be"),
    ("[scenario]\nduration = 10", "peers none"),
    (TEN + "[defaults]\ncount = 0", "defaults.count must be between 1 and 64"),
    (TEN + "[defaults]\ncount = 1\n[[peers]]\n[[peers]]", "defaults.count is 1 but"),
    (TWO + "speed = 2", "unknown key defaults.speed"),
    (TWO + "slowdown = 0.5", "defaults.slowdown must be a number >= 1"),
    (TEN + "[[peers]]\nup_mbit = 0", r"peers\[0\]\.up_mbit must be positive"),
    (TEN + "[[peers]]\n[[peers]]\nlatency_ms = -1", r"peers\[1\]\.latency_ms must be finite"),
    (TEN + "[[peers]]\nlatency_ms = 5\njitter_ms = 6", r"peers\[0\]\.jitter_ms must not"),
    (TEN + "[[peers]]\ndown_mbit = 'fast'", r"peers\[0\]\.down_mbit must be a number"),
    (TEN + "[[peers]]\ncount = 2.0", r"peers\[0\]\.count must be an integer"),
    (TEN + "[[peers]]\nstart_at = 20", r"peers\[0\]\.start_at must be before"),
    (TEN + "[[peers]]\nstart_at = 5", "peers none starts at 0 s"),
    (TEN + "peers = 3", "unknown key scenario.peers"),
    (TWO + "[[events]]\naction = 'kill'\npeer = 1", r"events\[0\]\.at is required"),
    (TWO + "[[events]]\nat = 10\naction = 'kill'\npeer = 1", r"events\[0\]\.at must be in \[0"),
    (TWO + "[[events]]\nat = 1\naction = 'nuke'\npeer = 1", r"events\[0\]\.action must be one of"),
    (TWO + "[[events]]\nat = 1\naction = 'kill'", r"events\[0\]\.peer is required"),
    (
        TWO + "[[events]]\nat = 1\naction = 'kill'\npeer = 2",
        r"events\[0\]\.peer must be a peer index, 0 to 1",
    ),
    (TWO + "[[events]]\nat = 1\naction = 'partition'\npeer = 1", r"events\[0\]\.seconds is required"),
    (
        TWO + "[[events]]\nat = 1\naction = 'kill'\npeer = 1\nseconds = 3",
        r"events\[0\]\.seconds is for partition",
    ),
    (
        TWO + "[[events]]\nat = 1\naction = 'kill'\npeer = 1\nup_mbit = 3",
        r"events\[0\]\.up_mbit is for link events only",
    ),
    (
        TWO + "[[events]]\nat = 1\naction = 'link'\npeer = 1",
        r"events\[0\] a link event changes at least one",
    ),
    (
        TWO + "[[events]]\nat = 1\naction = 'link'\npeer = 1\nup_mbit = -1",
        r"events\[0\]\.up_mbit must be positive",
    ),
    (
        TWO + "[[events]]\nat = 1\naction = 'restart'\npeer = 1",
        r"events\[0\] restarts peer 1 at 1 s, which is not down then \(running\)",
    ),
    (
        TWO + "[[events]]\nat = 1\naction = 'kill'\npeer = 1\n[[events]]\nat = 2\naction = 'kill'\npeer = 1",
        r"events\[1\] kills peer 1 at 2 s, which is not running then \(down\)",
    ),
    (
        TWO
        + "[[events]]\nat = 1\naction = 'start'\npeer = 1\n[[events]]\nat = 2\naction = 'start'\npeer = 1",
        r"events\[1\] starts peer 1 at 2 s, which was started before",
    ),
    (
        TEN + "[[peers]]\n[[peers]]\nstart_at = 5\n[[events]]\nat = 1\naction = 'start'\npeer = 1",
        r"peers\[1\]\.start_at and a start event both",
    ),
    (
        TEN + "[[peers]]\n[[peers]]\nstart_at = 5\n[[events]]\nat = 1\naction = 'cut'\npeer = 1",
        r"events\[0\] cut of peer 1 at 1 s, before it started",
    ),
    (
        TEN
        + "emulation = 'netns'\n[defaults]\ncount = 2\n"
        + "[[events]]\nat = 1\naction = 'partition'\npeer = 1\nseconds = 1",
        r"events\[0\]\.action 'partition' needs",
    ),
    (TWO + "[churn]\nrestart_after = 1", "churn.every is required"),
    (TWO + "[churn]\nevery = 0", "churn.every must be positive"),
    (TWO + "[churn]\nevery = 2\nkill = 1", "unknown key churn.kill"),
    (TWO + "[churn]\nevery = 2\npeers = [5]", "churn.peers 5 is not a peer index"),
    (TWO + "[churn]\nevery = 2\npeers = []", "churn.peers must be a non-empty"),
    (TWO + "[churn]\nevery = 2\nrestart_after = 3\npeers = [1]", "churn.restart_after must be shorter"),
    (TWO + "[churn]\nevery = 2\nstart = 12", r"churn.start must be in \[0"),
    (TWO + "[checks]\nidentical = 1", "checks.identical must be true or false"),
    (TWO + "[checks]\nutilization_min = 1.5", r"checks.utilization_min must be in \(0, 1\]"),
    (TWO + "[checks]\nutilization_modes = ['fast']", "checks.utilization_modes must be a list of"),
    (TWO + "[checks]\nrss_growth_max = -0.1", "checks.rss_growth_max must be finite and >= 0"),
    (TWO + "[checks]\nmin_steps = 'ten'", "checks.min_steps must be an integer"),
    (TWO + "[checks]\nsmooth = true", "unknown key checks.smooth"),
    (TWO + "[run_overrides]\ntraining = 1", "run_overrides.training must be a table"),
    (
        TWO + "[run_overrides.training]\nbatch = 1",
        r"run_overrides\.training\.batch is not a key of \[training\]",
    ),
    (TWO + "[run_overrides.gpu]\nx = 1", "run_overrides.gpu is not a run-file section"),
    (
        TEN + "[[peers]]\n[[peers]]\nadversary = 'evil'",
        r"peers\[1\]\.adversary must be one of nan, scale, random, inflate, garbage-reducer, sybil-epoch, "
        r"false-accusation, manifest-downgrade, silent-leader, partial-leader, trusted-liar, flaky-reducer, "
        r"mixed, sybil-majority, fake-progress, dht-flood, conn-flood, group-capture, trust-farm, "
        r"not 'evil'",
    ),
    (TEN + "[[peers]]\n[[peers]]\nadversary = 3", r"peers\[1\]\.adversary must be one of .*, not 3"),
    (TEN + "[[peers]]\n[[peers]]\nadversary = ''", r"peers\[1\]\.adversary must be one of"),
    (TWO + "adversary = 'nan'", "defaults.adversary is for \\[\\[peers\\]\\] entries only"),
    (
        TEN + "[[peers]]\ncount = 2\nadversary = 'scale'",
        "peers are all adversaries: at least one must be honest",
    ),
    (TWO + "[checks]\noffenders_named = 'yes'", "checks.offenders_named must be true or false"),
]


@pytest.mark.parametrize(("text", "message"), ERRORS, ids=[m for _, m in ERRORS])
def test_mistakes_are_refused_with_the_key_named(text: str, message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        parse(text)


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="cannot read scenario"):
        load_scenario(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[scenario\n")
    with pytest.raises(ScenarioError, match=r"bad.toml is not valid TOML"):
        load_scenario(bad)
    norun = tmp_path / "norun.toml"
    norun.write_text(MINIMAL.replace("duration = 100", "duration = 100\nrun = 'configs/none.toml'"))
    with pytest.raises(ScenarioError, match=r"norun.toml: scenario.run: cannot read"):
        load_scenario(norun)
    clash = tmp_path / "clash.toml"
    clash.write_text(MINIMAL + "[run_overrides.progress]\ninterval = 20.0\n")
    with pytest.raises(ScenarioError, match=r"progress\.ttl must be longer than progress\.interval"):
        load_scenario(clash)


# ---- the report's analysis -------------------------------------------------------------------------


def line(peer: int, t: float, step: int, digest: str, outcome: str = "averaged") -> dict[str, Any]:
    return {"peer": peer, "t": t, "step": step, "digest": digest, "outcome": outcome}


def test_equal_digests_on_every_step_are_identical() -> None:
    lines = [line(p, s + 0.1 * p, s, f"d{s}") for s in (1, 2, 3) for p in (0, 1, 2)]
    d = divergence(lines)
    assert d["verdict"] == "identical" and d["ok"] and d["steps_compared"] == 3


def test_a_fork_thrown_away_by_a_state_download_is_repaired_and_any_other_is_a_divergence() -> None:
    base = [line(p, s, s, f"d{s}") for s in (1, 2, 3) for p in (0, 1)]
    joiner = [line(2, 1.5, 1, "alone", "alone"), line(2, 3.5, 3, "d3", "synced")]
    d = divergence(base + joiner)
    assert d["verdict"] == "repaired forks only" and d["ok"]
    assert [(x["peer"], x["step"], x["repaired_by"]) for x in d["repaired_forks"]] == [
        (2, 1, "a later state download")
    ]
    rogue = [line(2, 2.5, 2, "other"), line(2, 3.5, 3, "other3")]
    d = divergence(base + rogue)
    assert not d["ok"] and d["verdict"] == "diverged"
    assert [(x["peer"], x["step"]) for x in d["divergences"]] == [(2, 2)]  # its last line died with it
    assert [(x["peer"], x["step"]) for x in d["repaired_forks"]] == [(2, 3)]


def test_recoveries_time_the_next_global_step_after_each_failure() -> None:
    lines = [line(0, t, s, "x") for t, s in ((10, 1), (14, 2), (40, 3), (44, 4))]
    timeline = [
        {"t": 12.0, "action": "kill", "peer": 1},
        {"t": 15.0, "action": "cut", "peer": 1},
        {"t": 20.0, "action": "restart", "peer": 1},
        {"t": 50.0, "action": "kill", "peer": 2},
        {"t": 59.0, "action": "kill", "peer": 3, "skipped": "the peer is not running"},
    ]
    got = recoveries(lines, timeline, window=20.0, end=60.0)
    assert [(r["t"], r["step"], r["next_step_s"], r["verdict"]) for r in got] == [
        (12.0, 1, 2.0, "ok"),
        (15.0, 2, 25.0, "late"),
        (50.0, 4, None, "inconclusive"),
    ]


def test_catch_ups_time_a_restarted_peer_to_the_swarms_step() -> None:
    lines = [line(0, t, s, "x") for t, s in ((10, 5), (20, 6), (30, 7))]
    lines += [line(1, 25, 6, "x", "synced"), line(1, 31, 7, "x")]
    timeline = [{"t": 15.0, "action": "restart", "peer": 1}, {"t": 35.0, "action": "start", "peer": 2}]
    got = catch_ups(sorted(lines, key=lambda x: x["t"]), timeline, window=60.0, end=50.0)
    assert got[0] | {} == {
        "t": 15.0,
        "action": "restart",
        "peer": 1,
        "swarm_step": 5,
        "caught_up_s": 10.0,
        "caught_up_step": 6,
        "first_sync_s": 10.0,
        "first_averaged_s": 16.0,
        "verdict": "ok",
    }
    assert got[1]["verdict"] == "inconclusive" and got[1]["caught_up_s"] is None


def test_memory_growth_is_judged_only_for_processes_that_ran_long_to_the_end() -> None:
    def series(pid: int, start: float, stop: float, mb: float, slope: float) -> list[dict[str, Any]]:
        return [{"t": float(t), "pid": pid, "rss_mb": mb + slope * t} for t in range(int(start), int(stop))]

    peers = [
        {
            "index": 0,
            "incarnations": [
                {"number": 1, "pid": 10, "started": 0.0, "ended": 100.0, "end": "stopped at the end"}
            ],
            "series": series(10, 0, 100, 100.0, 0.5),
        },
        {
            "index": 1,
            "incarnations": [
                {"number": 1, "pid": 11, "started": 0.0, "ended": 30.0, "end": "killed"},
                {"number": 2, "pid": 12, "started": 40.0, "ended": 100.0, "end": "stopped at the end"},
            ],
            "series": series(11, 0, 30, 100.0, 0.0) + series(12, 40, 100, 100.0, 0.0),
        },
    ]
    got = rss_growth(peers, warmup=40.0, end=100.0)  # judged: lived 80+ s to the end
    assert [(r["peer"], r["process"], r["judged"]) for r in got] == [
        (0, 1, True),
        (1, 1, False),
        (1, 2, False),
    ]
    assert got[0]["rss_warm_mb"] == 120.0 and got[0]["rss_end_mb"] == 149.5 and got[0]["growth"] == 0.2458


def test_checks_report_pass_fail_and_reported_only() -> None:
    s = parse(MINIMAL + "[checks]\nutilization_min = 0.9\nutilization_modes = ['diloco']\nmin_steps = 5\n")
    summary = {
        "divergence": divergence([]),
        "utilization": [{"peer": 0, "utilization": 0.5, "judged": True}],
        "last_step": 7,
        "problems": ["peer 1 exited by itself with status 1"],
    }
    got = {c["check"]: c["passed"] for c in evaluate_checks(s, summary, "sync")}
    assert got == {
        "identical parameters": False,  # nothing was compared
        "compute utilization (reported: sync mode)": None,
        "global steps": True,
        "no crashes": False,
    }
    assert Checks().identical and not Checks().continues


# ---- hostile peers ---------------------------------------------------------------------------------

HOSTILE = """
[scenario]
duration = 100
emulation = "none"
[run_overrides.eval]
every_steps = 5
[defaults]
count = 4
[[peers]]
count = 3
[[peers]]
adversary = "inflate"
[checks]
identical = true
loss_decreases = true
offenders_named = true
"""


def test_an_adversary_that_brings_itself_down_is_no_crash_of_the_swarm() -> None:
    """The NaN sender's own loss diverges and it exits: that failed the hostile run's "no crashes"
    check, which is about the honest peers."""
    s = parse(HOSTILE)
    loss = {"finite": True, "first": 3.0, "last": 2.0, "largest_rise": 0.0, "kind": "validation"}
    summary = {"divergence": divergence([]), "last_step": 7, "problems": [], "loss": loss, "offenders": []}

    def crashes(problems: list[str]) -> bool | None:
        checks = {
            c["check"]: c["passed"] for c in evaluate_checks(s, summary | {"problems": problems}, "sync")
        }
        return checks["no crashes (honest peers)"]

    assert crashes(["peer 3 exited by itself with status 1 at 20 s; see its node.log"]) is True
    assert crashes(["peer 1 exited by itself with status 1 at 20 s; see its node.log"]) is False
    assert crashes(["peer 0 did not stop within 20 s of SIGTERM"]) is False


def short(i: int) -> str:
    return PeerID(bytes([i + 1]) * 32).short()


def test_the_runner_starts_and_restarts_a_hostile_peer_with_its_attack(tmp_path: Path) -> None:
    s = parse(HOSTILE)
    runner = Runner(s, RunOptions(out=tmp_path))
    runner.backend = Backend(s)
    peers = [PeerProc(spec, tmp_path / f"peer-{spec.index}") for spec in s.peers]
    for resume in (False, True):  # the first start and every restart
        argv = runner.argv(peers[3], join="127.0.0.1:1", resume=resume, wait=4)
        assert argv[argv.index("--adversary") + 1] == "inflate" and ("--resume" in argv) == resume
    assert "--adversary" not in runner.argv(peers[0], join=None, resume=False, wait=4)


@pytest.mark.timeout(30)
def test_the_runner_scans_every_peers_log_for_the_others_ids(tmp_path: Path) -> None:
    s = parse(HOSTILE)
    runner = Runner(s, RunOptions(out=tmp_path))
    for spec in s.peers:
        folder = tmp_path / f"peer-{spec.index}"
        folder.mkdir()
        peer = PeerProc(spec, folder, status={"peer_id": PeerID(bytes([spec.index + 1]) * 32).to_string()})
        runner.peers.append(peer)
    banned = f"10:00:02 ERROR   p2ptrain.averaging.auditor: banned {short(3)}: reducer of partition 1"
    (tmp_path / "peer-0" / "node.log").write_text(
        f"10:00:01 INFO    p2ptrain.node: peer {short(3)} connected (we dialed)\n{banned}\n"
        f"10:00:03 INFO    p2ptrain.node: node {short(0)} is up\n"  # its own id: not another peer
    )
    peers = runner.collect()["peers"]
    assert peers[0]["log"] == {
        "3": {
            "peer_id": short(3),
            "mentions": 2,
            "accusations": 1,
            "examples": [banned],
        }
    }
    assert not any("log" in p for p in peers[1:])  # no log to scan: "not scanned", never "not accused"
    assert peers[3]["spec"]["adversary"] == "inflate"


ACCUSING = [  # (a node.log line about peer 3, does it accuse it?)
    ("INFO    p2ptrain.averaging.allreduce: slice of partition 2 from {x} failed: a slice holds NaN", True),
    ("WARNING p2ptrain.averaging.allreduce: round ab12: {x} claimed weight 6400, {cap} 80", True),
    ("WARNING p2ptrain.averaging.allreduce: round ab12: {x} claimed weight 480, {cap} 455.398", False),
    ("ERROR   p2ptrain.averaging.auditor: banned {x}: reducer of partition 1 in round ab12cd34: ...", True),
    ("WARNING p2ptrain.training.collaborative: adopted the swarm's ban of {x}", True),
    ("INFO    p2ptrain.averaging.allreduce: report from {x} ignored: inconsistent weights", True),
    ("WARNING p2ptrain.net.connection: closing connection to {x}: protocol violation: bad frame", True),
    ("WARNING p2ptrain.net.host: peer {x} makes more than 60000 calls a minute: refusing some", True),
    ("INFO    p2ptrain.dht.service: refused 12 record(s) from {x}: bad signature", True),
    ("WARNING p2ptrain.training.collaborative: step 4: left out {x}: its slices were outliers", True),
    ("INFO    p2ptrain.training.collaborative: step 4: {x}'s slices were outliers", False),  # not loud
    ("INFO    p2ptrain.node: peer {x} connected (we dialed)", False),
    ("INFO    p2ptrain.training.statesync: serving step 3's state (0.1 MB) to {x}", False),
    ("WARNING p2ptrain.training.statesync: state download from {x} failed: timed out", False),
    ("WARNING p2ptrain.averaging.averager: {x} has a low bandwidth estimate", False),
    ("ERROR   p2ptrain.averaging.auditor: banned {y}: reducer of partition 1", False),  # another peer
    (
        "WARNING p2ptrain.averaging.averager: leader {x} (subnet 10.0.0.0/24) failed us (no manifest"
        " within 5.5 s, past its deadline): not followed for 1800 s",
        True,
    ),
    ("INFO    p2ptrain.averaging.averager: leader {x} failed us (a group too small): suspected", False),
]


@pytest.mark.parametrize(("text", "accused"), ACCUSING, ids=[t[:60] for t, _ in ACCUSING])
def test_which_log_lines_accuse_a_peer(text: str, accused: bool) -> None:
    cap = "more than its records make plausible: counted as"  # honest peers are capped a little too
    line = "2025-01-01 10:00:00,000 " + text.format(x=short(3), y=short(2), cap=cap)
    assert accuses(line, short(3)) is accused
    got = scan_log([line], {short(3): 3, short(2): 2})
    if short(3) in line:
        assert got["3"]["mentions"] == 1 and got["3"]["accusations"] == int(accused)
        assert got["3"]["examples"] == ([line] if accused else [])
    else:
        assert "3" not in got


def hostile_run(accusing: bool) -> dict[str, Any]:
    """A made-up run of HOSTILE: peers 0-2 agree and learn; peer 3 (the adversary) diverges, its loss NaN."""
    s = parse(HOSTILE)
    peers = []
    for i in range(4):
        bad = i == 3
        metrics = [
            {
                "t": 10.0 + 5 * step,
                "time": 10.0 + 5 * step,
                "step": step,
                "digest": f"{'x' if bad else 'd'}{step}",
                "loss": 3.0 - 0.1 * step,
                "val_loss": math.nan if bad else 3.0 - 0.1 * step,
                "rounds": {
                    "last": {"outcome": "averaged", "excluded": {short(3): "too slow"} if step == 2 else {}}
                },
            }
            for step in range(1, 16)
        ]
        lines = [f"INFO    p2ptrain.node: peer {short(3)} connected (we dialed)"]
        cap = "claimed weight 900, more than its records make plausible: counted as 9"
        if accusing and i == 0:
            lines.append(f"WARNING p2ptrain.averaging.allreduce: round 01: {short(3)} {cap}")
        if i == 1:  # a false accusation of honest peer 2
            lines.append(f"ERROR   p2ptrain.averaging.auditor: banned {short(2)}: 3 rounds in a row failed")
        peers.append(
            {
                "index": i,
                "name": f"peer-{i}",
                "spec": {"slowdown": 1.0, "up_mbit": None, "down_mbit": None, "latency_ms": 0.0}
                | {"adversary": "inflate" if bad else None},
                "peer_id": PeerID(bytes([i + 1]) * 32).to_string(),
                "incarnations": [
                    {"number": 1, "pid": 10 + i, "started": 0.0, "ended": 100.0, "end": "stopped at the end"}
                ],
                "series": [],
                "metrics": metrics,
                "final_status": {"training": {"banned": {short(3): "reducer"} if i == 1 else {}}},
                "log": {} if bad else scan_log(lines, {short(k): k for k in range(4) if k != i}),
            }
        )
    return {
        "scenario": s,
        "peers": peers,
        "timeline": [],
        "run_config": {"eval": {"every_steps": 5}, "training": {"mode": "sync"}},
        "emulation": {"emulation": "none"},
        "seconds": 100.0,
        "interrupted": False,
        "problems": [],
    }


def test_parameters_and_loss_are_judged_over_honest_peers_and_every_offender_must_be_accused() -> None:
    summary = analyse(hostile_run(accusing=True))
    checks = {c["check"]: c for c in summary["checks"]}
    assert checks["identical parameters (honest peers)"]["passed"] is True  # peer 3 holds other ones
    assert checks["loss curve intact (honest peers)"]["passed"] is True  # peer 3's loss is NaN
    named = checks["offenders named"]
    assert named["passed"] is True
    accused = f"peer 3 (inflate, {short(3)}): accused by peer(s) 0 in 1 line(s)"
    assert named["measured"] == accused + "; honest peers accused: 2"
    (wrong,) = summary["false_accusations"]
    assert (wrong["peer"], wrong["accused_by"], wrong["accusing_lines"]) == (2, [1], 1)
    (o,) = summary["offenders"]
    assert (o["named_by"], o["mentioned_by"], o["banned_by"]) == ([0], [0, 1, 2], [1])
    assert o["excluded_rounds"] == 3 and o["accusing_lines"] == 1 and o["examples"][0].startswith("peer 0: ")
    h = summary["honest"]
    assert h["peers"] == [0, 1, 2] and h["adversaries"] == {"3": "inflate"} and h["kept_training"] is True
    assert h["final_step"] == 15 and h["val_points"] == [[5, 2.5], [10, 2.0], [15, 1.5]]
    assert [p["adversary"] for p in summary["per_peer"]] == [None, None, None, "inflate"]

    quiet = {c["check"]: c for c in analyse(hostile_run(accusing=False))["checks"]}["offenders named"]
    assert quiet["passed"] is False
    assert (
        "NOT accused (named without blame by 3 honest peer(s); left out of 3 honest round"
        in quiet["measured"]
    )
    assert "banned by peer(s) 1" in quiet["measured"]


def test_offenders_named_is_reported_only_when_nobody_attacks_and_honest_peers_must_keep_training() -> None:
    data = hostile_run(accusing=True)
    data["scenario"] = data["scenario"].with_changes(adversaries=[None] * 4)
    checks = {c["check"]: c["passed"] for c in analyse(data)["checks"]}
    assert checks["offenders named (no adversary in this run)"] is None
    assert checks["identical parameters"] is False  # peer 3 is judged now, and it diverged

    data = hostile_run(accusing=True)
    stalled = [m for m in data["peers"][1]["metrics"] if m["step"] <= 10]  # its last step at 60 s
    data["peers"][1]["metrics"] = stalled
    data["peers"][2]["incarnations"][0]["end"] = "exited 1"
    h = analyse(data)["honest"]
    assert [(r["peer"], r["kept"]) for r in h["per_peer"]] == [(0, True), (1, False), (2, False)]
    assert h["window_s"] == 30.0 and h["kept_training"] is False and h["final_step"] == 10


def test_a_report_read_back_keeps_the_attacks_the_run_had(tmp_path: Path) -> None:
    (tmp_path / "s.toml").write_text(HOSTILE)
    changes = {
        "duration": 50.0,
        "mode": None,
        "emulation": "none",
        "adversaries": ["scale", None, None, None],
    }
    meta = {
        "scenario_source": str(tmp_path / "s.toml"),
        "scenario_toml": HOSTILE,
        "scenario_changes": changes,
    }
    (tmp_path / "run.json").write_text(json.dumps(meta))
    assert load_run(tmp_path)["scenario"].adversaries == {0: "scale"}


def test_digests_listed_after_their_step_are_compared_too() -> None:
    """A large state is hashed in a thread after its step's metrics line was written (its "digest" is
    ""): the later lines' ``digests`` still say it, so peers are compared on every step, not only on
    the few whose line had it (a fork on step 2 was invisible before)."""

    def line(t: float, step: int, digest: str = "", **digests: str) -> dict[str, object]:
        return {"t": t, "step": step, "digest": digest, "digests": {k[1:]: v for k, v in digests.items()}}

    peers = [
        {"index": 0, "metrics": [line(1, 1), line(2, 2, s1="a1"), line(3, 3, s1="a1", s2="a2")]},
        {"index": 1, "metrics": [line(1, 1), line(2, 2, s1="a1"), line(3, 3, "x3", s1="a1", s2="b2")]},
    ]
    peers[1]["metrics"].append(line(4, 4, "x4"))  # (it went on: the fork was not repaired)
    verdict = divergence(digest_lines(peers))
    assert verdict["steps_compared"] == 2 and not verdict["ok"]
    assert [(d["step"], d["peer"]) for d in verdict["divergences"]] == [(2, 1)]
    assert len(digest_lines(peers)) == 6  # each (step, digest) of a peer once, at its first line


def test_the_hosts_emulation_gives_each_peer_its_own_loopback_address() -> None:
    """Per-address and per-subnet limits (connections, DHT storage, group origins) tell peers apart by
    address: on plain loopback every peer is 127.0.0.1, one host. ``hosts`` gives peer i 127.0.0.(10+i)
    to listen on and dial from, with no switch in between."""
    from simulations.replay.runner import HostsBackend, make_backend

    s = parse(MINIMAL).with_changes(emulation="hosts")
    backend = make_backend(s)
    assert isinstance(backend, HostsBackend)
    assert backend.node_args(0) == ["--listen", "127.0.0.10:0", "--source-address", "127.0.0.10"]
    assert backend.node_args(3)[1] == "127.0.0.13:0"
    assert backend.started(3, {"listening": ["/ip4/127.0.0.13/tcp/4000"]}) == "/ip4/127.0.0.13/tcp/4000"
