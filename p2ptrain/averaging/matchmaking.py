"""Matchmaking decisions: whom to follow, whom to admit, when to form the group (pure, no I/O).

Theory of operation: a peer ready to average announces itself in the DHT under the run and a group key,
with a deadline (when it would form a group of its own) and its bandwidth (0 until it measured it, see
``bandwidth``). Announcements are totally
ordered by ``(deadline, peer id)``. Each peer follows the smallest announcement below its own that can
lead (it accepts connections) and has not refused it; with none, it leads: it admits joiners until the
group reaches its target size or its deadline passes, then sends each a manifest signed with its key.

Why no deadlock is possible: a peer only ever waits for an answer from a peer strictly smaller in the
order, and a leader waits for nobody: it answers every joiner by its own deadline. A chain of waits is
therefore strictly decreasing, cannot close into a cycle, and ends at a leader whose deadline bounds it.
A peer asked to admit a joiner while it follows someone else answers at once with a redirect to its own
leader (smaller still), so requests flow down the order to the peer that gathers the group. hivemind's
documented deadlock (leaders waiting on each other) needs a wait from a smaller peer to a larger one,
which this rule forbids.

Origins (robust runs). Identities are free, subnets are not: in a run that aggregates with a robust rule,
a leader counts its joiners by *origin*, the subnet (/24, /64) it sees each one's connection come from,
so that one host's fresh keys cannot fill a group before the peers of other subnets ask. While one origin
holds more than half of the group, the group does not form early (it waits for the deadline), and a
joiner from a smaller origin that finds the group full takes the place of the newest joiner of the
largest one (told why). The manifest then says which members share an origin, and reducers count each
origin once (see ``robust``). A run with the plain mean admits first come, first served: one peer
already moves a mean anywhere, so counting origins would only slow honest groups on one subnet.

Quorum of known peers. A step's group must hold a majority of the step's peers, so that two groups cannot
both commit it (two lineages). Counted by id, fresh keys that join two groups would let both reach it;
so a training run names the peers it knows (those that publish progress) and how many of them the group
must hold (:class:`Quorum`): the group forms only with that many of them, and a known joiner that finds
the group full takes the place of the newest joiner that is not.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..errors import RemoteProtocolError
from ..identity import PeerID
from ..wire.codec import pack, unpack
from .rules import listed_subnet


@dataclass(frozen=True)
class Announcement:
    """A peer's readiness to average, as stored in the DHT (signed by the peer as the subkey owner)."""

    peer: PeerID
    addr: str  # "" when the peer is client-only: it can follow, never lead
    deadline: float  # wall-clock seconds: when this peer forms a group of its own
    bandwidth: float
    schema: bytes  # digest of the tensors' schema and the compression

    @property
    def order(self) -> tuple[float, bytes]:
        return (self.deadline, self.peer.digest)

    @property
    def can_lead(self) -> bool:
        return bool(self.addr)

    def closed(self) -> Announcement:
        """The same peer, no longer open: stored over the open announcement once a group formed."""
        return Announcement(self.peer, self.addr, 0.0, self.bandwidth, self.schema)

    def to_bytes(self) -> bytes:
        return pack([self.addr, self.deadline, self.bandwidth, self.schema])

    @classmethod
    def from_bytes(cls, peer: PeerID, data: bytes) -> Announcement:
        try:
            addr, deadline, bandwidth, schema = unpack(data)
        except (TypeError, ValueError):
            raise RemoteProtocolError("malformed announcement") from None
        if not (
            isinstance(addr, str)
            and len(addr) <= 300
            and isinstance(deadline, int | float)
            and math.isfinite(deadline)
            and isinstance(bandwidth, int | float)
            and math.isfinite(bandwidth)
            and 0 <= bandwidth <= 1e15  # 0: the peer has not measured its own yet
            and isinstance(schema, bytes)
            and len(schema) <= 32
        ):
            raise RemoteProtocolError("malformed announcement")
        return cls(peer, addr, float(deadline), float(bandwidth), schema)


def choose_leader(
    me: Announcement, seen: Iterable[Announcement], now: float, declined: set[Announcement]
) -> Announcement | None:
    """The peer to ask for a place, or None when this peer should gather a group itself.

    Candidates can lead, are still open (deadline in the future), have not refused us under this very
    announcement (a peer that refused while it was busy with its previous round may be asked again once
    it announces anew), and come before us in the order. Peers with another schema are skipped: they
    could never admit us.
    """
    best: Announcement | None = None
    for a in seen:
        if (
            a.peer == me.peer
            or not a.can_lead
            or a.deadline <= now
            or a in declined
            or a.schema != me.schema
            or (me.can_lead and a.order >= me.order)
        ):
            continue
        if best is None or a.order < best.order:
            best = a
    return best


@dataclass(frozen=True)
class Joiner:
    peer: PeerID
    addr: str
    bandwidth: float
    origin: str = ""  # the subnet its leader sees it from (the leader: its own, "" when it does not know)


