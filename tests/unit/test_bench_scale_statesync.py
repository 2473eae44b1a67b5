"""The scale and state-sync benchmarks' pure helpers: sizes, the RSS multiple, /proc parsing, log lines."""

from __future__ import annotations

import json

import pytest

from p2ptrain.tasks.gpt import GPTConfig
from simulations.benchmarks.scale import (
    BLOCK_SIZE,
    SIZES,
    downsample,
    link_bound_s,
    mem_available,
    parameter_count,
    parse_proc_status,
    parse_size,
    phase_peaks,
    round_summary,
    rss_multiple,
)
from simulations.benchmarks.statesync import (
    attempts,
    download_figures,
    failure_reason,
    first_contribution,
    host_port,
    on_step_x,
    parse_events,
    replay_bound,
    round_samples,
)


def test_named_sizes_have_the_parameter_counts_their_names_say():
    sizes = {"124m": (120e6, 128e6), "350m": (300e6, 356e6), "86m": (85e6, 87e6), "10m": (9e6, 12e6)}
    for name, (lo, hi) in sizes.items():
        assert lo <= parameter_count(SIZES[name]) <= hi, name


def test_parameter_count_matches_the_model_config_without_building_it():
    for shape in [*SIZES.values(), (2, 4, 64)]:
        layers, heads, width = shape
        config = GPTConfig(n_layer=layers, n_head=heads, n_embd=width, block_size=BLOCK_SIZE)
        assert parameter_count(shape) == config.num_parameters()


def test_parse_size_takes_a_name_or_an_explicit_shape():
    assert parse_size("124M") == ("124m", SIZES["124m"])
    assert parse_size("12x12x768") == ("12x12x768", (12, 12, 768))
    with pytest.raises(ValueError, match="one of"):
        parse_size("big")
    with pytest.raises(ValueError, match="divisible"):
        parse_size("2x5x64")


def test_rss_multiple_subtracts_the_footprint_and_divides_by_fp32_bytes():
    params = 100_000_000  # 400 MB in fp32
    assert rss_multiple(2_400_000_000 + 300_000_000, 300_000_000, params) == pytest.approx(6.0)
    assert rss_multiple(300_000_000, 300_000_000, params) == 0.0
    with pytest.raises(ValueError):
        rss_multiple(1, 0, 0)


def test_proc_status_fields_come_back_in_bytes():
    text = "Name:\tpython\nVmPeak:\t 1000 kB\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\nThreads:\t4\n"
    got = parse_proc_status(text)
    assert got["VmHWM"] == 2048 * 1024 and got["VmRSS"] == 1024 * 1024
    assert "Threads" not in got and "Name" not in got


def test_link_bound_is_the_butterfly_bound():
    # 2 peers, 100M fp16 values over 100 Mbit/s: each sends and receives 2 (N-1)/N = 1 vector of 200 MB
    assert link_bound_s(100_000_000, 2, 100.0, 2) == pytest.approx(16.0)
    assert link_bound_s(100_000_000, 4, 100.0, 4) == pytest.approx(1.5 * 32.0)
    with pytest.raises(ValueError):
        link_bound_s(1, 1, 100.0, 4)


def test_downsample_keeps_the_peak_and_bounds_the_length():
    series = [(float(i), i % 97) for i in range(1000)]
    series[503] = (503.0, 10_000)
    got = downsample(series, 50)
    assert len(got) <= 52
    assert (503.0, 10_000) in got
    assert downsample(series[:10], 50) == series[:10]


def test_round_summary_reads_outcome_seconds_and_bytes_per_step():
    lines = [
        {
            "step": 1,
            "bytes_sent": 1_000_000,
            "rounds": {"last": {"outcome": "averaged", "seconds": 2.5, "group": 2}},
        },
        {"step": 2, "bytes_sent": 501_000_000, "rounds": {"last": {"outcome": "alone"}}},
    ]
    got = round_summary(lines)
    assert got[0] == {"step": 1, "outcome": "averaged", "seconds": 2.5, "group": 2, "sent_mb": None}
    assert got[1]["sent_mb"] == 500.0 and got[1]["outcome"] == "alone"


