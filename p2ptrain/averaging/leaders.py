"""Which group leaders this peer no longer follows (pure: failures and ``now`` in, verdicts out).

Theory of operation. Leadership goes by a lottery the leader does not set (``matchmaking``), but a
leader that wins it can still take a follower's place and never deliver: hold the call and sign no
manifest, admit one peer and tell the rest the group is full, sign a manifest that breaks the run's
rules, or coordinate a round it never starts. Each of those costs the follower one matchmaking (its
window + grace) or one round, and nothing else can stop the next one: so the follower remembers.

:class:`LeaderBook` belongs to the node's group forming and lives across matchmakings. A leader that
surely failed this peer (:meth:`LeaderBook.failed`, with the reason: it held the follower past its
deadline + grace, or signed a manifest that breaks the rules) is not followed again for ``EXCLUSION``
seconds, twice as long on each repeat (up to ``MAX_EXCLUSION``); neither is any leader on the same
subnet (the /24 or /64 of the address this peer reached it at), since fresh keys are free and subnets
are not. A subnet's blame spares the leaders that delivered this peer a manifest before
(:meth:`LeaderBook.delivered`): honest peers that share a LAN with a failed one keep leading it. A
loopback address blames nobody else (processes of one machine share it in tests and small setups).

Some failures honest leaders show too: a group too small at the deadline (a quorum not met), a joiner
bumped at the deadline, an address that does not answer, a round that failed on its coordinator.
Excluding a leader for one of those split honest swarms: its followers led groups of their own, which
were too small in turn, and excluded each other. So each is a *suspicion* (:meth:`LeaderBook.suspect`):
the ``SUSPICIONS``-th of a leader since it last delivered a manifest, or of one subnet's leaders within
``EXCLUSION`` of each other, counts as a failure, but a failure inferred from suspicions is not followed
for ``SUSPECTED`` seconds only (doubling on each repeat like any other): evidence an honest leader also
leaves must not keep it from delivering the manifest that clears it. (With ``EXCLUSION`` there, peers of
one LAN whose first groups came out too small under load excluded each other's whole subnet for half an
hour before any of them had delivered, and no group formed meanwhile.)

The cost to an attacker, stated as an invariant: with k identities on m subnets, in any period of T
seconds (T up to ``MEMORY``) each honest peer is stalled at most ``SUSPICIONS`` x m x (1 + log2(1 +
T / ``SUSPECTED``)) times (plus ``SUSPICIONS`` per identity that delivered it a good manifest before),
each time for at most its own matchmaking window + ``DEADLINE_SLACK`` + ``JOIN_GRACE`` (or one
averaging timeout, for a coordinator that never starts its round): each cycle of ``SUSPICIONS`` stalls
buys an exclusion twice as long as the last. A stall no honest leader causes (holding the follower to
the end of its wait) counts once, not ``SUSPICIONS`` times, and excludes for ``EXCLUSION``, doubling.
Two cheaper nuisances are bounded per identity
instead, as nothing ties them to a subnet: an address where dials hang costs ``DIAL_LIMIT``
``SUSPICIONS`` times per identity, and a leader that keeps answering "ask again" costs ``RETRY_FOR``
per matchmaking it wins (``grouping``). A failure is recorded only by the peer that saw it (nobody
takes another's word for it), so the attacker pays those stalls per honest peer. Ids are free and a
key generator can grind ones that win the lottery, but each counts against its subnet.

What it costs an honest swarm: an honest leader that failed a follower (its machine died, or three of
its groups in a row were too small while the follower saw enough peers to form one) is not followed by
that follower for a while; it still joins groups and leads the others. Exclusion only removes
candidates, it never reorders the rest, so the no-deadlock argument of ``matchmaking`` is untouched.

The book is bounded: at most ``MAX_PEERS`` leaders, ``MAX_SUBNETS`` subnets and ``MAX_DELIVERED``
good leaders; past that, the entry that ends soonest goes (a flood of fresh failures can only push out
blame that was about to end anyway).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import TypeVar

from ..identity import PeerID

EXCLUSION = 1800.0  # seconds a failed leader (and its subnet) is not followed, the first time
SUSPECTED = 120.0  # the same after SUSPICIONS failures an honest leader also shows (see the docstring)
MAX_EXCLUSION = 24 * 3600.0  # doubling stops here
MEMORY = 24 * 3600.0  # how long after its exclusion ended a failure still counts as a repeat
MAX_PEERS = 1024
MAX_SUBNETS = 256
MAX_DELIVERED = 1024
SUSPICIONS = 3  # failures an honest leader also shows (see the module docstring) that make a failure

K = TypeVar("K")


@dataclass
class _Blame:
    until: float
    count: int
    why: str


def blames_subnet(subnet: str) -> bool:
    """Whether a failure on ``subnet`` excludes the other leaders there: not for "" (unknown: a relayed
    connection) nor a loopback address (one machine's processes share it)."""
    if not subnet:
        return False
    try:
        return not ipaddress.ip_network(subnet, strict=False).is_loopback
    except ValueError:
        return True  # a host name (the in-memory network's hosts): its own subnet


class LeaderBook:
    """Leaders (and subnets) this peer does not follow, and until when; see the module docstring."""

    def __init__(self, *, exclusion: float = EXCLUSION, suspected: float = SUSPECTED) -> None:
        self.exclusion, self.suspected = exclusion, suspected
        self._peers: dict[PeerID, _Blame] = {}
        self._subnets: dict[str, _Blame] = {}
        self._delivered: dict[PeerID, float] = {}  # leaders that delivered us a manifest -> when, last
        self._suspected: dict[PeerID, tuple[int, float]] = {}  # -> suspicions since it delivered, last when
        self._suspected_subnets: dict[str, tuple[int, float]] = {}  # -> suspicions, last when

    def failed(self, peer: PeerID, subnet: str, now: float, why: str, *, base: float | None = None) -> float:
        """``peer`` (reached at ``subnet``, "" if unknown) failed this peer as a leader: it is not
        followed, nor are the leaders of its subnet, until the time returned (``base``: the first
        exclusion's length, ``EXCLUSION`` unless given; doubled on each repeat)."""
        length = self.exclusion if base is None else base
        self._delivered.pop(peer, None)
        until = _blame(self._peers, peer, now, why, length, MAX_PEERS)
        if blames_subnet(subnet):
            until = max(until, _blame(self._subnets, subnet, now, why, length, MAX_SUBNETS))
        return until

    def suspect(self, peer: PeerID, subnet: str, now: float, why: str) -> float | None:
        """``peer`` failed this peer in a way an honest leader may too (a group too small, a late refusal,
        a round that failed on it): at the ``SUSPICIONS``-th such failure of the peer since it last
        delivered, or of its subnet within ``EXCLUSION``, it counts as :meth:`failed`, for ``SUSPECTED``
        seconds the first time (until when: returned)."""
        self._forget_suspicions(now)
        n = self._suspected.get(peer, (0, now))[0] + 1
        self._suspected[peer] = (n, now)
        sub = self._suspected_subnets.get(subnet, (0, now))[0] + 1 if blames_subnet(subnet) else 0
        if sub:
            self._suspected_subnets[subnet] = (sub, now)
        if n < SUSPICIONS and sub < SUSPICIONS:
            return None
        self._suspected.pop(peer, None)
        if sub >= SUSPICIONS:
            self._suspected_subnets.pop(subnet, None)
        why = f"{SUSPICIONS} times: {why}"
        return self.failed(peer, subnet if sub >= SUSPICIONS else "", now, why, base=self.suspected)

    def _forget_suspicions(self, now: float) -> None:
        _forget(self._suspected, now - self.exclusion)
        _forget(self._suspected_subnets, now - self.exclusion)

    def delivered(self, peer: PeerID, now: float) -> None:
        """``peer`` led a group this peer took part in: its subnet's blame does not extend to it, and
        what it was suspected of is forgotten."""
        self._suspected.pop(peer, None)
        if peer in self._peers and self._peers[peer].until > now:
            return  # (not while its own blame lasts)
        self._delivered.pop(peer, None)
        self._delivered[peer] = now
        while len(self._delivered) > MAX_DELIVERED:
            del self._delivered[next(iter(self._delivered))]  # the least recently good

    def excluded(self, peer: PeerID, subnet: str, now: float) -> str:
        """Why ``peer``, reached (or announced) at ``subnet``, is not followed now ("" if it may be)."""
        blame = self._peers.get(peer)
        if blame is not None and blame.until > now:
            left = blame.until - now
            return f"it failed this peer as a leader ({blame.why}); not followed for {left:.0f} s"
        sub = self._subnets.get(subnet) if subnet else None
        if sub is not None and sub.until > now and peer not in self._delivered:
            return (
                f"a leader of its subnet {subnet} failed this peer ({sub.why});"
                f" its subnet is not followed for {sub.until - now:.0f} s"
            )
        return ""

    def excluded_peers(self, now: float) -> frozenset[PeerID]:
        """The leaders blamed by name now (a subnet's blame needs the address: :meth:`excluded`)."""
        return frozenset(p for p, b in self._peers.items() if b.until > now)

    def __len__(self) -> int:
        return len(self._peers) + len(self._subnets)


def _blame(table: dict[K, _Blame], key: K, now: float, why: str, base: float, limit: int) -> float:
    """Blame ``key`` in ``table`` (twice as long as last time on a repeat), keep ``table`` bounded."""
    old = table.get(key)
    count = 1
    if old is not None and now <= old.until + MEMORY:
        count = old.count + (old.until <= now)  # a repeat after the exclusion ended: twice as long
    length = min(base * 2.0 ** (count - 1), MAX_EXCLUSION)
    until = max(now + length, old.until if old is not None else 0.0)
    table[key] = _Blame(until, count, why)
    for k in [k for k, b in table.items() if b.until + MEMORY < now]:
        del table[k]
    while len(table) > limit:
        del table[min(table, key=lambda k: table[k].until)]
    return until


def _forget(table: dict[K, tuple[int, float]], before: float) -> None:
    """Drop the suspicions last raised before ``before``; keep the table bounded (oldest first)."""
    for k in [k for k, (_, at) in table.items() if at < before]:
        del table[k]
    while len(table) > MAX_PEERS:
        del table[next(iter(table))]