@dataclass(frozen=True)
class Quorum:
    """A group forms only once it holds at least ``size`` of ``peers`` (the leader included)."""

    peers: frozenset[PeerID]
    size: int


@dataclass
class Gathering:
    """A leader's group in the making."""

    leader: Joiner
    schema: bytes
    target_size: int
    min_size: int
    by_origin: bool = False  # count joiners by origin (robust runs; see the module docstring)
    quorum: Quorum | None = None  # the known peers it must hold (see the module docstring)
    joiners: list[Joiner] = field(default_factory=list)
    bumped: dict[PeerID, str] = field(default_factory=dict)  # joiners that lost their place, and why
    formed: bool = False

    def offer(self, joiner: Joiner, schema: bytes) -> str | None:
        """Admit ``joiner``, or return why not."""
        if self.formed:
            return "the group is already formed"
        if schema != self.schema:
            return "schema mismatch: the leader averages tensors of other shapes, dtypes or compression"
        if joiner.peer == self.leader.peer or any(j.peer == joiner.peer for j in self.joiners):
            return "already in this group"
        if not (math.isfinite(joiner.bandwidth) and joiner.bandwidth >= 0):
            return "bandwidth must be finite and not negative (0: not measured yet)"
        listed = listed_subnet(joiner.addr)
        if self.by_origin and listed and joiner.origin and listed != joiner.origin:
            # Members refuse a manifest that splits a listed subnet over origins, or merges two: a joiner
            # listed in one subnet and counted in another (where it connects from) would make them
            # refuse the whole group.
            return f"the address offered is in {listed}, but the call came from {joiner.origin}"
        if self.full():
            out = self._displaced_by(joiner)
            if out is None:
                return "the group is full"
            self.joiners.remove(out)
            self.bumped[out.peer] = (
                "the group is full: its place went to a peer the leader knows"
                if self._counts(joiner)
                else "the group is full: its place went to a peer of a less represented subnet"
            )
        self.bumped.pop(joiner.peer, None)
        self.joiners.append(joiner)
        return None

    def _places(self) -> dict[str, int]:
        places: dict[str, int] = {self.leader.origin: 1}
        for j in self.joiners:
            places[j.origin] = places.get(j.origin, 0) + 1
        return places

    def _counts(self, joiner: Joiner) -> bool:
        return self.quorum is not None and joiner.peer in self.quorum.peers

    def counted(self) -> int:
        """Members of the quorum's peers in the group (the leader included)."""
        return sum(self._counts(j) for j in (self.leader, *self.joiners))

    def _displaced_by(self, joiner: Joiner) -> Joiner | None:
        """The joiner that gives up its place to ``joiner`` in a full group: for a peer of the quorum,
        the newest joiner that is not; else the newest of the origin holding the most places, if that
        holds at least two more than ``joiner``'s (so the places even out and never swing back and
        forth)."""
        if self.quorum is not None and self._counts(joiner):
            stranger = next((j for j in reversed(self.joiners) if not self._counts(j)), None)
            if stranger is not None:
                return stranger
        if not self.by_origin:
            return None
        places = self._places()
        movable = {j.origin for j in self.joiners}
        if not movable:
            return None
        largest = max(movable, key=lambda o: places[o])
        if places[largest] < places.get(joiner.origin, 0) + 2:
            return None
        return next(j for j in reversed(self.joiners) if j.origin == largest)

    def dominated(self) -> bool:
        """Does one origin hold more than half of the places (then the group waits for its deadline, so
        that peers of other subnets may still take places; see the module docstring)?"""
        if not self.by_origin:
            return False
        places = self._places()
        return len(places) > 1 and 2 * max(places.values()) > self.size()

    def ready(self) -> bool:
        """Full, and may form before its deadline."""
        quorate = self.quorum is None or self.counted() >= self.quorum.size
        return self.full() and quorate and not self.dominated()

    def origins(self, members: list[Joiner]) -> tuple[int, ...]:
        """For a manifest listing ``members``: each one's origin as the index of the first member that
        shares it; () when joiners are not counted by origin (every member its own)."""
        if not self.by_origin:
            return ()
        first: dict[str, int] = {}
        return tuple(first.setdefault(m.origin, i) for i, m in enumerate(members))

    def withdraw(self, peer: PeerID) -> None:
        """A joiner gave up before the group formed."""
        if not self.formed:
            self.joiners = [j for j in self.joiners if j.peer != peer]

    def size(self) -> int:
        return 1 + len(self.joiners)

    def full(self) -> bool:
        return self.size() >= self.target_size

    def form(self) -> list[Joiner] | str:
        """The members in order (leader first, then by peer id), or why the group cannot form."""
        self.formed = True
        if self.size() < self.min_size:
            return f"only {self.size()} of at least {self.min_size} peers joined in time"
        if self.quorum is not None and self.counted() < self.quorum.size:
            return f"only {self.counted()} of the at least {self.quorum.size} peers it knows joined in time"
        return [self.leader, *sorted(self.joiners, key=lambda j: j.peer.digest)]
