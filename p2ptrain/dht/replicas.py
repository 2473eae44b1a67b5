"""Where a key's records go: its replicas, found once and remembered.

Functions of a :class:`~p2ptrain.dht.service.DHT` (its ``_replicas`` and ``known_replicas`` call them).
A store goes to the key's ``replication`` closest peers, looked up once per ``TARGETS_TTL`` (a peer
publishing a record every few seconds looked them up every time), and again after a store that a
replica failed or refused; a read of a key stored under lately asks those replicas directly (see
``reads.read_replicas``). Peers that join closer to a key meanwhile get its records from
``upkeep.replicate``. Two shortcuts for a swarm smaller than the DHT's parameters:

- Fewer than ``replication`` replicas found means every peer the lookup found is one: the routing
  table's answering contacts met since are added at once (else a peer's first records, stored while it
  knew a few peers, reached only those for ``TARGETS_TTL``, and a read of two replicas missed them).
- A lookup that found fewer than ``k`` peers asked every peer it heard of: for ``SWARM_TTL`` after, any
  key's replicas are the closest of those and of the routing table's answering contacts (newcomers
  call us and land there), with no lookup per key (a new group key each round, a record's replicas
  every ``TARGETS_TTL``: most of a small swarm's lookups). A peer that fails a store leaves that set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..identity import PeerID
from .routing import Contact

if TYPE_CHECKING:
    from .service import DHT

MAX_TARGET_KEYS = 256  # keys whose replicas a node remembers ...
TARGETS_TTL = 30.0  # ... for this many seconds
SWARM_TTL = 120.0  # how long an exhaustive lookup stands for the whole swarm (peers met since: the table)


async def find(dht: DHT, kid: bytes) -> list[Contact]:
    """The peers to store a key on: remembered, else from the swarm's last exhaustive lookup, else
    looked up."""
    now = dht.clock()
    remembered = known(dht, kid)
    if remembered is not None:
        return remembered
    targets = _from_swarm(dht, kid, now)
    if targets is None:
        closest = await dht.find_node(kid)
        targets = closest[: dht.config.replication]
        if len(closest) < dht.config.k:  # (every candidate it heard of was asked)
            dht._swarm = (now + SWARM_TTL, {c.peer_id: c for c in closest})
    dht._targets[kid] = (now + TARGETS_TTL, targets)
    while len(dht._targets) > MAX_TARGET_KEYS:
        dht._targets.pop(next(iter(dht._targets)))
    return targets


def known(dht: DHT, kid: bytes) -> list[Contact] | None:
    """The replicas a store under ``kid`` found lately, with the peers met since where every peer is
    one; None: none within ``TARGETS_TTL``."""
    cached = dht._targets.get(kid)
    if cached is None or cached[0] <= dht.clock():
        return None
    if len(cached[1]) < dht.config.replication:
        grown = _closest(dht, kid, {c.peer_id: c for c in cached[1]})
        if len(grown) > len(cached[1]):
            cached = dht._targets[kid] = (cached[0], grown)
    return cached[1]


def forget(dht: DHT, peer: PeerID) -> None:
    """``peer`` failed a store: no key's replica from the swarm's set, until a lookup finds it again."""
    if dht._swarm is not None:
        dht._swarm[1].pop(peer, None)


def _from_swarm(dht: DHT, kid: bytes, now: float) -> list[Contact] | None:
    """A key's replicas from the last exhaustive lookup and the routing table; None (look them up):
    none lately, or the swarm has grown to ``k`` peers since."""
    if dht._swarm is None or dht._swarm[0] <= now:
        return None
    peers = _closest(dht, kid, dict(dht._swarm[1]), limit=dht.config.k)
    return None if len(peers) >= dht.config.k else peers[: dht.config.replication]


def _closest(dht: DHT, kid: bytes, peers: dict[PeerID, Contact], limit: int | None = None) -> list[Contact]:
    """``peers`` and the routing table's answering contacts, closest to ``kid`` first (at most
    ``limit``, default ``replication``)."""
    for c in dht.table.answering():
        peers.setdefault(c.peer_id, c)
    t = int.from_bytes(kid, "big")
    by_distance = sorted(peers.values(), key=lambda c: int.from_bytes(c.peer_id.digest, "big") ^ t)
    return by_distance[: limit or dht.config.replication]
