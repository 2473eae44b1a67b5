"""Reaching the round's decision: reports, the coordinator's decision, and relaying it.

Theory of operation: each reducer reports to the coordinator (member 0) whom it received
(:meth:`DecisionExchange.obtain`); the coordinator decides once every reducer reported or at the decision
deadline (:meth:`DecisionExchange.coordinate`; the rule is ``agreement``'s) and answers every report with
its signed decision (``serving``). A member that lost the coordinator asks the other members for the
decision until the gather deadline; a decision is taken only with the coordinator's valid signature over
this round. However it arrives, the decision is settled once (:meth:`DecisionExchange.settle`): the round
machine turns it into this member's plan, and a failed reducer's partition that the plan gives this
member gets its reducer here at once, before any contributor re-sends a slice of it.
"""

from __future__ import annotations

import logging

import trio

from ..errors import P2PError, RoundTimedOut
from ..net.host import Host
from .gathering import RELAY_RETRY, time_left
from .protocol import RELAY_DECISION, REPORT, Decision, RelayDecisionReq, open_decision, seal_decision
from .round_machine import RoundMachine
from .round_tensors import RoundTensors
from .signals import RoundSignals

log = logging.getLogger("p2ptrain.averaging.allreduce")  # (the round's lines, as before)

ASK_TIMEOUT = 5.0  # seconds one member may take to answer whether it holds the decision


class DecisionExchange:
    """The calls that bring this member the round's decision (handed the round's machine and memory)."""

    def __init__(
        self, host: Host, machine: RoundMachine, tensors: RoundTensors, signals: RoundSignals
    ) -> None:
        self.host, self.m, self.t, self.sig = host, machine, tensors, signals
        self.addrs = [mm.addr for mm in machine.manifest.members]
        self.tag = machine.digest.hex()[:8]

    async def coordinate(self) -> None:
        """As coordinator: decide once every reducer reported, or at the decision deadline."""
        m = self.m
        m.report_own(self.t.delivered(m.me))
        while not m.ready_to_decide(trio.current_time()):
            await self.sig.changed.wait_until(m.at.decide)
        decision, capped = m.decide()
        self.settle(decision, None)
        for i, claimed, allowed in capped:
            # (rates lag: honest peers overshoot a little; a liar claims far more)
            log.log(
                logging.WARNING if claimed > 2 * allowed else logging.INFO,
                "round %s: %s claimed weight %g, more than its records make plausible: counted as %g",
                self.tag,
                m.name(i),
                claimed,
                allowed,
            )

    def settle(self, decision: Decision, signed: bytes | None) -> None:
        """Take the decision (once): the machine's plan, and the reducers it gives this member."""
        if self.m.decision is not None:
            return
        plan = self.m.settle(
            decision, seal_decision(self.host.identity, decision) if signed is None else signed
        )
        assert plan is not None
        for p, own in plan.take_over:
            if p not in self.t.reducers:
                self.t.reduce(p, own)
        if plan.drop_own:  # we were too slow to report: our partition went elsewhere
            self.t.stop_reducing(self.m.me)
        self.sig.decided.set()
        self.sig.wake()

    async def obtain(self) -> Decision:
        """The decision: our own as coordinator, else from the coordinator or, failing it, any member."""
        m = self.m
        if m.me != 0:
            await self._report()
            while m.decision is None and trio.current_time() < m.at.gather:
                await self._ask_for_decision()
        with trio.move_on_at(m.at.gather):
            await self.sig.decided.wait()
        if m.decision is None:
            raise RoundTimedOut("no decision from the coordinator or any member before the deadline")
        return m.decision

    async def _report(self) -> None:
        m = self.m
        req = m.report(self.t.delivered(m.me))
        try:
            with trio.fail_after(max(0.0, m.at.await_decision - trio.current_time())):
                conn = await self.host.connect(self.addrs[0])
                reply = await conn.call_with_body(REPORT, req, timeout=time_left(m.at.await_decision))
            if reply.message.known:
                self._accept(bytes(reply.body))
        except (P2PError, trio.TooSlowError) as e:
            log.info("no decision from the coordinator %s: %s", m.name(0), e)

    async def _ask_for_decision(self) -> None:
        m = self.m

        async def ask(i: int) -> None:
            try:
                with trio.fail_after(max(0.0, min(m.at.gather - trio.current_time(), ASK_TIMEOUT))):
                    conn = await self.host.connect(self.addrs[i])
                    reply = await conn.call_with_body(RELAY_DECISION, RelayDecisionReq(m.digest))
                if reply.message.known:
                    self._accept(bytes(reply.body))
            except (P2PError, trio.TooSlowError):
                pass

        async with trio.open_nursery() as nursery:
            for i, addr in enumerate(self.addrs):
                if i != m.me and addr:
                    nursery.start_soon(ask, i)
        if m.decision is None:
            await trio.sleep(RELAY_RETRY)

    def _accept(self, data: bytes) -> None:
        m = self.m
        try:
            decision = open_decision(data, m.peers[0], m.digest, m.n)
        except P2PError as e:
            log.warning("ignoring a bad decision for round %s: %s", self.tag, e)
            return
        self.settle(decision, data)
