"""Rounds in the background: a CollaborativeOptimizer hands its work to a formed group's round and goes
on computing (sync, and DiLoCo with overlap); the round's result lands between two batches.

sync: the accumulated gradients leave as the mean gradient (weighted by the samples) and a fresh
accumulator takes the batches computed meanwhile; an aborted round's gradients go back into the
accumulator, unless the round averaged them in place (then they are dropped). DiLoCo: the
pseudo-gradient of the local parameters at the handoff leaves; the local parameters' progress since
then is put on top of the new global parameters when the round lands (the handoff's pseudo-gradient
waits in a spill file meanwhile). Top-k rounds fold the error feedback into what they send, and keep
the residual only if the round committed. A committed round whose contributors no longer hold the
peers this one must average with is not applied (``_short_of_quorum``).

:class:`BackgroundRounds` is a mixin of :class:`~p2ptrain.training.collaborative.CollaborativeOptimizer`,
which owns the attributes declared below.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch
import trio

from ..averaging.allreduce import RoundResult
from ..averaging.matchmaking import Quorum
from ..averaging.protocol import SignedManifest
from ..averaging.spill import Spilled, SpillFile
from ..errors import RoundAborted
from . import statesync
from .buffers import ParamBuffer
from .feedback import Saved
from .state import raw_bytes
from .swarm_state import SwarmState

log = logging.getLogger("p2ptrain.training.collaborative")  # (the optimizer's lines, as before)


@dataclass
class _InFlight:
    """A round running in the background: what it averages, and its outcome once ``done``."""

    done: trio.Event
    tensors: ParamBuffer
    weight: int
    since: float  # when the batch in progress at the handoff began: later samples count toward the next
    outcome: RoundResult | BaseException | None = None
    # diloco: this peer's pseudo-gradient, before the round averaged it (see ``_keep_aside``)
    own: list[Spilled | torch.Tensor] | None = None
    # top-k rounds: the error feedback's residual before this round (see ``feedback``)
    before: Saved | None = None
    digest: bytes = b""  # the round's


class BackgroundRounds(SwarmState):
    """Hand-off and landing of rounds that run while compute goes on (a mixin, over the shared state's)."""

    # Owned by CollaborativeOptimizer:
    summed: bool
    fragments: list[range]
    _slots: range
    _starts: list[int]
    _param_bytes: int
    _in_flight: _InFlight | None
    _spare: ParamBuffer | None
    _relaying: trio.Event | None
    _quorums: dict[bytes, Quorum]
    _next_batch: float
    _pseudo_gradients: Callable[[], None]
    _attach: Callable[[], None]
    _claim: Callable[[int], float]
    _note_abort: Callable[[BaseException], None]
    _after_abort: Callable[[ParamBuffer], None]
    _advance: Callable[[RoundResult | None, int], None]
    _apply_gradients: Callable[..., None]
    _outer_step: Callable[..., None]
    _off_loop: Callable[..., Awaitable[None]]

    def _start_in_background(self, manifest: SignedManifest) -> None:
        """Hand what this peer has done so far to the formed group's round and go on computing.

        sync: the accumulated gradients leave in the round (as the mean gradient, weighted by the
        samples); a fresh accumulator takes the batches computed meanwhile. diloco: the pseudo-gradient
        of the local parameters as they are now; local progress made meanwhile is kept on top of the new
        global parameters when the round lands.
        """
        assert self._nursery is not None
        weight = self.samples
        if weight <= 0:  # nothing to contribute (not expected: matchmaking waits for a first batch)
            self.node.averager.decline(manifest)
            return
        if self.diloco:
            self._pseudo_gradients()
            tensors = self.averaged
        else:
            tensors = self.averaged
            self.averaged = self._spare or ParamBuffer(self.params)  # (a spare only when not in place)
            self._spare = None
            if self.summed:
                self._attach()
            tensors.div_(weight)  # the mean gradient; the round weighs it by the sample count
            self.samples = 0  # the batches computed from now on count toward the next step
        done = trio.Event()
        # What is computed from here on counts toward the next step, the batch in progress included.
        self._in_flight = _InFlight(done, tensors, weight, since=self._next_batch, digest=manifest.digest)
        if not self.diloco:
            self._counting_from(self._next_batch)
        self._publish_now.set()  # others count this peer on the next epoch already (see ``landing``)

        async def run(flight: _InFlight) -> None:
            try:
                if self.diloco:  # kept for the landing, where the local progress since now goes on top
                    flight.own = await self._keep_aside(flight.tensors)
                    flight.before = await self._fold(flight.tensors)
                flight.outcome = await self.node.averager.run_round(
                    manifest,
                    flight.tensors.tensors,
                    weight=self._claim(weight),
                    in_place=flight.tensors.sendable,
                )
            except RoundAborted as e:
                flight.outcome = e
            finally:
                done.set()

        self._nursery.start_soon(run, self._in_flight)

    async def _land(self) -> bool:
        """Apply a background round's result once it is in (between batches: compute is not running)."""
        flight = self._in_flight
        if flight is None or not flight.done.is_set() or self._holds:
            return False
        self._in_flight = None
        outcome, tensors, weight = flight.outcome, flight.tensors, flight.weight
        try:
            return await self._land_flight(flight, outcome, tensors, weight)
        finally:
            for kept in flight.own or ():
                if isinstance(kept, Spilled):
                    kept.file.close()

    async def _land_flight(
        self,
        flight: _InFlight,
        outcome: RoundResult | BaseException | None,
        tensors: ParamBuffer,
        weight: int,
    ) -> bool:
        short = self._short_of_quorum(flight.digest, outcome) if isinstance(outcome, RoundResult) else ""
        if short and not self.diloco:  # the tensors hold the round's mean now: this peer's part is gone
            log.warning("step %d: the %d samples handed to the round are dropped", self.epoch, weight)
            self._note_abort(RoundAborted(short))
            if not tensors.sendable:  # (in place: the round may relay from them a while; then freed)
                tensors.zero_()
                self._spare = tensors
            return False
        if short:
            outcome = RoundAborted(short)  # diloco: the work is still in the local parameters
        self._unfold(flight.before, committed=isinstance(outcome, RoundResult))
        if not isinstance(outcome, RoundResult):
            self._note_abort(outcome or RoundAborted("the round ended without an outcome"))
            if not self.diloco and tensors.sendable:  # averaged in place: they are spoilt
                log.warning(
                    "step %d: the %d samples handed to the aborted round are dropped", self.epoch, weight
                )
            elif not self.diloco:  # the gradients go back: the next round counts them
                self.averaged.add_(tensors, alpha=weight)
                tensors.zero_()
                self.samples += weight
                self._spare = tensors
            self._after_abort(tensors)
            return False  # diloco: the work is still in the local parameters
        if self.diloco:
            assert flight.own is not None
            own = dict(zip(self._slots, flight.own, strict=True))  # parameter index -> kept values

            # new global + the local progress since the handoff: local now - (old global - own
            # pseudo-gradient), the local parameters at the handoff
            def progress(i: int) -> None:
                p, g, h = self.params[i], self.global_params[i], own[i]
                kept = h if isinstance(h, torch.Tensor) else torch.frombuffer(h.read(), dtype=p.dtype)
                with torch.no_grad():
                    p.sub_(g).add_(kept.view(p.shape).to(p.device))

            def on_top(i: int) -> None:
                with torch.no_grad():
                    self.params[i].add_(self.global_params[i])

            await self._off_loop(self._outer_step, progress, on_top)
            self._relaying = outcome.retired
            self.samples -= weight
            self._counting_from(flight.since)
        elif tensors.sendable:  # averaged in place: the round may relay from them a while; then freed
            await self._off_loop(self._apply_gradients, tensors, False)
        else:
            await self._off_loop(self._apply_gradients, tensors)
            self._spare = tensors
        self._advance(outcome, weight)
        return True

    def _short_of_quorum(self, digest: bytes, result: RoundResult) -> str:
        """Why a committed round must not be applied here ('' if it may): others contributed, but they
        no longer hold the peers this one must average with (see ``_form_group``): members of the
        formed group left it before it started, and with fresh keys in their places the rest would
        step on its own while those who left form a second group of the same step (two lineages). A
        round this peer was left alone in is its step alone, as when it is the only one on its step."""
        quorum = self._quorums.pop(digest, None)
        if quorum is None or len(result.contributors) <= 1:
            return ""
        held = len(quorum.peers & set(result.contributors))
        if held >= quorum.size:
            return ""
        return (
            f"its contributors hold {held} of the {quorum.size} peers this one must average with:"
            " applying it could split the swarm"
        )

    async def _fold(self, buffer: ParamBuffer) -> Saved | None:
        """Top-k rounds: ``buffer`` becomes what the round sends, with the error feedback (see
        ``feedback``); returns the residual as it was (None without top-k)."""
        if self.feedback is None:
            return None
        if self._param_bytes < statesync.THREAD_BYTES:
            return self.feedback.fold(buffer, self._start())
        return await trio.to_thread.run_sync(self.feedback.fold, buffer, self._start())

    def _start(self) -> int:
        """Where the current fragment's values begin in the flat order of all parameters."""
        return self._starts[self.fragments.index(self._slots)]

    def _unfold(self, before: Saved | None, *, committed: bool) -> None:
        """After a top-k round: the residual stays if it committed, else goes back to ``before``."""
        if self.feedback is None or before is None:
            return
        if committed:
            self.feedback.forget(before)
        else:
            self.feedback.unfold(before)

    async def _keep_aside(self, buffer: ParamBuffer) -> list[Spilled | torch.Tensor]:
        """``buffer``'s values in a spill file (a worker thread's job when large): a model-sized copy
        that the landing reads once, so it need not stay in memory meanwhile (in memory if the file
        cannot be written: a full disk)."""
        file = SpillFile()

        def write() -> list[Spilled | torch.Tensor]:
            try:
                return [file.put(raw_bytes(v)) for v in buffer.views]
            except OSError as e:
                log.warning("cannot spill the pseudo-gradient (%s): keeping a copy in memory", e)
                file.close()
                return [v.detach().clone() for v in buffer.views]

        if self._param_bytes < statesync.THREAD_BYTES:
            return write()
        return await trio.to_thread.run_sync(write)
