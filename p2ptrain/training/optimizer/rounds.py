"""A CollaborativeOptimizer's averaging rounds: forming a group, handing the work over, landing the result.

Theory of operation. When the swarm nears the target (early by the time groups take to form, see
``ProgressBoard.lead``), the peers on this epoch form a group in the background (``_form_group``): sized
by the freshest records, and held to a quorum of the peers that publish progress (only the trusted ones
in an open swarm), so that two groups of one step cannot both form. The formed group's round then runs:

- in the background (sync, and DiLoCo with overlap): this peer hands its work to the round and goes on
  computing (:meth:`RoundRunner.start_in_background`); the round's result lands between two batches
  (:meth:`RoundRunner.land`). sync: the accumulated gradients leave as the mean gradient (weighted by
  the samples) and a fresh accumulator takes the batches computed meanwhile; an aborted round's
  gradients go back into the accumulator, unless the round averaged them in place (then they are
  dropped). DiLoCo: the pseudo-gradient of the local parameters at the handoff leaves; the local
  parameters' progress since then is put on top of the new global parameters when the round lands (the
  handoff's pseudo-gradient waits in a spill file meanwhile).
- or now, compute paused (DiLoCo without overlap: :meth:`RoundRunner.average`).

Top-k rounds fold the error feedback into what they send, and keep the residual only if the round
committed. Whether a committed round is applied is decided from what its leader signed alone, the same
on every member: the quorum this peer named when it joined is the manifest's entry for it (checked
before it took part), and the round is applied only if its decided contributors meet every member's
entry (``averaging.matchmaking.short_of_quorums``). On the code before, each member checked the
contributors against its own quorum once the round had committed, and at 32 peers most members threw a
committed round away while the others applied it: two lineages of one step. A round that lands
returns ``(result, weight)``: the optimizer then takes the global step (its ``_advance``); nothing here
moves the epoch.

:class:`RoundRunner` owns the round in flight, the formed group waiting for ``step`` and the matchmaking
task.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import trio

from ...averaging.allreduce import RoundResult
from ...averaging.matchmaking import NEWCOMER_RANK, Quorum, opening, short_of_quorums
from ...averaging.protocol import SignedManifest
from ...averaging.spill import Spilled
from ...config import RunConfig
from ...dht.spread import bucket_of
from ...errors import GroupFormationFailed, RoundAborted
from ...identity import PeerID
from ...node import Node
from .board import ProgressBoard
from .bookkeeping import RoundStats, Tally
from .buckets import region_buckets
from .buffers import Contribution, ParamBuffer
from .feedback import Saved
from .local_steps import LocalSteps
from .outer import OuterStep
from .progress import SwarmView
from .shared_state import SharedState
from .solo import StepAlone
from .taken import TakenSteps
from .wake import Wake

log = logging.getLogger("p2ptrain.training.collaborative")  # (the optimizer's lines, as before)

RETRY_MATCHMAKING = 1.0  # seconds before matchmaking again after a group failed to form (at most)
# A peer that joined the group of the step after its own (its replay of the missed step in flight, see
# ``RoundRunner.start_matchmaking``) and could not hand its work over as the group formed (streaming
# DiLoCo) hands it over once the replay landed, within this share of the round's timeout (the round's
# scatter deadline is 0.4 of it); else it declines.
AHEAD_WAIT = 0.3
AHEAD_POLL = 0.05  # seconds between looks at whether the replay landed
LOOKS_KEPT = 64  # steps whose first look's time ``RoundRunner.began_looking`` keeps
SPARE_SHARE = 8  # a leader of rank 0 counts this many times the peers its quorum may miss (``lead_rank``)
AHEAD_STEPS = (
    2  # sync: a peer at most this many steps behind, replaying, joins the round of the step it lands on
)


def step_quorum(
    view: SwarmView,
    minimum: int,
    target: int,
    publishing: frozenset[PeerID],
    trusted: frozenset[PeerID] | None,
    absent: frozenset[PeerID],
    me: PeerID,
    anchored: bool,
    cohort: frozenset[PeerID] = frozenset(),
) -> tuple[Quorum, int]:
    """The quorum a group of ``view``'s step holds this peer to, and the group's minimum size:
    ``minimum`` (a majority of the step's peers) of the peers that publish progress, this one included.
    Only members that publish progress count toward that majority: ids that only join groups would let
    two groups of one step both reach it (two lineages). In an open swarm (``trusted`` not None) only the
    trusted among them: a fresh key that publishes records and joins first would otherwise make a group
    of two the "majority" of a joiner that trusts only its join peer, and start a lineage of its own with
    it; and where the trusted on the step are fewer than that majority, the quorum is all of them.
    Members check it too (a leader may lie). Trusted peers whose records are missing for a moment
    (``absent``: ``ProgressBoard.absent_trusted``) count as on the step: a group of those here could not
    be their majority, and a step taken here waits no longer for them.

    A newcomer (not ``anchored``: it has averaged with nobody yet and trusts its join peers alone) whose
    quorum is all of the two or more peers it trusts on the step, while it sees others there too (they
    count toward its majority for at most one fewer than the trusted), only follows (``Quorum.leads``,
    see ``matchmaking``: a peer leads only if whoever follows it can meet its quorum), and is held to a
    majority of the peers it trusts on the step instead of all of them. Both were needed at 64
    simulated peers: newcomers leading groups that their join peers, elsewhere, could never complete;
    then, with the first peer leading, most newcomers declining its group for want of one of their
    join peers, and those that counted on them after them, until the leader's own majority was not
    there. Why that is no fork: a follower's quorum decides only whether it takes part, never whether a
    group forms (leaders are anchored, or trust every peer they see, or need only themselves), and a
    majority of its trusted peers is also what decides which state it follows (``progress``). Nothing
    here counts what free ids say: ``anchored`` is earned by committed rounds (or is the swarm's first
    peer's, which joined through nobody), the trusted peers are the join peers and partners, and
    records of free ids can only make a newcomer's quorum tight, which keeps a newcomer following.

    Whatever it leads with, a peer that *joins* a group needs only a majority of the peers it trusts on
    the step (``Quorum.joins``; ``matchmaking``, "Followers' quorums"), and its announcement ranks it
    after the leaders whose quorum leaves room (``Quorum.rank``, :func:`lead_rank`).

    ``cohort``: the others of the round that took this peer to its step. They publish progress as
    surely as it does, whether or not the records read last hold theirs, so they are among the peers a
    joiner's quorum may name (``Quorum.nameable``), which sizes what a joiner may need of the group
    (``Gathering``'s slack). Left out, a leader at 128 simulated peers whose read held the records of
    100 of the 128 members of its last round refused every joiner that saw all 128 on the step ("its
    quorum needs 65 peers, more than this group can be held to (62 others)"), and the step's group
    came out with 71 of them."""
    mine = publishing | cohort | {me}
    if trusted is None:
        return Quorum(mine, minimum, mine), minimum
    known = (mine & (trusted | {me})) | absent
    here = view.vouched_here
    on_step = here + len(absent)  # this peer and the trusted peers on the step
    joins = on_step // 2 + 1  # what a group it joins must hold (see "Followers' quorums")
    size = min(minimum, here)
    if absent and joins <= target:
        size = max(size, joins)
        return Quorum(known, size, mine | absent, joining=joins, rank=lead_rank(size, on_step)), max(
            minimum, size
        )
    tight = size >= here > 1 and view.peers > here
    if anchored or not tight:
        joining = min(joins, size)
        return Quorum(known, size, mine | absent, joining=joining, rank=lead_rank(size, on_step)), minimum
    return Quorum(known, here // 2 + 1, mine | absent, leads=False), minimum


def lead_rank(size: int, on_step: int) -> int:
    """0 where a leader's quorum of ``size`` leaves out at least an eighth of the ``on_step`` peers it
    counts on the step (a group that misses a few of them still forms), else 1: such a leader leads only
    where no leader of rank 0 does (``matchmaking``, "Who leads first")."""
    return 0 if on_step - size >= max(1, on_step // SPARE_SHARE) else 1


Landed = tuple[RoundResult, int]
"""A round that committed and was applied: its result and the samples this peer handed to it."""


@dataclass
class Looking:
    """A look for a group, in the background: of step ``epoch`` (``ahead``: past this peer's own, the
    one its replay in flight lands it on); ``done`` once it ended, however. ``follows``: this peer only
    follows, until :meth:`RoundRunner.promote` (its view capped by trust had not reached the target)."""

    epoch: int
    ahead: bool
    scope: trio.CancelScope
    done: trio.Event
    follows: bool = False


@dataclass
class InFlight:
    """A round running in the background: what it averages, and its outcome once ``done``."""

    done: trio.Event
    tensors: ParamBuffer
    weight: int
    since: float  # when the batch in progress at the handoff began: later samples count toward the next
    outcome: RoundResult | BaseException | None = None
    # diloco: this peer's pseudo-gradient, before the round averaged it (``OuterStep.keep_aside``; a
    # site's is empty: its ranks keep their shards of it)
    own: list[Spilled | torch.Tensor] | None = None
    # top-k rounds: the error feedback's residual before this round (see ``feedback``)
    before: Saved | None = None
    digest: bytes = b""  # the round's
    epoch: int = 0  # the step whose state its result is applied to (past this peer's own: joined ahead)
    manifest: SignedManifest | None = None  # the round's (its signed quorums decide whether it is applied)
    # a split swarm's round (``RoundRunner.states``): the training state (the parameters and the
    # optimizer's) as it was at the handoff, averaged along with the gradients and taken before the
    # mean gradient is applied
    states: bool = False
    state: list[torch.Tensor] | None = None  # (copied in the round's task, off the event loop)

    @property
    def in_place(self) -> bool:
        """Whether the round averages ``tensors`` in place (one flat buffer, no state beside it)."""
        return self.tensors.sendable and not self.states


class RoundRunner:
    """Matchmaking, and the hand-off and landing of rounds."""

    def __init__(
        self,
        node: Node,
        config: RunConfig,
        *,
        tally: Tally,
        contribution: Contribution,
        outer: OuterStep | None,
        local: LocalSteps,
        state: SharedState,
        board: ProgressBoard,
        alone: StepAlone,
        stats: RoundStats,
        wake: Wake,
        clock: Callable[[], float],
    ) -> None:
        self.node, self.config, self.clock = node, config, clock
        self.tally, self.contribution, self.outer, self.local = tally, contribution, outer, local
        self.state, self.board, self.alone, self.stats, self.wake = state, board, alone, stats, wake
        self.in_flight: InFlight | None = None  # a round running in the background
        self.formed: tuple[int, SignedManifest] | None = None  # a group formed for step() to run
        self._looking: Looking | None = None  # the matchmaking in progress
        # step -> when this peer first looked for its group (the last ``LOOKS_KEPT`` steps): how early or
        # late it came to each step's group, which the scale simulator reports
        self.began_looking: dict[int, float] = {}
        self.retry_at = 0.0
        self._next_batch = clock()  # when the training loop began computing its next batch
        self._prepared = -1  # the step whose matchmaking key was located ahead (see ``prepare``)
        self.no_group_on = -1  # the last step a look for a group of ended without one
        self._told_too_many = False  # a step's majority did not fit one group (said once)
        self._keyed: dict[str, int] = {}  # group keys made lately -> their step (see ``look_buckets``)
        self._nursery: trio.Nursery | None = None
        self.taken = TakenSteps(node, board)  # the steps its rounds committed (asked as others land)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own matchmaking and the rounds in the background, until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.taken.serve()
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None
                self.taken.release()

    def batch_started(self, now: float) -> None:
        """The training loop computes its next batch from ``now`` on: a round handed the work before it
        ends counts that batch toward the next step."""
        self._next_batch = now

    # ---- forming groups ----

    def prepare(self, epoch: int) -> None:
        """Once per step, well before its look: its matchmaking key's replicas are found in the
        background (``Averager.prepare_group``), so that the look's store and reads ask them directly
        instead of spending the first second of the leader's window on a lookup."""
        if self._prepared != epoch:
            self._prepared = epoch
            self.node.averager.prepare_group(self.group_key(epoch))

    @property
    def matchmaking(self) -> bool:
        """Whether a group is being looked for (in the background)."""
        return self._looking is not None

    def looks_for(self, epoch: int) -> bool:
        """Whether a group of ``epoch`` or a later step is being looked for."""
        return self._looking is not None and self._looking.epoch >= epoch

    def start_matchmaking(self, ahead: int = 0, *, follows: bool = False) -> None:
        """Look for a group for this peer's epoch, in the background.

        ``follows``: only follow a leader of it (announced as a reducer that never leads), until
        :meth:`promote`: what every record read says puts the target within reach, while this peer's own
        view, which counts the untrusted records for at most as much as the trusted ones, does not (see
        ``progress``, "A view capped by trust").

        ``ahead``: for the epoch that many steps further instead, the one the replay in flight of the
        missed steps' results (``state.replay``) lands this peer on. Replaying alone, a peer whose replay
        takes longer than the time from a step to the next round's group lands after every group formed
        and trails the swarm for good (a sync peer on 10 Mbit/s, its replays landing each just after the
        next group formed, averaged in none of 9 steps); so it takes part in the round of the step it
        lands on:

        - DiLoCo, one step behind (its local progress to be carried onto the new global parameters):
          it hands its work over as the group forms, and the round's result is applied once the replay
          landed (:meth:`land`). Its pseudo-gradient is the same whichever global parameters it is
          taken against once its progress is carried onto them, so it need not wait for the replay:
          waiting, a 45M joiner on 50 Mbit/s (a 23 s replay against the 18 s it could wait, then its
          85 MB to send before the scatter deadline) declined every group it joined. Streaming DiLoCo
          (a step's fragment is the step's own) still hands over once the replay landed.
        - sync, at most ``AHEAD_STEPS`` behind: it hands over at once the gradients it computed while
          replaying (on the state it replays from: as stale as the steps it is behind, weighted by their
          samples like anyone's), and the round's result is applied once the replay landed on its step
          (:meth:`land`): from then on it is on the swarm's step, averaging with it.

        A look for a group of an earlier step still in progress is given up for this one (it ends
        before this one begins: one group is looked for at a time). The swarm has left that step: a
        home peer whose replays land each about when the next group forms went on looking for the group
        of the step it had just landed on, long formed without it, and so never looked for the next
        one (the namespace lab's home on 10 Mbit/s averaged in 0 of 44 steps).
        """
        assert self._nursery is not None
        epoch = self.tally.epoch + ahead
        before = self._looking
        if before is not None:
            assert epoch > before.epoch, "a look for a later step's group only supersedes one"
            before.scope.cancel()
        self.began_looking.setdefault(epoch, self.clock())
        while len(self.began_looking) > LOOKS_KEPT:
            del self.began_looking[min(self.began_looking)]
        looking = Looking(epoch, bool(ahead), trio.CancelScope(), trio.Event(), follows=follows and not ahead)
        self._looking = looking
        self._nursery.start_soon(self._matchmake, looking, before)

    @property
    def follows(self) -> bool:
        """Whether the look in progress only follows (see :meth:`start_matchmaking`)."""
        return self._looking is not None and self._looking.follows

    def promote(self) -> None:
        """The look in progress, which only followed, may lead from now on: this peer's own view reached
        what it looked by. A try that follows a leader goes on; one that follows nobody ends at once,
        and the next try is announced as a leader's (``averaging.grouping``'s ``leads_now``)."""
        if self._looking is not None:
            self._looking.follows = False

    def cancel_matchmaking(self) -> None:
        """The state changed: a group for the epoch we left is no use (one joined ahead, for a step this
        peer is on now or is headed to, is: see :meth:`headed`)."""
        looking = self._looking
        if looking is not None and not (looking.ahead and self._lands_on(looking.epoch)):
            looking.scope.cancel()

    def headed(self) -> int:
        """The step this peer lands on once what is in flight landed: the one after a round in flight
        (joined ahead or of its own step), else the one a replay in flight lands it on, else its own."""
        flight, download = self.in_flight, self.state.download
        if flight is not None and flight.epoch >= self.tally.epoch:
            return flight.epoch + 1
        if download is not None and download.replaying:
            return max(download.target, self.tally.epoch)
        return self.tally.epoch

    def _lands_on(self, epoch: int) -> bool:
        """Whether ``epoch`` is this peer's step or one what is in flight lands it on (:meth:`headed`):
        a look ahead for its group is still this peer's."""
        return self.tally.epoch <= epoch <= self.headed()

    @property
    def states(self) -> bool:
        """Whether rounds average states (the training state at the handoff) along with the gradients: a
        split swarm's (``progress.regions``), whose region's peers come from different regions of the
        step before, so hold different states. A round leaves its members with one state: the mean of
        theirs (the parameters and the optimizer's state, Adam's step count too, weighted as their
        gradients are), the mean gradient then applied to it. Regions pair other buckets each step, so
        any ``ceil(bits / span)`` steps in a row mix every bucket's state into every other's
        (``buckets``). Not for a group joined ahead (its state is the one a replay in flight leaves:
        see :meth:`joined_ahead`)."""
        return self.board.regions.split

    def round_tensors(
        self, buffer: ParamBuffer, state: list[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """What a round takes: the buffer's tensors, and where rounds average states the state's after
        them (``state``: a copy taken at the handoff; as a group forms, the live tensors stand for it:
        only their shapes matter then)."""
        if not self.states:
            return buffer.tensors
        return [*buffer.tensors, *(self.local.state_tensors() if state is None else state)]

    def _keep_state(self, flight: InFlight) -> None:
        """A copy of this peer's training state as it is now goes with ``flight``'s round (see
        ``LocalSteps.state_tensors``)."""
        flight.state = [t.detach().clone() for t in self.local.state_tensors()]

    def look_past_ahead(self) -> None:
        """sync, a round joined ahead in flight (its replay landing this peer on that round's step):
        look now for the group of the step after, the one this peer lands on once both landed, as a
        client-only member; its work goes to that group once they landed (``step`` takes it).

        Landing there takes this peer a replay and a round's result over its link, about twice what a
        member of the swarm's rounds takes; the next group's leader waits for it until its deadline
        (its record says ``toward``), and looked for only once both landed, that group had often formed
        without it: it fell behind again and replayed (the namespace lab's home on 10 Mbit/s, 63% of
        the steps in one run, each such step lost at this hand-over)."""
        flight = self.in_flight
        if (
            self.outer is not None
            or self.states
            or flight is None
            or flight.epoch <= self.tally.epoch
            or self.looks_for(flight.epoch + 1)
            or self.clock() < self.retry_at
        ):
            return
        epoch = flight.epoch + 1
        if epoch - self.tally.epoch > AHEAD_STEPS:
            return
        view = self.board.view_of(epoch)
        if not view.behind and view.peers > 1:
            self.start_matchmaking(ahead=epoch - self.tally.epoch)

    def joined_ahead(self, epoch: int) -> bool:
        """Whether a group of ``epoch``, past this peer's step, is this peer's to hand its work to now
        (a replay in flight that lands it there: see :meth:`start_matchmaking`). DiLoCo: one step
        behind, its local progress carried onto the step the replay lands on, with one fragment (a
        streaming step's fragment is the step's own) and an outer step that can hold the round's buffer
        apart from the replay's (not a site's): else it hands over once the replay landed."""
        flight = self.state.download
        if flight is None or not flight.replaying or flight.target != epoch or self.in_flight is not None:
            return False
        if self.states:
            return False
        if self.outer is None:
            return 0 < epoch - self.tally.epoch <= AHEAD_STEPS
        return (
            epoch == self.tally.epoch + 1
            and flight.carry_from == self.tally.epoch
            and len(self.contribution.fragments) == 1
            and self.outer.hands_over_ahead
            and self.tally.samples > 0
        )

    def take_formed(self) -> tuple[int, SignedManifest] | None:
        """The group formed for ``step`` to run (DiLoCo without overlap, summed gradients), if any."""
        formed, self.formed = self.formed, None
        return formed

    async def _matchmake(self, looking: Looking, before: Looking | None) -> None:
        """Look for a group of ``looking.epoch`` until one formed, the look ended (its conditions no
        longer hold) or it was cancelled (this peer's epoch changed meanwhile: a download).

        A look whose group failed to form looks again after :meth:`retry_gap`, here, not at this peer's
        next batch. The invariant: two peers looking for the same step's group are announced at once
        for at least ``matchmaking_time - retry_gap`` in every window of either, so the one later in the
        lottery's order sees the other's announcement open and follows it. Restarted by the batches, a
        peer was unannounced for up to a batch after each failed look, and two peers whose batches ran
        out of phase led alternate windows of one step, each alone, for good (a 3-peer DiLoCo swarm
        took 1-2 steps in 60 s, about 1 run in 3)."""
        try:
            with looking.scope:  # cancelled when this peer's epoch changes meanwhile (a download)
                if before is not None:
                    await before.done.wait()  # (the averager looks for one group at a time)
                lead = not looking.ahead
                while True:
                    follows = looking.follows
                    if not await self._form_group(looking, lead=lead):
                        break
                    if not follows or looking.follows:  # (a try that followed, promoted since: at once)
                        await trio.sleep(self.retry_gap())
                    if not self._still_wanted(looking):
                        return
                    lead = looking.epoch == self.tally.epoch  # (a look ahead whose replay landed may lead)
        finally:
            if self._looking is looking:
                self._looking = None
            looking.done.set()

    def retry_gap(self) -> float:
        """Seconds between a look whose group failed to form and the next: under half the matchmaking
        window, so that two peers looking for one group are never announced in alternate windows."""
        return min(RETRY_MATCHMAKING, 0.5 * self.config.averaging.matchmaking_time)

    def _still_wanted(self, looking: Looking) -> bool:
        """Whether ``looking`` is still this peer's to look again for: of its step, or (joined ahead) of
        the step its replay in flight lands it on, no round in flight for that step."""
        if self._looking is not looking or self.formed is not None:
            return False
        flight = self.in_flight
        if flight is not None and flight.epoch >= looking.epoch:
            return False
        if looking.ahead:
            return self._lands_on(looking.epoch)
        return looking.epoch == self.tally.epoch

    async def _form_group(self, looking: Looking, *, lead: bool) -> bool:
        """One look for a group of ``looking.epoch``; True when none formed in time (look again)."""
        cfg = self.config.averaging
        diloco = self.outer is not None
        epoch, follows = looking.epoch, looking.follows
        try:
            board = self.board
            reading = self.clock()
            # Sized by the freshest records (a peer that just caught up counts): those its partners
            # offered it since the last read, which are the replicas' where they are sure
            # (``ProgressBoard.asks_replicas``). Read from the replicas at every look, a look waited for
            # them (128 simulated peers with 48 slots a node: 0.9 s at the median, 2.4 s at p90, up to
            # 4 s), and a follower that asked its leader 3.7 s after its look began found the group
            # formed 0.03 s before.
            await board.refresh(network=board.asks_replicas())
            view = board.view if epoch == self.tally.epoch else board.view_of(epoch)
            assert view is not None
            if view.behind or view.peers <= 1:
                return False  # step() catches up or steps alone
            if not self.alone.majority_here(view, epoch):
                return True  # the peers one step behind arrive soon: look again then
            target = min(view.peers + view.arriving, cfg.max_group_size)
            # a majority: two groups cannot both form (all of those here, once waiting gave up)
            minimum = min(view.peers, target, view.quorum)
            if view.quorum > cfg.max_group_size and not self._told_too_many:
                self._told_too_many = True  # (said once: the swarm stays that large for a while)
                log.warning(
                    "%d peers on step %d: their majority (%d) is more than one group holds (at most %d"
                    " members), so a group forms only when full, and two groups of one"
                    " step may both commit (split the swarm into regions, each with a group of its own:"
                    " [progress] regions, see the docs' swarms at scale)",
                    view.peers,
                    epoch,
                    view.quorum,
                    cfg.max_group_size,
                )
            publishing = frozenset(r.peer for r in board.region_records(epoch))
            # anchored beyond its join peers: it averaged, or it has none (it trusts the peers connected)
            node = self.node
            anchored = board.anchored
            absent = board.absent_trusted(epoch)  # (their records missing for a moment)
            quorum, minimum = step_quorum(
                view,
                minimum,
                target,
                publishing,
                board.trusted(),
                absent,
                node.peer_id,
                anchored,
                board.cohort(),
            )
            # (its window opens when every record read expects the target; so for an anchored peer that
            # leads by it, ``ProgressBoard.leads_by_heard``)
            by_heard = follows or (anchored and board.leads_by_heard(view))
            if follows:  # (until its own view reaches the target: see ``start_matchmaking``)
                quorum = dataclasses.replace(quorum, leads=False)
            elif board.regions.split and not anchored and view.vouched_here <= 1 and not absent:
                # A newcomer that trusts nobody of its region on the step (its join peers are in
                # others) counts no quorum of it but the region's majority (``minimum``). It follows a
                # leader that is anchored where one may be there: led from here, a group of the late
                # joiners of a region whose peers had taken the step committed it a second time (16
                # simulated peers). Where the region's records say nobody of it is (``region_unled``),
                # it leads after everyone else (``NEWCOMER_RANK``): only following, a region of
                # newcomers formed no group until a round's members landed in it, and at a swarm's
                # start the regions' leaders spread a step at a time from its first peer's (64
                # simulated peers over 8 regions: 11% to 18% of the live peers in a round at the
                # first step, 22% to 39% at the second). Its own view capped by trust never reaches
                # the target there: it leads by every record once its trusted peers' views are done
                # with the step (``ProgressBoard.leads_by_heard``).
                if board.region_unled(epoch):
                    quorum = dataclasses.replace(quorum, rank=NEWCOMER_RANK)
                    by_heard = board.leads_by_heard(view)
                else:
                    quorum = dataclasses.replace(quorum, leads=False)
            log.debug(
                "looking for a group of step %d: %d to %d peers (%s; %d arriving; records read in %.2f s,"
                " %.2f s after the look began)%s",
                epoch,
                minimum,
                target,
                view.reason,
                view.arriving,
                self.clock() - reading,
                self.clock() - self.began_looking.get(epoch, reading),
                f", as a follower: every record read says {view.heard:.0f} at {view.heard_rate:.1f}/s"
                if follows
                else "",
            )
            # A group of a step this peer is not on yet (joined ahead, its replay in flight) is
            # joined, never led: the peers on the step decide whether a group of it forms, by their
            # quorums. Led from here, its quorum counted this peer itself as one of the step's peers,
            # and a group of this peer alone committed the step (a lineage of its own; it downloaded
            # the state again). Decided as this try began, not now: a look that began ahead stays a
            # follower's when its replay lands meanwhile (during the records' refresh above), since
            # its view and quorum were taken as a spectator's (a try after it landed may lead).
            # The window opens when this view expects the step's target, not when this look began: a
            # look begins up to a batch early (``CollaborativeOptimizer.step``: 0.5 to 2 s a batch in
            # the simulator), and a window from there left the peers whose looks began last out of the
            # group of the leader whose began first (at 64 simulated peers the looks of a step's members
            # began over 8 s, the left-out's about a second after the members' median).
            opens = opening(self.clock(), view.heard_eta if by_heard else view.eta, cfg.matchmaking_time)
            manifest = await self.node.averager.form_group(
                self.round_tensors(self.contribution.buffer),
                timeout=cfg.timeout,
                group_key=self.group_key(epoch),
                target_size=target,
                min_size=minimum,
                quorum=quorum,
                lead=lead and epoch == self.tally.epoch,
                opens=opens,
                leads_now=(lambda: not looking.follows) if follows else None,
            )
        except GroupFormationFailed as e:
            if follows and not looking.follows:
                log.debug("looking for a group of step %d again, as a leader: its own view reached it", epoch)
                return True
            log.info("no group for step %d: %s", epoch, e)
            self.stats.note_no_group(epoch, str(e))
            self.no_group_on = max(self.no_group_on, epoch)
            self.retry_at = self.clock() + self.retry_gap()
            return True
        else:
            # (counted from the window's opening: the wait for the target is not the group's)
            self.board.group_took(min(max(0.0, self.clock() - opens), cfg.matchmaking_time))
            in_loop = self.outer is not None and self.outer.hands_over_between_batches
            if (diloco and (not self.config.diloco.overlap or in_loop)) or self.contribution.summed:
                # step() runs it, with compute paused; or hands it over between two batches (summed
                # gradients, one batch may be adding to them right now; a site's pseudo-gradient, a
                # collective of its ranks: ``hand_over``); a group joined ahead, once the replay landed
                # (``step`` lands it first)
                self.formed = (epoch, manifest)
                return False
            if self.joined_ahead(epoch):  # replaying: the work computed meanwhile goes now
                await self.state.idle()  # (a batch being added in a worker thread)
                if self.joined_ahead(epoch):
                    self.start_in_background(manifest, epoch)
                else:
                    self.node.averager.decline(manifest)
                return False
            if self.tally.epoch < epoch <= self.headed():
                # joined ahead: the replay (and a round joined ahead) lands between two batches
                # (``step``), then the work goes, once there is some (what was computed on the old
                # state meanwhile is dropped: a batch on the new one); cancelled meanwhile (the state
                # moved elsewhere), the group is told at once rather than left to wait for its slices
                try:
                    with trio.move_on_after(AHEAD_WAIT * cfg.timeout):
                        while self.tally.epoch < epoch <= self.headed() or self._no_work_yet(epoch):  # noqa: ASYNC110
                            await trio.sleep(AHEAD_POLL)
                except trio.Cancelled:
                    self.node.averager.decline(manifest)
                    raise
            if self.tally.epoch == epoch and self.in_flight is None and self.state.download is None:
                await self.state.idle()  # work in a thread changes what we would send
                if self.tally.epoch == epoch and self.in_flight is None and self.state.download is None:
                    self.start_in_background(manifest)
                else:
                    self.node.averager.decline(manifest)
            else:  # the state moved on meanwhile: tell the group at once rather than let it wait for us
                self.node.averager.decline(manifest)
        return False

    def _no_work_yet(self, epoch: int) -> bool:
        """On ``epoch`` with nothing to hand over yet (it just landed there: a batch is under way)."""
        return self.tally.epoch == epoch and self.tally.samples <= 0 and self.in_flight is None

    def group_key(self, epoch: int) -> str:
        """Groups form per step (and per region of it, where the swarm is split: ``progress.regions``);
        streaming DiLoCo's also per fragment count (what each step averages)."""
        mode, count = self.config.training.mode, len(self.contribution.fragments)
        region = self.board.regions.tag(self.node.peer_id, epoch)
        key = f"{mode}-{epoch}{region}" if count == 1 else f"{mode}/{count}-{epoch}{region}"
        self._keyed[key] = epoch
        while len(self._keyed) > LOOKS_KEPT:
            del self._keyed[next(iter(self._keyed))]
        return key

    def look_buckets(self, group_key: str) -> list[int] | None:
        """The buckets whose matchmaking keys a look for ``group_key`` reads (``RoundPolicy``): a split
        swarm's region's at the key's step, where every peer that may join its group announces (each
        under its own bucket's key); None (every bucket's) with one region, or for a key not made
        here. Read whole, the keys of a step's announcements were every looker's, O(N) a read."""
        epoch = self._keyed.get(group_key)
        regions = self.board.regions
        if epoch is None or not regions.split:
            return None
        return region_buckets(
            bucket_of(self.node.peer_id.digest, regions.bits), regions.bits, epoch, regions.span
        )

    # ---- running a round now (DiLoCo without overlap) ----

    async def average(self, manifest: SignedManifest) -> Landed | None:
        """DiLoCo without overlap: run the formed group's round now, compute paused; apply it if it
        commits (an abort changes nothing: the work is still in the local parameters)."""
        outer = self.outer
        assert outer is not None
        weight = self.tally.samples
        outer.pseudo_gradients()
        buffer = self.contribution.buffer
        before = await outer.fold(buffer)
        try:
            result = await self.node.averager.run_round(
                manifest, buffer.tensors, weight=self.board.claim(weight), in_place=buffer.sendable
            )
        except RoundAborted as e:
            self.note_abort(e)
            await self.state.off_loop(functools.partial(outer.unfold, before, committed=False))
            self.contribution.after_abort(buffer)
            return None
        short = short_of_quorums(manifest.manifest, result.contributors, self.node.peer_id)
        if short:  # (the leader and the members it counts alike) the work is still in the local parameters
            self.short(manifest, short)
            await self.state.off_loop(functools.partial(outer.unfold, before, committed=False))
            self.contribution.after_abort(buffer)
            return None
        outer.unfold(before, committed=True)
        self.taken.committed(self.tally.epoch)  # (a peer of another group asking hears of it)
        self.contribution.relay(result.retired)
        # for peers behind (``state.replay``); a large one in the background, read from the buffer
        await self.state.keep_result(self.tally.epoch, buffer.views, buffered=True)
        await self.state.unheld()
        # (the outer step passes over the whole model: a site's is a collective of its ranks)
        await self.state.off_loop(outer.step, None, outer.reset_local)
        self.tally.took(weight)
        self.tally.counting_from(self.clock())
        return result, weight

    # ---- rounds in the background ----

    async def hand_over(self, manifest: SignedManifest) -> None:
        """DiLoCo with overlap, an outer step whose pseudo-gradient is a collective of a site's ranks
        (``OuterStep.hands_over_between_batches``), called by ``step`` between two batches: the
        pseudo-gradient of the local parameters as they are now goes into the round's buffer (each rank
        keeping its shard of it aside for the landing), and the round runs in the background while the
        next batches compute. Taken from the matchmaking task, as an unsharded peer's is, the ranks'
        collective would wait for the batch in progress, and what it sent would hold a batch that the
        samples handed over did not count."""
        outer = self.outer
        assert outer is not None
        if self.tally.samples <= 0:  # (nothing to send; and a fold not followed by its round's landing
            self.node.averager.decline(manifest)  # would leave top-k's residual changed for nothing)
            return
        outer.pseudo_gradients()
        buffer = self.contribution.buffer
        own = await outer.keep_aside(buffer)
        before = await outer.fold(buffer)
        self.start_in_background(manifest, folded=(own, before))

    def start_in_background(
        self,
        manifest: SignedManifest,
        epoch: int | None = None,
        *,
        folded: tuple[list[Spilled | torch.Tensor], Saved | None] | None = None,
    ) -> None:
        """Hand what this peer has done so far to the formed group's round and go on computing.

        sync: the accumulated gradients leave in the round (as the mean gradient, weighted by the
        samples); a fresh accumulator takes the batches computed meanwhile. diloco: the pseudo-gradient
        of the local parameters as they are now; local progress made meanwhile is kept on top of the new
        global parameters when the round lands. ``epoch``: the step of the group (sync: one joined
        ahead, see :meth:`start_matchmaking`); this peer's own by default. ``folded``: the
        pseudo-gradient is in the contribution's buffer already, kept aside and folded (see
        :meth:`hand_over`).
        """
        assert self._nursery is not None
        weight = self.tally.samples
        if weight <= 0:  # nothing to contribute (not expected: matchmaking waits for a first batch)
            self.node.averager.decline(manifest)
            return
        ahead = epoch is not None and epoch != self.tally.epoch
        outer = self.outer
        if ahead:
            download = self.state.download
            assert download is not None
            if outer is None:
                download.keep_work = False  # what is computed from now on, on the old state, is dropped
            log.info(
                "step %d: %d samples' %s computed while replaying from step %d go to its round",
                epoch,
                weight,
                "gradients" if outer is None else "local progress",
                self.tally.epoch,
            )
        if outer is not None:
            if folded is None:
                outer.pseudo_gradients()
            # (joined ahead: the replay in flight applies its results in a buffer of its own meanwhile)
            tensors = self.contribution.take() if ahead else self.contribution.buffer
        else:
            tensors = self.contribution.hand_over()
            tensors.div_(weight)  # the mean gradient; the round weighs it by the sample count
            self.tally.took(weight)  # the batches computed from now on count toward the next step
        done = trio.Event()
        # What is computed from here on counts toward the next step, the batch in progress included.
        self.in_flight = InFlight(
            done,
            tensors,
            weight,
            since=self._next_batch,
            digest=manifest.digest,
            epoch=self.tally.epoch if epoch is None else epoch,
            manifest=manifest,
            states=self.states and outer is None,
        )
        self.tally.handed(True, epoch if ahead else None)
        if outer is None:
            self.tally.counting_from(self._next_batch)
        self.wake.set()  # others count this peer on the next epoch already (see ``landing``)

        async def run(flight: InFlight) -> None:
            try:
                if folded is not None:
                    flight.own, flight.before = folded
                elif outer is not None:  # kept for the landing: the local progress since now goes on top
                    flight.own = await outer.keep_aside(flight.tensors)
                    flight.before = await outer.fold(flight.tensors)
                if flight.states:  # (the state stays as it is while a round is in flight)
                    await self.state.off_loop(self._keep_state, flight)
                flight.outcome = await self.node.averager.run_round(
                    manifest,
                    self.round_tensors(flight.tensors, flight.state),
                    weight=self.board.claim(weight),
                    in_place=flight.in_place,
                )
                self.taken.committed(flight.epoch)  # (before it is checked and applied: ``taken``)
            except RoundAborted as e:
                flight.outcome = e
            finally:
                done.set()

        self._nursery.start_soon(run, self.in_flight)

    async def land(self) -> Landed | None:
        """Apply a background round's result once it is in (between batches: compute is not running);
        returns it if it was applied (the caller then takes the global step)."""
        flight = self.in_flight
        if flight is None or not flight.done.is_set() or self.state.holds:
            return None
        if flight.epoch > self.tally.epoch and self.state.download is not None:
            return None  # joined ahead: its result is applied to the state the replay lands on
        self.in_flight = None
        self.tally.handed(False)
        outcome, tensors, weight = flight.outcome, flight.tensors, flight.weight
        try:
            if flight.epoch != self.tally.epoch:  # the replay did not land on the round's step
                self.taken.dropped(flight.epoch)
                self.note_abort(
                    RoundAborted(f"the round was of step {flight.epoch}, and the catch-up ended elsewhere")
                )
                if self.outer is not None:  # (not expected: DiLoCo hands over once its replay landed)
                    self.outer.unfold(flight.before, committed=False)
                    self.contribution.after_abort(tensors)
                    return None
                if isinstance(outcome, RoundResult) or flight.in_place:
                    return None  # (its buffer holds the average, or a round's relay may still read it)
                tensors.zero_()
                self.contribution.keep_spare(tensors)
                return None
            return await self.land_flight(flight, outcome, tensors, weight)
        finally:
            for kept in flight.own or ():
                if isinstance(kept, Spilled):
                    kept.file.close()

    async def land_flight(
        self,
        flight: InFlight,
        outcome: RoundResult | BaseException | None,
        tensors: ParamBuffer,
        weight: int,
    ) -> Landed | None:
        """Apply ``flight``'s ``outcome`` (see :meth:`land`)."""
        outer = self.outer
        diloco = outer is not None
        short = ""
        if isinstance(outcome, RoundResult) and flight.manifest is not None:
            short = short_of_quorums(flight.manifest.manifest, outcome.contributors, self.node.peer_id)
        if short and flight.manifest is not None:
            self.short(flight.manifest, short)
        elif isinstance(outcome, RoundResult) and flight.manifest is not None:
            # another group of the region took the step first, by a peer this one trusts (or such a
            # peer stayed busy): not applied here (this member alone; it catches up to the region's
            # state), nor is the leader suspected. The group is the round's contributors, not its
            # manifest: a member that declined it (signed out, or its state moved on) may have taken the
            # step in another group (128 simulated peers, 48 slots: a member signed out of a group of 26
            # ran a group of 11 of the region that landed 6 s before the 26's, and a member of the 26
            # that trusted it applied its copy: a fork)
            took_part = frozenset(outcome.contributors) | {self.node.peer_id}
            short = await self.taken.elsewhere(flight.epoch, took_part)
            if short:
                self.note_abort(RoundAborted(short))
        if short:
            self.taken.dropped(flight.epoch)
        if short and not diloco:  # the tensors hold the round's mean now: this peer's part is gone
            log.warning("step %d: the %d samples handed to the round are dropped", self.tally.epoch, weight)
            if not flight.in_place:  # (in place: the round may relay from them a while; then freed)
                tensors.zero_()
                self.contribution.keep_spare(tensors)
            return None
        if short:  # diloco: the work is still in the local parameters
            if outer is not None:
                outer.unfold(flight.before, committed=False)
            self.contribution.after_abort(tensors)
            return None
        if outer is not None:
            outer.unfold(flight.before, committed=isinstance(outcome, RoundResult))
        if not isinstance(outcome, RoundResult):
            self.note_abort(outcome or RoundAborted("the round ended without an outcome"))
            if not diloco and flight.in_place:  # averaged in place: they are spoilt
                what = "step %d: the %d samples handed to the aborted round are dropped"
                log.warning(what, self.tally.epoch, weight)
            elif not diloco:  # the gradients go back: the next round counts them
                self.contribution.buffer.add_(tensors, alpha=weight)
                tensors.zero_()
                self.tally.gave_back(weight)
                self.contribution.keep_spare(tensors)
            self.contribution.after_abort(tensors)
            return None  # diloco: the work is still in the local parameters
        if outer is not None:
            assert flight.own is not None
            self.contribution.adopt(tensors)  # (joined ahead: the replay had a buffer of its own)
            await self.state.keep_result(self.tally.epoch, tensors.views, buffered=True)  # for peers behind
            await self.state.off_loop(outer.land_on_top, flight.own)
            self.contribution.relay(outcome.retired)
            self.tally.took(weight)
            self.tally.counting_from(flight.since)
        elif flight.in_place:  # averaged in place: the round may relay from them a while; then freed
            await self.state.keep_result(self.tally.epoch, tensors.views)  # for peers behind
            await self.state.off_loop(self.local.apply, tensors, False)
        else:
            await self.state.keep_result(self.tally.epoch, tensors.views)
            if flight.state is not None:  # the region's mean state first, then the mean gradient on it
                await self.state.off_loop(self._take_state, flight.state)
            await self.state.off_loop(self.local.apply, tensors)
            self.contribution.keep_spare(tensors)
        return outcome, weight

    def _take_state(self, state: list[torch.Tensor]) -> None:
        """The training state becomes a round's mean (a split swarm's, see :meth:`states`)."""
        with torch.no_grad():
            for live, mean in zip(self.local.state_tensors(), state, strict=True):
                live.copy_(mean)

    def short(self, manifest: SignedManifest, why: str) -> None:
        """A committed round whose contributors miss its signed quorums: not applied (by the leader and
        the members it counts alike; a member it does not count also for its own entry), and its leader
        suspected (three suspicions and it is not followed for a while), so that a group
        whose rounds keep falling short (a reducer refusing the slices others need) is not formed again
        and again under the same leader."""
        self.note_abort(RoundAborted(why))
        leader = manifest.manifest.peers()[0]
        if leader != self.node.peer_id:
            self.node.averager.groups.round_failed(manifest, {leader: f"its round fell short: {why}"})

    def note_abort(self, e: BaseException) -> None:
        log.warning("step %d: averaging round aborted, nothing applied: %s", self.tally.epoch, e)
        self.stats.note_abort(self.tally.epoch, str(e))
