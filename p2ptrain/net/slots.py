"""Shares of what a node serves in bulk (its state's chunks, the results it kept), by who asks.

Theory of operation. A stream of model-sized data costs the node serving it its uplink for as long as it
runs (and, while a window of it is read, that window's memory). Identities are free: a cap per peer id
alone lets k ids take k shares, and four ids took every state stream a donor had, so that no joiner
could download from it. :class:`ServingSlots` caps the streams running at once in all, per peer id
and per origin (:func:`~p2ptrain.net.admission.subnet_of`: a /24 or /64, where a host's addresses and
an operator's hosts mostly are; a relayed caller under its relay's address, as every per-origin
limit of this node counts it).

Origins cost an attacker more than ids, but not much more: caps per origin alone let k origins take k
shares, and two /24s took all 16 slots. So a full set of slots does not simply turn newcomers away
(whoever filled it first would keep everyone else out for as long as its streams last, and a stream
that is never read lasts until its call's deadline): a caller takes over a running stream's slot,
**max-min fair by origin**, as inbound connections do (``admission``):

- from the origin holding the most slots, if it holds at least two more than the caller's origin
  would (it keeps the most even so), its longest-running stream;
- else, from an origin holding more than the caller's, a stream that has had its turn (``turn``
  seconds), to the first in line among the origins still asking (refused, and asking again within
  ``WAITING`` seconds): the one holding the fewest slots, then the one waiting longest. So the slots go
  round among the origins that ask, first come first served, whatever their number and however often
  each asks;
- else the caller is answered ``busy`` at once, before anything is read, which a downloader takes as
  "another donor, or later".

The invariant: **an origin that keeps asking, with k other origins asking too, gets a slot within
about ceil((k + 1) / total) turns, whatever the number of ids they bring**, and while some origin is
refused none holds two slots more than it does. A stream whose slot is taken over ends with ``busy``
("its turn went to another"), as if refused at its next chunk: its caller asks again for the rest
(downloads keep the chunks they verified). The node serves at most ``total`` streams at once, plus
those taken over and not yet ended (a moment: their task is cancelled).

One instance is shared by every bulk service of a node (``SharedState`` hands it to the state server and
to the result store), since they share the uplink it guards.

Replies to small requests are the other way to spend a node's uplink: a DHT read of a full key asks in
a hundred bytes for up to 768 KiB, and control replies go out before bulk data (the all-reduce's), so a
flood of them from free ids stalls a node's rounds. :class:`ReplyBudget` is a token bucket of reply
bytes per origin: a reply is sent while its origin has tokens left (it may overdraw them by one
reply), and while it has none a call is refused ``busy`` before any work, until the rate refills them.
Per origin alone, k origins would draw k origins' rate (a megabyte a second each, more than a home
uplink), so the budget also holds the node's replies in all to ``total`` (a share of its uplink), and
shares that max-min as the slots are shared: each origin owes what it was sent, paid back at its fair
share of the total, and once the node-wide bucket is spent, the origins owing the most wait while
those that took less than their share are still served. The invariant: **an origin asking for less
than the node's total over the origins asking is never refused for the node's sake, and the node sends
about twice its total at most, however many origins ask.**
"""

from __future__ import annotations

import contextlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import trio

from ..errors import CallRefused, RemoteCallError
from ..identity import PeerID
from .admission import subnet_of

BUSY = "busy"
FULL = "already serving"
"""How a refusal for want of a slot begins (a caller refused so keeps its place in line)."""


def busy(error: BaseException) -> bool:
    """Whether ``error`` is a node's ``busy`` answer (its slots, or this caller's origin's share of its
    replies, spent for now): the node is alive and holds what it held; ask again later, or another."""
    return isinstance(error, RemoteCallError) and error.code == BUSY


TURN = 20.0
"""Seconds a stream runs before an origin holding fewer slots may take its slot over (see the module
docstring): 25 MB at 10 Mbit/s, 250 MB at 100 Mbit/s, and then the caller asks again for the rest (a
round trip and a second's pause: a few percent of the turn)."""
WAITING = 5.0
"""Seconds an origin refused for want of a slot keeps its place among those waiting without asking
again (a downloader asks again after a second)."""


@dataclass(eq=False)
class Slot:
    """One running stream's slot: who holds it, since when, and the scope its stream runs in."""

    peer: PeerID
    origin: str
    began: float
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    taken_over: bool = False


