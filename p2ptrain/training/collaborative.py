"""CollaborativeOptimizer: many peers train one model, as if it were one optimizer with a huge batch.

Theory of operation. The training loop calls ``await opt.step(samples)`` after each backward pass. A
global step (an *epoch*) ends when the whole swarm has processed ``target_batch_size`` samples, which each
peer judges from the others' signed progress records (see ``progress``): fast peers simply contribute
more samples to an epoch than slow ones, and nobody waits for anybody until the target is reached.

- **sync**: gradients accumulate locally (as sums over samples). When the swarm reaches the target, the
  peers on this epoch form a group (matchmaking runs in the background while compute goes on). As soon
  as the group forms, each member hands its accumulated gradients to the round (its mean gradient,
  weighted by its sample count) and goes on computing into a fresh accumulator: nobody waits for a slow
  peer's batch in progress (it counts toward the next step). At the first ``step`` after the round
  committed, every member applies the same averaged gradient with the same optimizer: parameters stay
  bit-identical. An aborted round's gradients go back into the accumulator (unless the round averaged
  them in place, as it does the flat accumulator of a model in host memory: then they are dropped).
- **diloco**: each peer takes inner steps of its own optimizer; at the target the peers average their
  pseudo-gradients (global parameters minus local ones), weighted by samples, and apply an outer Nesterov
  SGD step to the global parameters; local parameters restart from the new global ones. With ``overlap``
  the averaging of round t runs while round t+1 computes, and the local progress made meanwhile is kept
  on top of the new global parameters when round t's result lands.

Failures follow the all-reduce rule: a round that aborted changed nothing, and the peer goes on
accumulating and tries again; a peer that missed a step (its round failed while others committed, it
joined late, or its parameters diverged from the majority's) downloads the state from a peer that has
it (see ``fetch``) and takes part from the next epoch. A peer alone on its epoch steps alone: at once
when it never saw another peer or its partners said they left, after an averaging timeout when their
records vanished, and never while no connected peer answers it (it may be the one cut off: a step
alone would start a second lineage under the swarm's step numbers).

The shared state (its digest, snapshots for joiners, downloads) is ``swarm_state``'s; rounds that run
while compute goes on are ``inflight``'s; progress records out and in are ``progress_exchange``'s; when a peer
alone on its epoch may step is ``solo``'s; DiLoCo's global parameters and outer step are ``outer``'s;
the swarm's ban verdicts are ``bans``'.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import trio

from ..averaging.allreduce import RoundResult
from ..averaging.compression import parse_compression
from ..averaging.matchmaking import Quorum
from ..averaging.protocol import SignedManifest
from ..averaging.robust import parse_aggregation
from ..config import RunConfig
from ..errors import ConfigError, GroupFormationFailed, RoundAborted
from ..identity import PeerID
from ..idwork import work_bits
from ..node import BackgroundNode, Node
from . import fragments, statesync
from .bans import BanRecords
from .bookkeeping import RateMeter, RoundStats, run_fingerprint
from .buffers import ParamBuffer
from .feedback import ErrorFeedback
from .fetch import Fetcher, ProgressFn
from .inflight import BackgroundRounds, _InFlight
from .offheap import FileTensors
from .outer import OuterSteps
from .progress import PeerProgress, ProgressRecord, SwarmView
from .solo import StepAlone
from .statesync import StateServer
from .swarm_state import _Download

log = logging.getLogger(__name__)

RETRY_MATCHMAKING = 1.0  # seconds before matchmaking again after a group failed to form
LEAD_SMOOTHING = 0.3  # how fast the expected time to form a group follows what groups took


class CollaborativeOptimizer(StepAlone, OuterSteps, BackgroundRounds, BanRecords):
    """Wraps a torch optimizer; ``await step(samples)`` after every backward pass."""

    def __init__(
        self,
        node: Node,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: RunConfig,
        *,
        clock: Callable[[], float] = time.time,
        summed_grads: bool = False,
    ) -> None:
        """``summed_grads`` (sync mode): the training loop scales each batch's loss by its sample count
        and never clears the parameters' ``.grad``: backward passes then add up right in the gradient
        accumulator, whose views are the ``.grad`` (one model-sized tensor less than copying each batch's
        mean gradient into it). Otherwise each backward pass leaves the batch's mean gradient, which
        ``step`` adds to the accumulator, weighted by the batch's samples."""
        self.node, self.model, self.optimizer, self.config = node, model, optimizer, config
        if work_bits(node.peer_id, node.host.work) < config.run.id_work:
            raise ConfigError(
                f"run.id_work asks for {config.run.id_work} bits of work on each peer id and this node's id"
                f" carries {work_bits(node.peer_id, node.host.work)}: start its node with"
                f" HostConfig(id_work={config.run.id_work}) (p2ptrain node does)"
            )
        self.clock = clock
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.diloco = config.training.mode == "diloco"
        self.summed = summed_grads and not self.diloco
        self.epoch = 0
        self.samples = 0  # toward the current epoch, on this peer
        self.inner_steps = 0
        self.inner_seconds = 0.0  # DiLoCo: time in the inner optimizer's steps (training compute too)
        self.rate = RateMeter()
        self.stats = RoundStats()
        self.view: SwarmView | None = None
        self.records: list[PeerProgress] = []
        self._said: dict[tuple[PeerID, int], ProgressRecord] = {}  # see ``said_on``
        self.fingerprint = run_fingerprint(config, model)
        self.key = f"p2ptrain/{node.config.run_id}/progress".encode()
        self._param_bytes = sum(p.numel() * p.element_size() for p in self.params)
        self.outer_file: FileTensors | None = None
        self.momentum: list[torch.Tensor] = []
        self.feedback: ErrorFeedback | None = None
        # the parameters' fragments (streaming DiLoCo; one otherwise), and each one's first element
        sizes = [p.numel() for p in self.params]
        count = config.diloco.fragments if self.diloco else 1
        if count > max(1, len(self.params)):
            raise ConfigError(
                f"diloco.fragments = {count}: the model has only {len(self.params)} trainable parameters"
            )
        self.fragments = fragments.split(sizes, count) if self.params else [range(0)]
        self._starts = [sum(sizes[: f.start]) for f in self.fragments]
        self._slots = self.fragments[0]  # the parameters ``averaged`` holds: the current step's fragment
        if self.diloco:
            self._init_outer(config.diloco)
            compression = parse_compression(config.averaging.compression)
            if compression.sparse:
                self.feedback = ErrorFeedback(self.params, compression)
        # DiLoCo: pseudo-gradients; sync: gradient sums (the parameters' .grad when summed)
        self.averaged = ParamBuffer(self._slot_params())
        if self.summed:
            self._attach()
        self._in_flight: _InFlight | None = None  # a round running in the background
        self._spare: ParamBuffer | None = None  # sync: the accumulator the last round gave back
        self._relaying: trio.Event | None = None  # set once the last round stopped reading ``averaged``
        self._download: _Download | None = None  # a state download running in the background
        self._formed: tuple[int, SignedManifest] | None = None
        self._quorums: dict[bytes, Quorum] = {}  # formed rounds -> the peers they must hold (see _form_group)
        self._matchmaking = False
        self._matchmaking_scope = trio.CancelScope()
        self._retry_at = 0.0
        self._sync_retry_at = 0.0
        self._alone_since: float | None = None
        self._cut_off = False  # out of touch with every peer (see ``_out_of_touch``): said once
        self._probe: trio.Event | None = None  # set when the probe started then has an answer ...
        self._answered = False  # ... this one: did any peer answer its ping
        # Peers of the run seen live that did not say they left: while any is missing from the records,
        # stepping alone waits (once) for it. Keyed by id: a record can only say its own peer left.
        self._partners: set[PeerID] = set()
        self._lagging: tuple[int, float] | None = None  # (epoch, since when) peers here were no majority
        self._counting: dict[PeerID, ProgressRecord] = {}  # see refresh()
        # (epoch, members): the others of the round that took this peer to that epoch (see ``progress``)
        self._cohort: tuple[int, frozenset[PeerID]] = (-1, frozenset())
        self._seeded = False  # _partners took in the partners a checkpoint remembers (_may_step_alone)
        self._refused: set[PeerID] = set()  # peers whose far-off step claims were refused (said once)
        self._started = 0.0
        self._lead = 0.5  # seconds a group takes to form: matchmaking starts that long before the target
        self._publish_now = trio.Event()
        self._arrived = trio.Event()  # a record arrived (see ``ProgressExchange._progress_loop``)
        self._published: ProgressRecord | None = None  # the last record that went out
        self._records_read = trio.Event()
        self._asked_at = -math.inf  # when the replicas were last read (see _ask_replicas)
        self._met_swarm = False  # records were read once the DHT had bootstrapped (see _may_step_alone)
        self._nursery: trio.Nursery | None = None
        self._version = 0  # bumped whenever the state changes
        self._holds = 0  # threads reading the live state: nothing may change it meanwhile
        self._local_idle = trio.Event()  # set while no step work runs in a worker thread (_off_loop)
        self._local_idle.set()
        self._released = trio.Event()
        self._digest_set = trio.Event()
        self._hashes: tuple[int, list[bytes]] | None = None  # the chunk hashes of a state version
        # The digests of the last few steps, once hashed (a large state is hashed in a thread, after
        # the step's metrics line was written): what the metrics report for comparing peers.
        self.hashed: dict[int, bytes] = {}
        self.digest = b""  # the root of the current state; b"" while it is being hashed
        self.on_download_progress: ProgressFn | None = None
        self.download_progress = (0, 0)  # bytes received and expected by the download in progress
        self.leaving = False
        self._epoch_began = clock()  # since when ``samples`` counts (see ``_counting_from``)
        self._next_batch = clock()
        a = config.averaging
        # The run decides how its rounds go, whatever the node was started with.
        node.averager.config = dataclasses.replace(
            node.averager.config,
            compression=a.compression,
            aggregation=parse_aggregation(a.aggregation),
            audit=a.audit,
            matchmaking_time=a.matchmaking_time,
        )
        node.averager.weight_cap = self._weight_cap
        node.averager.auditor.on_ban = self._on_ban
        # A proof of this run's rounds is about one fp32 copy of the model (a partition's slices from
        # each contributor); twice that covers uneven partitions.
        model_bytes = 4 * sum(p.numel() for p in self.params)
        node.averager.auditor.max_proof_bytes = 2 * model_bytes + (1 << 20)
        self.bans_key = f"p2ptrain/{node.config.run_id}/bans".encode()
        self._examining = False  # an examination of published bans runs (see ``bans``)
        s = config.statesync
        self.server = StateServer(node.host.registry, self._prepare_snapshot) if s.serve else None
        self.fetcher = Fetcher(
            node.host,
            max_size=self.max_state_bytes(),
            chunk_timeout=s.chunk_timeout,
            max_donors=s.max_donors,
            on_progress=self._on_download_progress,
        )
        self._rehash()

    # ---- lifecycle ---------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Publish progress and read the swarm's, until cancelled (start it in the node's nursery)."""
        self._started = self.clock()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._progress_loop)
            if self.server is not None:
                nursery.start_soon(self.server.run)
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    # ---- the training loop's side ------------------------------------------------------------------

    async def step(self, samples: int) -> bool:
        """Account for a backward pass over ``samples`` samples; True when a global step was taken (or
        the state was replaced by a download), so the caller may evaluate, checkpoint, log."""
        if not (isinstance(samples, int) and samples > 0):
            raise ValueError("samples must be a positive int")
        # A loop being cancelled (a hard stop) returns from its batch's thread to here, after ``run``
        # already ended: that is a cancellation, not a misuse.
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._nursery is None:
            raise RuntimeError("start CollaborativeOptimizer.run in a nursery first")
        self._next_batch = self.clock()  # the training loop computes its next batch from about now
        if self.diloco:
            await self._inner_step()
        else:
            await self._off_loop(self._accumulate, samples)
        self.samples += samples
        self.rate.add(samples, self.clock())
        changed = await self._land()
        changed = self._land_download() or changed
        flight = self._download
        if flight is not None and flight.carry_from is None and self._in_flight is None:
            # Nothing computed meanwhile would survive the download (sync accumulators are reset, and
            # DiLoCo carries local progress only one step): the link and the CPU are the download's.
            await flight.done.wait()
            await self.unheld()
            changed = self._land_download() or changed
        if self._in_flight is not None or self._download is not None:
            return changed  # a round or a download is in flight: nothing else may touch the state
        view = self._update_view()
        if (view.behind or view.diverged(self.digest)) and self.clock() >= self._sync_retry_at:
            self._start_download(view)
            return changed
        if self._formed is not None:
            epoch, manifest = self._formed
            self._formed = None
            if epoch == self.epoch and self.diloco:
                return await self._average(manifest) or changed
            if epoch == self.epoch:  # summed gradients: handed over between two backward passes
                self._start_in_background(manifest)
                return changed
            self.node.averager.decline(manifest)
        if not self._matchmaking and self.clock() >= self._retry_at:
            if view.peers > 1 and view.samples + view.rate * self._lead >= view.target:
                # Early by the time groups take to form: the round starts on target. Not before this
                # peer's first batch (just synced): it would have nothing to send, and its group would
                # wait for it in vain. Nor while the peers here are no majority of those on this step
                # and the one before (see ``progress``): they arrive soon, and a group without them would
                # commit this step on a lineage of its own.
                if self.samples > 0 and self._majority_here(view):
                    self._start_matchmaking()
            elif (
                view.peers <= 1
                and view.ready
                and not view.overtaken
                and not self._holds
                and self._may_step_alone(view)
            ):
                self._solo_step()
                return True
        return changed

    def _accumulate(self, samples: int) -> None:
        if self.summed:  # the backward pass added into the accumulator itself
            for p, acc in zip(self.params, self.averaged.views, strict=True):
                if p.grad is None:  # (cleared, and not used by this batch)
                    p.grad = acc
                elif p.grad.data_ptr() != acc.data_ptr():
                    raise RuntimeError(
                        "summed_grads: a parameter's .grad was replaced (cleared by the training loop?):"
                        " the gradients accumulated so far are no longer where backward adds"
                    )
            return
        with torch.no_grad():
            for p, acc in zip(self.params, self.averaged.views, strict=True):
                if p.grad is not None:
                    acc.add_(p.grad, alpha=samples)  # the loss is a mean: its gradient times samples
                p.grad = None

    async def _off_loop(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn`` (work over the whole model: an inner step, accumulating gradients, applying a
        round) in a worker thread when the model is large: AdamW over 124M parameters takes about a
        second of CPU, which the event loop would not serve the network in (a donor's upload ran at 58%
        of its link). Meanwhile the training loop waits for ``step``, and a round that forms and a
        snapshot wait for ``_local_idle``."""
        if self._param_bytes < statesync.THREAD_BYTES:
            fn(*args)
            return
        self._local_idle = trio.Event()
        try:
            await trio.to_thread.run_sync(fn, *args)
        finally:
            self._local_idle.set()

    async def _inner_step(self) -> None:
        """DiLoCo's local step."""
        self._set_lr(self.inner_steps)
        await self._off_loop(self._local_step)
        self.inner_steps += 1

    def _local_step(self) -> None:
        began = time.perf_counter()
        self._clip()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.inner_seconds += time.perf_counter() - began

    def _set_lr(self, step: int) -> None:
        t = self.config.training
        lr = t.lr * min(1.0, (step + 1) / t.warmup_steps) if t.warmup_steps else t.lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _clip(self, shared: bool = False) -> None:
        """Clip the gradients' norm. ``shared``: they are a round's buffer that it may still serve to
        members fetching late (averaged in place): they are left alone, and the clipped gradients go
        into copies (only when clipping changes them). The same bits either way: one multiplication by
        the same factor."""
        limit = self.config.training.grad_clip
        if limit <= 0:
            return
        if not shared:
            torch.nn.utils.clip_grad_norm_(self.params, limit)
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        factor = torch.clamp(limit / (torch.nn.utils.get_total_norm(grads) + 1e-6), max=1.0)
        if float(factor) < 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad = p.grad * factor

    # ---- global steps --------------------------------------------------------------------------------

    def _start_matchmaking(self) -> None:
        assert self._nursery is not None
        self._matchmaking = True
        self._matchmaking_scope = trio.CancelScope()
        self._nursery.start_soon(self._matchmake, self.epoch, self._matchmaking_scope)

    async def _matchmake(self, epoch: int, scope: trio.CancelScope) -> None:
        try:
            with scope:  # cancelled when this peer's epoch changes meanwhile (a download)
                await self._form_group(epoch)
        finally:
            self._matchmaking = False

    async def _form_group(self, epoch: int) -> None:
        cfg = self.config.averaging
        began = self.clock()
        try:
            await self.refresh()  # size the group by the freshest records: a peer that just caught up counts
            assert self.view is not None
            if self.view.behind or self.view.peers <= 1 or not self._majority_here(self.view):
                return  # step() catches up, steps alone, or waits for the peers one step behind
            target = min(self.view.peers + self.view.arriving, cfg.max_group_size)
            # a majority: two groups cannot both form (all of those here, once waiting gave up)
            minimum = min(self.view.peers, target, self.view.quorum)
            # Only members that publish progress count toward that majority: ids that only join groups
            # would let two groups of one step both reach it (two lineages). In an open swarm, only the
            # trusted among them (see ``trusted``): a fresh key that publishes records and joins first
            # would otherwise make a group of two the "majority" of a joiner that trusts only its join
            # peer, and start a lineage of its own with it. Members check it too (a leader may lie).
            publishing = frozenset(r.peer for r in self.records) | {self.node.peer_id}
            trusted = self.trusted()
            if trusted is None:
                quorum = Quorum(publishing, minimum)
            else:
                known = publishing & (trusted | {self.node.peer_id})
                quorum = Quorum(known, min(minimum, self.view.vouched_here))
            manifest = await self.node.averager.form_group(
                self.averaged.tensors,
                timeout=cfg.timeout,
                group_key=self._group_key(epoch),
                target_size=target,
                min_size=minimum,
                quorum=quorum,
            )
            while len(self._quorums) >= 4:  # (formed rounds that never ran: declined, or superseded)
                del self._quorums[next(iter(self._quorums))]
            self._quorums[manifest.digest] = quorum
        except GroupFormationFailed as e:
            log.info("no group for step %d: %s", epoch, e)
            self.stats.no_group += 1
            self.stats.last = {"epoch": epoch, "outcome": "no group", "reason": str(e)}
            self._retry_at = self.clock() + RETRY_MATCHMAKING
        else:
            took = min(self.clock() - began, cfg.matchmaking_time)
            self._lead += LEAD_SMOOTHING * (took - self._lead)
            if (self.diloco and not self.config.diloco.overlap) or self.summed:
                # step() runs it, with compute paused; or, summed, hands the gradients over between two
                # backward passes (one may be adding to them right now)
                self._formed = (epoch, manifest)
            elif self.epoch == epoch and self._in_flight is None and self._download is None:
                await self._local_idle.wait()  # work in a thread changes what we would send
                if self.epoch == epoch and self._in_flight is None and self._download is None:
                    self._start_in_background(manifest)
                else:
                    self.node.averager.decline(manifest)
            else:  # the state moved on meanwhile: tell the group at once rather than let it wait for us
                self.node.averager.decline(manifest)

    def _group_key(self, epoch: int) -> str:
        """Groups form per step; streaming DiLoCo's also per fragment count (what each step averages)."""
        mode, count = self.config.training.mode, len(self.fragments)
        return f"{mode}-{epoch}" if count == 1 else f"{mode}/{count}-{epoch}"

    async def _average(self, manifest: SignedManifest) -> bool:
        """DiLoCo without overlap: run the formed group's round now, compute paused; apply it if it
        commits (an abort changes nothing: the work is still in the local parameters)."""
        weight = self.samples
        self._pseudo_gradients()
        before = await self._fold(self.averaged)
        try:
            result = await self.node.averager.run_round(
                manifest, self.averaged.tensors, weight=self._claim(weight), in_place=self.averaged.sendable
            )
        except RoundAborted as e:
            self._note_abort(e)
            self._unfold(before, committed=False)
            self._after_abort(self.averaged)
            return False
        short = self._short_of_quorum(manifest.digest, result)
        if short:  # the work is still in the local parameters, as after an abort
            self._note_abort(RoundAborted(short))
            self._unfold(before, committed=False)
            self._after_abort(self.averaged)
            return False
        self._unfold(before, committed=True)
        self._relaying = result.retired
        await self.unheld()
        self._outer_step(after=self._reset_local)
        self.samples -= weight
        self._counting_from()
        self._advance(result, weight)
        return True

    def _apply_gradients(self, grads: ParamBuffer, zero: bool = True) -> None:
        """One optimizer step with ``grads``, then zeroed for reuse as an accumulator; ``zero`` False:
        a round averaged them in place and may still serve them, so nothing writes into them."""
        self._set_lr(self.epoch)
        held = [p.grad for p in self.params]  # summed: the accumulator of the next step
        for p, g in zip(self.params, grads.views, strict=True):
            p.grad = g
        self._clip(shared=not zero)
        self.optimizer.step()
        for p, h in zip(self.params, held, strict=True):
            p.grad = h
        if zero:
            grads.zero_()

    def _attach(self) -> None:
        """Summed gradients: the accumulator's views become the parameters' .grad."""
        for p, acc in zip(self.params, self.averaged.views, strict=True):
            p.grad = acc

    def _solo_step(self) -> None:
        """No other peer on this epoch: the step is this peer's alone."""
        weight = self.samples
        if self.diloco:
            self._pseudo_gradients()
            if self.feedback is not None:  # nothing to send: what earlier rounds left out goes in whole
                self.feedback.flush_into(self.averaged, self._start())
            self._outer_step(after=self._reset_local)
        else:
            self.averaged.div_(weight)
            self._apply_gradients(self.averaged)
        self.samples = 0
        self._counting_from()
        self.stats.solo += 1
        self._advance(None, weight)

    def _advance(self, result: RoundResult | None, weight: int) -> None:
        self.stats.steps += 1
        self._alone_since = None
        if result is not None:
            self.stats.averaged += 1
            mine = self.node.peer_id in result.contributors
            if not mine:
                log.warning("step %d: our %d samples were left out of the round", self.epoch, weight)
            self.stats.last = {
                "epoch": self.epoch,
                "outcome": "averaged",
                "group": result.group_size,
                "contributors": len(result.contributors),
                "samples": int(result.total_weight),
                "mine": weight if mine else 0,  # this peer's samples in the average
                "seconds": round(result.round_seconds, 3),
                "reduced": result.reduced,  # elements of the average this peer reduced (its share)
                "shares": {p.short(): n for p, n in result.shares.items()},  # every member's
                "excluded": {p.short(): why for p, why in result.excluded.items()},
            }
        else:
            self.stats.last = {"epoch": self.epoch, "outcome": "alone", "samples": weight, "mine": weight}
        self.epoch += 1
        self._fit_buffer()
        others = frozenset(result.contributors) - {self.node.peer_id} if result is not None else frozenset()
        self.node.averager.trained_with(others)  # trusted from now on (see ``trusted``)
        self._cohort = (self.epoch, others)
        self._state_changed()

    def _note_abort(self, e: BaseException) -> None:
        log.warning("step %d: averaging round aborted, nothing applied: %s", self.epoch, e)
        self.stats.aborted += 1
        self.stats.last = {"epoch": self.epoch, "outcome": "aborted", "reason": str(e)}

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def finite(self) -> bool:
        return all(math.isfinite(float(p.detach().abs().max())) for p in self.params)

    async def drain(self, timeout: float) -> None:
        """Finish the averaging round this peer takes part in, before it stops (the training loop calls
        ``step`` no more): its group would otherwise lose the round, or its coordinator.

        A group being formed forms (or gives up, within the matchmaking time and the joiners' grace); a
        formed group's round runs now (DiLoCo without overlap); a round running in the background is
        waited for. A result is applied as ``step`` would apply it; nothing new starts. Returns after
        ``timeout`` seconds at the latest: what still runs then is cut when the caller cancels.
        """
        with trio.move_on_after(timeout) as waited:
            while self._matchmaking:  # noqa: ASYNC110  (no event marks its end; it ends on its own)
                await trio.sleep(0.05)
            if self._formed is not None:
                epoch, manifest = self._formed
                self._formed = None
                if epoch != self.epoch or self._in_flight is not None or self._download is not None:
                    self.node.averager.decline(manifest)
                elif self.diloco:
                    await self._average(manifest)
                else:  # summed gradients, handed over now (no backward pass runs any more)
                    self._start_in_background(manifest)
            flight = self._in_flight
            if flight is not None:
                await flight.done.wait()
                await self.unheld()  # a thread reading the state (a donor's snapshot) delays the step
                await self._land()
        if waited.cancelled_caught:
            log.warning("stopped waiting for the averaging round in progress after %g s", timeout)


class SyncCollaborativeOptimizer:
    """A :class:`CollaborativeOptimizer` for a plain synchronous training loop, on a
    :class:`~p2ptrain.node.BackgroundNode`::

        with BackgroundNode(identity, node_config) as node:
            opt = SyncCollaborativeOptimizer(node, model, torch.optim.AdamW(model.parameters()), run_config)
            for x, y in batches:
                loss_fn(model(x), y).backward()
                if opt.step(len(x)):          # True when the swarm took a global step
                    print(opt.epoch, opt.stats.last)

    ``step`` blocks while this peer averages with the others when a round cannot run in the background
    (DiLoCo without overlap), and while it downloads a state that what it computes meanwhile could not
    be carried onto (DiLoCo one step behind computes on: its work rolls into the next round).
    """

    def __init__(
        self,
        node: BackgroundNode,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: RunConfig,
    ) -> None:
        async def build() -> CollaborativeOptimizer:  # in the node's thread: it registers RPC handlers
            return CollaborativeOptimizer(node.node, model, optimizer, config)

        self._node = node
        self.optimizer = node.call(build)
        node.start_service(self.optimizer.run)
        node.at_close(self.optimizer.leave)  # peers need not wait for this one once it is gone

    def step(self, samples: int) -> bool:
        """:meth:`CollaborativeOptimizer.step`, from synchronous code."""
        return self._node.call(lambda: self.optimizer.step(samples))

    def wait_for_peers(self, count: int, timeout: float) -> int:
        """:meth:`CollaborativeOptimizer.wait_for_peers`, from synchronous code."""
        return self._node.call(lambda: self.optimizer.wait_for_peers(count, timeout))

    @property
    def epoch(self) -> int:
        return self.optimizer.epoch

    @property
    def stats(self) -> RoundStats:
        return self.optimizer.stats
