"""The averaging service of a node: matchmaking through the DHT, then one butterfly round per call.

``await averager.average(tensors, weight=..., timeout=...)`` announces this peer under the run and the
group key, follows or leads (see ``matchmaking``), checks the signed manifest against its own tensors
before sending anything, and runs the round (see ``allreduce``). Outcomes are typed: a
:class:`RoundResult`, or :class:`GroupTooSmall`, :class:`SchemaMismatch`, :class:`GroupFormationFailed`,
:class:`RoundAborted` / :class:`RoundTimedOut`; in every error case the caller's tensors are unchanged.

A training loop that overlaps averaging with compute splits the call: ``form_group`` (matchmaking
only), then ``run_round`` with the manifest; if its state moved on in between it calls ``decline``
instead, so that the group learns at once that this member will not take part.

Forming the group (announcing, leading, following, admitting joiners) is ``grouping``'s
:class:`GroupForming`, which the averager owns; each round is an :class:`AllReduceRound` (``allreduce``)
whose calls the averager dispatches by the round's digest.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import torch
import trio

from ..dht.service import DHT
from ..errors import (
    CallRefused,
    GroupFormationFailed,
    P2PError,
    RemoteProtocolError,
    RoundAborted,
    SchemaMismatch,
)
from ..identity import PeerID
from ..net.admission import subnet_of
from ..net.connection import Connection
from ..net.host import Host
from ..net.rpc import CallContext, Reply
from ..net.streams import RpcStream
from ..wire.codec import pack
from . import sparse, spill
from .allreduce import AllReduceRound, FaultHook, RoundEvidence, RoundResult
from .auditor import AUDIT_WINDOW, Auditor
from .bandwidth import BandwidthEstimate
from .bounds import ResultHistory
from .buffers import BufferPool
from .compression import Compression, all_finite, parse_compression, roundtrip
from .grouping import JOIN_GRACE, GroupForming
from .matchmaking import Quorum
from .offload import run_pass
from .partition import offsets
from .protocol import (
    FETCH,
    FETCH_EARLY,
    JOIN,
    LEAVE,
    LEFT_ROUND,
    MAX_GROUP,
    PART,
    RECALL,
    RELAY_DECISION,
    RELAY_RESULT,
    REPORT,
    ROUND_OVER,
    TABLES,
    Ack,
    Decision,
    DecisionResp,
    FetchReq,
    LeaveReq,
    PartReq,
    RelayDecisionReq,
    ReportReq,
    SignedManifest,
    TensorSpec,
    seal_decision,
)
from .round_machine import SCATTER
from .round_tensors import partition_scales
from .settings import AveragerConfig, RoundPolicy
from .spill import Spilled, SpillFile
from .trust import UNSEEN, TrustLedger

log = logging.getLogger(__name__)

_DTYPES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
}
ROUND_WAIT = 10.0  # how long a call for a round we have not started yet waits for its manifest
LEAVE_WAIT = ROUND_WAIT + 5.0  # how long a member that left a round tries to tell each reducer
MAX_WAITING_CALLS = 256
MAX_WAITING_PER_PEER = 8  # calls one peer may have waiting for rounds we have not started
MAX_WAITING_PER_SUBNET = 32  # ... and one subnet (/24, /64): ids are free, subnets are not
MAX_PARTNERS = 4096  # peers remembered as ones we averaged with (see ``Averager.partners``)


def schema_of(tensors: Sequence[torch.Tensor]) -> tuple[TensorSpec, ...]:
    specs = []
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise TypeError(f"cannot average tensors of dtype {t.dtype}; use a floating point dtype")
        specs.append(TensorSpec(tuple(t.shape), _DTYPES[t.dtype]))
    return tuple(specs)


async def _flatten(tensors: Sequence[torch.Tensor], pool: BufferPool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(source, flat)``: the values to send as one float32 vector, and a buffer from ``pool`` for the
    averages. A single contiguous float32 CPU tensor is sent from where it lies (no copy); anything else
    is copied into ``flat``, which then serves as both. ValueError on NaN or infinity. (A large copy and
    check run in a worker thread: ``offload``.)"""
    count = sum(t.numel() for t in tensors)
    flat = pool.take(count)
    try:
        source = await run_pass(count, _fill, tensors, flat)
    except BaseException:
        pool.give(flat)
        raise
    return source, flat