class ServingSlots:
    """Streams of bulk data running at once: at most ``total``, ``per_peer`` per peer id and
    ``per_origin`` per origin, shared max-min fairly by origin with turns of ``turn`` seconds (see the
    module docstring). ``clock``: seconds (trio's, by default)."""

    def __init__(
        self,
        total: int = 16,
        per_peer: int = 4,
        per_origin: int = 8,
        turn: float = TURN,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        if not 1 <= per_peer <= per_origin <= total:
            raise ValueError("slots need 1 <= per_peer <= per_origin <= total")
        if not turn > 0:
            raise ValueError("a turn is a positive number of seconds")
        self.total, self.per_peer, self.per_origin, self.turn = total, per_peer, per_origin, turn
        self._clock = clock
        self._slots: list[Slot] = []  # (those taken over stay until their stream ended)
        # origins refused for want of a slot, the longest waiting first: (waiting since, asked last)
        self._waiting: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self.refused = 0  # calls answered busy (for a node's status)
        self.taken_over = 0  # streams whose slot went to another origin

    def _live(self) -> list[Slot]:
        return [s for s in self._slots if not s.taken_over]

    @property
    def running(self) -> int:
        """Streams holding a slot (not counting those taken over, which are ending)."""
        return len(self._live())

    def held_by(self, origin: str) -> int:
        return sum(1 for s in self._live() if s.origin == origin)

    def admit(self, peer: PeerID, origin: str, now: float) -> tuple[Slot | None, str]:
        """Whether a stream for ``peer`` from ``origin`` may run now: (a slot to take over or None,
        "") to run, (None, why) to refuse (pure: nothing changes)."""
        live = self._live()
        by_origin = Counter(s.origin for s in live)
        if by_origin[origin] >= self.per_origin:
            return None, f"at most {self.per_origin} streams at once to {origin}"
        if sum(1 for s in live if s.peer == peer) >= self.per_peer:
            return None, f"at most {self.per_peer} streams at once per peer"
        if len(live) < self.total:
            return None, ""
        mine = by_origin[origin]
        most = max(by_origin.values())
        if most >= mine + 2:  # the origin holding the most, its longest-running stream
            top = [s for s in live if by_origin[s.origin] == most]
            return min(top, key=lambda s: s.began), ""
        done = [s for s in live if by_origin[s.origin] >= mine + 1 and now - s.began >= self.turn]
        # (else a stream that had its turn, from an origin holding more: to the first in line)
        if done and self._first_waiting(origin, by_origin, now):
            return min(done, key=lambda s: s.began), ""
        return None, f"{FULL} {self.total} streams"

    def _first_waiting(self, origin: str, by_origin: Counter[str], now: float) -> bool:
        """Whether ``origin`` is first in line (pure): no other origin still asking holds fewer slots,
        or as many and has waited longer (one holding more could not take the slot it would)."""
        mine = (by_origin[origin], self._waiting.get(origin, (now, now))[0])
        return not any(
            (by_origin[other], since) < mine and now - asked <= WAITING
            for other, (since, asked) in self._waiting.items()
            if other != origin
        )

    def _note(self, origin: str, now: float, refused: bool) -> None:
        """``origin`` asked at ``now``: refused for want of a slot, it keeps (or takes) its place in
        line; served, it leaves the line. Those that stopped asking are forgotten."""
        if refused:
            since = self._waiting.pop(origin, (now, now))[0]
            self._waiting[origin] = (since, now)  # (the most recent asker last: the oldest go first)
        else:
            self._waiting.pop(origin, None)
        while self._waiting:
            first, (_, asked) = next(iter(self._waiting.items()))
            if now - asked <= WAITING and len(self._waiting) <= MAX_ORIGINS:
                break
            del self._waiting[first]

    @contextlib.contextmanager
    def taken(self, peer: PeerID, host: str) -> Iterator[Slot]:
        """A slot for ``peer`` calling from ``host`` while the block runs; ``CallRefused("busy")``, with
        the cap it hit, when none is left to it, or when its slot was taken over meanwhile (the block
        is cancelled then)."""
        origin, now = subnet_of(host), self._clock()
        victim, reason = self.admit(peer, origin, now)
        self._note(origin, now, refused=reason.startswith(FULL))
        if reason:
            self.refused += 1
            raise CallRefused(BUSY, reason)
        if victim is not None:
            victim.taken_over = True
            victim.scope.cancel()
            self.taken_over += 1
        slot = Slot(peer, origin, now)
        self._slots.append(slot)
        try:
            with slot.scope:
                yield slot
        finally:
            self._slots.remove(slot)
        if slot.scope.cancelled_caught:
            raise CallRefused(BUSY, "this stream's turn went to a caller with fewer streams here: ask again")


MAX_ORIGINS = 4096  # origins whose reply tokens are remembered (one forgotten starts with a full bucket)
SHARE_WINDOW = 10.0
"""An origin that got no reply for this many seconds no longer counts among those sharing the node's
replies; one may be owed up to this many seconds of its fair share and still be served."""
POOL_SECONDS = 4.0  # the node-wide bucket holds this many seconds of its rate


class ReplyBudget:
    """Reply bytes per origin: ``rate`` bytes a second, up to ``burst`` saved; and, where ``total`` is
    given, reply bytes of the whole node, shared max-min among the origins (see the module docstring).
    ``now``: the caller's clock, in seconds.

    ``total`` is asked at each check for the node's reply bytes a second in all (its uplink's share for
    replies: it may change as the uplink is measured). While the node-wide bucket holds tokens, every
    origin is served within its own. Each origin also owes what it was sent, paid back at its fair
    share (``total`` over the origins sent a reply in the last ``SHARE_WINDOW`` seconds); once the
    node-wide bucket is spent, an origin is refused ``busy`` while it owes ``SHARE_WINDOW`` seconds of
    its share or more. So the origins taking the most wait, one taking less than its share is never
    refused for the node's sake, and over time the node sends at most about twice ``total``: the
    bucket's rate, and what the origins take at their shares while it is spent."""

    def __init__(
        self, rate: float = 1e6, burst: float = 8e6, total: Callable[[], float] | None = None
    ) -> None:
        if not (rate > 0 and burst > 0):
            raise ValueError("a reply budget needs a positive rate and burst")
        self.rate, self.burst, self.total = rate, burst, total
        self._tokens: OrderedDict[str, tuple[float, float]] = OrderedDict()  # origin -> (tokens, at)
        # the node-wide bucket, and what each origin owes, oldest reply first, for as long as it had one
        # within the window
        self._pool: tuple[float, float] | None = None  # (tokens, at)
        self._owed: OrderedDict[str, tuple[float, float]] = OrderedDict()  # origin -> (bytes, at)
        self.refused = 0

    def tokens(self, origin: str, now: float) -> float:
        """What ``origin`` (:func:`~p2ptrain.net.admission.subnet_of` of a caller's address) may still
        be sent now."""
        tokens, at = self._tokens.get(origin, (self.burst, now))
        return min(self.burst, tokens + (now - at) * self.rate)

    def pool(self, now: float, total: float) -> float:
        """What the whole node may still send now, at ``total`` bytes a second."""
        if self._pool is None:
            return POOL_SECONDS * total
        tokens, at = self._pool
        return min(POOL_SECONDS * total, tokens + max(0.0, now - at) * total)

    def fair(self, origin: str, now: float, total: float) -> float:
        """``origin``'s share of ``total``: over the origins sent a reply within ``SHARE_WINDOW``, it
        among them."""
        while self._owed and now - next(iter(self._owed.values()))[1] > SHARE_WINDOW:
            self._owed.popitem(last=False)  # (no reply within the window: it shares no more)
        return total / (len(self._owed) + (origin not in self._owed))

    def owed(self, origin: str, now: float, fair: float) -> float:
        """What ``origin`` owes now, paying back at ``fair`` bytes a second since its last reply."""
        got = self._owed.get(origin)
        return 0.0 if got is None else max(0.0, got[0] - max(0.0, now - got[1]) * fair)

    def check(self, origin: str, now: float) -> None:
        """``CallRefused("busy")`` while ``origin`` has no tokens left, or while the node's are spent
        and ``origin`` owes ``SHARE_WINDOW`` seconds of its share or more."""
        if self.tokens(origin, now) <= 0:
            self.refused += 1
            raise CallRefused(BUSY, f"replies to {origin} used up their share of this node's uplink: later")
        if self.total is None:
            return
        total = self.total()
        if self.pool(now, total) > 0:
            return
        fair = self.fair(origin, now, total)
        if self.owed(origin, now, fair) >= fair * SHARE_WINDOW:
            self.refused += 1
            raise CallRefused(
                BUSY,
                f"this node's replies are at its uplink's share, and {origin} took its part of them: later",
            )

    def charge(self, origin: str, nbytes: int, now: float) -> None:
        """``nbytes`` sent to ``origin``."""
        self._tokens[origin] = (self.tokens(origin, now) - nbytes, now)
        self._tokens.move_to_end(origin)
        while len(self._tokens) > MAX_ORIGINS:
            self._tokens.popitem(last=False)
        if self.total is None:
            return
        total = self.total()
        self._pool = (self.pool(now, total) - nbytes, now)
        fair = self.fair(origin, now, total)
        self._owed[origin] = (self.owed(origin, now, fair) + nbytes, now)
        self._owed.move_to_end(origin)
        while len(self._owed) > MAX_ORIGINS:
            self._owed.popitem(last=False)
