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
it (see ``state.download``) and takes part from the next epoch. A peer alone on its epoch steps alone: at once
when it never saw another peer or its partners said they left, after an averaging timeout when their
records vanished, and never while no connected peer answers it (it may be the one cut off: a step
alone would start a second lineage under the swarm's step numbers).

The optimizer is a facade over parts that each own their state and are handed their collaborators at
construction (nothing below calls back up into it; what a part must report, it returns):

- ``bookkeeping.Tally``: where this peer is (its step, the samples toward the next one, since when);
- ``buffers.Contribution``: what it hands to the next round (gradient sums, pseudo-gradients);
- ``local_steps.LocalSteps``: the wrapped optimizer (inner steps, applying an averaged gradient);
- ``outer.OuterStep``: DiLoCo's global parameters, outer momentum, error feedback;
- ``shared_state.SharedState``: the state's digest, snapshots for joiners, downloads;
- ``board.ProgressBoard``: progress records out and in, the swarm's view, weight caps, who is trusted;
- ``solo.StepAlone``: when a peer alone on its epoch may step;
- ``rounds.RoundRunner``: matchmaking, rounds now or in the background, their landing;
- ``bans.BanBook``: the swarm's ban verdicts.

The optimizer decides each ``step`` from what they say, and takes the global step itself (``_advance``).
The run decides how its rounds go, whatever the node was started with: the optimizer hands the node's
averager its settings and a ``RoundPolicy`` (weight caps from the board, bans published by the ban
book, the largest proof worth fetching for this model) once, when it is built.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence

import torch
import trio

from ...averaging import RoundPolicy
from ...averaging.allreduce import RoundResult
from ...averaging.compression import Compression
from ...config import DilocoSection, RunConfig
from ...errors import ConfigError
from ...identity import PeerID
from ...idwork import work_bits
from ...node import BackgroundNode, Node
from ..state.download import ProgressFn
from ..state.file_tensors import FileTensors
from ..state.serve import StateServer
from . import fragments
from .bans import BanBook
from .board import ProgressBoard
from .bookkeeping import RateMeter, RoundStats, Tally, run_fingerprint
from .buffers import Contribution, ParamBuffer
from .feedback import ErrorFeedback
from .local_steps import LocalSteps
from .outer import OuterStep
from .progress import PeerProgress, ProgressRecord, SwarmView
from .rounds import AHEAD_STEPS, RoundRunner
from .shared_state import Download, SharedState
from .solo import StepAlone
from .wake import Wake

log = logging.getLogger("p2ptrain.training.collaborative")  # (the optimizer's lines, as before)


@dataclasses.dataclass(frozen=True)
class Parts:
    """The parts that hold a peer's model-sized state, for a peer that does not hold its model whole (a
    sharded site's rank 0, see ``training.site``): they are built by these instead of the usual ones,
    with the same arguments."""

    buffer: Callable[[Sequence[torch.Tensor]], ParamBuffer]
    outer: Callable[[list[torch.Tensor], Contribution, DilocoSection, Compression], OuterStep]
    state: type[SharedState]


class CollaborativeOptimizer:
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
        on_download_progress: ProgressFn | None = None,
        parts: Parts | None = None,
    ) -> None:
        """Build the optimizer's parts and hand the node's averager the run's rules for its rounds.

        Args:
            node: The running member of the swarm this peer trains in (its averager's settings are
                replaced by the run's, once).
            model: The model; its parameters that require gradients are trained.
            optimizer: The torch optimizer over them (sync: steps with the averaged gradient; DiLoCo:
                the inner optimizer).
            config: The run file's settings.
            clock: The wall clock (tests pass ``trio.current_time``).
            summed_grads: Sync mode: the training loop scales each batch's loss by its sample count and
                never clears the parameters' ``.grad``: backward passes then add up right in the gradient
                accumulator, whose views are the ``.grad`` (one model-sized tensor less than copying each
                batch's mean gradient into it). Otherwise each backward pass leaves the batch's mean
                gradient, which ``step`` adds to the accumulator, weighted by the batch's samples.
            on_download_progress: Called with the bytes received and expected as a state download goes
                on (a console's progress bar, a log line every tenth).
            parts: Builds the buffer, the outer step and the shared state of a peer that does not hold
                its model whole (a sharded site's rank 0); None: the usual ones.

        Raises:
            ConfigError: This node's id carries less work than the run asks for, or the run asks for
                more DiLoCo fragments than the model has parameters.
        """
        self.node, self.model, self.optimizer, self.config = node, model, optimizer, config
        if work_bits(node.peer_id, node.host.work) < config.run.id_work:
            raise ConfigError(
                f"run.id_work asks for {config.run.id_work} bits of work on each peer id and this node's id"
                f" carries {work_bits(node.peer_id, node.host.work)}: start its node with"
                f" HostConfig(id_work={config.run.id_work}) (p2ptrain node does)"
            )
        self.clock = clock
        self.params: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.diloco = config.training.mode == "diloco"
        self.fingerprint = run_fingerprint(config, model)
        self.stats = RoundStats()
        # the parameters' fragments (streaming DiLoCo; one otherwise)
        count = config.diloco.fragments if self.diloco else 1
        if count > max(1, len(self.params)):
            raise ConfigError(
                f"diloco.fragments = {count}: the model has only {len(self.params)} trainable parameters"
            )
        split = fragments.split([p.numel() for p in self.params], count) if self.params else [range(0)]
        self.tally = Tally(clock())
        self._withheld_on = -1  # the step whose withheld look was logged (``_withheld``)
        self.wake = Wake()
        self.contribution = Contribution(
            self.params,
            split,
            diloco=self.diloco,
            summed=summed_grads and not self.diloco,
            make_buffer=parts.buffer if parts is not None else ParamBuffer,
        )
        make_outer = parts.outer if parts is not None else OuterStep
        self.outer_step = (
            make_outer(self.params, self.contribution, config.diloco, config.averaging.compression)
            if self.diloco
            else None
        )
        self.local = LocalSteps(optimizer, self.params, config.training, self.contribution, self.tally)
        self.bans = BanBook(node, config.progress.buckets.bit_length() - 1)
        self.alone = StepAlone(node, config, self.fingerprint, clock)
        self.shared = (parts.state if parts is not None else SharedState)(
            node,
            model,
            optimizer,
            config,
            params=self.params,
            names=self.names,
            tally=self.tally,
            contribution=self.contribution,
            outer=self.outer_step,
            stats=self.stats,
            wake=self.wake,
            clock=clock,
            on_download_progress=on_download_progress,
            local=self.local,
        )
        self.board = ProgressBoard(
            node,
            config,
            fingerprint=self.fingerprint,
            tally=self.tally,
            state=self.shared,
            alone=self.alone,
            bans=self.bans,
            wake=self.wake,
            clock=clock,
        )
        self.rounds = RoundRunner(
            node,
            config,
            tally=self.tally,
            contribution=self.contribution,
            outer=self.outer_step,
            local=self.local,
            state=self.shared,
            board=self.board,
            alone=self.alone,
            stats=self.stats,
            wake=self.wake,
            clock=clock,
        )
        self._nursery: trio.Nursery | None = None
        a = config.averaging
        # The run decides how its rounds go, whatever the node was started with. A proof of this run's
        # rounds is about one fp32 copy of the model (a partition's slices from each contributor); twice
        # that covers uneven partitions.
        model_bytes = 4 * sum(p.numel() for p in self.params)
        node.averager.follow(
            dataclasses.replace(
                node.averager.config,
                compression=a.compression,
                aggregation=a.aggregation,
                audit=a.audit,
                matchmaking_time=a.matchmaking_time,
            ),
            RoundPolicy(
                weight_cap=self.board.weight_cap,
                weight_caps=self.board.weight_caps,
                on_ban=self.bans.on_ban,
                max_proof_bytes=2 * model_bytes + (1 << 20),
                key_bits=self.board.bits,  # (the progress records' buckets: ``dht.spread``)
                look_buckets=self.rounds.look_buckets,  # (a split swarm's: its region's)
            ),
        )

    # ---- lifecycle ---------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Publish progress and read the swarm's, serve the state, run rounds, until cancelled.

        Start it in the node's nursery (``await nursery.start(opt.run)``) before the first ``step``.

        Args:
            task_status: Reports readiness to ``nursery.start``.
        """
        async with trio.open_nursery() as nursery:
            await nursery.start(self.shared.run)
            await nursery.start(self.bans.run)
            await nursery.start(self.alone.run)
            await nursery.start(self.rounds.run)
            await nursery.start(self.board.run)
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    @property
    def nursery(self) -> trio.Nursery | None:
        """The nursery of the optimizer's own tasks while it runs (tools that attach work to its life)."""
        return self._nursery

    # ---- the training loop's side ------------------------------------------------------------------

    async def step(self, samples: int) -> bool:
        """Account for a backward pass, and take a global step when the swarm reached its target.

        Args:
            samples: The samples of the batch whose backward pass just ran (a positive int).

        Returns:
            True when a global step was taken (or the state was replaced by a download), so the caller
            may evaluate, checkpoint, log.

        Raises:
            ValueError: ``samples`` is not a positive int.
            RuntimeError: :meth:`run` was not started.
        """
        if not (isinstance(samples, int) and samples > 0):
            raise ValueError("samples must be a positive int")
        # A loop being cancelled (a hard stop) returns from its batch's thread to here, after ``run``
        # already ended: that is a cancellation, not a misuse.
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._nursery is None:
            raise RuntimeError("start CollaborativeOptimizer.run in a nursery first")
        rounds, shared, tally = self.rounds, self.shared, self.tally
        rounds.batch_started(self.clock())  # the training loop computes its next batch from about now
        if self.diloco:
            self.local.set_lr(tally.inner_steps)
            await shared.off_loop(self.local.inner_step)
            tally.inner_step()
        else:
            await shared.off_loop(self.local.accumulate, samples)
        tally.count(samples, self.clock())
        rounds.prepare(tally.epoch)
        changed = await self._land_round()
        if await self._land_download():
            changed = True
            changed = await self._land_round() or changed  # a round joined ahead of the replay's step
        changed = await self._land_when_done() or changed
        flight = shared.download
        if flight is not None and flight.replaying and rounds.in_flight is None:
            self._join_ahead(flight, samples)
        elif not self.diloco:
            rounds.look_past_ahead()
        if rounds.in_flight is not None or shared.download is not None:
            return changed  # a round or a download is in flight: nothing else may touch the state
        view = self.board.update_view()
        if self._keeps_pace(view):
            await self.solo_step()
            return True
        if (
            (view.behind or view.diverged(shared.digest))
            and self.clock() >= shared.sync_retry_at
            and not self._finishing_look()
        ):
            board = self.board
            shared.start_download(
                view,
                board.vouched_digest,
                lambda e: board.view_of(e).donors,
                roots=board.vouched_roots if board.regions.split else None,
            )
            flight = shared.download
            self.wake.set()  # its record says what it catches up to (``board.toward``)
            if flight is not None and flight.replaying:
                # At once, not after the next batch: the replay lands about when the group of the
                # step it lands on forms, and a batch later that group had formed without this peer
                # (the namespace lab's home on 10 Mbit/s replayed each step and averaged in none).
                self._join_ahead(flight, samples)
            else:
                # Waited for here, not after one more batch thrown away: that batch landed it a batch
                # late on its step (at 16 simulated peers in two regions, a newcomer 0.3 s late for its
                # region's group after each download, the leader's deadline ended first, downloaded
                # the next step, and the next, and averaged in none).
                changed = await self._land_when_done() or changed
            return changed
        waiting = rounds.formed
        if waiting is not None and waiting[0] == tally.epoch and not self.diloco and tally.samples <= 0:
            # (a group joined ahead, this peer just landed on its step: what it computed on the old
            # state meanwhile is dropped, and the group waits one batch for its work rather than lose
            # it: a client-only member that declines is called by nobody, and its reducers waited for
            # its slices until the scatter deadline, 12 s)
            return changed
        formed = rounds.take_formed()
        if formed is not None:
            epoch, manifest = formed
            if epoch == tally.epoch and self.diloco and self.config.diloco.overlap:
                await rounds.hand_over(manifest)  # (a site's: see ``RoundRunner.hand_over``)
                return changed
            if epoch == tally.epoch and self.diloco:
                landed = await rounds.average(manifest)
                if landed is None:
                    return changed
                self._advance(*landed)
                return True
            if epoch == tally.epoch:  # summed gradients: handed over between two backward passes
                rounds.start_in_background(manifest)
                return changed
            self.node.averager.decline(manifest)
        # (Or by this peer's own batch where that is longer: it looks again only once its next batch
        # is done. On 8 simulated peers, one whose batches took 1.1 s came to every group up to a
        # batch late, found it formed without it, and downloaded each step instead of averaging.)
        rate = tally.rate.rate
        batch = min(samples / rate, self.config.averaging.matchmaking_time) if rate > 0 else 0.0
        lead = max(self.board.lead, batch)
        # (an anchored peer, or a newcomer of a region only newcomers may lead, goes by every record once
        # its trusted peers' views are done with the step: ``ProgressBoard.leads_by_heard``)
        near = view.near(lead) or (view.heard_near(lead) and self.board.leads_by_heard(view))
        if near and rounds.follows:
            rounds.promote()  # (its own view reached what its look followed by: it may lead now)
        if not rounds.matchmaking and self.clock() >= rounds.retry_at:
            # What every record says may put the target within reach before this peer's own view does:
            # that counts the untrusted records for at most as much as the trusted ones, and a peer that
            # trusts few (one a round left out earns no trust) saw a fraction of the swarm's samples and
            # looked for the group after it formed, round after round. It looks then, as a follower only
            # (leaders are peers whose own views reached the target): see ``progress``, "A view capped
            # by trust".
            heard = not near and view.heard_near(lead)
            if view.peers > 1 and (near or heard):
                # Early by the time groups take to form: the round starts on target. Not before this
                # peer's first batch (just synced): it would have nothing to send, and its group would
                # wait for it in vain. Nor while the peers here are no majority of those on this step
                # and the one before (see ``progress``): they arrive soon, and a group without them would
                # commit this step on a lineage of its own.
                # (A split swarm's peer looks at once: its round sends its state too, the group waits
                # one batch for its work, see above, and a batch later the region's group had formed
                # without it, step after step.)
                if tally.samples <= 0 and not self.board.regions.split:
                    self._withheld("no batch done on it yet")
                elif not self.alone.majority_here(view, tally.epoch):
                    self._withheld("too few of the step's peers here yet")
                elif self._left_out():
                    self._withheld("its trusted peers' round runs without it")
                else:
                    rounds.start_matchmaking(follows=not near)
            elif (
                view.peers <= 1
                and view.ready
                and not view.overtaken
                and not shared.holds
                and self.alone.may_step_alone(
                    view, self.board.region_records(tally.epoch), tally.epoch, self.board.met_swarm
                )
            ):
                await self.solo_step()
                return True
        return changed

    def _keeps_pace(self, view: SwarmView) -> bool:
        """A split swarm: whether this peer takes its step alone, to stay on the swarm's step. Its
        trusted peers are one step on (in other regions, or in its own, whose round ran without it), and
        its region formed no group of its step with it: its look ended without one, or its view would
        have it catch up (a newcomer whose region nobody can lead, or whose region took the step
        without it). Its state is already the swarm's lineage (it is anchored, or it downloaded one);
        the next step's round averages it with its region's.

        Caught up instead, by a download of what its trusted peers hold, a peer landed on their step
        when that step's groups had formed or were forming, often one step further on (64 simulated
        peers over 8 regions: 11 of a region's 13 peers went from step 3 to step 5); anchored peers
        waited until their trusted peers were two on and then downloaded too, so a region that had a
        leader lost it; and regions' steps drifted apart, so the regions the pairings were meant to mix
        never met. Two steps behind, it downloads (``view.behind``): that is no longer the swarm's
        step's pace but a peer cut off or far slower."""
        board, rounds, epoch = self.board, self.rounds, self.tally.epoch
        if not board.regions.split or self.diloco or self.shared.holds:
            return False
        if board.swarm_newest != epoch + 1 or not (board.anchored or self.shared.downloads > 0):
            return False
        # Wherever ``step`` would catch up by a download instead (its look ends first only while its
        # region may still take the step, ``_finishing_look``); a look in flight is cancelled by the
        # step, as by a download. Kept to the look's end, a peer whose region took the step while it
        # looked downloaded one step behind (``test_regions``, about 1 run in 8 of one seed).
        if view.behind and not self._finishing_look():
            return True
        return rounds.no_group_on >= epoch and not rounds.matchmaking and rounds.formed is None

    def _finishing_look(self) -> bool:
        """A split swarm: whether this peer finishes its look for its step's group before it catches up
        with a step its trusted peers of other regions took (its own region's have not: its group may
        still form). Caught up at once, newcomers that follow their join peers of other regions left
        the groups of their own as they formed, and those rounds waited for them to the scatter
        deadline (64 simulated peers: a step's round took 12.7 s). The look ends within its window."""
        return (
            self.board.regions.split
            and self.rounds.looks_for(self.tally.epoch)
            and not self.board.region_behind
        )

    def _withheld(self, why: str) -> None:
        """Say once a step (debug) why this peer does not look for the step's group although its view
        says the target is near: where a swarm's looks spread, the log says which wait held whom."""
        if self._withheld_on != self.tally.epoch:
            self._withheld_on = self.tally.epoch
            log.debug("step %d: the target is near, not looking yet: %s", self.tally.epoch, why)

    def _left_out(self) -> bool:
        """Whether every trusted peer on this step handed its work to the step's round already (their
        records say ``landing``): that round runs without this peer (one just caught up), and a group of
        the step would hold nobody but it. It waits for their step, behind by one, and replays it."""
        me, epoch, trusted = self.node.peer_id, self.tally.epoch, self.board.trusted()
        here = [
            r.record
            for r in self.board.region_records(epoch)
            if r.peer != me
            and r.record.epoch == epoch
            and r.record.run == self.fingerprint
            and not r.record.leaving
            and (trusted is None or r.peer in trusted)
        ]
        return bool(here) and all(rec.landing for rec in here)

    def _join_ahead(self, flight: Download, samples: int) -> None:
        """A replay of the missed steps' results in flight: look for a group of the step it lands this
        peer on, as a client-only member that never leads it (a group of a step is led only by a peer
        on it), to take part in that round (``RoundRunner.start_matchmaking``); ``step`` calls this
        between batches and once as a replay starts:
        DiLoCo one step behind (its local progress carried onto the new global parameters) hands its
        work over as the group forms (streaming: once the replay landed); sync, at most
        ``AHEAD_STEPS`` behind, hands over at once the gradients it computed meanwhile (a group formed
        for ``step`` to hand them to is taken here). Not while a whole state downloads: that rarely
        lands within the round's wait, and a coordinator that declines aborts the round for all."""
        rounds, tally = self.rounds, self.tally
        if not self.diloco:
            formed = rounds.take_formed()  # summed gradients: a group joined ahead, handed over here
            if formed is not None:
                epoch, manifest = formed
                if rounds.joined_ahead(epoch):
                    rounds.start_in_background(manifest, epoch)
                    return
                self.node.averager.decline(manifest)
        epoch = tally.epoch + 1 if self.diloco else flight.target
        if (
            rounds.states  # (a split swarm's round averages states: not the one a replay is yet to land)
            or (
                flight.carry_from != tally.epoch
                if self.diloco
                else not 0 < epoch - tally.epoch <= AHEAD_STEPS
            )
            or rounds.looks_for(epoch)  # (a look for an earlier step's group is superseded)
            or (self.diloco and tally.samples <= 0)
            or self.clock() < rounds.retry_at
        ):
            return
        view = self.board.view_of(epoch)
        if view.behind or view.peers <= 1:
            return
        if not self.diloco:
            # sync: at once, whatever its view of the step's samples. It only follows (it leads no
            # group), and a leader of the step waits for it until its deadline (its record says what
            # it catches up to: ``progress.swarm_view``'s ``arriving``); its gradients go when the group
            # formed, between two batches, so there are some by then. Timed by its view, it looked
            # too late: a peer that trusts only its join peer counts the others' samples for at most as
            # many as that peer's (2/3 of them in a swarm of 3), and its view reached the target after
            # the group had formed (in memory, a home on 4 Mbit/s averaged in 0 of 17 steps).
            rounds.start_matchmaking(ahead=epoch - tally.epoch)
            return
        rate = tally.rate.rate  # (this peer's own batch, where longer: see ``step``)
        batch = min(samples / rate, self.config.averaging.matchmaking_time) if rate > 0 else 0.0
        if view.near(max(self.board.lead, batch)):
            rounds.start_matchmaking(ahead=epoch - tally.epoch)

    async def _land_round(self) -> bool:
        """A background round's result, applied once it is in; True when it took a global step."""
        landed = await self.rounds.land()
        if landed is None:
            return False
        self._advance(*landed)
        return True

    async def _land_when_done(self) -> bool:
        """Wait for the download in flight and land it where nothing computed meanwhile would survive it
        (sync accumulators are reset, and DiLoCo carries local progress only one step): the link and the
        CPU are the download's. False, at once, where none is in flight, or it is a replay or carries
        progress, or a round is in flight."""
        flight = self.shared.download
        if (
            flight is None
            or flight.carry_from is not None
            or flight.replaying
            or self.rounds.in_flight is not None
        ):
            return False
        await flight.done.wait()
        await self.shared.unheld()
        return await self._land_download()

    async def _land_download(self) -> bool:
        """A background download or replay, applied once it is in; True when the state was replaced."""
        if not await self.shared.land_download():
            return False
        log.debug("on step %d: a download landed", self.tally.epoch)
        self.state_changed()
        return True

    async def solo_step(self) -> None:
        """Take the global step alone (no other peer on this epoch), with what this peer has done; the
        passes over the whole model in a worker thread when it is large (``SharedState.off_loop``: a
        site's are collectives of its ranks, which take as long as the slowest rank).

        ``step`` decides when; tests drive it directly.
        """
        weight = self.tally.samples
        outer = self.outer_step
        shared = self.shared
        if outer is not None:
            outer.pseudo_gradients()
            # nothing to send: what earlier rounds left out goes in whole
            await shared.off_loop(outer.flush_feedback)
            await shared.keep_result(self.tally.epoch, self.contribution.buffer.views, buffered=True)
            await shared.off_loop(outer.step, None, outer.reset_local)
        elif weight > 0:
            self.contribution.buffer.div_(weight)
            await shared.keep_result(self.tally.epoch, self.contribution.buffer.views)
            await shared.off_loop(self.local.apply, self.contribution.buffer)
        # (else nothing was computed on this state: a split swarm's peer keeping pace, ``_keeps_pace``,
        # just landed; the step moves its epoch alone)
        self.tally.took(weight)
        self.tally.counting_from(self.clock())
        self._advance(None, weight)

    def _advance(self, result: RoundResult | None, weight: int) -> None:
        """The global step: to the next epoch, after ``result`` (None: alone) took ``weight`` samples."""
        epoch = self.tally.epoch
        self.alone.stepped()
        if result is not None:
            mine = self.node.peer_id in result.contributors
            if not mine:
                log.warning("step %d: our %d samples were left out of the round", epoch, weight)
            self.stats.note_step(
                {
                    "epoch": epoch,
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
            )
        else:
            self.stats.note_step({"epoch": epoch, "outcome": "alone", "samples": weight, "mine": weight})
        others = frozenset(result.contributors) - {self.node.peer_id} if result is not None else frozenset()
        self.tally.advance(others, by_round=result is not None)
        log.debug(
            "on step %d: %s",
            self.tally.epoch,
            f"a round of {result.group_size} landed, {result.round_seconds:.1f} s after it began"
            if result is not None
            else "stepped alone",
        )
        self.contribution.fit(self.tally.epoch)
        if result is not None:  # those it verified earn trust (see ``averaging.trust``)
            self.node.averager.trained_with(result)
        self.state_changed()

    def state_changed(self) -> None:
        """Say that the state changed: a group for the epoch left is no use; the state is hashed,
        served and published anew. ``step`` and ``restore`` call it; so do tools that change the live
        state by hand (tests, adversaries)."""
        self.rounds.cancel_matchmaking()
        self.shared.changed()

    async def drain(self, timeout: float) -> None:
        """Finish the averaging round this peer takes part in, before it stops.

        The training loop calls ``step`` no more; its group would otherwise lose the round, or its
        coordinator. A group being formed forms (or gives up, within the matchmaking time and the
        joiners' grace); a formed group's round runs now (DiLoCo without overlap); a round running in
        the background is waited for. A result is applied as ``step`` would apply it; nothing new
        starts. What still runs after ``timeout`` is cut when the caller cancels.

        Args:
            timeout: Seconds to wait at most.
        """
        rounds = self.rounds
        with trio.move_on_after(timeout) as waited:
            while rounds.matchmaking:  # noqa: ASYNC110  (no event marks its end; it ends on its own)
                await trio.sleep(0.05)
            formed = rounds.take_formed()
            if formed is not None:
                epoch, manifest = formed
                busy = rounds.in_flight is not None or self.shared.download is not None
                if epoch != self.tally.epoch or busy:
                    self.node.averager.decline(manifest)
                elif self.diloco:
                    landed = await rounds.average(manifest)
                    if landed is not None:
                        self._advance(*landed)
                else:  # summed gradients, handed over now (no backward pass runs any more)
                    rounds.start_in_background(manifest)
            flight = rounds.in_flight
            if flight is not None:
                await flight.done.wait()
                await self.shared.unheld()  # a thread reading the state (a donor's snapshot) delays the step
                await self._land_round()
        if waited.cancelled_caught:
            log.warning("stopped waiting for the averaging round in progress after %g s", timeout)

    # ---- the state -----------------------------------------------------------------------------------

    def capture(self, copy: bool = True, own: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The state to serve or checkpoint.

        The model (with DiLoCo's global parameters in place of the local ones), the optimizer whose
        state global steps change (inner in sync, outer in DiLoCo) and the epoch.

        Args:
            copy: False returns the live tensors, for a caller that reads them before the next ``step``.
            own: With what is this peer's alone (a checkpoint's): top-k's error feedback.

        Returns:
            The tensors by name, and the metadata.
        """
        return self.shared.capture(copy, own)

    def restore(
        self,
        tensors: Mapping[str, torch.Tensor],
        meta: Mapping[str, str],
        *,
        epoch: int | None = None,
        owned: bool = False,
    ) -> None:
        """Load a state from :meth:`capture` (a download or a checkpoint); everything is checked first.

        Args:
            tensors: The state's tensors by name.
            meta: Its metadata.
            epoch: The step the state is known to be (a download's verified root commits to it), instead
                of the one its metadata claims; a download takes nothing else from its metadata either
                (its optimizer's hyperparameters and this peer's inner step count stay local: the root
                does not cover them, see ``state.capture.restore``).
            owned: The tensors are handed over, not copied.

        Raises:
            RemoteProtocolError: The state does not fit this model, or says no plausible step.
        """
        self.shared.restore(tensors, meta, epoch=epoch, owned=owned)
        self.state_changed()

    async def hashed_digest(self) -> bytes:
        """The current state's digest, once known.

        A large state is hashed in a thread after it changes (``digest`` is b"" meanwhile), and a peer
        that stops reports the digest it stops with.

        Returns:
            The digest (``state.chunks.root``) of the state at this step.
        """
        return await self.shared.hashed_digest()

    def max_state_bytes(self) -> int:
        """The most a download of this model's state could need (bounds what a donor may send).

        Returns:
            A byte count.
        """
        return self.shared.max_state_bytes()

    def release_outer(self) -> None:
        """DiLoCo with a file-backed outer state: drop the pages this process touched."""
        if self.outer_step is not None:
            self.outer_step.release()

    # ---- the swarm -----------------------------------------------------------------------------------

    async def refresh(self, *, network: bool = True) -> None:
        """Read the swarm's progress records (see :meth:`ProgressBoard.refresh`).

        Args:
            network: False reads those this peer holds, asking nobody.
        """
        await self.board.refresh(network=network)

    def record(self) -> ProgressRecord:
        """This peer's progress record as it stands now.

        Returns:
            The record (not yet signed or published).
        """
        return self.board.record()

    def trusted(self) -> frozenset[PeerID] | None:
        """The peers whose progress records may move this one to another state.

        Returns:
            Their ids; None (every record) in a private swarm. See :meth:`ProgressBoard.trusted`.
        """
        return self.board.trusted()

    def said_on(self, epoch: int) -> list[PeerProgress]:
        """The records of ``epoch`` this peer read lately from peers it trusted then.

        Args:
            epoch: The step.

        Returns:
            The records, superseded ones too (see :meth:`ProgressBoard.said_on`).
        """
        return self.board.said_on(epoch)

    async def leave(self, timeout: float = 5.0) -> None:
        """Tell the swarm this peer stops (its record says so), so nobody waits for it in a group.

        Args:
            timeout: Seconds to try publishing the record at most.
        """
        await self.board.leave(timeout)

    async def wait_for_peers(self, count: int, timeout: float) -> int:
        """Wait until ``count`` peers (this one included) publish progress in the run, or ``timeout``.

        Lets a swarm that starts together begin together.

        Args:
            count: The peers to wait for, this one included.
            timeout: Seconds to wait at most.

        Returns:
            How many peers published progress.
        """
        return await self.board.wait_for_peers(count, timeout)

    # ---- what the loop, the metrics and the console read -----------------------------------------------

    def lr(self) -> float:
        """The learning rate of the wrapped optimizer's last step."""
        return self.local.lr()

    def finite(self) -> bool:
        """Whether every trained parameter is finite."""
        return all(math.isfinite(float(p.detach().abs().max())) for p in self.params)

    @property
    def epoch(self) -> int:
        """The global step this peer is on."""
        return self.tally.epoch

    @property
    def samples(self) -> int:
        """The samples this peer computed toward the next global step."""
        return self.tally.samples

    @property
    def inner_steps(self) -> int:
        """DiLoCo: the inner steps this peer took."""
        return self.tally.inner_steps

    @property
    def inner_seconds(self) -> float:
        """DiLoCo: the time spent in the inner optimizer's steps."""
        return self.local.inner_seconds

    @property
    def rate(self) -> RateMeter:
        """This peer's samples per second."""
        return self.tally.rate

    @property
    def view(self) -> SwarmView | None:
        """The swarm's view from the records read last (None before the first read)."""
        return self.board.view

    @property
    def records(self) -> list[PeerProgress]:
        """The progress records read last."""
        return self.board.records

    @property
    def leaving(self) -> bool:
        """Whether this peer told the swarm it stops."""
        return self.board.leaving

    @property
    def key(self) -> bytes:
        """The DHT key this peer's progress records go under (its bucket's: ``ProgressBoard.keys``)."""
        return self.board.key

    @property
    def bans_key(self) -> bytes:
        """The DHT key of the run's ban records that accusations of this peer go under (its bucket's;
        each accusation goes under its accused's)."""
        return self.bans.key

    @property
    def digest(self) -> bytes:
        """The root of the current state; b"" while it is being hashed."""
        return self.shared.digest

    @property
    def hashed(self) -> dict[int, bytes]:
        """The digests of the last few steps, once hashed (what the metrics report)."""
        return self.shared.hashed

    @property
    def server(self) -> StateServer | None:
        """What serves this peer's state to joiners (None when the run does not serve)."""
        return self.shared.server

    @property
    def download_progress(self) -> tuple[int, int]:
        """Bytes received and expected by the state download in progress."""
        return self.shared.download_progress

    @property
    def averaged(self) -> ParamBuffer:
        """What the next round takes: gradient sums (sync) or pseudo-gradients (DiLoCo)."""
        return self.contribution.buffer

    @property
    def fragments(self) -> list[range]:
        """The parameters' fragments (streaming DiLoCo averages one a step; one otherwise)."""
        return self.contribution.fragments

    @property
    def global_params(self) -> list[torch.Tensor]:
        """DiLoCo: the global parameters (empty in sync mode)."""
        return self.outer_step.global_params if self.outer_step is not None else []

    @property
    def momentum(self) -> list[torch.Tensor]:
        """DiLoCo: the outer momentum buffers (empty without momentum, and in sync mode)."""
        return self.outer_step.momentum if self.outer_step is not None else []

    @property
    def outer(self) -> torch.optim.SGD:
        """DiLoCo: the outer optimizer (Nesterov SGD over the global parameters)."""
        if self.outer_step is None:
            raise AttributeError("a sync run has no outer optimizer")
        return self.outer_step.sgd

    @property
    def outer_file(self) -> FileTensors | None:
        """DiLoCo: the file the global parameters and momentum live in (None: in memory)."""
        return self.outer_step.file if self.outer_step is not None else None

    @property
    def feedback(self) -> ErrorFeedback | None:
        """DiLoCo with top-k rounds: the error feedback (None otherwise)."""
        return self.outer_step.feedback if self.outer_step is not None else None


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
        """Build the optimizer in the node's thread and start it there.

        Args:
            node: The node, started (``BackgroundNode.start`` or ``with``).
            model: The model; its parameters that require gradients are trained.
            optimizer: The torch optimizer over them.
            config: The run file's settings.
        """

        async def build() -> CollaborativeOptimizer:  # in the node's thread: it registers RPC handlers
            return CollaborativeOptimizer(node.node, model, optimizer, config)

        self._node = node
        self.optimizer = node.call(build)
        node.start_service(self.optimizer.run)
        node.at_close(self.optimizer.leave)  # peers need not wait for this one once it is gone

    def step(self, samples: int) -> bool:
        """:meth:`CollaborativeOptimizer.step`, from synchronous code.

        Args:
            samples: The samples of the batch whose backward pass just ran.

        Returns:
            True when the swarm took a global step (or the state was replaced by a download).
        """
        return self._node.call(lambda: self.optimizer.step(samples))

    def wait_for_peers(self, count: int, timeout: float) -> int:
        """:meth:`CollaborativeOptimizer.wait_for_peers`, from synchronous code.

        Args:
            count: The peers to wait for, this one included.
            timeout: Seconds to wait at most.

        Returns:
            How many peers published progress.
        """
        return self._node.call(lambda: self.optimizer.wait_for_peers(count, timeout))

    @property
    def epoch(self) -> int:
        """The global step this peer is on."""
        return self.optimizer.epoch

    @property
    def stats(self) -> RoundStats:
        """What the optimizer did so far."""
        return self.optimizer.stats
