"""The trio events one round's tasks wait on, in one place (the round's driver owns them).

Theory of operation: the round's state lives in its pure machine (``round_machine``) and its tensors
(``round_tensors``); the tasks around them (senders, the reducer's handlers, fetches) re-check a
condition whenever something may have changed. ``changed`` wakes them (level-triggered: a waiter that
misses a firing re-checks on the next one or at its deadline); ``published`` wakes the early-result
streams when a reducer publishes chunks, decides, or retires; the events mark steps that happen once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio


class Signal:
    """A level-triggered 'something changed' for tasks that re-check a condition."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait_until(self, deadline: float) -> None:
        with trio.move_on_at(deadline):
            await self._event.wait()


@dataclass
class RoundSignals:
    changed: Signal = field(default_factory=Signal)
    published: Signal = field(
        default_factory=Signal
    )  # a reducer here published early chunks, decided, or retired
    decided: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)  # no one needs this round any more
    retired: trio.Event = field(default_factory=trio.Event)  # the averager stopped serving it
    _finalized: dict[int, trio.Event] = field(default_factory=dict)

    def finalized(self, p: int) -> trio.Event:
        """Set once the partition ``p`` reduced here holds its result."""
        return self._finalized.setdefault(p, trio.Event())

    def wake(self) -> None:
        self.changed.fire()
        self.published.fire()
