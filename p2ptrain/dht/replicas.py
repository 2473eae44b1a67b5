"""Where a key's records go: its replicas, found once and remembered.

Theory of operation: a store goes to the key's ``replication`` closest peers, looked up when they
change, not on a timer: again after a store that a replica failed or refused (it left, or it is full),
and at the latest ``TARGETS_TTL`` after the last lookup; a read of a key stored under lately asks those
replicas directly (see :meth:`~p2ptrain.dht.reads.Reader.get`). Peers that join closer to a key
meanwhile take the place of the farthest replicas as soon as this node has met them (its routing
table's answering contacts are merged in, at most every ``NEWCOMERS_CHECK``): a lookup costs about
``k`` queries of ``k`` contacts each, and with one every 30 s per key written (a progress record, the
peer list, what is re-published) those were half of a 32-peer swarm's control bytes. Peers that join
closer to a key and that this node has not met are heard of from the replicas themselves: every
``NEWCOMERS_CHECK`` a direct read asks the replica it asks first for its nearest contacts too. Those
closer than the farthest replica remembered, up to ``MAX_PROBED`` of them, the reader then asks itself,
and each that answers takes the place of a farthest replica at the address its connection proved
(hearsay never becomes a replica by being named: only by answering, as a lookup would have found it).
More than ``MAX_PROBED`` of them make the next store look the replicas up again. (Each heard-of peer
used to start a whole lookup, about ``k`` queries of ``k`` contacts each: at 256 simulated peers, 1.8
lookups a peer a step, about half of its ``dht.find_node`` bytes.) Before that, such peers got this
node's records from the maintenance's re-replication alone (every ``replicate_interval``, 600 s), and the
replicas stayed as they were for ``TARGETS_TTL``: in a swarm that grew while it wrote, a writer's early
lookup left out the peers that joined closest to its key, readers that had met them read those and missed
its records, for minutes (128 simulated DHT nodes joining over 32 s, each writing and reading one key:
readers that held 122 of the 128 live records at every read for the minute after the last join; 40 nodes
with 5 replicas a key: 75% of the records for a tenth of the reads).
Two shortcuts for a swarm smaller than the DHT's parameters:

- Fewer than ``replication`` replicas found means every peer the lookup found is one: the routing
  table's answering contacts met since are added at once (else a peer's first records, stored while it
  knew a few peers, reached only those until the next lookup, and a read of two replicas missed them).
- A lookup that found fewer than ``k`` peers asked every peer it heard of: for ``SWARM_TTL`` after, any
  key's replicas are the closest of those and of the routing table's answering contacts (newcomers
  call us and land there), with no lookup per key (a new group key each round, a record's replicas
  every ``TARGETS_TTL``: most of a small swarm's lookups). A peer that fails a store leaves that set.

:class:`Replicas` owns this memory and does no I/O: whoever needs a key's replicas asks
:meth:`Replicas.cached` first, and only where it answers None runs the lookup and hands its result to
:meth:`Replicas.found`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..identity import PeerID
from .routing import Contact, RoutingTable, distance

MAX_TARGET_KEYS = 256  # keys whose replicas a node remembers ...
TARGETS_TTL = 300.0  # ... for this many seconds at most (less: a store that a replica failed or refused)
MAX_DOUBTED = 64  # peers heard of as closer to a key, not found by the lookup since, kept per key
MAX_PROBED = 3  # peers heard of as closer to a key that a read asks itself (more: a lookup again) ...
MAX_ADDRESSES = 2  # ... at up to this many addresses each (a liar may name a true id at a false one)
NEWCOMERS_CHECK = 10.0  # how often the peers met since join a remembered key's replicas (see known)
SWARM_TTL = 120.0  # how long an exhaustive lookup stands for the whole swarm (peers met since: the table)


def in_places(targets: list[Contact], closest: list[Contact]) -> list[Contact]:
    """The replicas ``closest`` in the order ``targets`` had them, the new ones after (a replica demoted
    for being slow stays last)."""
    keep = {c.peer_id for c in closest}
    kept = [c for c in targets if c.peer_id in keep]
    had = {c.peer_id for c in kept}
    return kept + [c for c in closest if c.peer_id not in had]


@dataclass
class _Known:
    until: float  # looked up again from then on
    checked: float  # when the peers met since were last merged in
    targets: list[Contact]  # closest to the key first
    asked: float  # when a replica was last asked for its nearest contacts (see ``ask_nearest``)
    doubted: frozenset[PeerID] = frozenset()  # heard of as closer, not found by the lookup since
    silent: frozenset[Contact] = frozenset()  # heard of as closer, asked there, no answer (``probed``)


class Replicas:
    """The replicas of the keys this node stored under lately (see the module docstring)."""

    def __init__(self, table: RoutingTable, *, k: int, replication: int, clock: Callable[[], float]) -> None:
        self._table = table
        self._k = k
        self._replication = replication
        self._clock = clock
        self._targets: dict[bytes, _Known] = {}  # key id -> its replicas
        self._swarm: tuple[float, dict[PeerID, Contact]] | None = None  # (until, every peer)
        self._heard: dict[bytes, frozenset[PeerID]] = {}  # key id -> closer peers heard of (a lookup due)

    def cached(self, kid: bytes, now: float) -> list[Contact] | None:
        """A key's replicas without a lookup: remembered, else from the swarm's last exhaustive lookup
        (then remembered from now on); None: look them up (and hand the result to :meth:`found`)."""
        remembered = self.known(kid)
        if remembered is not None:
            return remembered
        targets = self._from_swarm(kid, now)
        if targets is not None:
            self._remember(kid, targets, now)
        return targets

    def found(self, kid: bytes, closest: list[Contact], now: float) -> list[Contact]:
        """A lookup begun at ``now`` found ``closest`` for ``kid``: its replicas, remembered."""
        targets = closest[: self._replication]
        if len(closest) < self._k:  # (every candidate it heard of was asked)
            self._swarm = (now + SWARM_TTL, {c.peer_id: c for c in closest})
        self._remember(kid, targets, now)
        return targets

    def _remember(self, kid: bytes, targets: list[Contact], now: float) -> None:
        # peers heard of as closer that this lookup did not find (gone, or not answering): no lookup
        # again for them while these replicas stand
        heard = self._heard.pop(kid, frozenset())
        doubted = heard - {c.peer_id for c in targets}
        self._targets[kid] = _Known(now + TARGETS_TTL, now, targets, now, doubted)
        while len(self._targets) > MAX_TARGET_KEYS:
            self._targets.pop(next(iter(self._targets)))

    def known(self, kid: bytes) -> list[Contact] | None:
        """The replicas a store under ``kid`` found lately, with the peers met since that are closer to
        the key than the farthest of them in their places (every peer met, where every peer is one);
        None: none within ``TARGETS_TTL``."""
        cached = self._targets.get(kid)
        now = self._clock()
        if cached is None or cached.until <= now:
            return None
        if len(cached.targets) < self._replication or now >= cached.checked + NEWCOMERS_CHECK:
            cached.checked = now
            closest = self._closest(kid, {c.peer_id: c for c in cached.targets})
            cached.targets = in_places(cached.targets, closest)
        return list(cached.targets)

    def ask_nearest(self, kid: bytes) -> bool:
        """Whether a direct read of ``kid`` now asks its first replica for its nearest contacts too:
        once every ``NEWCOMERS_CHECK`` per key (see the module docstring)."""
        cached = self._targets.get(kid)
        now = self._clock()
        if cached is None or now < cached.asked + NEWCOMERS_CHECK:
            return False
        cached.asked = now
        return True

    def heard(self, kid: bytes, contacts: list[Contact]) -> list[Contact]:
        """A replica of ``kid`` named ``contacts`` as its nearest: those that this node does not doubt
        and that are closer to the key than the farthest replica remembered (or any, while the replicas
        are fewer than ``replication``), closest first, at each address they were named at (up to
        ``MAX_ADDRESSES``), for the reader to ask themselves (then :meth:`probed`). Where more than
        ``MAX_PROBED`` are, the replicas are forgotten instead (the next store or read looks them up
        again) and none is returned."""
        cached = self._targets.get(kid)
        if cached is None:
            return []
        have = {c.peer_id for c in cached.targets} | {self._table.local}
        # (the farthest by distance, not the last: a replica demoted for being slow, or one that took
        # a place since, may stand last)
        farthest = (
            max(distance(c.peer_id.digest, kid) for c in cached.targets)
            if len(cached.targets) >= self._replication
            else None
        )
        # (each address named: a liar that names a true id at a false address does not hide the one
        # the id was named at by others)
        closer: dict[PeerID, list[Contact]] = {}
        for c in contacts:
            if (
                c.peer_id not in have
                and c.peer_id not in cached.doubted
                and c not in cached.silent
                and (farthest is None or distance(c.peer_id.digest, kid) < farthest)
            ):
                named = closer.setdefault(c.peer_id, [])
                if c not in named and len(named) < MAX_ADDRESSES:
                    named.append(c)
        if len(closer) <= MAX_PROBED:
            ids = sorted(closer, key=lambda p: distance(p.digest, kid))
            return [c for p in ids for c in closer[p]]
        # (a replica that names fresh ids each time costs at most a lookup per ``NEWCOMERS_CHECK``;
        # the ids kept to doubt are bounded)
        self._heard[kid] = frozenset(list(closer.keys() | cached.doubted)[:MAX_DOUBTED])
        while len(self._heard) > MAX_TARGET_KEYS:
            self._heard.pop(next(iter(self._heard)))
        self.drop(kid)
        return []

    def probed(self, kid: bytes, answered: list[Contact], silent: list[Contact]) -> None:
        """Peers heard of as closer to ``kid`` (:meth:`heard`) were asked themselves: those that
        ``answered`` take the places of the farthest replicas; the ``silent`` ones are not asked at
        those addresses again while these replicas stand (a true id that a liar named at a false
        address is still asked where another replica names it)."""
        cached = self._targets.get(kid)
        if cached is None:
            return
        merged = {c.peer_id: c for c in cached.targets}
        for c in answered:
            merged.setdefault(c.peer_id, c)
        closest = sorted(merged.values(), key=lambda c: distance(c.peer_id.digest, kid))
        cached.targets = in_places(cached.targets, closest[: self._replication])
        cached.silent = frozenset(list(cached.silent | set(silent))[:MAX_DOUBTED])

    def remembered(self, kid: bytes) -> list[Contact] | None:
        """The replicas remembered for ``kid`` as they stand, expired or not (None: none)."""
        cached = self._targets.get(kid)
        return None if cached is None else list(cached.targets)

    def demote(self, kid: bytes, contact: Contact, among: int = 1) -> None:
        """``contact``, asked first for ``kid``, was slow: where it is still among the ``among`` closest
        (a reader asks first one of those: ``reads.first_asked``), it goes last."""
        cached = self._targets.get(kid)
        if cached is not None and contact in cached.targets[:among]:
            cached.targets.remove(contact)
            cached.targets.append(contact)

    def drop(self, kid: bytes) -> None:
        """A replica of ``kid`` failed or refused: the next read and store look them up again."""
        self._targets.pop(kid, None)

    def forget(self, peer: PeerID) -> None:
        """``peer`` failed a store: no key's replica from the swarm's set, until a lookup finds it again."""
        if self._swarm is not None:
            self._swarm[1].pop(peer, None)

    def _from_swarm(self, kid: bytes, now: float) -> list[Contact] | None:
        """A key's replicas from the last exhaustive lookup and the routing table; None (look them up):
        none lately, or the swarm has grown to ``k`` peers since."""
        if self._swarm is None or self._swarm[0] <= now:
            return None
        peers = self._closest(kid, dict(self._swarm[1]), limit=self._k)
        return None if len(peers) >= self._k else peers[: self._replication]

    def _closest(self, kid: bytes, peers: dict[PeerID, Contact], limit: int | None = None) -> list[Contact]:
        """``peers`` and the routing table's answering contacts, closest to ``kid`` first (at most
        ``limit``, default ``replication``)."""
        for c in self._table.answering():
            peers.setdefault(c.peer_id, c)
        by_distance = sorted(peers.values(), key=lambda c: distance(c.peer_id.digest, kid))
        return by_distance[: limit or self._replication]