def test_phase_peaks_attribute_the_largest_sample_to_a_phase_of_the_node_life():
    series = [(1.0, 100), (5.0, 300), (9.0, 200), (12.0, 900), (14.0, 400), (15.0, 950)]
    got = phase_peaks(series, [6.0, 10.0], 13.0)
    assert [(p["phase"], p["rss_max_bytes"]) for p in got] == [
        ("to step 1", 300),
        ("to step 2", 200),
        ("to the stopped line", 900),  # the final checkpoint comes before that line
        ("to the exit", 950),
    ]
    assert got[-1]["until_s"] is None
    assert [p["phase"] for p in phase_peaks(series[:2], [], None)] == ["to the exit"]


def test_mem_available_reads_meminfo():
    assert mem_available("MemTotal:  100 kB\nMemAvailable:   50 kB\n") == 50 * 1024
    assert mem_available("MemTotal:  100 kB\n") is None


# ---- state sync ----------------------------------------------------------------------------------------


def log(t: float, message: str, level: str = "info") -> str:
    return json.dumps({"time": t, "level": level, "logger": "p2ptrain.training", "message": message})


JOINER_LOG = [
    log(100.0, "node Abc..def is up in run 'x'; others join with --join and the address above"),
    "Traceback (most recent call last):",  # not JSON: skipped
    log(101.0, "catching up: 2 peer(s) are on step 1, this one on step 0"),
    log(102.0, "state download from AAA..111 failed: timed out", "warning"),
    log(110.0, "downloading the swarm's state: 25% of 1500.0 MB"),
    log(140.0, "downloading the swarm's state: 100% of 1500.0 MB"),
    log(142.0, "downloaded step 1's state (1500.0 MB) from BBB..222"),
    log(142.5, "now on step 1 (state from BBB..222)"),
    log(150.0, "catching up: diverged"),
    log(180.0, "could not catch up (no peer delivered a valid state (CCC..333: timed out)); retrying in 2 s"),
]


def test_parse_events_reads_json_lines_and_skips_the_rest():
    events = parse_events(JOINER_LOG)
    kinds = "up catching_up failed progress progress downloaded applied catching_up could_not"
    assert [e.kind for e in events] == kinds.split()
    assert events[2].groups == ("AAA..111", "timed out")
    assert events[5].groups == ("1", "1500.0", "BBB..222")


def test_attempts_time_the_transfer_from_the_last_failed_donor():
    got = attempts(parse_events(JOINER_LOG))
    assert len(got) == 2
    ok, bad = got
    assert ok["outcome"] == "downloaded" and ok["start"] == 101.0 and ok["transfer_start"] == 102.0
    assert ok["bytes"] == 1_500_000_000 and ok["end"] == 142.0 and ok["t25"] == 110.0
    assert ok["t100"] == 140.0
    assert ok["failures"] == ["AAA..111: timed out"] and ok["donor"] == "BBB..222"
    assert bad["outcome"] == "failed" and "no peer delivered" in bad["reason"]


