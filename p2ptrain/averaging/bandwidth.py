"""Measuring the bandwidth a member announces, from the rounds it takes part in.

A member's share of a reduction is proportional to the bandwidth it announces (see ``partition``), so
the number should be what the member can really move. Unless a bandwidth is configured, each member
measures its own, during every round it takes part in, with no probe traffic of its own.

Why not just bytes over a round's duration: every member's round ends when the slowest member is done,
so that ratio is nearly the same on every member whatever its link. Instead a round's :class:`RateMeter`
samples the host's traffic counters from the start of the round until the *first* of the member's
flows in one direction completes. Until then every flow in that direction is still running (the
butterfly starts them all at once), so the aggregate rate is what this member's link, or its share of
the others' links, carries: a member on a slow link measures its link; a member on a fast one measures
at least what the others can feed it. Bytes sent are counted only once the remote acknowledged them
(see ``Host.delivered_traffic``): the kernel takes the first megabytes of a stream at memory speed.

:class:`BandwidthEstimate` keeps the last few rounds' rates: a round disturbed by a straggler or a crash
measures too little, so the estimate is the best of the recent ones in each direction, and the smaller
of the two directions (a reducer receives its partition from every member, then sends the result back
to every member, so both directions carry the same share).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

MIN_SECONDS = 0.05
"""A window shorter than this measures latency and scheduling, not bandwidth: no sample."""
MIN_BYTES = 1 << 20
"""Nor does a window that moved less than this."""
KEEP = 5
"""Rounds whose rates the estimate remembers (the best of them counts)."""
MAX_SPREAD = 16.0
"""A leader counts no member's bandwidth above this many times the group's lower median: a member that
claims a huge one (the wire allows up to 1e15 B/s) would otherwise reduce nearly everything, and every
round would wait for it."""


@dataclass
class Rates:
    """One round's measurement, in bytes per second; None where the round gave no sample."""

    upload: float | None = None
    download: float | None = None


class RateMeter:
    """One round's upload and download rates (see the module docstring).

    ``traffic`` returns the host's cumulative (bytes sent and acknowledged, bytes received); ``now``
    the clock. Call :meth:`flow_done` when a flow of the round completes, with its direction.
    """

    def __init__(self, traffic: Callable[[], tuple[int, int]], now: Callable[[], float]) -> None:
        self._traffic, self._now = traffic, now
        self._start = now()
        self._sent, self._received = traffic()
        self.rates = Rates()
        self._closed = {"upload": False, "download": False}

    def flow_done(self, direction: str) -> None:
        """A flow in ``direction`` ("upload" or "download") completed: the first one ends its window."""
        if self._closed[direction]:
            return
        self._closed[direction] = True
        seconds = self._now() - self._start
        sent, received = self._traffic()
        moved = sent - self._sent if direction == "upload" else received - self._received
        if seconds >= MIN_SECONDS and moved >= MIN_BYTES:
            setattr(self.rates, direction, moved / seconds)


class BandwidthEstimate:
    """The bandwidth a member announces, from its recent rounds' rates (see the module docstring)."""

    def __init__(self, keep: int = KEEP) -> None:
        self.upload: deque[float] = deque(maxlen=keep)
        self.download: deque[float] = deque(maxlen=keep)

    def add(self, rates: Rates) -> None:
        if rates.upload is not None:
            self.upload.append(rates.upload)
        if rates.download is not None:
            self.download.append(rates.download)

    def best(self) -> Rates:
        """The best recent rate in each direction (None where none was measured)."""
        return Rates(max(self.upload, default=None), max(self.download, default=None))

    def value(self) -> float | None:
        """Bytes per second, or None before any round measured anything."""
        best = self.best()
        known = [r for r in (best.upload, best.download) if r is not None]
        return min(known) if known else None


def partition_bandwidths(bandwidths: list[float]) -> list[float]:
    """The bandwidths a leader splits a round by, from those its members announced: 0 (a member that
    has not measured its own yet) becomes the median of the others' (1.0 if nobody knows theirs), so a
    newcomer gets a typical share, not an extreme one, until its first rounds tell; and none counts for
    more than MAX_SPREAD times the lower median. The result is its own image (applying this again
    changes nothing), which is how a member checks that a leader's manifest follows this rule."""
    known = sorted(b for b in bandwidths if b > 0)
    if not known:
        return [1.0] * len(bandwidths)
    typical, low = known[len(known) // 2], known[(len(known) - 1) // 2]
    return [min(b if b > 0 else typical, MAX_SPREAD * low) for b in bandwidths]
