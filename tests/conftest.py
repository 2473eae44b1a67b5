"""Fixtures every layer of the suite shares."""

from __future__ import annotations

import os

import pytest
import trio.testing

from tests.harness.clock import threads_take_no_virtual_time


@pytest.fixture
def autojump_clock(monkeypatch: pytest.MonkeyPatch) -> trio.testing.MockClock:
    """pytest-trio's virtual clock that jumps to the next timer whenever every task waits, except while
    a worker thread runs (see ``tests.harness.clock``): otherwise how far virtual time leaps during a
    thread's real work, and so which deadlines fire, would depend on how busy the machine is."""
    threads_take_no_virtual_time(monkeypatch)
    return trio.testing.MockClock(autojump_threshold=0)


@pytest.fixture
def autojump_clock_through_threads() -> trio.testing.MockClock:
    """The plain autojump clock, which jumps while worker threads run: for a test whose thread waits on
    something only the test's own (sleeping) tasks do, which a clock standing still would never let
    happen."""
    return trio.testing.MockClock(autojump_threshold=0)


# Tests that start processes of their own run one after another within their group, on one worker,
# beside the in-process tests on the others (two of them side by side would share the cores their
# processes and timeouts were sized for): the tests that start real ``p2ptrain`` processes or build
# network-namespace labs (two groups of about equal time), and the sharded-site tests that spawn their
# rank processes. The seeded attacker mixes share their baselines (one honest swarm per mode) only
# within one worker, so they form a group too. The groups are the largest scopes, so xdist hands them
# out first.
GROUPS = {
    "processes-train": (
        "tests/e2e/test_training_cli.py",
        "tests/e2e/test_average.py",
        "tests/e2e/test_scenario_run.py",
        "tests/e2e/test_dataset_task.py",
    ),
    "processes-net": (
        "tests/e2e/",
        "tests/integration/test_nat_lab.py",
        "tests/integration/test_nat_reset.py",
        "tests/integration/test_netns_lab.py",
    ),
    "site-ranks": (
        "tests/integration/test_sharded_checkpoint.py",
        "tests/integration/test_sharded_failure.py",
        "tests/integration/test_sharded_outer.py",
        "tests/integration/test_sharded_statesync.py",
        "tests/integration/test_sharded_swarm.py",
        "tests/integration/test_site_bounded_waits.py",
        "tests/integration/test_site_launch.py",
        "tests/integration/test_site_hash_spread.py",
        "tests/integration/test_site_hash_turns.py",
        "tests/integration/test_site_recovery.py",
        "tests/integration/test_site_replay.py",
        "tests/integration/test_site_statesync.py",
        "tests/integration/test_site_swarm.py",
        "tests/integration/test_site_torchrun_restart.py",
    ),
    "attacker-mixes": ("tests/integration/test_adversarial_swarm.py",),
}


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (the default, in pyproject.toml): one worker more than the cores, at most four. The
    process groups spend much of their time waiting on real processes and clocks; the extra worker keeps
    the cores busy meanwhile with the in-process tests (on the virtual clock, which load does not move)."""
    return max(1, min((os.cpu_count() or 1) + 1, 4))


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Every test is a unit of work of its own, except each of ``GROUPS``, which is one unit. (Not
    ``--dist loadgroup`` with marks: pytest 9.2 ignores the node-id suffix that xdist 3.8 groups by.)"""
    from xdist.scheduler import LoadScopeScheduling

    class Scheduler(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return next((group for group, paths in GROUPS.items() if nodeid.startswith(paths)), nodeid)

    return Scheduler(config, log)
