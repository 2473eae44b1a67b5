"""One butterfly all-reduce round on trio: scatter, decide, gather, commit or abort.

Theory of operation (member ``me`` of a group of ``n``, coordinator = member 0, round length ``T``):

1. Scatter, until ``0.4 T``: stream my slice of partition ``j`` to its reducer ``j``, for every ``j`` at
   once; as a reducer, accumulate the slices arriving for my partition. A reducer stops waiting once every
   sender delivered or failed, or at the deadline (a straggler counts as failed). A member whose every
   connection with us closed and stayed closed for ``GONE_AFTER`` seconds counts as failed at once: a
   dead peer costs the others that grace, not the phase's deadline (its streams cannot resume on a new
   connection, so nothing it could still send is lost).
2. Decide, until ``0.5 T``: reducers report whom they received; the coordinator decides (see
   ``agreement``) and answers every member's report call with the signed decision. Losing the
   coordinator, a member asks the others for the decision until ``0.9 T``, then aborts.
3. Re-reduce: for a reducer that did not report, every contributor streams that partition's slice again
   to the replacement the decision names.
4. Gather, until ``0.9 T``: each reducer computes the mean over exactly the decided contributors and
   serves it; members fetch every partition. A member that cannot fetch a partition from its reducer, or
   whose fetch stalls for ``STALLED_AFTER`` seconds, asks the other members too, who relay it if they hold
   it (a reducer that serves some members and then hangs cannot split the group).
5. Commit when every partition is here: the averaged values are written into the caller's tensors. Else
   abort: the caller's tensors are untouched.

Pipelined gather (plain means, rounds not audited): from the start of the round each member also fetches
every other partition early, and its reducer serves chunk ``k`` of the mean as soon as every member's
chunk ``k`` is in (their sum divided by all their weights). Once the decision is in, the reducer answers
whether those chunks are the result: they are when the decision names every member with the weight it
sent, the usual round, and then nothing is sent again. Otherwise they are void and the member fetches as
in 4. So the links do not idle between the phases.

Only the reducer of a partition (or its single replacement) computes that partition's result, and the
decision settles which result it is (computed after it, or confirmed by it), so every member that commits
holds the same bits. Every wait is bounded by a
deadline of the round; nothing waits forever. The round keeps serving fetches and relays after its own
member commits, until every member has fetched or the round's time is up.

The round's RPC handlers are ``serving``, its decision ``deciding``, its results and fetches ``gathering``
(mixins of :class:`AllReduceRound`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import torch
import trio

from ..errors import P2PError, RemoteCallError, RoundAborted, RoundTimedOut
from ..identity import PeerID
from ..net.host import Host
from .agreement import Coordinator, excluded_reasons
from .audit import hash_pieces, seal_commit
from .bandwidth import RateMeter, Rates
from .buffers import BufferPool
from .compression import Compression, encoded_chunk
from .deciding import RoundDeciding
from .gathering import RoundGathering, time_left
from .partition import chunks, offsets
from .protocol import (
    LEFT_ROUND,
    PART,
    Decision,
    PartReq,
    SignedManifest,
)
from .reducer import PartitionReducer
from .rules import SeenOrigins
from .serving import RoundServing, Signal
from .spill import Spilled, SpillFile

log = logging.getLogger(__name__)

SCATTER, DECIDE, AWAIT_DECISION, GATHER = 0.4, 0.5, 0.6, 0.9  # phase deadlines, fractions of the round
GONE_AFTER = 1.0  # seconds a member's connections must stay closed before it counts as failed
WATCH_EVERY = 0.1  # seconds between looks at the members' connections


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


class AllReduceRound(RoundServing, RoundDeciding, RoundGathering):
    """A member's state for one round, and the round's RPC handlers (``serving``; dispatched by the
    averager)."""

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
    ) -> None:
        """``flat`` receives the averaged values (and holds this member's own values too unless
        ``source``, a flat float32 view of them, is given: then nothing of ``source`` is written).

        ``backup`` (an in-place round): ``flat`` is the caller's own tensor (``tensors`` is ``[flat]``),
        not the pool's. Own values that early results overwrite go to ``backup`` first (a failed
        reducer's replacement needs them again), and the caller must not change the tensor before
        ``retired`` is set: the round relays held partitions from it. After an abort it holds a mix of
        own values and averages. ``own_saved``: this member's values of its own partition, already in
        ``backup``: the partition is then reduced right where its mean goes, in ``flat``."""
        self.fault = fault
        self.pool = pool  # where ``flat`` and the accumulators go back once nothing reads them
        m = signed.manifest
        self.host, self.signed, self.manifest = host, signed, m
        self.digest = signed.digest
        self.peers = m.peers()
        self.n = len(self.peers)
        self.me = self.peers.index(host.identity.peer_id)
        self.mode: Compression = m.settings.mode
        self.sizes = list(m.sizes)
        self.offsets = offsets(self.sizes)
        self.flat, self.weight, self.tensors = flat, weight, tensors
        self.source = flat if source is None else source
        self.backup = backup
        self.saved: dict[int, Spilled] = {}  # in place: partition -> own values overwritten by results
        if own_saved is not None:
            self.saved[self.me] = own_saved
        start = trio.current_time() if clock_start is None else clock_start
        self.start, self.end = start, start + m.timeout
        self.deadline = {
            k: start + f * m.timeout
            for k, f in (
                ("scatter", SCATTER),
                ("decide", DECIDE),
                ("await", AWAIT_DECISION),
                ("gather", GATHER),
            )
        }
        self.reducers: dict[int, PartitionReducer] = {}
        self.audit = m.audit
        self.sent: dict[int, tuple[list[bytes], bytes]] = {}  # audited: partition -> (pieces, commitment)
        self.local: dict[int, bytes] = {}  # audited: partition reduced here -> own raw slice
        self.attestations: dict[int, bytes] = {}
        # Pipelined rounds (plain means, not audited): each reducer serves its partition's mean chunk by
        # chunk while the scatter is still running, and members fetch it early (see on_fetch_early).
        self.pipelined = m.aggregation == "mean" and not self.audit
        self.early_done: dict[int, trio.Event] = {}  # partition -> its early fetch has ended
        self.early_scopes: dict[int, trio.CancelScope] = {}
        self.overwritten: set[int] = set()  # partitions whose early results overwrote our own values
        self.published = Signal()  # a reducer here published early chunks, decided, or retired
        if self.sizes[self.me] > 0:
            self.reducers[self.me] = self._new_reducer(self.me, weight)
            if self.pipelined:
                self.reducers[self.me].expect(range(self.n))
        self.scatter_open = True
        self.failed_senders: dict[int, set[int]] = {}  # partition -> senders whose stream broke
        self.unreachable: set[int] = set()  # reducers my slices could not reach
        self.gone: set[int] = set()  # members whose connections closed for good during the round
        self.seen: set[int] = set()  # members we were connected with during the round
        self.coordinator = Coordinator(self.digest, self.sizes) if self.me == 0 else None
        self.caps: dict[int, float] = {}  # the most weight this member finds plausible per member
        self.origins = SeenOrigins(m)  # the leader's origins, checked against what we see
        self.decision: Decision | None = None
        self.decision_bytes = b""
        self.decided = trio.Event()
        self.finalized: dict[int, trio.Event] = {}
        self.held: set[int] = set()  # partitions whose final values are in ``flat``
        self.progress: dict[int, float] = {}  # partition -> when its fetch last received something
        self.fetches_left = 0  # fetches of the partitions reduced here that members have yet to make
        self.finished = False  # this member's own part of the round is over (committed or aborted)
        self.done = trio.Event()  # no one needs this round any more
        self.retired = trio.Event()  # the averager stopped serving it
        self.streaming = 0  # handlers sending from ``flat`` or an accumulator right now
        self.released = False
        self.changed = Signal()
        self.phases: dict[str, float] = {}
        self.meter = RateMeter(host.delivered_traffic, trio.current_time)

    def _buffer(self, numel: int) -> torch.Tensor | None:
        return None if self.pool is None else self.pool.take(numel)

    def _reduced_in_flat(self, p: int) -> bool:
        """Partition ``p`` accumulates right where its mean goes, in ``flat`` (no copy at the end): our
        own partition, unless ``flat`` is also what we send from (it must stay intact until the decision)."""
        return p == self.me and (self.source is not self.flat or p in self.saved)

    def _new_reducer(self, p: int, weight: float | None) -> PartitionReducer:
        """A reducer for partition ``p``, holding this member's own slice if ``weight`` is given."""
        size = self.sizes[p]
        buffer = self._slice(p) if self._reduced_in_flat(p) else self._buffer(size)
        red = PartitionReducer(
            size,
            self.mode,
            buffer,
            self.manifest.aggregation,
            members=self.n,
            origins=self.manifest.origins,
            canonical=self.audit,
        )
        if weight is not None:
            # Reduced in place: its own values are in ``flat``, where the mean goes, and in the backup. (A
            # failed reducer's partition we replace: in the backup alone, if early averages overwrote them.)
            in_place = self._reduced_in_flat(p) and p in self.saved
            own = self._slice(p) if in_place else self._own(p)
            if self.audit:
                raw = bytes(encoded_chunk(own, Compression.NONE))
                self.local[p] = raw
                red.commits[self.me] = seal_commit(
                    self.host.identity, self.digest, p, weight, hash_pieces([raw])
                )
            red.add_local(self.me, own, weight, kept=self.saved[p] if in_place else None)
        return red

    def _pieces(
        self, p: int, values: torch.Tensor | None = None
    ) -> tuple[Iterable[bytes | memoryview], bytes]:
        """The encoded chunks of this member's slice of ``p`` (``values``, else read by ``_own``), and its
        signed commitment (audited rounds: computed once, kept for the audit). Else encoded as they are
        sent: a compressed copy of the whole slice would cost memory for nothing."""
        values = self._own(p) if values is None else values
        if not self.audit:
            return (encoded_chunk(values[a:b], self.mode) for a, b in chunks(self.sizes[p], self.mode)), b""
        if p not in self.sent:
            pieces = [
                bytes(encoded_chunk(values[a:b], self.mode)) for a, b in chunks(self.sizes[p], self.mode)
            ]
            commit = seal_commit(self.host.identity, self.digest, p, self.weight, hash_pieces(pieces))
            self.sent[p] = (pieces, commit)
        pieces, commit = self.sent[p]
        return list(pieces), commit

    def retire(self) -> None:
        """No new call is served from now on; the buffers are released once the last stream ends."""
        for red in self.reducers.values():
            red.drop()
        self.retired.set()
        self.changed.fire()
        self.published.fire()
        self._release()

    def _release(self) -> None:
        if self.released or self.streaming or not self.retired.is_set():
            return
        self.released = True
        if self.pool is not None:
            for p, red in self.reducers.items():
                if not self._reduced_in_flat(p):  # (else its accumulator is part of ``flat``)
                    self.pool.give(red.acc)
            if self.backup is None:  # (in place, ``flat`` is the caller's)
                self.pool.give(self.flat)
        if self.backup is not None:  # (after the above: what was reduced in place depends on it)
            self.backup.close()
            self.saved.clear()
        # Whatever still refers to this round object (a late call's context, a log record) must not keep
        # the caller's tensors or the buffers alive: they are model-sized.
        self.flat = self.source = torch.empty(0)
        self.tensors = []
        self.reducers.clear()

    def _mark(self, phase: str) -> None:
        self.phases[phase] = round(trio.current_time() - self.start, 6)

    async def _point(self, name: str) -> None:
        if self.fault is not None:
            await self.fault(self, name)

    def _own(self, p: int) -> torch.Tensor:
        """This member's own values in partition ``p`` (what it sends)."""
        if p in self.saved:  # (read back on the rare path that needs them: a failed reducer's replacement)
            return torch.frombuffer(self.saved[p].read(), dtype=torch.float32)
        if p in self.overwritten:  # early results went where we send from: take them from the tensors
            return self._own_from_tensors(p)
        return self.source[self.offsets[p] : self.offsets[p + 1]]

    def _own_from_tensors(self, p: int) -> torch.Tensor:
        """Our values of partition ``p`` as float32, from the caller's tensors (left alone until commit)."""
        lo, hi = self.offsets[p], self.offsets[p + 1]
        out = torch.empty(hi - lo, dtype=torch.float32)
        off = 0
        with torch.no_grad():
            for t in self.tensors:
                a, b = max(lo, off), min(hi, off + t.numel())
                if a < b:
                    out[a - lo : b - lo].copy_(t.detach().reshape(-1)[a - off : b - off])
                off += t.numel()
        return out

    def _slice(self, p: int) -> torch.Tensor:
        """Where partition ``p``'s average goes (the same memory as ``_own`` unless a source was given)."""
        return self.flat[self.offsets[p] : self.offsets[p + 1]]

    def name(self, i: int) -> str:
        return self.peers[i].short()

    # ---- the member's side -------------------------------------------------------------------------

    async def run(self) -> RoundResult:
        """Drive the round for this member; raises RoundAborted (the caller's tensors unchanged)."""
        try:
            with trio.move_on_at(self.end):
                return await self._run()
            raise RoundTimedOut(f"this member did not finish the round in its {self.manifest.timeout:g} s")
        finally:
            self.finished = True
            if self.fetches_left <= 0:
                self.done.set()

    async def _run(self) -> RoundResult:
        failure: Exception | None = None
        async with trio.open_nursery() as early:
            if self.pipelined:
                for p, size in enumerate(self.sizes):
                    if size > 0 and p != self.me:
                        self.early_done[p], self.early_scopes[p] = trio.Event(), trio.CancelScope()
                        early.start_soon(self._fetch_early, p)
            try:
                result = await self._phases()
            except Exception as e:  # raised as itself, not inside the nursery's exception group
                failure = e
            early.cancel_scope.cancel()  # (a gather waits for its early fetch: none is left after one)
        if failure is not None:
            raise failure
        return result

    async def _phases(self) -> RoundResult:
        n = sum(x > 0 for x in self.sizes)
        log.debug("round %s: scattering to %d reducers", self.digest.hex()[:8], n)
        await self._point("before_send")
        with trio.move_on_at(self.deadline["scatter"]):
            async with trio.open_nursery() as senders:
                for j, size in enumerate(self.sizes):
                    if size > 0 and j != self.me:
                        senders.start_soon(self._send_slice, j, j)
                if self.me in self.reducers:
                    senders.start_soon(self._await_slices)
        self.scatter_open = False
        self._mark("scattered")
        if self.coordinator is not None:
            await self._point("decide")
            await self._coordinate()
        decision = await self._obtain_decision()
        self._mark("decided")
        if decision.abort:
            raise RoundAborted(f"round aborted by the coordinator: {decision.abort}")
        for f in decision.failed:  # its reducer failed: whatever it served early is void
            if f in self.early_scopes:
                self.early_scopes[f].cancel()
                await self.early_done[f].wait()
        async with trio.open_nursery() as nursery:
            if self.me in decision.contributors:
                for f, r in zip(decision.failed, decision.replacements, strict=True):
                    if r != self.me:
                        nursery.start_soon(self._send_slice, f, r, self.deadline["gather"])
            for p in list(self.reducers):
                nursery.start_soon(self._finalize, p, decision)
            for p, size in enumerate(self.sizes):
                if size > 0:
                    nursery.start_soon(self._gather, p, self._holder(p, decision))
        self._mark("gathered")
        missing = [p for p, s in enumerate(self.sizes) if s > 0 and p not in self.held]
        if missing:
            raise RoundTimedOut(
                f"partitions {missing} could not be fetched before the deadline; every member that"
                " lacks them aborts, and none can have committed without them"
            )
        return self._commit(decision)

    async def _send_slice(self, p: int, to: int, deadline: float | None = None) -> None:
        """Stream my slice of partition ``p`` to member ``to``."""
        addr = self.manifest.members[to].addr
        own = None
        if p in self.saved and p not in self.sent:  # read back from the backup: a worker thread's job
            own = await trio.to_thread.run_sync(self._own, p)
        pieces, commit = self._pieces(p, own)
        try:
            with trio.fail_after(max(0.0, (deadline or self.deadline["scatter"]) - trio.current_time())):
                conn = await self.host.connect(addr)
                async with conn.open_stream(
                    PART, PartReq(self.digest, p, self.weight, commit), timeout=time_left(self.end)
                ) as stream:
                    for index, piece in enumerate(pieces):
                        await stream.send(piece)
                        if index == 0:
                            await self._point("mid_send")
                    await stream.send_eof()
                    ack = await stream.response()
            if ack.ok:
                self.meter.flow_done("upload")
            else:
                log.info("%s refused my slice of partition %d: %s", self.name(to), p, ack.reason)
        except (P2PError, trio.TooSlowError) as e:
            log.info("could not deliver partition %d to %s: %s", p, self.name(to), e)
            if isinstance(e, RemoteCallError) and e.code == LEFT_ROUND and to not in self.gone:
                self._mark_gone(to, "it left the round before it started")  # it sends nothing either
            self.unreachable.add(to)
            if self.coordinator is not None:
                self.coordinator.unreachable.add(to)
                self.changed.fire()

    async def watch_members(self) -> None:
        """Mark members whose connections with us closed (and stayed closed) as gone, until the decision
        (run beside :meth:`run` by the averager).

        Only members we were connected with during the round count: one we never reached is the senders'
        and the coordinator's business (an unreachable reducer, a slice that never came).
        """
        lost_at: dict[int, float] = {}
        while self.decision is None and not self.finished and trio.current_time() < self.end:
            now = trio.current_time()
            live = {c.peer for c in self.host.connections() if not c.closed}
            for i, peer in enumerate(self.peers):
                if i == self.me or i in self.gone:
                    continue
                if peer in live:
                    self.seen.add(i)
                    lost_at.pop(i, None)
                elif i in self.seen and now - lost_at.setdefault(i, now) >= GONE_AFTER:
                    self._mark_gone(i, f"no connection for {GONE_AFTER:g} s")
            await trio.sleep(WATCH_EVERY)

    def _mark_gone(self, i: int, why: str) -> None:
        log.info("%s is gone (%s): counted as failed", self.name(i), why)
        self.gone.add(i)
        if self.me in self.reducers and i not in self.reducers[self.me].delivered:
            self.failed_senders.setdefault(self.me, set()).add(i)
        if (
            self.coordinator is not None
            and i in self.coordinator.reducers
            and i not in self.coordinator.reports
        ):
            self.coordinator.unreachable.add(i)
        self.changed.fire()

    async def _await_slices(self) -> None:
        own = self.reducers[self.me]
        while True:
            failed = self.failed_senders.get(self.me, set())
            if all(i in own.delivered or i in failed for i in range(self.n)):
                return
            await self.changed.wait_until(self.deadline["scatter"])
            if trio.current_time() >= self.deadline["scatter"]:
                return

    def _holder(self, p: int, decision: Decision) -> int:
        r = decision.replacement_of(p)
        return p if r is None else r

    def blame(self) -> dict[PeerID, str]:
        """After an abort: the members this round failed on, as far as this member can tell (the
        coordinator if no decision came, else the holders of the partitions it never got)."""
        if self.decision is None:
            return {} if self.me == 0 else {self.peers[0]: "its decision never came"}
        if self.decision.abort:
            return {}
        out = {}
        for p, size in enumerate(self.sizes):
            if size and p not in self.held:
                holder = self._holder(p, self.decision)
                if holder != self.me:
                    out[self.peers[holder]] = f"partition {p} never came from it"
        return out

    def _commit(self, decision: Decision) -> RoundResult:
        off = 0
        with torch.no_grad():
            for t in self.tensors:
                k = t.numel()
                if t.data_ptr() != self.flat[off:].data_ptr():  # (in place: already there)
                    t.copy_(self.flat[off : off + k].view(t.shape))
                off += k
        names = [self.name(i) for i in range(self.n)]
        return RoundResult(
            round=self.digest,
            tensors=self.tensors,
            contributors=[self.peers[i] for i in decision.contributors],
            total_weight=math.fsum(decision.weights),
            group_size=self.n,
            reduced=self.sizes[self.me],
            shares=dict(zip(self.peers, self.sizes, strict=True)),
            excluded={self.peers[i]: why for i, why in excluded_reasons(decision, self.n, names).items()},
            round_seconds=trio.current_time() - self.start,
            phases=self.phases,
            evidence=self._evidence(decision) if self.audit else None,
            rates=self.meter.rates,
            retired=self.retired,
        )

    def _evidence(self, decision: Decision) -> RoundEvidence:
        return RoundEvidence(
            digest=self.digest,
            manifest=self.signed.envelope,
            peers=self.peers,
            addresses=[m.addr for m in self.manifest.members],
            sizes=self.sizes,
            mode=self.mode,
            aggregation=self.manifest.aggregation,
            origins=self.manifest.origins,
            holders={p: self._holder(p, decision) for p, s in enumerate(self.sizes) if s > 0},
            attestations=dict(self.attestations),
            sent={p: b"".join(pieces) for p, (pieces, _) in self.sent.items()},
            local=dict(self.local),
        )