def _fill(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> torch.Tensor:
    """The values of ``tensors`` as one float32 vector: the tensor itself where it can be sent from where
    it lies, else copied into ``flat``; ValueError on NaN or infinity."""
    if len(tensors) == 1 and _sendable_in_place(tensors[0]):
        source = tensors[0].detach().view(-1)
    else:
        source, off = flat, 0
        with torch.no_grad():
            for t in tensors:
                flat[off : off + t.numel()].copy_(t.detach().reshape(-1))  # converts dtype and device
                off += t.numel()
    if not all_finite(source):
        raise ValueError("tensors to average hold NaN or infinite values")
    return source


async def _compress(source: torch.Tensor, flat: torch.Tensor, mode: Compression) -> None:
    """``flat`` := ``source`` as a top-k round sends it (partitions start on whole blocks, so its blocks
    are theirs): the member's own partition then adds what the others would receive, the values it
    sends again to a failed reducer's replacement are the same, and an in-place caller sees what it
    sent (for its error feedback). Large vectors in a worker thread, piece by piece."""

    def run() -> None:
        step = 256 * sparse.BLOCK
        for a in range(0, source.numel(), step):
            flat[a : a + step].copy_(roundtrip(source[a : a + step], mode))

    if source.numel() * 4 < spill.SPILL_BYTES:
        run()
    else:
        await trio.to_thread.run_sync(run)


def _sendable_in_place(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def _sizes(config: AveragerConfig, target: int | None, minimum: int | None) -> tuple[int, int]:
    target = config.target_size if target is None else target
    minimum = min(config.min_size, target) if minimum is None else minimum
    if not 1 <= minimum <= target <= MAX_GROUP:
        raise ValueError(f"need 1 <= min_size <= target_size <= {MAX_GROUP}")
    return target, minimum


def schema_digest(
    schema: tuple[TensorSpec, ...], mode: Compression, aggregation: str = "mean", audit: bool = False
) -> bytes:
    """What peers must share to average together: the tensors, the compression, the rule, the audit."""
    fields: list[object] = [[s.to_obj() for s in schema], mode.value]
    if aggregation != "mean" or audit:  # a plain group's digest stays what it was before these existed
        fields += [str(aggregation), audit]
    return hashlib.blake2b(pack(fields), digest_size=16).digest()


def seen_at(connections: Iterable[Connection], peers: Iterable[PeerID]) -> list[tuple[PeerID, str]]:
    """(peer, the subnet it counts in) for each of ``peers``, from the ``connections`` a member holds:
    a direct connection's subnet first, else the subnet of the relay a circuit runs through, else
    ``UNSEEN`` (see :meth:`Averager._seen_at`)."""
    direct: dict[PeerID, str] = {}
    relayed: dict[PeerID, str] = {}
    for c in connections:
        (relayed if c.relayed else direct)[c.peer] = subnet_of(c.remote_host)  # circuits: the relay's
    seen = relayed | direct
    return [(p, seen.get(p, UNSEEN)) for p in peers]


class Averager:
    """Averages tensors with the peers of a run; one instance per node, serving its rounds."""

    def __init__(
        self,
        host: Host,
        dht: DHT | None,
        config: AveragerConfig | None = None,
        *,
        policy: RoundPolicy | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``policy``: the rules of the training run this averager serves (see :class:`RoundPolicy`);
        a node's averager gets them later, once, from :meth:`follow`."""
        self.host = host
        self.config = config or AveragerConfig()
        self.policy = policy or RoundPolicy()
        self._followed = policy is not None
        self._rounds: dict[bytes, AllReduceRound] = {}
        self.pool = BufferPool()  # flat copies and accumulators, reused across rounds
        self._flattening = False  # an average() call is copying its tensors (see ``average``)
        self._round_started: dict[bytes, trio.Event] = {}
        # Rounds this member will not run -> when to forget them, and (if it coordinates them) its
        # signed abort decision, given to the members that ask for the decision.
        self._declined: dict[bytes, tuple[float, bytes]] = {}
        # Rounds retired here -> when to forget them, and their signed decision (b"" without one): a
        # member may still ask for it (it fetched its results early, and this member served the last of
        # its fetches first); any other call for such a round is refused at once (ROUND_OVER).
        self._over: dict[bytes, tuple[float, bytes]] = {}
        # Groups formed here whose rounds did not start yet -> until when their members' calls wait for
        # it (the scatter deadline: see ``_round``), and those members.
        self._formed: dict[bytes, tuple[float, frozenset[PeerID]]] = {}
        self._waiting: Counter[PeerID] = Counter()  # calls waiting in _round, per caller
        self._waiting_subnet: Counter[str] = Counter()  # ... per caller's subnet
        self._nursery: trio.Nursery | None = None
        self.fault: FaultHook | None = None  # tests: awaited at each phase of every round
        self.auditor = Auditor(host, policy=lambda: self.policy)
        self.history = ResultHistory()  # this member's accepted results: bounds where it sends zeros
        # Credits for verified useful work: whose records of later states the trainer trusts (see
        # ``trust``; ``partners`` is the read-only view).
        self.trust = TrustLedger(host.peer_id)
        self._clock = clock
        self.measured = BandwidthEstimate()  # from this member's rounds (see ``bandwidth``)
        self.groups = GroupForming(
            host,
            dht,
            config=lambda: self.config,
            policy=lambda: self.policy,
            measured=self.measured,
            auditor=self.auditor,
            decline=self.decline,
            clock=clock,
        )
        reg = self.host.registry
        reg.add_unary(JOIN, self.groups.on_join)
        reg.add_unary(RECALL, self.groups.on_recall)
        reg.add_stream(PART, self._on_part)
        reg.add_unary(REPORT, self._on_report)
        reg.add_stream(FETCH, self._on_fetch)
        reg.add_stream(FETCH_EARLY, self._on_fetch_early)
        reg.add_unary(RELAY_DECISION, self._on_relay_decision)
        reg.add_unary(LEAVE, self._on_leave)
        reg.add_stream(RELAY_RESULT, self._on_relay_result)
        reg.add_stream(TABLES, self._on_tables)

    def follow(self, config: AveragerConfig, policy: RoundPolicy) -> None:
        """Take a training run's rules for this node's rounds: its settings replace the node's, and its
        policy (weight caps, bans published, the largest proof fetched) takes effect.

        The one way to change them after construction, and only once: a node builds its averager
        before the run's optimizer exists, and the policy reads that optimizer's progress records and
        publishes its bans, so the optimizer hands them over when it is built, before any round.

        Args:
            config: The run's averaging settings.
            policy: The run's policy.

        Raises:
            RuntimeError: This averager follows a run already.
        """
        if self._followed:
            raise RuntimeError("this averager follows a training run already (one per node)")
        self._followed = True
        self.config, self.policy = config, policy

    def unfollow(self) -> None:
        """The run's optimizer that this averager follows is replaced by another of the same run (a
        sharded site rebuilds its parts when its group restarts: ``training.site``): the next
        :meth:`follow` takes the new one's rules. Until then the old ones stay."""
        self._followed = False

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the tasks that keep finished rounds serving their last fetches."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.auditor.run)
            await nursery.start(self.groups.run)
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    async def average(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        weight: float = 1.0,
        timeout: float = 60.0,
        group_key: str = "default",
        compression: str | None = None,  # (text, parsed here: this call's own compression)
    ) -> RoundResult:
        """Average ``tensors`` in place with a group of peers; see the module docstring for outcomes."""
        if self._nursery is None:
            raise RuntimeError("start Averager.run in a nursery first")
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError("weight must be positive and finite")
        if self.groups.busy or self._flattening:
            raise RuntimeError("an average() call is already in progress on this node")
        mode = parse_compression(compression) if compression else self.config.compression
        tensors = list(tensors)
        schema = schema_of(tensors)
        self._flattening = True  # (a large flatten runs in a thread: no second call starts meanwhile)
        try:
            source, flat = await _flatten(tensors, self.pool)
        finally:
            self._flattening = False
        began = trio.current_time()
        try:
            sizes = (self.config.target_size, self.config.min_size)
            signed = await self.groups.form(
                group_key,
                schema,
                schema_digest(schema, mode, self.config.aggregation, self.config.audit),
                mode,
                timeout,
                sizes,
            )
        except BaseException:
            self.pool.give(flat)  # no round will use it
            raise
        matchmaking = trio.current_time() - began
        result = await self._run_round(signed, tensors, source, flat, weight)
        result.matchmaking_seconds = matchmaking
        self.trained_with(result)
        return result

    @property
    def bandwidth(self) -> float:
        """The bytes per second this member announces: the configured bandwidth, else what its recent
        rounds measured, else 0 (not known yet: a leader gives it a typical share)."""
        return self.groups.bandwidth

    def address(self, *, reducer: bool = False) -> str:
        """Where others dial this peer, "" for nowhere (see :meth:`GroupForming.address`)."""
        return self.groups.address(reducer=reducer)

    @property
    def partners(self) -> frozenset[PeerID]:
        """The peers this one trusts for verified useful work (see ``trust``): whose records of later
        states the trainer may follow. Read-only: rounds change it through :meth:`trained_with`, a
        checkpoint through :meth:`remember_partners`."""
        self.trust.update(self._clock())
        return self.trust.partners

    def trained_with(self, result: RoundResult) -> None:
        """Credit the contributors this member verified in ``result`` (its reducers judged their slices
        useful work, see ``trust``): call it once the round's result is applied. Contributors it did
        not verify (zeros, noise, or any contributor when it reduced nothing) earn nothing.

        A round that completes is not yet a round its members apply: a trainer may drop it (a replay
        that landed it on another step than the round's), and a peer that trusted its contributors
        anyway would follow their records into a second lineage of the swarm's steps. (Whether the
        contributors hold the peers a member must average with is settled before the round commits,
        the same for every member: see ``matchmaking``.)"""
        verified = [(p, seen) for p, seen in self._seen_at(result.verified) if p in result.contributors]
        named = self.trust.credit(result.round, verified, self._clock())
        if named:
            log.info("trusted from now on, for verified useful work: %s", ", ".join(p.short() for p in named))

    def _seen_at(self, peers: Iterable[PeerID]) -> list[tuple[PeerID, str]]:
        """The subnet each of ``peers`` counts in for the ledger's per-subnet bound: where this member
        reached it directly; through a relay's circuit, the relay's subnet (a circuit hides the peer's
        own address, and a key that only ever shows up relayed must not stand for a subnet of its own:
        keys behind one relay share its bound, so an attacker's relay lends its keys one subnet's
        worth of partners, and an honest relay's home peers compete for that much); seen nowhere
        (its connection closed before the round ended), ``UNSEEN``, one bucket all such keys share
        unless the ledger knows where the key was seen before."""
        return seen_at(self.host.connections(), peers)

    def remember_partners(self, peers: Iterable[PeerID]) -> None:
        """Partners a checkpoint remembers: trusted again (their credits decay as any, see ``trust``)."""
        self.trust.seed(peers, self._clock())

    def prepare_group(self, group_key: str) -> None:
        """A call of :meth:`form_group` under ``group_key`` comes soon: its key's replicas are found
        now, in the background, so that the matchmaking asks them directly (``GroupForming.prepare``)."""
        self.groups.prepare(group_key)

    async def form_group(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        timeout: float = 60.0,
        group_key: str = "default",
        compression: str | None = None,
        target_size: int | None = None,
        min_size: int | None = None,
        quorum: Quorum | None = None,
        lead: bool = True,
        opens: float | None = None,
        leads_now: Callable[[], bool] | None = None,
    ) -> SignedManifest:
        """Only the matchmaking half of :meth:`average`: the signed manifest of the group found.

        Every member must then call :meth:`run_round` with it soon (the others wait for a member's
        slices only until the round's scatter deadline). ``target_size`` and ``min_size`` override the
        configured group sizes for this call (a training run sizes groups by the peers it sees).
        ``quorum``: a group led here forms only with that many of those peers (see ``matchmaking``).
        ``lead=False``: join a group led by another peer or none (a client-only member of it).
        ``opens``: when the matchmaking window begins, if later than now (at most a window later).
        ``leads_now``: a peer that only follows (``quorum.leads`` False) ends the look once this says it
        may lead while it follows nobody (GroupFormationFailed), to look again as a leader.
        """
        if self.groups.busy:
            raise RuntimeError("an average() call is already in progress on this node")
        mode = parse_compression(compression) if compression else self.config.compression
        schema = schema_of(list(tensors))
        sizes = _sizes(self.config, target_size, min_size)
        signed = await self.groups.form(
            group_key,
            schema,
            schema_digest(schema, mode, self.config.aggregation, self.config.audit),
            mode,
            timeout,
            sizes,
            quorum,
            lead=lead,
            opens=opens,
            leads_now=leads_now,
        )
        self._expect(signed)
        return signed

    def _expect(self, signed: SignedManifest) -> None:
        """A group formed here: its members' calls for its round wait for this member to run it (or
        decline it) until the round's scatter deadline, as they wait for this member's slices, rather
        than ``ROUND_WAIT``. Its caller runs the round when it gets to it: a training loop between two
        batches, after a pass over its parameters (a site's, a collective of its ranks), which took
        longer than ``ROUND_WAIT``, so that the others' slices of the partitions it reduces were
        refused, and it was left out of every round."""
        now = trio.current_time()
        for digest in [d for d, (until, _) in self._formed.items() if until < now]:
            del self._formed[digest]
        if len(self._formed) < MAX_WAITING_CALLS:
            m = signed.manifest
            self._formed[signed.digest] = (now + SCATTER * m.timeout, frozenset(m.peers()))
        self._admit_members(signed)

    def _admit_members(self, signed: SignedManifest) -> None:
        """The group's other members reach this node for its round, whatever else holds its inbound
        slots (``Host.expect``: a node of a 1,024-peer swarm had its 512 slots full of the DHT's
        connections, and members dialling it heard "busy": their slices never arrived), until the
        round's end."""
        m = signed.manifest
        me = self.host.identity.peer_id
        others = [p for p in m.peers() if p != me]
        until = trio.current_time() + m.timeout + JOIN_GRACE
        self.host.expect(others, [x.addr for x in m.members if x.addr and x.peer != me.digest], until)

    async def run_round(
        self,
        signed: SignedManifest,
        tensors: Sequence[torch.Tensor],
        *,
        weight: float = 1.0,
        in_place: bool = False,
    ) -> RoundResult:
        """Run one round of an already formed group (the manifest's members call this together).

        ``in_place``: ``tensors`` is one contiguous float32 CPU tensor, and the averages go straight into
        it as they arrive: no model-sized buffer besides it. The price: after an abort it holds a mix of
        its values and averages (discard it), and it must stay unchanged until the result's ``retired``
        is set (the round may relay averages from it to slower members until then).

        The caller decides whether it applies the result; once it does, it names the contributors to
        :meth:`trained_with` (``average`` does both)."""
        if self._nursery is None:
            raise RuntimeError("start Averager.run in a nursery first")
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError("weight must be positive and finite")
        tensors = list(tensors)
        m = signed.manifest
        ours = m.schema == schema_of(tensors) and self.host.identity.peer_id in m.peers()
        mode = m.settings.mode
        sparse_mode = mode if mode.sparse and ours else None  # (else _run_round says why not)
        if not in_place:
            source, flat = await _flatten(tensors, self.pool)
            if sparse_mode is not None:
                await _compress(source, flat, sparse_mode)
                source = flat
            return await self._run_round(signed, tensors, source, flat, weight)
        if len(tensors) != 1 or not _sendable_in_place(tensors[0]):
            raise ValueError("an in-place round takes one contiguous float32 CPU tensor")
        flat = tensors[0].detach().view(-1)
        if not await run_pass(flat.numel(), all_finite, flat):
            raise ValueError("tensors to average hold NaN or infinite values")
        if sparse_mode is not None:
            await _compress(flat, flat, sparse_mode)
        backup, own = SpillFile(), None
        if self.host.identity.peer_id in m.peers() and sum(m.sizes) == flat.numel():
            # Our own partition is reduced where its mean goes: its values go to the backup first
            at = offsets(list(m.sizes))
            me = m.peers().index(self.host.identity.peer_id)
            mine = flat[at[me] : at[me + 1]].view(torch.uint8).numpy().data
            try:
                own = await spill.put(backup, mine)
            except OSError as e:  # (a full disk): our partition is reduced in a buffer of its own
                log.warning("cannot back our partition up (%s): reducing it in a separate buffer", e)
        return await self._run_round(signed, tensors, flat, flat, weight, backup=backup, own_saved=own)

    def decline(self, signed: SignedManifest) -> None:
        """Take no part in the round of a formed group after all (the caller's state moved on).

        The other members leave it out and go on without it at once, instead of waiting for its slices
        until the scatter deadline: it tells the members that reduce a partition (``avg.leave``), and a
        call to it is refused. (It once relied on that refusal alone: nobody calls a member that
        reduces nothing, a client-only one, so a group waited for its slices to the scatter deadline,
        0.4 x the round's timeout: 240 s in a 600 s DiLoCo run.)
        """
        now = trio.current_time()
        for digest in [d for d, (until, _) in self._declined.items() if until < now]:
            del self._declined[digest]
        abort = b""
        if signed.manifest.peers()[0] == self.host.identity.peer_id:  # the coordinator: abort it for all
            why = "the coordinator left the group before the round started"
            abort = seal_decision(self.host.identity, Decision(round=signed.digest, abort=why))
        if len(self._declined) < MAX_WAITING_CALLS:
            self._declined[signed.digest] = (now + signed.manifest.timeout + JOIN_GRACE, abort)
        self._formed.pop(signed.digest, None)
        started = self._round_started.pop(signed.digest, None)
        if started is not None:
            started.set()  # calls already waiting for it get the answer now
        signed_out = signed.manifest.signs_out(self.host.identity.peer_id)
        if self._nursery is not None and not signed_out:  # (signed out: nobody waits for it)
            self._nursery.start_soon(self._say_left, signed)
        log.info("left the group formed for %s before its round started", signed.manifest.group_key)

    async def _say_left(self, signed: SignedManifest) -> None:
        """Tell each member that reduces a partition of ``signed``'s round that this one left it (at most
        ``LEAVE_WAIT`` seconds each, all at once; a member that cannot be told waits as before)."""
        m, me = signed.manifest, self.host.identity.peer_id

        async def tell(peer: PeerID, addr: str) -> None:
            try:
                with trio.fail_after(min(LEAVE_WAIT, m.timeout)):
                    conn = await self.host.connect(addr)
                    ack = await conn.call(LEAVE, LeaveReq(signed.digest))
                if not ack.ok:
                    log.debug("%s did not take our leaving: %s", peer.short(), ack.reason)
            except (P2PError, trio.TooSlowError) as e:
                log.debug("could not tell %s that we left the round: %s", peer.short(), e)

        async with trio.open_nursery() as nursery:
            for peer, member, size in zip(m.peers(), m.members, m.sizes, strict=True):
                if peer != me and size > 0 and member.addr:
                    nursery.start_soon(tell, peer, member.addr)

    async def _run_round(
        self,
        signed: SignedManifest,
        tensors: list[torch.Tensor],
        source: torch.Tensor,
        flat: torch.Tensor,
        weight: float,
        backup: SpillFile | None = None,
        own_saved: Spilled | None = None,
    ) -> RoundResult:
        m = signed.manifest
        problem: P2PError | None = None
        if m.schema != schema_of(tensors):
            problem = SchemaMismatch("the group's manifest describes other tensors than ours")
        elif self.host.identity.peer_id not in m.peers():
            problem = GroupFormationFailed("the manifest does not list this peer")
        if problem is not None:
            if backup is None:  # (in place, ``flat`` is the caller's)
                self.pool.give(flat)
            raise problem
        # (measured off the event loop when large; calls for the round wait for it meanwhile)
        scales = await run_pass(source.numel(), partition_scales, source, m.sizes)
        rnd = AllReduceRound(
            self.host,
            signed,
            flat,
            weight,
            tensors,
            fault=self.fault,
            pool=self.pool,
            source=source,
            backup=backup,
            own_saved=own_saved,
            caps=self._caps(m.peers()),
            history=self.history,
            own_scales=scales,
            deferred=True,
        )
        await run_pass(m.sizes[rnd.me], rnd.prepare, passes=3)  # (not served before: the round is not known)
        self._start_round(rnd)
        try:
            result = await rnd.run()
        except RoundAborted:
            blame = rnd.blame()
            for peer, why in blame.items():
                self.auditor.strike(peer, why)
            self.groups.round_failed(signed, blame)  # a leader whose round never ran is not followed
            raise
        finally:
            self.measured.add(rnd.meter.rates)  # (an aborted round's flows measured the links too)
            for peer, why in rnd.convicted().items():  # bytes it sent or served broke the rules
                self.auditor.convict(peer, why)
        for peer in result.contributors:  # peers we trained with: a connection flood never evicts them
            self.host.protect(peer)
        if result.evidence is not None and self._nursery is not None:
            self.auditor.keep(result.evidence)
            self._nursery.start_soon(self._audit, result.evidence)
        return result

    def _caps(self, peers: list[PeerID]) -> dict[int, float]:
        """The most weight each other member may carry in a round: the coordinator caps weights, and
        every reducer refuses far-off ones (see ``agreement``)."""
        weight_cap, weight_caps = self.policy.weight_cap, self.policy.weight_caps
        others = [peer for peer in peers if peer != self.host.peer_id]
        if weight_caps is not None:
            of = weight_caps(others)
        elif weight_cap is not None:
            of = {peer: weight_cap(peer) for peer in others}
        else:
            return {}
        return {i: cap for i, peer in enumerate(peers) if (cap := of.get(peer)) is not None}

    async def _audit(self, evidence: RoundEvidence) -> None:
        """Audit what this member was chosen for, then keep the evidence for the others' audits a while."""
        try:
            await self.auditor.audit(evidence)
        except P2PError as e:
            log.warning("the audit of round %s failed: %s", evidence.digest.hex()[:8], e)
        try:
            await trio.sleep(AUDIT_WINDOW)
        finally:
            self.auditor.forget(evidence.digest)

    def round(self, digest: bytes) -> AllReduceRound | None:
        """The round ``digest`` while this node serves it."""
        return self._rounds.get(digest)

    async def wait_idle(self) -> None:
        """Wait until every round this node took part in is over for all its members (or timed out).

        A member that committed may still be serving its partition to slower members; a process that
        is about to exit calls this first.
        """
        while self._rounds:
            await next(iter(self._rounds.values())).retired.wait()

    # ---- rounds ----

    def _start_round(self, rnd: AllReduceRound) -> None:
        self._rounds[rnd.digest] = rnd
        self._admit_members(rnd.signed)
        self._formed.pop(rnd.digest, None)
        started = self._round_started.pop(rnd.digest, None)
        if started is not None:
            started.set()
        assert self._nursery is not None
        self._nursery.start_soon(self._retire, rnd)
        self._nursery.start_soon(rnd.watch_members)

    async def _retire(self, rnd: AllReduceRound) -> None:
        with trio.move_on_at(rnd.end):
            await rnd.done.wait()
        self._rounds.pop(rnd.digest, None)
        rnd.retire()
        now = trio.current_time()
        for digest in [d for d, (until, _) in self._over.items() if until < now]:
            del self._over[digest]
        if len(self._over) < MAX_WAITING_CALLS:
            self._over[rnd.digest] = (rnd.end + JOIN_GRACE, rnd.decision_bytes)

    async def _round(self, digest: bytes, ctx: CallContext) -> AllReduceRound:
        """The round ``digest``, waiting a little for it to start: a member may call us before our own
        copy of the manifest arrived (``ROUND_WAIT``), or, a member of a group formed here, before our
        caller ran its round (until its scatter deadline: see ``_expect``). Until then its stream holds
        at most the protocol's initial window of data here, and one peer, or one subnet, may have only a
        few such calls waiting."""
        peer, subnet = ctx.peer, subnet_of(ctx.remote_host)
        rnd = self._rounds.get(digest)
        if rnd is not None:
            return rnd
        if digest in self._declined:
            raise CallRefused(LEFT_ROUND, f"this member left round {digest.hex()[:8]} before it started")
        if digest in self._over:
            raise CallRefused(ROUND_OVER, f"round {digest.hex()[:8]} is over here: nothing of it is served")
        if (
            len(self._round_started) >= MAX_WAITING_CALLS
            or self._waiting[peer] >= MAX_WAITING_PER_PEER
            or self._waiting_subnet[subnet] >= MAX_WAITING_PER_SUBNET
        ):
            raise RemoteProtocolError("unknown round (and too many calls waiting for unknown rounds)")
        event = self._round_started.setdefault(digest, trio.Event())
        wait = ROUND_WAIT
        formed = self._formed.get(digest)
        if formed is not None and peer in formed[1]:
            wait = max(wait, formed[0] - trio.current_time())
        self._waiting[peer] += 1
        self._waiting_subnet[subnet] += 1
        try:
            with trio.move_on_after(wait):
                await event.wait()
        finally:
            self._waiting[peer] -= 1
            self._waiting_subnet[subnet] -= 1
            self._waiting, self._waiting_subnet = +self._waiting, +self._waiting_subnet  # (drop zeros)
        rnd = self._rounds.get(digest)
        if rnd is None:
            if not event.is_set():
                self._round_started.pop(digest, None)
            if digest in self._declined:
                raise CallRefused(LEFT_ROUND, f"this member left round {digest.hex()[:8]} before it started")
            raise RemoteProtocolError(f"unknown round {digest.hex()[:8]}")
        return rnd

    async def _on_part(self, ctx: CallContext, req: PartReq, stream: RpcStream) -> Ack:
        return await (await self._round(req.round, ctx)).server.on_part(ctx, req, stream)

    def _known_decision(self, digest: bytes) -> bytes:
        """The signed decision of a round declined or over here, if it had one (else empty)."""
        return self._declined.get(digest, (0.0, b""))[1] or self._over.get(digest, (0.0, b""))[1]

    async def _on_report(self, ctx: CallContext, req: ReportReq) -> Reply[DecisionResp]:
        if req.round not in self._rounds and (decision := self._known_decision(req.round)):
            return Reply(DecisionResp(True), decision)
        return await (await self._round(req.round, ctx)).server.on_report(ctx, req)

    async def _on_fetch(self, ctx: CallContext, req: FetchReq, stream: RpcStream) -> Ack:
        return await (await self._round(req.round, ctx)).server.on_fetch(ctx, req, stream)

    async def _on_fetch_early(self, ctx: CallContext, req: FetchReq, stream: RpcStream) -> Ack:
        return await (await self._round(req.round, ctx)).server.on_fetch_early(ctx, req, stream)

    async def _on_tables(self, ctx: CallContext, req: FetchReq, stream: RpcStream) -> Ack:
        return await (await self._round(req.round, ctx)).server.on_tables(ctx, req, stream)

    async def _on_leave(self, ctx: CallContext, req: LeaveReq) -> Ack:
        if req.round in self._declined:
            return Ack(False, "this member left that round too")
        return await (await self._round(req.round, ctx)).server.on_leave(ctx, req)

    async def _on_relay_decision(self, ctx: CallContext, req: RelayDecisionReq) -> Reply[DecisionResp]:
        rnd = self._rounds.get(req.round)
        if rnd is None:
            decision = self._known_decision(req.round)
            return Reply(DecisionResp(bool(decision)), decision)
        return await rnd.server.on_relay_decision(ctx, req)

    async def _on_relay_result(self, ctx: CallContext, req: FetchReq, stream: RpcStream) -> Ack:
        rnd = self._rounds.get(req.round)
        if rnd is None:
            if req.round in self._over:
                raise CallRefused(ROUND_OVER, f"round {req.round.hex()[:8]} is over here: nothing is relayed")
            return Ack(False, "unknown round")
        return await rnd.server.on_relay_result(ctx, req, stream)
