"""Worker threads on the virtual clock.

trio's autojump clock jumps to the next timer as soon as no task can run, and a task waiting for a
worker thread cannot run: so while a thread hashes a snapshot for a few real milliseconds, virtual time
may leap past every deadline in the swarm, and how far depends on how busy the machine is.
:func:`threads_take_no_virtual_time` makes the test deterministic again: while any thread runs, the
clock does not jump (its autojump threshold is infinite), so it stands still until the threads are done
(their work takes no virtual time, as a test's ``compute`` sleeps stand for the real cost)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing

_THREADS = trio.to_thread.run_sync  # trio's own, before any test replaced it


def _standing_still(real: Callable[..., Any]) -> Callable[..., Any]:
    """``real`` (trio's ``to_thread.run_sync``), with an autojump clock standing still while it runs."""
    running = 0

    async def run_sync(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        nonlocal running
        clock = trio.lowlevel.current_clock()
        if not isinstance(clock, trio.testing.MockClock):
            return await real(fn, *args, **kwargs)
        running += 1
        clock.autojump_threshold = math.inf
        try:
            return await real(fn, *args, **kwargs)
        finally:
            running -= 1
            if not running:
                clock.autojump_threshold = 0

    return run_sync


def threads_take_no_virtual_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Patch ``trio.to_thread.run_sync`` (for the rest of the test) so that an autojump clock stands
    still while a worker thread runs. A test that replaced it already (one that runs the "thread's"
    work in the event loop, taking virtual time of its own) keeps its own."""
    real = trio.to_thread.run_sync
    if real is not _THREADS:
        return
    monkeypatch.setattr(trio.to_thread, "run_sync", _standing_still(real))


def process_clock() -> trio.testing.MockClock:
    """An autojump clock for a process of the test's own (a spawned rank, where no fixture reaches):
    there, worker threads take no virtual time for the rest of the process, as with
    :func:`threads_take_no_virtual_time`. Only for code whose threads never wait for the event loop's
    timers (the clock stands still while they run)."""
    if trio.to_thread.run_sync is _THREADS:
        trio.to_thread.run_sync = _standing_still(_THREADS)  # type: ignore[assignment]
    return trio.testing.MockClock(autojump_threshold=0)
