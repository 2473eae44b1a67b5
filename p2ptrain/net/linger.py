"""Refused connections, held open a while before they are closed (a tarpit).

A flood that re-opens each connection as soon as it is closed turns every refusal into another accept,
and the accepting side pays for each one (the kernel's handshake, a task, a close: about a quarter of a
millisecond of CPU on a small machine). Holding a refused connection open, unread, for ``hold`` seconds
costs a file descriptor and a sleeping task, no CPU, and slows such a flood by that much. The hold is
bounded: past ``capacity`` connections the oldest is closed at once. A dialer that reads the refusal
("busy", sent before the hold: every honest dialer reads it) closes its end and learns why at once.
"""

from __future__ import annotations

from collections import OrderedDict

import trio


def default_capacity() -> int:
    """How many refused connections to hold: a quarter of the file descriptors this process may open
    (see :func:`raise_fd_limit`), between 64 and 2,048."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 64
    if soft == resource.RLIM_INFINITY:
        return 2048
    return max(64, min(2048, soft // 4))


def raise_fd_limit(want: int = 16384) -> int:
    """Raise this process's soft limit on open files toward ``want`` (within the hard limit: no privilege
    needed), for a node's inbound slots and held connections; returns the limit now in force."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < want:
            target = want if hard == resource.RLIM_INFINITY else min(want, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        return int(soft)
    except (ImportError, OSError, ValueError):
        return 0


class Lingering:
    """Refused connections' handlers, each kept waiting ``hold`` seconds in :meth:`hold` (the stream is
    closed when its handler returns), at most ``capacity`` at a time: the oldest is let go first."""

    def __init__(self, hold: float, capacity: int | None = None) -> None:
        self.hold_s = hold
        self.capacity = default_capacity() if capacity is None else capacity
        self._waiting: OrderedDict[int, trio.CancelScope] = OrderedDict()
        self._next = 0

    def __len__(self) -> int:
        return len(self._waiting)

    async def hold(self) -> None:
        """Return after ``hold`` seconds, or sooner when ``capacity`` newer ones push this one out."""
        self._next += 1
        key = self._next
        scope = trio.CancelScope(deadline=trio.current_time() + self.hold_s)
        self._waiting[key] = scope
        while len(self._waiting) > self.capacity:
            self._waiting.popitem(last=False)[1].cancel()
        try:
            with scope:
                await trio.sleep_forever()
        finally:
            self._waiting.pop(key, None)
