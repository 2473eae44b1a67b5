"""Shares of what a node serves in bulk (its state's chunks, the results it kept), by who asks.

Theory of operation. A stream of model-sized data costs the node serving it its uplink for as long as it
runs (and, while a window of it is read, that window's memory). Identities are free: a cap per peer id
alone lets k ids take k shares, and four ids took every state stream a donor had, so that no joiner
could download from it. :class:`ServingSlots` caps the streams running at once in all, per peer id
and per origin (:func:`~p2ptrain.net.admission.subnet_of`: a /24 or /64, where a host's addresses and
an operator's hosts mostly are; a relayed caller under its relay's address, as every per-origin
limit of this node counts it). Whatever the number of its ids, an origin holds at most
``per_origin`` of the ``total`` slots, so at least ``total - per_origin`` are left for the others; past
a cap a call is answered ``busy`` at once, before anything is read, which a downloader takes as "another
donor, or later".

One instance is shared by every bulk service of a node (``SharedState`` hands it to the state server and
to the result store), since they share the uplink it guards.

Replies to small requests are the other way to spend a node's uplink: a DHT read of a full key asks in
a hundred bytes for up to 768 KiB, and control replies go out before bulk data (the all-reduce's), so a
flood of them from free ids stalls a node's rounds. :class:`ReplyBudget` is a token bucket of reply
bytes per origin: a reply is sent while its origin has tokens left (it may overdraw them by one
reply), and while it has none a call is refused ``busy`` before any work, until the rate refills them.
"""

from __future__ import annotations

import contextlib
from collections import Counter, OrderedDict
from collections.abc import Iterator

from ..errors import CallRefused
from ..identity import PeerID
from .admission import subnet_of

BUSY = "busy"


class ServingSlots:
    """Streams of bulk data running at once: at most ``total``, ``per_peer`` per peer id and
    ``per_origin`` per origin (see the module docstring)."""

    def __init__(self, total: int = 16, per_peer: int = 4, per_origin: int = 8) -> None:
        if not 1 <= per_peer <= per_origin <= total:
            raise ValueError("slots need 1 <= per_peer <= per_origin <= total")
        self.total, self.per_peer, self.per_origin = total, per_peer, per_origin
        self._by_peer: Counter[PeerID] = Counter()
        self._by_origin: Counter[str] = Counter()
        self.refused = 0  # calls answered busy (for a node's status)

    @property
    def running(self) -> int:
        return sum(self._by_peer.values())

    def held_by(self, origin: str) -> int:
        return self._by_origin[origin]

    @contextlib.contextmanager
    def taken(self, peer: PeerID, host: str) -> Iterator[None]:
        """A slot for ``peer`` calling from ``host`` while the block runs; ``CallRefused("busy")``, with
        the cap it hit, when none is left to it."""
        origin = subnet_of(host)
        if self.running >= self.total:
            reason = f"already serving {self.total} streams"
        elif self._by_origin[origin] >= self.per_origin:
            reason = f"at most {self.per_origin} streams at once to {origin}"
        elif self._by_peer[peer] >= self.per_peer:
            reason = f"at most {self.per_peer} streams at once per peer"
        else:
            reason = ""
        if reason:
            self.refused += 1
            raise CallRefused(BUSY, reason)
        self._by_peer[peer] += 1
        self._by_origin[origin] += 1
        try:
            yield
        finally:
            self._by_peer[peer] -= 1
            self._by_origin[origin] -= 1
            if not self._by_peer[peer]:
                del self._by_peer[peer]
            if not self._by_origin[origin]:
                del self._by_origin[origin]


MAX_ORIGINS = 4096  # origins whose reply tokens are remembered (one forgotten starts with a full bucket)


class ReplyBudget:
    """Reply bytes per origin: ``rate`` bytes a second, up to ``burst`` saved (see the module
    docstring). ``now``: the caller's clock, in seconds."""

    def __init__(self, rate: float = 1e6, burst: float = 8e6) -> None:
        if not (rate > 0 and burst > 0):
            raise ValueError("a reply budget needs a positive rate and burst")
        self.rate, self.burst = rate, burst
        self._tokens: OrderedDict[str, tuple[float, float]] = OrderedDict()  # origin -> (tokens, at)
        self.refused = 0

    def tokens(self, origin: str, now: float) -> float:
        """What ``origin`` (:func:`~p2ptrain.net.admission.subnet_of` of a caller's address) may still
        be sent now."""
        tokens, at = self._tokens.get(origin, (self.burst, now))
        return min(self.burst, tokens + (now - at) * self.rate)

    def check(self, origin: str, now: float) -> None:
        """``CallRefused("busy")`` while ``origin`` has no tokens left."""
        if self.tokens(origin, now) <= 0:
            self.refused += 1
            raise CallRefused(BUSY, f"replies to {origin} used up their share of this node's uplink: later")

    def charge(self, origin: str, nbytes: int, now: float) -> None:
        """``nbytes`` sent to ``origin``."""
        self._tokens[origin] = (self.tokens(origin, now) - nbytes, now)
        self._tokens.move_to_end(origin)
        while len(self._tokens) > MAX_ORIGINS:
            self._tokens.popitem(last=False)
