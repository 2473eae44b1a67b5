"""The state a CollaborativeOptimizer shares with the swarm: its digest, snapshots for joiners, downloads.

Theory of operation: the state peers agree on (and serve to joiners) is the model with, in DiLoCo, the
global parameters in place of the local ones, plus the optimizer state that global steps change (the
inner optimizer in sync mode, the outer one in DiLoCo). Its digest (``layout.root``) commits to every
byte; only global steps and downloads change it, and only between batches. Hashing it after each change,
and writing a snapshot for joiners (``statesync``), read the live tensors in a worker thread when the
state is large: meanwhile the state is *held* (a finished round or download waits to be applied until
the hold ends), never copied in memory. A peer that is behind or diverged downloads the state in the
background (``fetch``) and applies it between two batches.

:class:`SwarmState` is a mixin of :class:`~p2ptrain.training.collaborative.CollaborativeOptimizer`,
which owns the attributes declared below.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import trio

from ..config import RunConfig
from ..errors import P2PError, RemoteProtocolError
from ..identity import PeerID
from ..node import Node
from . import layout as lay
from . import model_state, statesync
from .buffers import ParamBuffer
from .feedback import FEEDBACK, ErrorFeedback
from .fetch import Downloaded, Fetcher, Partial, fill_from
from .offheap import FileTensors
from .progress import PeerProgress, SwarmView, vouched_digest
from .statesync import LiveState, Snapshot, StateServer

if TYPE_CHECKING:
    from .bookkeeping import RoundStats

log = logging.getLogger(__name__)

RETRY_SYNC = 2.0  # seconds before downloading again after every donor failed
HASHED_KEPT = 4  # the digests of this many recent steps are kept for the metrics (``hashed``)


@dataclass
class _Download:
    """A state download running in the background (see ``_start_download``)."""

    done: trio.Event
    carry_from: int | None  # diloco: the epoch whose local progress is carried onto the downloaded state
    outcome: Downloaded | P2PError | None = None


class SwarmState:
    """Digest, snapshots and downloads of a CollaborativeOptimizer's shared state (a mixin)."""

    # Owned by CollaborativeOptimizer:
    node: Node
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    config: RunConfig
    clock: Callable[[], float]
    diloco: bool
    params: list[torch.Tensor]
    names: list[str]
    global_params: list[torch.Tensor]
    outer: torch.optim.SGD
    outer_file: FileTensors | None
    momentum: list[torch.Tensor]
    averaged: ParamBuffer
    feedback: ErrorFeedback | None
    epoch: int
    inner_steps: int
    samples: int
    records: list[PeerProgress]
    fingerprint: bytes
    trusted: Callable[[], frozenset[PeerID] | None]
    said_on: Callable[[int], list[PeerProgress]]
    _fit_buffer: Callable[[], None]
    stats: RoundStats
    digest: bytes
    server: StateServer | None
    fetcher: Fetcher
    download_progress: tuple[int, int]
    on_download_progress: Callable[[int, int], None] | None
    _nursery: trio.Nursery | None
    _matchmaking_scope: trio.CancelScope
    _publish_now: trio.Event
    _version: int
    _holds: int
    _released: trio.Event
    _digest_set: trio.Event  # set while ``digest`` is known (see ``hashed_digest``)
    _hashes: tuple[int, list[bytes]] | None
    hashed: dict[int, bytes]
    _download: _Download | None
    _sync_retry_at: float
    _epoch_began: float
    _local_idle: trio.Event
    _cohort: tuple[int, frozenset[PeerID]]

    def _counting_from(self, when: float | None = None) -> None:
        """``self.samples`` counts what was computed from ``when`` on (default: now): the start of the
        time over which others judge how many samples this peer could have done (``since``)."""
        self._epoch_began = self.clock() if when is None else when

    def _state_changed(self) -> None:
        self._matchmaking_scope.cancel()  # a group for the epoch we left is no use
        self._version += 1
        if self.server is not None:
            self.server.invalidate()
        self._rehash()
        self._publish_now.set()

    def capture(self, copy: bool = True, own: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The state to serve or checkpoint: the model (with DiLoCo's global parameters in place of the
        local ones), the optimizer whose state global steps change (inner in sync, outer in DiLoCo) and
        the epoch. ``copy=False`` returns the live tensors, for a caller that reads them before the next
        ``step``. ``own``: with what is this peer's alone (a checkpoint's): top-k's error feedback."""
        if self.diloco:
            global_values = dict(zip(self.names, self.global_params, strict=True))
            extra = {FEEDBACK: self.feedback.residual} if own and self.feedback is not None else {}
            tensors, meta = model_state.capture(
                self.model, {"outer": self.outer}, values=global_values, extra=extra, copy=copy
            )
        else:
            tensors, meta = model_state.capture(self.model, {"inner": self.optimizer}, copy=copy)
        meta["p2ptrain.epoch"] = str(self.epoch)
        meta["p2ptrain.inner_steps"] = str(self.inner_steps)
        return tensors, meta

    def _live(self) -> LiveState:
        tensors, meta = self.capture(copy=False)
        layout = lay.Layout.of(tensors)
        hashes = self._hashes[1] if self._hashes and self._hashes[0] == self._version else None
        ordered = [tensors[e.name] for e in layout.entries]
        return LiveState(self.epoch, layout, ordered, meta, hashes, source=self.outer_file)

    # ---- holding the state still while threads read it ----

    async def unheld(self) -> None:
        """Wait until no thread reads the live state (then it may change)."""
        while self._holds:
            await self._released.wait()

    async def _read_in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        self._holds += 1
        try:
            return await trio.to_thread.run_sync(fn, *args)
        finally:
            self._holds -= 1
            if not self._holds:
                self._released.set()
                self._released = trio.Event()

    def _rehash(self) -> None:
        """The state changed: its digest is computed now (small states) or in a thread (large ones)."""
        live = self._live()
        if live.layout.size < statesync.THREAD_BYTES or self._nursery is None:
            self._set_digest(live, lay.hash_chunks(live.layout, live.tensors, live.source))
            return
        self.digest = b""  # published as unknown meanwhile: nobody takes us for diverged
        if self._digest_set.is_set():
            self._digest_set = trio.Event()
        self._nursery.start_soon(self._hash_in_thread, live, self._version)

    async def hashed_digest(self) -> bytes:
        """The current state's digest, once known: a large state is hashed in a thread after it
        changes (``digest`` is b"" meanwhile), and a peer that stops reports the digest it stops with."""
        while not self.digest:  # (a hash of the state's latest version is under way)
            await self._digest_set.wait()
        return self.digest

    async def _hash_in_thread(self, live: LiveState, version: int) -> None:
        hashes = await self._read_in_thread(lay.hash_chunks, live.layout, live.tensors, live.source)
        if version == self._version:
            self._set_digest(live, hashes)

    def _set_digest(self, live: LiveState, hashes: list[bytes]) -> None:
        self._hashes = (self._version, hashes)
        self.digest = lay.root(live.epoch, live.layout, hashes)
        self.hashed[live.epoch] = self.digest
        self._digest_set.set()
        for old in sorted(self.hashed)[:-HASHED_KEPT]:
            del self.hashed[old]
        self._publish_now.set()

    async def _prepare_snapshot(self) -> Snapshot | None:
        """A snapshot of the state as it is now, for joiners (see ``StateServer``)."""
        await self._local_idle.wait()  # a round being applied in a worker thread changes the state
        live = self._live()
        if live.layout.size < statesync.THREAD_BYTES:
            snap = statesync.write_snapshot(live)
        else:
            snap = await self._read_in_thread(statesync.write_snapshot, live)
        return snap

    def restore(
        self,
        tensors: Mapping[str, torch.Tensor],
        meta: Mapping[str, str],
        *,
        epoch: int | None = None,
        owned: bool = False,
    ) -> None:
        """Load a state from :meth:`capture` (a download or a checkpoint); everything is checked first.
        ``epoch``: the step the state is known to be (a download's verified root commits to it), instead
        of the one its metadata claims; a download takes nothing else from its metadata either (its
        optimizer's hyperparameters and this peer's inner step count stay local: the root does not
        cover them, see ``model_state.restore``). ``owned``: the tensors are handed over, not copied."""
        verified = epoch is not None
        try:
            claimed = int(meta.get("p2ptrain.epoch", ""))
            inner_steps = int(meta.get("p2ptrain.inner_steps", "0"))
        except ValueError:
            raise RemoteProtocolError("the state does not say which step it is") from None
        epoch = claimed if epoch is None else epoch
        if not (0 <= epoch <= 2**53 and 0 <= inner_steps <= 2**53):
            raise RemoteProtocolError(f"implausible step {epoch}")
        if self.diloco:
            # Older checkpoints kept the global parameters apart ("extra.global.*"), the local ones as
            # the model's; now the model entries are the global parameters.
            legacy = bool(self.names) and f"extra.global.{self.names[0]}" in tensors
            old = [f"global.{n}" for n in self.names] if legacy else []
            # a checkpoint's own error feedback (another peer's state never brings one: see feedback)
            mine = not verified and f"extra.{FEEDBACK}" in tensors
            if mine and self.feedback is not None:
                self.feedback.check(tensors[f"extra.{FEEDBACK}"])
            extra = model_state.restore(
                self.model,
                {"outer": self.outer},
                tensors,
                meta,
                extra_names=old + [FEEDBACK] * mine,
                owned=owned,
                tensors_only=verified,
            )
            if self.feedback is not None:
                self.feedback.load(extra.get(FEEDBACK))
            with torch.no_grad():
                for i, (g, p) in enumerate(zip(self.global_params, self.params, strict=True)):
                    if old:
                        p.copy_(extra[old[i]])
                    g.copy_(p)
            self._rehome_momentum()
        else:
            model_state.restore(
                self.model, {"inner": self.optimizer}, tensors, meta, owned=owned, tensors_only=verified
            )
            self.averaged.zero_()
        if not verified:
            self.inner_steps = max(self.inner_steps, inner_steps)
        self.epoch, self.samples = epoch, 0
        self._fit_buffer()
        self._counting_from()
        self._state_changed()

    def _rehome_momentum(self) -> None:
        """After the outer optimizer loaded a state: its momentum goes back into this peer's own buffers
        (file-backed ones stay file-backed; a state without momentum, an older format's first step,
        means zeros), and what the restore touched leaves the resident set."""
        with torch.no_grad():
            for g, m in zip(self.global_params, self.momentum, strict=True) if self.momentum else ():
                slot = self.outer.state[g]
                loaded = slot.get("momentum_buffer")
                if loaded is None:
                    m.zero_()
                elif loaded is not m:
                    m.copy_(loaded)
                slot["momentum_buffer"] = m
        self.release_outer()

    def release_outer(self) -> None:
        """DiLoCo with a file-backed outer state: drop the pages this process touched (see ``offheap``)."""
        if self.outer_file is not None:
            self.outer_file.release()

    def max_state_bytes(self) -> int:
        """The most a download of this model's state could need (bounds what a donor may send): the model,
        up to three optimizer states per parameter (Adam's moments, amsgrad's maximum) and DiLoCo's
        global copy and momentum, plus headers. Not our own state's size: a joiner's optimizer has no
        state yet."""
        entries = self.model.state_dict()
        model_bytes: int = sum(t.numel() * t.element_size() for t in entries.values())
        headers = (len(entries) + 5 * len(self.params)) * 1024
        return 6 * model_bytes + headers + (1 << 20)

    def _start_download(self, view: SwarmView) -> None:
        """Download the state most peers hold (we are behind, or diverged), in the background: compute
        goes on meanwhile, and ``step`` applies the state between two batches once it is in."""
        assert self._nursery is not None
        why = view.reason if view.behind else f"diverged from the majority on step {view.epoch}"
        log.info("catching up: %s", why)
        # DiLoCo, one step behind (this peer missed the last round): its local progress since the global
        # parameters it holds is carried onto the new ones, so the work rolls into the next round.
        carry = self.diloco and view.behind and view.newest == self.epoch + 1
        flight = self._download = _Download(trio.Event(), self.epoch if carry else None)
        want = view.newest if view.behind else self.epoch

        def expected(epoch: int) -> bytes:  # what the trusted report; our own digest vouches for nothing
            ours = [r for r in self.records if r.record.run == self.fingerprint]  # (leaving ones still serve)
            trusted = self.trusted()  # (said_on kept only this run's records)
            return vouched_digest(ours, epoch, trusted) or vouched_digest(self.said_on(epoch), epoch, trusted)

        async def run() -> None:
            try:
                flight.outcome = await self.fetcher.fetch(
                    view.donors, want_epoch=want, expected=expected, reuse=self._reuse
                )
            except P2PError as e:
                flight.outcome = e
            finally:
                flight.done.set()

        self._nursery.start_soon(run)

    async def _reuse(self, partial: Partial) -> None:
        """Copy the chunks of a new download that this peer's own state holds (``fetch.fill_from``)."""
        live = self._live()
        if live.hashes is not None:
            await self._read_in_thread(fill_from, partial, live)

    def _land_download(self) -> bool:
        """Apply a background download once it is in; True when the state was replaced."""
        flight = self._download
        if flight is None or not flight.done.is_set() or self._holds:
            return False
        self._download = None
        got = flight.outcome
        try:
            if not isinstance(got, Downloaded):
                raise got or P2PError("the download ended without an outcome")
            local: list[torch.Tensor] = []
            if flight.carry_from is not None:
                local = [p - g for p, g in zip(self.params, self.global_params, strict=True)]
                self.release_outer()
            samples, counting_since = self.samples, self._epoch_began
            self.restore(got.tensors, got.metadata, epoch=got.epoch, owned=True)
            self._cohort = (-1, frozenset())  # a download: no round of ours vouches for this state
        except P2PError as e:
            log.warning("could not catch up (%s); retrying in %.0f s", e, RETRY_SYNC)
            self._sync_retry_at = self.clock() + RETRY_SYNC
            return False
        carried = flight.carry_from is not None and self.epoch == flight.carry_from + 1
        if carried:
            with torch.no_grad():
                for p, d in zip(self.params, local, strict=True):
                    p.add_(d)
            self.samples = samples
            self._counting_from(counting_since)
        self.stats.syncs += 1
        self.stats.last = {"epoch": self.epoch, "outcome": "synced", "from": got.donor.short()}
        log.info(
            "now on step %d (state from %s)%s",
            self.epoch,
            got.donor.short(),
            f"; {self.samples} samples of local progress carried into it" if carried else "",
        )
        return True

    def _on_download_progress(self, got: int, total: int) -> None:
        self.download_progress = (got, total)
        if self.on_download_progress is not None:
            self.on_download_progress(got, total)