def test_the_replay_bound_is_the_least_time_a_download_and_replays_can_take():
    """A 400 MB state on 50 Mbit/s (64 s), results of 100 MB a step (16 s) and a swarm that steps every
    32 s: the joiner must receive the state and half a step's worth more for every second it spends,
    so it can be on the swarm's step no sooner than 1 / (1 - 16/32) = 2 downloads."""
    events = parse_events(
        [
            log(1000.0, "catching up: 2 peer(s) are on step 3, this one on step 0"),
            log(1064.0, "downloaded step 3's state (400.0 MB) from BBB..222"),
            log(1064.5, "now on step 3 (state from BBB..222)"),
            log(1100.0, "now on step 5: replayed 2 step(s) from step 3 (200.0 MB from 2 peer(s) in 33.0 s)"),
        ]
    )
    swarm = [(990.0 + 32.0 * k, 3 + k) for k in range(5)] + [(990.5, 3), (900.0, 0)]  # (two donors' lines)
    got = replay_bound(events, swarm, 50.0, 400_000_000)
    assert got["result_mb_per_step"] == 100.0 and got["result_s_at_link"] == 16.0
    assert got["swarm_step_s"] == 32.0 and got["download_s_at_link"] == 64.0
    assert got["bound_x"] == 2.0
    slow = replay_bound(events, [(990.0 + 10.0 * k, 3 + k) for k in range(12)], 50.0, 400_000_000)
    assert slow["bound_x"] == float("inf")  # (a step's result takes longer than the swarm's step)
    assert replay_bound(events[:3], swarm, 50.0, 400_000_000) == {}  # (no replay: nothing to bound by)


def test_download_figures_give_the_rate_as_a_fraction_of_the_link():
    ok = attempts(parse_events(JOINER_LOG))[0]
    got = download_figures(ok, 400.0)
    assert got["seconds"] == 40.0
    assert got["rate_mbit"] == 300.0  # 1.5 GB in 40 s
    assert got["fraction_of_link"] == 0.75
    assert got["from_catching_up_s"] == 41.0
    assert got["body_rate_mbit"] == pytest.approx(0.75 * 1500 * 8 / 30)  # 25% to 100%: 30 s
    assert got["bytes_in_s"] == 38.0 and got["decode_and_check_s"] == 2.0


def test_multi_donor_messages_parse_too_and_a_resumed_download_is_timed_from_its_first_attempt():
    lines = [
        log(10.0, "catching up: behind: 3 peer(s) are on step 2, this one on 0"),
        log(40.0, "state download from AAA..111: no chunk for 30 s", "warning"),
        log(41.0, "could not catch up (1000 of 1480 chunks still missing; kept the rest); retrying in 2 s"),
        log(43.0, "catching up: behind: 3 peer(s) are on step 2, this one on 0"),
        log(60.0, "downloaded step 2's state (1480.0 MB) from 3 donor(s) in 17.0 s (87.1 MB/s): A 500.0 MB"),
    ]
    events = parse_events(lines)
    assert [e.kind for e in events] == ["catching_up", "failed", "could_not", "catching_up", "downloaded"]
    assert events[1].groups == ("AAA..111", "no chunk for 30 s")
    assert events[4].groups[:2] == ("2", "1480.0")
    tries = attempts(events)
    assert [a["outcome"] for a in tries] == ["failed", "downloaded"]
    got = download_figures(tries[1], 400.0, first_start=tries[0]["start"])
    assert got["seconds"] == 50.0 and got["timed_from"] == "the first failed attempt"
    assert download_figures(tries[1], 400.0)["seconds"] == 17.0
    assert tries[1]["donors_used"] == 3 and "donor" not in tries[1]


def test_failure_reason_quotes_the_last_failures():
    events = parse_events(JOINER_LOG)
    why = failure_reason(events)
    assert (
        why is not None
        and why.startswith("state download from AAA..111 failed")
        and "could not catch up" in why
    )
    assert failure_reason(parse_events(JOINER_LOG[:2])) is None


def step_line(step: int, outcome: str, mine: int, contributors: int) -> dict:
    last = {"outcome": outcome, "mine": mine, "contributors": contributors, "group": contributors}
    return {"time": 1000.0 + step, "step": step, "rounds": {"last": last}}


def test_first_contribution_needs_its_own_samples_and_another_contributor():
    lines = [
        step_line(1, "synced", 0, 0),
        step_line(2, "averaged", 0, 3),  # left out of the round
        step_line(3, "alone", 4, 1),
        {"event": "stopped", "rounds": {"last": {"outcome": "averaged", "mine": 4, "contributors": 3}}},
        step_line(4, "averaged", 4, 3),
    ]
    assert first_contribution(lines)["step"] == 4
    assert first_contribution(lines[:4]) is None


