"""The iterative Kademlia lookup as a pure state machine.

Theory of operation: a lookup keeps every candidate it has heard of, sorted by XOR distance to the
target. The driver asks :meth:`Lookup.next_queries` for up to ``alpha`` contacts to query in parallel,
and reports each answer (:meth:`on_response`, with the contacts it returned) or failure
(:meth:`on_failure`). The lookup is finished when the ``k`` closest candidates that have not failed have
all answered, or when no candidate is left to ask, or when the driver calls :meth:`stop` (a value lookup
that has what it needs). Malformed or unhelpful answers cost one query, never the lookup.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ..identity import PeerID
from .routing import Contact

PENDING, IN_FLIGHT, ANSWERED, FAILED = "pending", "in-flight", "answered", "failed"
MAX_TRIES = 2
"""Addresses tried per candidate: the first heard, and one other if that one failed."""


@dataclass
class Candidate:
    """A peer the lookup heard of: where it was told to ask it, how far it is, and how asking went."""

    contact: Contact
    distance: int
    state: str = PENDING
    tries: int = 0
    hops: int = 1  # queries on the chain that named it (a seed from the routing table: 1)


class Lookup:
    def __init__(
        self,
        target: bytes,
        seeds: list[Contact],
        *,
        local: PeerID,
        k: int = 20,
        alpha: int = 3,
        max_candidates: int = 1000,
    ) -> None:
        self.target = target
        self.k = k
        self.alpha = alpha
        self.local = local
        self.max_candidates = max_candidates
        self._t = int.from_bytes(target, "big")
        self._cands: dict[PeerID, Candidate] = {}
        self._stopped = False
        self.queries = 0
        self._add(seeds)

    def _add(self, contacts: list[Contact], hops: int = 1) -> int:
        added = 0
        for c in contacts:
            if c.peer_id == self.local:
                continue
            known = self._cands.get(c.peer_id)
            if known is not None:
                self._maybe_retry(known, c)
                continue
            d = int.from_bytes(c.peer_id.digest, "big") ^ self._t
            if len(self._cands) >= self.max_candidates and not self._make_room(d):
                continue
            self._cands[c.peer_id] = Candidate(c, d, hops=hops)
            added += 1
        return added

    def _maybe_retry(self, cand: Candidate, contact: Contact) -> None:
        """A failed candidate reported at another address gets one more try there.

        Otherwise a liar who answers first with a false address for a true id would hide that peer
        from the lookup for good. Tries are capped, so liars cannot make us query a peer forever.
        """
        if cand.state == FAILED and cand.tries < MAX_TRIES and contact.address != cand.contact.address:
            cand.contact, cand.state = contact, PENDING

    def _make_room(self, d: int) -> bool:
        """At the cap, drop the farthest candidate neither in flight nor failed, if farther than ``d``.

        Keeping the first ``max_candidates`` heard of instead would stop a full lookup from learning
        closer contacts, and it would end on the wrong k. Failed candidates stay, so they are not retried.
        """
        evictable = [c for c in self._cands.values() if c.state in (PENDING, ANSWERED)]
        if not evictable:
            return False
        far = max(evictable, key=lambda c: c.distance)
        if far.distance <= d:
            return False
        del self._cands[far.contact.peer_id]
        return True

    def _frontier(self) -> list[Candidate]:
        """The k closest candidates that have not failed, closest first."""
        alive = [c for c in self._cands.values() if c.state != FAILED]
        alive.sort(key=lambda c: c.distance)
        return alive[: self.k]

    @property
    def candidates(self) -> Mapping[PeerID, Candidate]:
        """Every candidate the lookup holds, by peer (a read-only view)."""
        return MappingProxyType(self._cands)

    @property
    def in_flight(self) -> int:
        return sum(1 for c in self._cands.values() if c.state == IN_FLIGHT)

    def next_queries(self) -> list[Contact]:
        """Contacts to query now (marked in flight); empty when nothing more should start."""
        if self._stopped:
            return []
        room = self.alpha - self.in_flight
        out = []
        for cand in self._frontier():
            if room <= 0:
                break
            if cand.state == PENDING:
                cand.state = IN_FLIGHT
                cand.tries += 1
                out.append(cand.contact)
                room -= 1
        self.queries += len(out)
        return out

    def on_response(self, peer: PeerID, contacts: list[Contact]) -> int:
        """``peer`` answered with ``contacts``; returns how many new candidates that added."""
        cand = self._cands.get(peer)
        if cand is None or cand.state != IN_FLIGHT:
            return 0
        cand.state = ANSWERED
        return self._add(contacts, cand.hops + 1)

    def on_failure(self, peer: PeerID) -> None:
        cand = self._cands.get(peer)
        if cand is not None and cand.state == IN_FLIGHT:
            cand.state = FAILED

    def stop(self) -> None:
        self._stopped = True

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def finished(self) -> bool:
        if self._stopped:
            return self.in_flight == 0
        front = self._frontier()
        return all(c.state == ANSWERED for c in front)

    def closest(self, count: int | None = None) -> list[Contact]:
        """The closest contacts that answered, closest first."""
        answered = [c for c in self._cands.values() if c.state == ANSWERED]
        answered.sort(key=lambda c: c.distance)
        return [c.contact for c in answered[: self.k if count is None else count]]

    @property
    def hops(self) -> int:
        """Hops to the closest peer that answered: the length of the chain of answers that led to it
        (1: the routing table knew it already; 0: nobody answered)."""
        answered = [c for c in self._cands.values() if c.state == ANSWERED]
        return min(answered, key=lambda c: c.distance).hops if answered else 0

    def failed(self) -> list[PeerID]:
        return [p for p, c in self._cands.items() if c.state == FAILED]
