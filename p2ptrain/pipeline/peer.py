"""A pipeline peer: a node that serves one stage and sends its own micro-batches through the pipeline.

Theory of operation: a :class:`PipelinePeer` is handed a running :class:`~p2ptrain.node.Node` (its
host, DHT and averager) and composes the pipeline's parts around it: a
:class:`~.server.StageServer` for its stage (registered on the node's RPC registry), a
:class:`~.router.Router` for its micro-batches, its stage's optimizer, and a task that publishes its
directory record (``directory``) and reads the others' every ``interval`` seconds.

One step (:meth:`PipelinePeer.step`): send this peer's micro-batches of the step through the pipeline,
``concurrency`` at a time (a pipeline is full when each stage has one in flight); wait until its own
stage server has been quiet for a moment (the other callers of the step are done with it); close the
step; average the stage's gradients with its peers (``stagewise``); apply the optimizer step; open the
next step. Peers run their steps in lockstep by construction: a stage server refuses micro-batches of
a step it has not reached yet (``pipeline_not_yet``: the caller asks again) and of steps it closed.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import trio

from ..averaging.compression import Compression
from ..config import DilocoSection
from ..errors import CallRefused, P2PError
from ..identity import PeerID
from ..net.rpc import CallContext, Reply
from ..node import Node
from ..tasks.gpt import GPTConfig
from ..training.optimizer.buffers import Contribution
from ..training.optimizer.outer import OuterStep
from .directory import StagePeer, announce_stage, choose_stage, link_bytes_per_sample, read_directory
from .protocol import WRONG_STAGE, StageRecord
from .router import Candidate, MicroBatch, Router
from .server import StageServer
from .settings import PipelineSection
from .stages import Stage, build_stage, tied_index
from .stagewise import StageAverage, average_stage, tie_ends
from .transfer import NO_STATE, STATE, Snapshot, StateReq, StateResp, apply_snapshot, take_snapshot

log = logging.getLogger(__name__)

# DiLoCo: the tied embedding's two copies step with this share of the sum of their stages' averaged
# pseudo-gradients: 1, the sum, as the synchronous path sums the gradients (measured against the mean,
# 0.5, with ``bench_pipeline --diloco 4 --tied-outer``: see docs/pipeline.md)
TIED_OUTER = 1.0

FORGET_AFTER = 4  # directory refreshes without a peer's entry before it is forgotten


@dataclass
class StepReport:
    step: int
    stage: int
    losses: list[float]  # of this peer's micro-batches that passed (the last stage's loss)
    given_up: int
    retries: int
    counted: int  # samples this peer's stage server counted in the step
    average: StageAverage
    seconds: float = 0.0
    bytes_sent: int = 0  # activations, gradients and tokens this peer's micro-batches sent to stage peers
    bytes_received: int = 0
    micro_batches: int = 0
    queue: int = 0  # this peer's stage server's micro-batches in flight at the end of the step
    throughput: float = 0.0  # samples per second its stage server computes (its measured speed)
    tied: StageAverage | None = None  # stage 0 and the last stage: the tied embedding's round


@dataclass
class PeerMetrics:
    steps: list[StepReport] = field(default_factory=list)


class PipelinePeer:
    """One peer of a pipeline run (see the module docstring)."""

    def __init__(
        self,
        node: Node,
        pipeline: PipelineSection,
        model: GPTConfig,
        *,
        seed: int,
        lr: float = 1e-3,
        stage: int | None = None,
        interval: float = 2.0,
        concurrency: int | None = None,
        rng: random.Random | None = None,
        throughput: float | None = None,
        slowdown: float = 1.0,
        costs: Sequence[float] = (),
        diloco: DilocoSection | None = None,
        local_steps: int = 1,
    ) -> None:
        """``stage``: the stage to serve (None: the one the directory says limits the swarm, chosen in
        :meth:`join`); ``throughput``: a fixed figure to announce instead of the measured one (tests);
        ``slowdown``: this peer's stage computes that many times slower (an emulated slow device);
        ``costs``: per stage, emulated seconds of compute per sample (``StageServer``'s ``cost``);
        ``diloco``: the run's ``[diloco]`` in a DiLoCo run (None: sync), whose stage peers average their
        pseudo-gradients every ``local_steps`` steps (see :meth:`step`)."""
        if local_steps < 1:
            raise ValueError("local_steps must be at least 1")
        self.diloco = diloco
        self.local_steps = local_steps
        self.outer: OuterStep | None = None  # DiLoCo: the stage's global weights and outer optimizer
        self._round_samples = 0  # DiLoCo: samples this peer's stage counted since the last outer step
        self.node = node
        self.pipeline = pipeline
        self.model = model
        self.seed = seed
        self.lr = lr
        self.interval = interval
        self.concurrency = concurrency or pipeline.num_stages
        self.rng = rng or random.Random()
        self.fixed_throughput = throughput
        self.stage_index = stage
        self.link_bytes = link_bytes_per_sample(model, pipeline)  # per stage: a sample's bytes on a link
        self.directory: list[StagePeer] = []
        self._known: dict[PeerID, tuple[StagePeer, float]] = {}  # every entry read lately, and when
        self.empty_stages: list[int] = []  # stages no peer in the directory serves
        self.metrics = PeerMetrics()
        self.server: StageServer | None = None
        self.router: Router | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.step_number = 0
        self.why = ""
        self.slowdown = slowdown
        self.costs = tuple(costs)
        self.announcing = False  # publish a joining record before this peer serves (see ``trainer``)
        self.downloads = 0  # stage states downloaded (``transfer``)
        self._digest = b""  # of the stage's weights at the start of the current step
        self.stale = False  # it sat out its stage's average: off the lineage until it downloads again
        self._prepared: Stage | None = None
        # snapshots of the stage's state at step starts, taken while somebody asks (``transfer``)
        self._snapshots: dict[int, Snapshot] = {}
        self._snapshot_taken = trio.Event()
        self._wanted_until = -1.0
        self._between_steps = True  # (no step in progress: the state is a step's start)

    @property
    def stage(self) -> Stage:
        assert self.server is not None, "join() first"
        return self.server.stage

    def throughput(self) -> float:
        """Samples per second this peer's stage computes (what it announces)."""
        if self.fixed_throughput is not None:
            return self.fixed_throughput
        return self.server.throughput if self.server is not None else 0.0

    def bandwidth(self) -> float:
        """Bytes per second this peer's link carried its stage's inputs at (what it announces)."""
        return self.server.bandwidth if self.server is not None else 0.0

    def record(self, *, left: bool = False) -> StageRecord:
        """This peer's directory entry: its stage, or (before it serves) that it is joining."""
        addresses = tuple(str(a) for a in self.node.host.advertised_addresses())
        if self.server is None:
            return StageRecord(
                self.stage_index or 0,
                self.pipeline.num_stages,
                addresses,
                0.0,
                0,
                self.step_number,
                self.node.clock(),
                left,
                True,
            )
        return StageRecord(
            self.server.index,
            self.pipeline.num_stages,
            addresses,
            self.throughput(),
            self.server.queue,
            self.step_number,
            self.node.clock(),
            left,
            False,
            b"" if self.stale else self.digest_bytes(),
            self.bandwidth(),
        )

    def digest_bytes(self) -> bytes:
        """The first 8 bytes of :meth:`weights_digest` at the start of the current step (cached)."""
        if not self._digest and self.server is not None:
            self._digest = bytes.fromhex(self.weights_digest())[:8]
        return self._digest

    async def refresh(self) -> None:
        """Publish this peer's record and read the directory again. A read may miss entries that other
        replicas hold (a lookup stops at its quorum), so what was read is merged with what was known:
        an entry stays until no read has returned it for ``FORGET_AFTER`` intervals."""
        if self.server is not None or self.announcing:
            await announce_stage(self.node.dht, self.node.config.run_id, self.record(), ttl=6 * self.interval)
        found = await read_directory(self.node.dht, self.node.config.run_id, self.pipeline.num_stages)
        now = trio.current_time()
        for p in found:
            self._known[p.peer] = (p, now)
        if self.server is not None:
            self._known[self.node.identity.peer_id] = (
                StagePeer(self.node.identity.peer_id, self.record()),
                now,
            )
        horizon = now - FORGET_AFTER * self.interval
        self._known = {k: v for k, v in self._known.items() if v[1] >= horizon}
        self.directory = sorted((p for p, _ in self._known.values()), key=lambda p: p.peer)
        served = {p.record.stage for p in self.directory if not p.record.joining}
        empty = [s for s in range(self.pipeline.num_stages) if s not in served]
        if empty != self.empty_stages and self.server is not None:
            if empty:  # said out loud, once per change: no micro-batch passes until a peer takes it
                log.warning(
                    "no peer serves stage %s: micro-batches cannot pass until a peer takes it (a joiner"
                    " takes an empty stage first)",
                    ", ".join(map(str, empty)),
                )
            else:
                log.info("every stage has a peer again")
        self.empty_stages = empty

    def candidates(self, stage: int) -> list[Candidate]:
        out = []
        for p in self.directory:
            r = p.record
            if r.stage != stage or r.joining or (not r.addresses and p.peer != self.node.identity.peer_id):
                continue
            address = r.addresses[0] if r.addresses else ""
            out.append(Candidate(p.peer, address, r.throughput, r.queue, r.bandwidth))
        return out

    async def answering(self, cands: list[Candidate]) -> set[PeerID]:
        """Those of ``cands`` that answer a ping within the pipeline's timeout (this peer does)."""
        alive: set[PeerID] = set()

        async def one(c: Candidate) -> None:
            if c.peer == self.node.identity.peer_id:
                alive.add(c.peer)
                return
            try:
                with trio.fail_after(self.pipeline.timeout):
                    conn = await self.node.host.connect(c.address, timeout=self.pipeline.timeout)
                    await conn.ping(timeout=self.pipeline.timeout)
                alive.add(c.peer)
            except (P2PError, trio.TooSlowError):
                pass

        async with trio.open_nursery() as nursery:
            for c in cands:
                nursery.start_soon(one, c)
        return alive

    def everyone(self) -> list[Candidate]:
        return [c for s in range(self.pipeline.num_stages) for c in self.candidates(s)]

    async def warm_up(self) -> None:
        """The process's one-time costs of training, paid in a worker thread before this peer asks for
        any state: torch builds its optimizer machinery on the first AdamW (seconds of imports) and its
        autograd on the first backward. Paid after a download instead, on the event loop, they left a
        restarted peer's downloaded state a step stale before it served (measured under load: 18 s)."""

        def warm() -> None:
            w = torch.nn.Parameter(torch.zeros(2, 2))
            opt = torch.optim.AdamW([w], lr=1e-3)
            torch.autograd.backward((w @ torch.ones(2, 2)).sum())
            opt.step()

        await trio.to_thread.run_sync(warm)

    def prepare(self, index: int) -> Stage:
        """Stage ``index`` built from the run's seed (what :meth:`join` serves next), e.g. to size the
        download of its state."""
        if self._prepared is None or self._prepared.index != index:
            self._prepared = build_stage(self.model, self.pipeline, index, self.seed)
        return self._prepared

    async def join(self, stage_index: int | None = None, snapshot: Snapshot | None = None) -> None:
        """Serve a stage and announce it: ``stage_index``, else the one given at construction, else the
        one the directory says limits the swarm. Its weights are the run's initial ones, or
        ``snapshot``'s (a state downloaded from the stage's peers: ``transfer``), with its step. Called
        again (a move to another stage, or a resync), it replaces what this peer served."""
        await self.refresh()
        if stage_index is not None:
            self.stage_index = stage_index
        if self.stage_index is None:
            self.stage_index, self.why = choose_stage(
                self.directory,
                self.pipeline.num_stages,
                me=self.node.identity.peer_id,
                link_bytes=self.link_bytes,
            )
            log.info("serving %s", self.why)
        if self.server is not None and self.server.index == self.stage_index:
            stage = self.server.stage  # a resync: the same stage, other weights
        else:
            stage = self.prepare(self.stage_index)
        self._prepared = None
        optimizer = torch.optim.AdamW(stage.parameters(), lr=self.lr, weight_decay=0.0)
        params = [p for p in stage.parameters() if p.requires_grad]
        moments: list[torch.Tensor | None] = []
        if snapshot is not None:
            apply_snapshot(snapshot, params, optimizer)
            self.step_number = snapshot.step
            if self.diloco is not None:  # (a DiLoCo state: the global weights and the outer momentum)
                moments = [optimizer.state.pop(p, {}).get("exp_avg") for p in params]
        if self.diloco is not None:
            contribution = Contribution(params, [range(len(params))], diloco=True, summed=False)
            tensors: list[torch.Tensor] = list(params)
            self.outer = OuterStep(tensors, contribution, self.diloco, Compression.NONE)
            with torch.no_grad():
                for m, saved in zip(self.outer.momentum, moments, strict=False):
                    if saved is not None:
                        m.copy_(saved)
            self._round_samples = 0
        if self.server is not None and self.server.stage is stage:
            self.server.close_step()
            self.server.open_step(self.step_number)
        else:
            cost = self.costs[stage.index] if self.costs else 0.0
            self.server = StageServer(
                stage, self.pipeline, step=self.step_number, slowdown=self.slowdown, cost=cost
            )
            self.server.register(self.node.registry, replace=True)
        self.optimizer = optimizer
        self._digest = b""
        self.stale = False
        self._snapshots.clear()
        if self.node.registry.get(STATE.name) is None:
            self.node.registry.add_unary(STATE, self._on_state)
        self.router = self.router or Router(
            self.node.host, self.pipeline, self.model, self.candidates, local=self.server, rng=self.rng
        )
        self.router.local = self.server
        await self.refresh()

    async def keep_fresh(self) -> None:
        """Publish this peer's record and read the others' every ``interval`` seconds."""
        while True:
            await trio.sleep(self.interval)
            with trio.move_on_after(3 * self.interval):
                await self.refresh()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Join, then keep the directory fresh (:meth:`keep_fresh`)."""
        await self.join()
        task_status.started()
        await self.keep_fresh()

    async def leave(self) -> None:
        """Tell the directory this peer serves no more (its callers stop picking it at their next read)."""
        await announce_stage(
            self.node.dht, self.node.config.run_id, self.record(left=True), ttl=6 * self.interval
        )

    # ------------------------------------------------------------------ the stage's state (``transfer``)

    async def _on_state(self, ctx: CallContext, req: StateReq) -> Reply[StateResp]:
        if self.server is None or self.server.index != req.stage or self.optimizer is None:
            raise CallRefused(WRONG_STAGE, f"this peer serves no stage {req.stage}")
        self._wanted_until = trio.current_time() + 2 * self.pipeline.timeout + 3 * self.interval
        if req.chunk >= 0:
            snap = self._snapshots.get(req.step)
            if snap is None or req.chunk >= len(snap.digests):
                raise CallRefused(NO_STATE, f"no state of step {req.step} here")
            return Reply(StateResp(snap.step, snap.adam_steps, len(snap.body), ()), snap.chunk(req.chunk))
        if req.step <= self.step_number and self.step_number not in self._snapshots and self._between_steps:
            self._snapshot()
        with trio.move_on_after(self.pipeline.timeout + 3 * self.interval):
            while not any(s >= req.step for s in self._snapshots):
                self._snapshot_taken = trio.Event()
                await self._snapshot_taken.wait()
        recent = [s for s in self._snapshots if s >= req.step]
        if not recent:
            raise CallRefused(NO_STATE, f"no state of step {req.step} or later here yet")
        return Reply(self._snapshots[max(recent)].manifest())

    def state_snapshot(self) -> Snapshot:
        """The stage's state as the start of the current step (what a joiner downloads and a checkpoint
        holds): the weights and AdamW's moments; in a DiLoCo run the stage's global weights (those of
        its last outer step, the same on all its peers) with the outer momentum in the first moment's
        place (a joiner's inner optimizer starts afresh: the inner state is every peer's own)."""
        assert self.server is not None and self.optimizer is not None
        if self.outer is None:
            return take_snapshot(self.step_number, self.server.params, self.optimizer)
        holder = torch.optim.SGD(self.outer.global_params, lr=1.0)
        for g, m in (
            zip(self.outer.global_params, self.outer.momentum, strict=True) if self.outer.momentum else ()
        ):
            holder.state[g] = {"step": torch.tensor(1.0), "exp_avg": m, "exp_avg_sq": torch.zeros_like(m)}
        return take_snapshot(self.step_number, self.outer.global_params, holder)

    def _snapshot(self) -> None:
        assert self.server is not None and self.optimizer is not None
        snap = self.state_snapshot()
        self._snapshots[snap.step] = snap
        for old in sorted(self._snapshots)[:-2]:
            del self._snapshots[old]
        self._snapshot_taken.set()

    async def step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> StepReport:
        """One step: this peer's micro-batches through the pipeline, then the stage-wise average."""
        assert self.server is not None and self.router is not None and self.optimizer is not None
        self._between_steps = False
        began = trio.current_time()
        sent0, received0 = self.router.stats.bytes_sent, self.router.stats.bytes_received
        results: list[MicroBatch] = []
        limit = trio.Semaphore(self.concurrency)
        router = self.router
        # duplicated micro-batches compare two stage peers' answers: only on a step whose weights are the
        # same on every peer of a stage (DiLoCo: the first inner step after an outer one)
        router.checking = self.outer is None or self.step_number % self.local_steps == 0

        async def one(x: torch.Tensor, y: torch.Tensor) -> None:
            async with limit:
                results.append(await router.run(self.step_number, x, y))

        async with trio.open_nursery() as nursery:
            for x, y in micro_batches:
                nursery.start_soon(one, x, y)
        # the step ends for this stage once every live caller is done with it: those that heard this
        # peer's "done" (a dead or unreachable one cannot, and calls nobody), less those that answered
        # that they were done already (their own "done" went out before this peer served, e.g. after a
        # restart); a caller that dies meanwhile: after a while
        self.server.caller_done = self.step_number
        heard, finished = await router.done(self.step_number, self.everyone())
        self.server.mark_done(self.step_number, finished)
        done = await self.server.wait_done(
            heard | {self.node.identity.peer_id}, limit=2 * self.pipeline.timeout
        )
        # stage 0's embedding and the last stage's head are one tensor held twice: the two ends sum their
        # gradients after their stage averages (``stagewise.tie_ends``); under DiLoCo their inner steps
        # are every peer's own, and the two ends tie their averaged pseudo-gradients at the outer steps
        averages = self.outer is None or (self.step_number + 1) % self.local_steps == 0
        tied = tied_index(self.stage) if averages else None
        ends: list[Candidate] = []
        if tied is not None:
            other = self.pipeline.num_stages - 1 - self.server.index
            ends = [c for c in self.candidates(other) if c.peer in done]
        # the peers that are done and still answer: a peer that died after it was done must not hold the
        # others' group up (the group needs every member: see stagewise)
        own = [c for c in self.candidates(self.server.index) if c.peer in done]
        alive = await self.answering(own + ends)
        mates = {c.peer for c in own} & alive
        partners = {c.peer for c in ends} & alive
        # a mate known done only from its answer never told this peer itself: it did not know this peer
        # served when it ended its step (this peer just joined), so it will not wait for it in the
        # stage's group; waiting for it would cost the round's whole timeout
        unaware = mates - self.server.told(self.step_number) - {self.node.identity.peer_id}
        grads, counted = self.server.close_step()
        tie: StageAverage | None = None
        members = max(1, len(mates | {self.node.identity.peer_id}))
        group = mates | {self.node.identity.peer_id}
        if unaware and averages:
            log.info(
                "stage %d's peers %s do not know this peer serves yet: it sits out step %d's average and"
                " downloads the stage's state again",
                self.server.index,
                ", ".join(p.short() for p in sorted(unaware)),
                self.step_number,
            )
            avg = StageAverage(False, 0, 0.0, "the stage's other peers do not know this peer yet")
            self.stale = True  # (no digest in its record until it downloads: see ``catchup.behind``)
            if self.outer is not None:
                for i in range(len(self.outer.params)):
                    self.outer.reset_local(i)
                self._round_samples = 0
        elif self.outer is not None:
            avg, tie = await self._diloco_step(
                grads, counted, members, tied=tied, group=group, ends=len(partners)
            )
        else:
            avg = await average_stage(
                self.node.averager,
                self.server.index,
                self.step_number,
                grads,
                counted,
                members=members,
                timeout=max(30.0, 3 * self.pipeline.timeout),
            )
            if tied is not None:  # the two copies of the tied embedding get the sum of their gradients
                tie = await tie_ends(
                    self.node.averager,
                    self.step_number,
                    grads[tied],
                    group=group,
                    steps=avg.applied,
                    members=len(group) + len(partners),
                    timeout=max(30.0, 3 * self.pipeline.timeout),
                )
            if avg.applied:
                for i, (p, g) in enumerate(zip(self.server.params, grads, strict=True)):
                    # (a tied round that did not apply: neither end moves its copy this step)
                    p.grad = None if i == tied and tie is not None and not tie.applied else g
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        self.step_number += 1
        self.server.open_step(self.step_number)
        self._digest = b""
        self._between_steps = True
        if trio.current_time() < self._wanted_until:  # somebody is downloading the stage's state
            self._snapshot()
        report = StepReport(
            self.step_number,
            self.server.index,
            [r.loss for r in results if r.loss is not None],
            sum(1 for r in results if r.loss is None),
            sum(r.retries for r in results),
            counted,
            avg,
            trio.current_time() - began,
            self.router.stats.bytes_sent - sent0,
            self.router.stats.bytes_received - received0,
            len(results),
            self.server.queue,
            self.server.throughput,
            tie,
        )
        self.metrics.steps.append(report)
        return report

    async def _diloco_step(
        self,
        grads: list[torch.Tensor],
        counted: int,
        members: int,
        *,
        tied: int | None,
        group: set[PeerID],
        ends: int,
    ) -> tuple[StageAverage, StageAverage | None]:
        """DiLoCo per stage: one inner step with this peer's own gradients; after every ``local_steps``-th
        step the stage's pseudo-gradients (global minus local weights) are averaged by its peers
        (``stagewise``, weighted by the samples each counted in the round) and the outer optimizer
        (``OuterStep``: Nesterov SGD) steps the global weights, which every peer's local weights restart
        from: the same average into the same outer state gives every peer of the stage the same weights.
        An aborted average aborts on every member: each then restarts from the global weights it held
        (the round's inner steps are lost), so they stay identical too.

        The tied embedding (``tied``: this stage's copy, on stage 0 and the last stage; ``group``: this
        peer's stage group, ``ends``: the other end's peers in the round): after the stage average the
        two ends' peers tie their copy's averaged pseudo-gradient (``stagewise.tie_ends``) and both
        step their copy with the sum of the two ends' (:data:`TIED_OUTER`), the same value into the
        same outer state: the copies stay equal after every outer step. When the tied round does not
        apply (on every member alike), neither end moves its copy: its global value and outer momentum
        are put back after the outer step."""
        assert self.server is not None and self.optimizer is not None and self.outer is not None
        if counted > 0:
            for p, g in zip(self.server.params, grads, strict=True):
                p.grad = g
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self._round_samples += counted
        if (self.step_number + 1) % self.local_steps:
            return StageAverage(True, 1, float(counted), "inner step"), None
        outer = self.outer
        outer.pseudo_gradients()
        buffer = outer.contribution.buffer
        timeout = max(30.0, 3 * self.pipeline.timeout)
        avg = await average_stage(
            self.node.averager,
            self.server.index,
            self.step_number,
            buffer.tensors,
            self._round_samples,
            members=members,
            timeout=timeout,
        )
        self._round_samples = 0
        tie: StageAverage | None = None
        if tied is not None:
            tie = await tie_ends(
                self.node.averager,
                self.step_number,
                buffer.views[tied],  # (a view: the sum lands in the buffer the outer step reads)
                group=group,
                steps=avg.applied,
                members=len(group) + ends,
                timeout=timeout,
            )
            if tie.applied and TIED_OUTER != 1.0:
                with torch.no_grad():
                    buffer.views[tied].mul_(TIED_OUTER)
        if not avg.applied:
            for i in range(len(outer.params)):
                outer.reset_local(i)
            return avg, tie
        kept: list[torch.Tensor] = []
        if tied is not None and tie is not None and not tie.applied:
            # (neither end moves its copy: the value and the momentum it held stay)
            kept = [outer.global_params[tied].detach().clone()]
            kept += [outer.momentum[tied].detach().clone()] if outer.momentum else []
        outer.step(after=outer.reset_local)
        if kept and tied is not None:
            with torch.no_grad():
                outer.global_params[tied].copy_(kept[0])
                if outer.momentum:
                    outer.momentum[tied].copy_(kept[1])
            outer.reset_local(tied)
        return avg, tie

    def stage_weights(self) -> list[torch.Tensor]:
        """The stage's agreed weights: the local ones (sync), or the global ones of the last outer step
        (DiLoCo: the local ones differ between outer steps)."""
        if self.outer is not None:
            return list(self.outer.global_params)
        return list(self.stage.parameters())

    def weights_digest(self) -> str:
        """A digest of this peer's stage weights (:meth:`stage_weights`): equal on every peer of a stage
        after every step."""
        h = hashlib.blake2b(digest_size=16)
        for p in self.stage_weights():
            h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()
