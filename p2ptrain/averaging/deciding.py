"""The deciding side of an all-reduce round: reports, the coordinator's decision, and relaying it.

Each reducer reports to the coordinator (member 0) whom it received (``_report``); the coordinator
decides once every reducer reported or at the decision deadline (``_coordinate``; see ``agreement``)
and answers every report with its signed decision. A member that lost the coordinator asks the other
members for the decision (``_ask_for_decision``) until the gather deadline; a decision is taken only
with the coordinator's valid signature over this round. A decision that names this member as a failed
reducer's replacement prepares that partition's reducer (``_prepare_replacements``).

:class:`RoundDeciding` is a mixin of :class:`~p2ptrain.averaging.allreduce.AllReduceRound`, which owns
the attributes declared below.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from ..errors import P2PError, RoundTimedOut
from ..identity import PeerID
from ..net.host import Host
from .agreement import Coordinator
from .gathering import RELAY_RETRY, time_left
from .protocol import (
    RELAY_DECISION,
    REPORT,
    Decision,
    Manifest,
    RelayDecisionReq,
    ReportReq,
    open_decision,
    seal_decision,
)
from .reducer import PartitionReducer
from .serving import Signal

log = logging.getLogger("p2ptrain.averaging.allreduce")  # (the round's lines, as before)


class RoundDeciding:
    """Reporting, deciding and obtaining the round's decision (a mixin)."""

    # Owned by AllReduceRound:
    host: Host
    manifest: Manifest
    digest: bytes
    peers: list[PeerID]
    n: int
    me: int
    weight: float
    deadline: dict[str, float]
    reducers: dict[int, PartitionReducer]
    unreachable: set[int]
    coordinator: Coordinator | None
    decision: Decision | None
    decision_bytes: bytes
    decided: trio.Event
    changed: Signal
    published: Signal
    name: Callable[[int], str]
    _new_reducer: Callable[[int, float | None], PartitionReducer]

    async def _coordinate(self) -> None:
        """As coordinator: decide once every reducer reported, or at the decision deadline."""
        assert self.coordinator is not None
        own = self.reducers.get(self.me)
        if own is not None:
            self.coordinator.report(self.me, own.delivered)
        while not self.coordinator.ready() and trio.current_time() < self.deadline["decide"]:
            await self.changed.wait_until(self.deadline["decide"])
        self._set_decision(self.coordinator.decide(), None)
        for i, (claimed, allowed) in self.coordinator.capped.items():
            # (rates lag: honest peers overshoot a little; a liar claims far more)
            log.log(
                logging.WARNING if claimed > 2 * allowed else logging.INFO,
                "round %s: %s claimed weight %g, more than its records make plausible: counted as %g",
                self.digest.hex()[:8],
                self.name(i),
                claimed,
                allowed,
            )

    def _set_decision(self, decision: Decision, signed: bytes | None) -> None:
        if self.decision is not None:
            return
        if signed is None:
            signed = seal_decision(self.host.identity, decision)
        self.decision, self.decision_bytes = decision, signed
        if not decision.abort:
            self._prepare_replacements(decision)
        self.decided.set()
        self.changed.fire()
        self.published.fire()

    async def _obtain_decision(self) -> Decision:
        if self.me != 0:
            await self._report()
            while self.decision is None and trio.current_time() < self.deadline["gather"]:
                await self._ask_for_decision()
        with trio.move_on_at(self.deadline["gather"]):
            await self.decided.wait()
        if self.decision is None:
            raise RoundTimedOut("no decision from the coordinator or any member before the deadline")
        return self.decision

    async def _report(self) -> None:
        own = self.reducers.get(self.me)
        req = ReportReq(
            self.digest,
            tuple(sorted(own.delivered)) if own else None,
            tuple(own.delivered[i] for i in sorted(own.delivered)) if own else (),
            tuple(sorted(self.unreachable)),
        )
        try:
            with trio.fail_after(max(0.0, self.deadline["await"] - trio.current_time())):
                conn = await self.host.connect(self.manifest.members[0].addr)
                reply = await conn.call_with_body(REPORT, req, timeout=time_left(self.deadline["await"]))
            if reply.message.known:
                self._accept_decision(bytes(reply.body))
        except (P2PError, trio.TooSlowError) as e:
            log.info("no decision from the coordinator %s: %s", self.name(0), e)

    async def _ask_for_decision(self) -> None:
        async def ask(i: int) -> None:
            try:
                with trio.fail_after(max(0.0, min(self.deadline["gather"] - trio.current_time(), 5.0))):
                    conn = await self.host.connect(self.manifest.members[i].addr)
                    reply = await conn.call_with_body(RELAY_DECISION, RelayDecisionReq(self.digest))
                if reply.message.known:
                    self._accept_decision(bytes(reply.body))
            except (P2PError, trio.TooSlowError):
                pass

        async with trio.open_nursery() as nursery:
            for i, m in enumerate(self.manifest.members):
                if i != self.me and m.addr:
                    nursery.start_soon(ask, i)
        if self.decision is None:
            await trio.sleep(RELAY_RETRY)

    def _accept_decision(self, data: bytes) -> None:
        try:
            decision = open_decision(data, self.peers[0], self.digest, self.n)
        except P2PError as e:
            log.warning("ignoring a bad decision for round %s: %s", self.digest.hex()[:8], e)
            return
        self._set_decision(decision, data)

    def _prepare_replacements(self, decision: Decision) -> None:
        for f, r in zip(decision.failed, decision.replacements, strict=True):
            if r == self.me and f not in self.reducers:
                own = self.weight if self.me in decision.contributors else None
                self.reducers[f] = self._new_reducer(f, own)
        if self.me in decision.failed:  # we were too slow to report: our partition went elsewhere
            self.reducers.pop(self.me, None)
