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


# The tests that start real ``p2ptrain`` processes or build network-namespace labs: they run one after
# another on one worker, beside the in-process tests on the others (two of them side by side would
# share the cores their processes and timeouts were sized for).
ONE_AT_A_TIME = (
    "tests/e2e/",
    "tests/integration/test_nat_lab.py",
    "tests/integration/test_nat_reset.py",
    "tests/integration/test_netns_lab.py",
)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (the default, in pyproject.toml): one worker per core, at most four (the heavy tests
    start several processes of their own)."""
    return max(1, min(os.cpu_count() or 1, 4))


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Every test is a unit of work of its own, except ``ONE_AT_A_TIME``'s, which are one unit. (Not
    ``--dist loadgroup`` with marks: pytest 9.2 ignores the node-id suffix that xdist 3.8 groups by.)"""
    from xdist.scheduler import LoadScopeScheduling

    class Scheduler(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "one-at-a-time" if nodeid.startswith(ONE_AT_A_TIME) else nodeid

    return Scheduler(config, log)