def test_round_samples_make_a_round_outlast_the_transfer():
    params = 123_000_000
    state = 3 * 4 * params
    one = round_samples(1, params, state, 100.0, 2)
    three = round_samples(3, params, state, 100.0, 2)
    assert three == 2 * one  # three donors share the same two cores as two would
    assert round_samples(1, 1_000, 12_000, 100.0, 2) >= 2  # a tiny model: at least a batch per donor


def test_host_port_reads_multiaddrs_and_plain_addresses():
    assert host_port("/ip4/127.0.0.10/tcp/37579/p2p/BLVRSJck1YRt") == ("127.0.0.10", 37579)
    assert host_port("127.0.0.11:4000") == ("127.0.0.11", 4000)
    assert host_port("/dns/example/tcp/x") is None
    assert host_port("nothing") is None


# ---- the suite's rows ----------------------------------------------------------------------------------


def test_suite_rows_give_a_lower_bound_for_a_run_killed_for_memory_and_a_miss_for_a_failed_join(tmp_path):
    from simulations.benchmarks.suite import scale_rows, statesync_rows

    ok = {"size": "124m", "mode": "sync", "peers": 2, "status": "ok", "max_multiple": 5.5, "target": 6.0}
    ok |= {"met": True, "round_seconds_median": 3.0, "outcomes": {"node0": {"averaged": 2}}, "command": "c1"}
    killed = {"size": "350m", "mode": "diloco", "peers": 2, "status": "aborted", "error": "nodes killed"}
    killed |= {"target": 7.0, "met": None, "nodes": [{"multiple": 8.5}, {"multiple": 6.0}], "command": "c2"}
    skipped = {"size": "350m", "mode": "sync", "status": "skipped", "error": "needs 30 GiB", "command": "c3"}
    scale = {"results": [ok, killed, skipped]}
    failed = {"donors": 1, "size": "124m", "status": "failed", "reason": "cut at 30 s", "met": False}
    three = {"donors": 3, "size": "124m", "status": "ok", "rate_mbit": 100.0, "first_contribution_s": 200.0}
    three |= {"download": {"bytes": 1e9, "seconds": 90.0, "fraction_of_link": 0.89}, "met": None}
    sync = {"results": [failed, three]}
    (tmp_path / "scale.json").write_text(json.dumps(scale))
    (tmp_path / "statesync.json").write_text(json.dumps(sync))
    ok, killed, skipped = scale_rows(tmp_path)
    assert ok["met"] is True and ok["p2ptrain"] == "5.5 x" and ok["target"] == "<= 6x"
    assert killed["p2ptrain"] == ">= 8.50x" and killed["met"] is False  # already above the target
    assert skipped["met"] is None and "needs 30 GiB" in skipped["metric"]
    failed, three = statesync_rows(tmp_path)
    assert failed["p2ptrain"] == "failed" and failed["met"] is False and "cut at 30 s" in failed["metric"]
    assert three["p2ptrain"] == "89%" and three["target"] == "-"


def test_on_step_x_counts_from_the_first_catching_up_in_downloads_at_the_link_rate():
    """A 400 MB state on 50 Mbit/s is 64 s at the link rate; catching up began at 1000 s and the joiner
    first landed on the swarm's step at 1096 s: 1.5 downloads."""
    events = parse_events(
        [
            log(990.0, "node Abc..def is up in run 'x'; others join with --join and the address above"),
            log(1000.0, "catching up: 2 peer(s) are on step 3, this one on step 0"),
            log(1064.0, "downloaded step 3's state (400.0 MB) from BBB..222"),
        ]
    )
    assert on_step_x(events, 1096.0, 50.0, 400_000_000) == 1.5
    assert on_step_x(events[:1], 1096.0, 50.0, 400_000_000) is None  # (it never caught up)
