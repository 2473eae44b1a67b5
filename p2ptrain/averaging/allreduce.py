"""One butterfly all-reduce round on trio: the driver that does the round's streaming I/O.

Theory of operation: the round's decisions are pure and live in :class:`~.round_machine.RoundMachine`
(read its docstring for the phases: scatter, decide, re-reduce, gather, commit or abort); the memory it
works on lives in :class:`~.round_tensors.RoundTensors`. This driver owns both and the tasks around them:

- the scatter: streams this member's slice of every partition to its reducer (chunks, with
  backpressure), while the partition reduced here is accumulated as its chunks arrive (``serving``);
- the decision: reports and the coordinator's decision travel through ``deciding``;
- after it, the plan: void early results of failed reducers, re-send our slices to their replacements,
  finalize the partitions reduced here over exactly the decided contributors (attested in an audited
  round), and fetch every partition (``gathering``, with relays when a holder fails or stalls);
- the commit: once every partition is held, the averages go into the caller's tensors; else the round
  raises :class:`RoundAborted` and the caller's tensors are untouched (an in-place round's excepted).

Pipelined gather (plain means, rounds not audited): from the start of the round each member also fetches
every other partition early, and its reducer serves chunk ``k`` of the mean as soon as every member's
chunk ``k`` is in. Once the decision is in, the reducer answers whether those chunks are the result: they
are when the decision names every member with the weight it sent, and then nothing is sent again.
Otherwise they are void and the member fetches as usual. So the links do not idle between the phases.

Where to look: a reducer's failure (declared by the coordinator, re-reduced by its replacement, relayed
around when it hangs) is ``round_machine`` and ``agreement``; the RPC handlers are ``serving``; fetches
and relays are ``gathering``; the decision's calls are ``deciding``. The round keeps serving fetches and
relays after its own member commits, until every member has fetched or the round's time is up.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch
import trio

from ..errors import P2PError, RemoteCallError, RoundAborted, RoundTimedOut, passing
from ..identity import PeerID
from ..net.host import Host
from .agreement import excluded_reasons
from .audit import Attestation, hash_pieces, seal_attestation
from .bandwidth import RateMeter, Rates
from .bounds import ResultHistory, Scale
from .buffers import BufferPool
from .compression import Compression, all_finite
from .deciding import DecisionExchange
from .gathering import Gatherer, time_left
from .offload import run_pass
from .protocol import LEFT_ROUND, PART, Ack, Decision, PartReq, SignedManifest
from .reducer import PartitionReducer
from .round_machine import GONE_AFTER, SCATTER, Deadlines, RoundMachine
from .round_tensors import RoundTensors
from .serving import RoundServer
from .signals import RoundSignals
from .spill import Spilled, SpillFile

FINALIZE_PASSES = 8  # passes over a partition finalizing it takes, about (the trust check's Gram matrix)

log = logging.getLogger(__name__)

__all__ = ["GONE_AFTER", "SCATTER", "AllReduceRound", "FaultHook", "RoundEvidence", "RoundResult"]

WATCH_EVERY = 0.1  # seconds between looks at the members' connections
RETRY = 0.25  # seconds between a slice's tries, where its reducer failed it for a moment (``_deliver``)


@dataclass
class RoundResult:
    """What an averaging round produced for this member."""

    round: bytes  # the digest of the signed manifest
    tensors: list[torch.Tensor]  # the caller's tensors, now holding the average
    contributors: list[PeerID]
    total_weight: float
    group_size: int
    reduced: int = 0  # elements of the flat vector this member reduced (its share, from its bandwidth)
    shares: dict[PeerID, int] = field(default_factory=dict)  # every member's share (the manifest's)
    excluded: dict[PeerID, str] = field(default_factory=dict)  # members left out, and why
    # Contributors whose slices every partition reduced here judged useful work (see ``trust``): the
    # only ones this member may trust for the round. Empty when it reduced nothing (client-only).
    verified: list[PeerID] = field(default_factory=list)
    round_seconds: float = 0.0  # from the manifest to holding the average
    matchmaking_seconds: float = 0.0  # finding the group (0 when the caller brought the manifest)
    phases: dict[str, float] = field(default_factory=dict)  # seconds from the round's start to each phase
    evidence: RoundEvidence | None = None  # audited rounds: what this member needs to audit and be audited
    rates: Rates = field(default_factory=Rates)  # what this member's links carried (see ``bandwidth``)
    # Set once no member can read this member's tensors any more (an in-place round relays from them).
    retired: trio.Event = field(default_factory=trio.Event)


@dataclass
class RoundEvidence:
    """What an audited round leaves behind on a member for the audit after it (see ``audit``)."""

    digest: bytes
    manifest: bytes  # the signed manifest (its hash is ``digest``): part of a proof against a reducer
    peers: list[PeerID]
    addresses: list[str]  # "" for client-only members
    sizes: list[int]
    mode: Compression
    aggregation: str
    origins: tuple[int, ...]  # the manifest's origins (see ``robust.by_origin``)
    holders: dict[int, int]  # partition -> the member that reduced it
    attestations: dict[int, bytes]  # partition -> the signed attestation fetched with its result
    sent: dict[int, bytes]  # partition -> the bytes this member sent its reducer (as committed)
    local: dict[int, bytes]  # partition this member reduced -> its own slice, raw float32 (as committed)


FaultHook = Callable[["AllReduceRound", str], Awaitable[None]]
"""Awaited at each named point of a round (tests crash or delay a member there)."""


class AllReduceRound:
    """A member's side of one round: owns the round's machine, memory and signals, and runs its tasks.
    The averager dispatches the round's calls to :attr:`server`."""

    def __init__(
        self,
        host: Host,
        signed: SignedManifest,
        flat: torch.Tensor,
        weight: float,
        tensors: list[torch.Tensor],
        *,
        clock_start: float | None = None,
        fault: FaultHook | None = None,
        pool: BufferPool | None = None,
        source: torch.Tensor | None = None,
        backup: SpillFile | None = None,
        own_saved: Spilled | None = None,
        caps: dict[int, float] | None = None,
        history: ResultHistory | None = None,
        own_scales: list[Scale] | None = None,
        deferred: bool = False,
    ) -> None:
        """``flat``, ``source``, ``backup``, ``own_saved``, ``own_scales``: see :class:`RoundTensors` (in
        place: ``flat`` is the caller's own tensor, which must not change before ``retired`` is set).
        ``caps``: the most weight this member finds plausible per member (see ``agreement``).
        ``history``: this member's accepted results, which bound results where it sends only zeros (see
        ``bounds``). ``deferred``: the caller calls :meth:`prepare` (in a worker thread, for a large
        vector) before anything can reach the round."""
        m = signed.manifest
        self.host, self.signed, self.manifest, self.digest = host, signed, m, signed.digest
        self.peers = m.peers()
        me = self.peers.index(host.identity.peer_id)
        start = trio.current_time() if clock_start is None else clock_start
        self.machine = RoundMachine(m, self.digest, me, weight, Deadlines.of(start, m.timeout), caps)
        self.tensors = RoundTensors(
            host.identity,
            m,
            self.digest,
            me,
            weight,
            flat,
            tensors,
            pool=pool,
            source=source,
            backup=backup,
            own_saved=own_saved,
            history=history.get(m.schema) if history is not None else None,
            prior=history.prior(m.schema, flat.numel()) if history is not None else None,
            own_scales=own_scales,
        )
        self.history = history
        self.signals = RoundSignals()
        self.meter = RateMeter(host.delivered_traffic, trio.current_time)
        self.fault = fault
        self.phases: dict[str, float] = {}
        # Pipelined rounds (plain means, not audited): each reducer serves its partition's mean chunk by
        # chunk while the scatter is still running, and members fetch it early.
        self.pipelined = m.aggregation == "mean" and not m.audit
        self._weight = weight
        # Set once this member's tensors hold the round's result: a deadline that passes after that is
        # no timeout (the caller's tensors changed; an abort must leave them untouched).
        self.committed: RoundResult | None = None
        if not deferred:
            self.prepare()
        self.server = RoundServer(self.machine, self.tensors, self.signals, self.meter, self._point)
        self.gatherer = Gatherer(host, self.machine, self.tensors, self.signals, self.meter)
        self.decisions = DecisionExchange(host, self.machine, self.tensors, self.signals)

    def prepare(self) -> None:
        """This member's own slice into the partition it reduces (a pass over that partition; blocking).
        Only before the round is served: nothing else touches its memory meanwhile."""
        if self.manifest.sizes[self.me] > 0 and self.me not in self.tensors.reducers:
            self.tensors.reduce(self.me, self._weight, expect=self.pipelined)

    # What the averager and a fault hook read:

    @property
    def me(self) -> int:
        return self.machine.me

    @property
    def end(self) -> float:
        return self.machine.at.end

    @property
    def done(self) -> trio.Event:
        """Set once no member needs this round any more."""
        return self.signals.done

    @property
    def retired(self) -> trio.Event:
        return self.signals.retired

    @property
    def decision_bytes(self) -> bytes:
        return self.machine.decision_bytes

    @property
    def reducers(self) -> dict[int, PartitionReducer]:
        return self.tensors.reducers

    @property
    def source(self) -> torch.Tensor:
        return self.tensors.source

    @property
    def flat(self) -> torch.Tensor:
        return self.tensors.flat

    def blame(self) -> dict[PeerID, str]:
        return self.machine.blame()

    def convicted(self) -> dict[PeerID, str]:
        """After an abort: members whose served bytes broke the rules beyond doubt (see ``round_machine``)."""
        return self.machine.convicted()

    def retire(self) -> None:
        """No new call is served from now on; the buffers are released once the last stream ends."""
        self.tensors.retire()
        self.signals.retired.set()
        self.signals.wake()

    def _mark(self, phase: str) -> None:
        self.phases[phase] = round(trio.current_time() - self.machine.at.start, 6)

    async def _point(self, name: str) -> None:
        if self.fault is not None:
            await self.fault(self, name)

    # ---- the member's side -------------------------------------------------------------------------

    async def run(self) -> RoundResult:
        """Drive the round for this member; raises RoundAborted (the caller's tensors unchanged)."""
        try:
            with trio.move_on_at(self.end):
                return await self._run()
            if self.committed is not None:  # (the deadline passed just after the commit wrote the tensors)
                return self.committed
            raise RoundTimedOut(f"this member did not finish the round in its {self.manifest.timeout:g} s")
        finally:
            if self.machine.finish():
                self.signals.done.set()

    async def _run(self) -> RoundResult:
        failure: Exception | None = None
        async with trio.open_nursery() as early:
            if self.pipelined:
                self.gatherer.start_early(early)
            try:
                result = await self._phases()
            except Exception as e:  # raised as itself, not inside the nursery's exception group
                failure = e
            early.cancel_scope.cancel()  # (a gather waits for its early fetch: none is left after one)
        if failure is not None:
            raise failure
        return result

    async def _phases(self) -> RoundResult:
        m, t = self.machine, self.tensors
        log.debug("round %s: scattering to %d reducers", self.digest.hex()[:8], len(m.partitions))
        await self._point("before_send")
        with trio.move_on_at(m.at.scatter):
            async with trio.open_nursery() as senders:
                for j in m.partitions:
                    if j != m.me:
                        senders.start_soon(self._send_slice, j, j)
                if m.me in t.reducers:
                    senders.start_soon(self._await_slices)
        m.close_scatter()
        self._mark("scattered")
        if m.coordinator is not None:
            await self._point("decide")
            await self.decisions.coordinate()
        decision = await self.decisions.obtain()
        self._mark("decided")
        plan = m.plan
        assert plan is not None
        if plan.abort:
            raise RoundAborted(plan.reason)
        for f in plan.void_early:  # its reducer failed: whatever it served early is void
            await self.gatherer.void(f)
        async with trio.open_nursery() as nursery:
            for f, r in plan.resend:
                nursery.start_soon(self._send_slice, f, r, m.at.gather)
            for p in list(t.reducers):
                nursery.start_soon(self._finalize, p, decision)
            for p in m.partitions:
                nursery.start_soon(self.gatherer.gather, p, m.holder(p))
        self._mark("gathered")
        outcome = m.outcome()
        if m.faults:  # a result broke the rules: nothing of it is applied, the round ends here
            raise RoundAborted(outcome.reason)
        if not outcome.committed:
            raise RoundTimedOut(outcome.reason)
        return await self._commit(decision)

    async def _send_slice(self, p: int, to: int, deadline: float | None = None) -> None:
        """Stream my slice of partition ``p`` to member ``to``."""
        m, t = self.machine, self.tensors
        addr = self.manifest.members[to].addr
        own = await trio.to_thread.run_sync(t.own, p) if t.needs_read_back(p) else None
        try:
            with trio.fail_after(max(0.0, (deadline or m.at.scatter) - trio.current_time())):
                ack = await self._deliver(p, to, addr, own)
            if ack.ok:
                self.meter.flow_done("upload")
            else:
                log.info("%s refused my slice of partition %d: %s", m.name(to), p, ack.reason)
        except (P2PError, trio.TooSlowError) as e:
            log.info("could not deliver partition %d to %s: %s", p, m.name(to), e)
            left = isinstance(e, RemoteCallError) and e.code == LEFT_ROUND
            gone = m.unreachable_reducer(to, left, t.delivered(m.me))
            if gone:
                log.info("%s", gone)
            self.signals.changed.fire()

    async def _deliver(self, p: int, to: int, addr: str, own: torch.Tensor | None) -> Ack:
        """Stream my slice of ``p`` to reducer ``to`` at ``addr`` and return its answer; tried again every
        ``RETRY`` seconds (until the caller's deadline, or until ``to`` counts as gone) while the
        failure is one a live reducer gives, that its own next moment may undo (``errors.passing``):

        - it answers the dial "busy": its slots admit this round's members once it holds the manifest
          (``Host.expect``), which a large group's members get a moment apart (relayed: ``grouping``).
          At 128 simulated peers with 48 inbound slots a node, 61 of the 65 slices that never reached
          their reducer were refused so, none by a reducer that expected the sender yet, and rounds of
          the swarm's second step committed without half their members.
        - the connection closes under the slice (``ConnectionClosed``): a node over its inbound slots
          closes an idle connection when a round member arrives, and one idle a moment ago may be the
          one a sender just began to use (the request still on its way). In the same runs, after the
          first fix, each of 10 members of a round of 32 lost its slice so to a reducer that started
          the round 0.1 s later, gave it up with 12 s of the scatter left, and the round committed
          short of its members' quorums: all 32 aborted it and formed another, 18 s later.
        - the call is answered "busy" (too many calls on the connection, or from this peer).

        Any other refusal, a dial that finds nobody, and a deadline are final, as before. A slice a
        reducer took in part before the connection closed is not taken twice: it answers the second
        "duplicate" (``RoundServer.on_part``), and counts the sender as failed, as it did."""
        m, t = self.machine, self.tensors
        while True:
            try:
                conn = await self.host.connect(addr)
                pieces, commit = t.pieces(p, own)
                async with conn.open_stream(
                    PART,
                    PartReq(self.digest, p, m.weight, commit, t.own_table()[0]),
                    timeout=time_left(m.at.end),
                ) as stream:
                    for index, piece in enumerate(pieces):
                        await stream.send(piece)
                        if index == 0:
                            await self._point("mid_send")
                    await stream.send_eof()
                    return await stream.response()
            except P2PError as e:
                if not passing(e) or to in m.gone:
                    raise
                log.debug("partition %d to %s: %s; again in %g s", p, m.name(to), e, RETRY)
            await trio.sleep(RETRY)

    async def _await_slices(self) -> None:
        """As a reducer: until every sender of our partition delivered or failed, or the scatter ends."""
        m = self.machine
        while not m.slices_settled(self.tensors.delivered(m.me) or {}):
            await self.signals.changed.wait_until(m.at.scatter)
            if trio.current_time() >= m.at.scatter:
                return

    async def watch_members(self) -> None:
        """Mark members whose connections with us closed (and stayed closed) as gone, until the decision
        (run beside :meth:`run` by the averager)."""
        m = self.machine
        while m.watching(trio.current_time()):
            live = {c.peer for c in self.host.connections() if not c.closed}
            gone = m.watch(live, trio.current_time(), self.tensors.delivered(m.me))
            for line in gone:
                log.info("%s", line)
            if gone:
                self.signals.changed.fire()
            await trio.sleep(WATCH_EVERY)

    async def _finalize(self, p: int, decision: Decision) -> None:
        """Compute partition ``p``'s result over exactly the decided contributors, once all their slices
        are here (a replacement waits for the re-sent ones)."""
        m, red = self.machine, self.tensors.reducers[p]
        event = self.signals.finalized(p)
        while not m.contributors_in(red.delivered):
            if trio.current_time() >= m.at.gather:
                log.info("partition %d: not every contributor re-sent its slice in time", p)
                return
            await self.signals.changed.wait_until(m.at.gather)
        # A pass (or several: the trust check's Gram matrix) over the partition: in a worker thread when
        # large (``offload``); meanwhile no slice is added to it and its memory is not given back.
        # Passes over the partition (finalize: several, with the trust check's Gram matrix), in a worker
        # thread when large (``offload``); meanwhile no slice is added to it, it is not dropped, and the
        # round's memory is not given back. A round retired meanwhile (its deadline passed) ends here.
        red.finalizing = True
        try:
            with self.tensors.reading():
                await run_pass(
                    red.size, red.finalize, decision.contributors, decision.weights, passes=FINALIZE_PASSES
                )
                for sender, ratio in red.outliers:
                    log.warning(
                        "round %s: the slice of partition %d from %s is an outlier (%s the median distance"
                        " to the %s result): its influence was bounded",
                        self.digest.hex()[:8],
                        p,
                        m.name(sender),
                        "NaN times" if math.isnan(ratio) else f"{ratio:.0f}x",
                        red.aggregation,
                    )
                await self._point("after_reduce")  # (a test's fault hook may tamper with the result here)
                if self.signals.retired.is_set():
                    return
                if self.tensors.audit:
                    red.attestation = self._attest(p, red, decision)
                assert red.result is not None
                kept = await run_pass(red.result.numel(), self._keep_result, p, red, passes=4)
        finally:
            red.finalizing = False
        if self.signals.retired.is_set():
            return
        if not kept:
            # never applied here, whoever built it (the others check what we serve themselves)
            log.warning("round %s: %s", self.digest.hex()[:8], m.spoilt(p, "it holds NaN or infinite values"))
        m.finalized(p)
        event.set()
        self.signals.changed.fire()

    def _attest(self, p: int, red: PartitionReducer, decision: Decision) -> bytes:
        assert red.encoded is not None
        att = Attestation(
            round=self.digest,
            partition=p,
            contributors=decision.contributors,
            weights=decision.weights,
            commits=tuple(red.commits[c] for c in decision.contributors),
            result=hash_pieces(red.encoded),
        )
        return seal_attestation(self.host.identity, att)

    def _keep_result(self, p: int, red: PartitionReducer) -> bool:
        """Partition ``p``'s result, reduced here, into the round's memory, if it is finite (a pass
        over the partition: ``offload``)."""
        assert red.result is not None
        if not all_finite(red.result):
            return False
        self.tensors.write_result(p, red.result, red.scales)
        return True

    def _settle(self) -> list[torch.Tensor]:
        """The round's result checked, remembered and written into the caller's tensors (passes over the
        whole vector: ``offload``)."""
        m, t = self.machine, self.tensors
        if not all_finite(t.flat):  # (every partition passed its checks: a last guard, one pass)
            raise RoundAborted("the round's result holds NaN or infinite values: not applied")
        if self.history is not None and len(t.results) == len(m.partitions):
            self.history.record(self.manifest.schema, Scale.total(t.results.values()), t.whole)
            self.history.remember(self.manifest.schema, t.flat)
        return t.commit()

    async def _commit(self, decision: Decision) -> RoundResult:
        m, t = self.machine, self.tensors
        # Written into the caller's tensors: never half a commit (shielded), and the round's memory is not
        # given back meanwhile (a deadline that passes retires the round).
        with trio.CancelScope(shield=True), t.reading():
            tensors = await run_pass(t.flat.numel(), self._settle)
        names = [m.name(i) for i in range(m.n)]
        self.committed = RoundResult(
            round=self.digest,
            tensors=tensors,
            contributors=[self.peers[i] for i in decision.contributors],
            total_weight=math.fsum(decision.weights),
            group_size=m.n,
            reduced=m.sizes[m.me],
            shares=dict(zip(self.peers, m.sizes, strict=True)),
            excluded={
                self.peers[i]: why for i, why in excluded_reasons(decision, m.n, names, m.signed_out).items()
            },
            verified=self._verified(decision),
            round_seconds=trio.current_time() - m.at.start,
            phases=self.phases,
            evidence=self._evidence(decision) if self.tensors.audit else None,
            rates=self.meter.rates,
            retired=self.signals.retired,
        )
        return self.committed

    def _verified(self, decision: Decision) -> list[PeerID]:
        """The other contributors every partition reduced here judged useful (see ``reducer``)."""
        judged = [red.verdicts for red in self.tensors.reducers.values() if red.verdicts]
        if not judged:
            return []
        if log.isEnabledFor(logging.DEBUG):  # (why a contributor earned nothing, where asked for)
            for p, red in self.tensors.reducers.items():
                for i, v in red.verdicts.items():
                    if not v.useful and i != self.me:
                        who = self.peers[i].short()
                        log.debug("partition %d: %s's slice earns no trust: %s", p, who, v.reason)
        return [
            self.peers[i]
            for i in decision.contributors
            if i != self.me and all(i in v and v[i].useful for v in judged)
        ]

    def _evidence(self, decision: Decision) -> RoundEvidence:
        m, t = self.machine, self.tensors
        return RoundEvidence(
            digest=self.digest,
            manifest=self.signed.envelope,
            peers=self.peers,
            addresses=[mm.addr for mm in self.manifest.members],
            sizes=m.sizes,
            mode=t.mode,
            aggregation=self.manifest.aggregation,
            origins=self.manifest.origins,
            holders={p: m.holder(p) for p in m.partitions},
            attestations=dict(self.gatherer.attestations),
            sent={p: b"".join(pieces) for p, (pieces, _) in t.sent.items()},
            local=dict(t.local),
        )
