"""Fixtures every layer of the suite shares."""

from __future__ import annotations

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
