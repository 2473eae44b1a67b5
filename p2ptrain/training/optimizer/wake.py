"""A wake-up call for the progress loop: this peer's record changed (a step, a digest, a round handed its
samples over, leaving), so it goes out now rather than at the next heartbeat.

The parts that change what the record says are handed the one :class:`Wake` at construction and
:meth:`Wake.set` it; the progress board waits for it between reads and renews it after each record.
"""

from __future__ import annotations

import trio


class Wake:
    """A renewable ``trio.Event``."""

    def __init__(self) -> None:
        self.event = trio.Event()

    def set(self) -> None:
        self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()

    def renew(self) -> None:
        """Start waiting for the next call (a set one is replaced)."""
        self.event = trio.Event()

    async def wait(self) -> None:
        await self.event.wait()
