"""The state a CollaborativeOptimizer shares with the swarm: its digest, snapshots for joiners, downloads.

Theory of operation: the state peers agree on (and serve to joiners) is the model with, in DiLoCo, the
global parameters in place of the local ones, plus the optimizer state that global steps change (the
inner optimizer in sync mode, the outer one in DiLoCo). Its digest (``state.chunks.root``) commits to
every byte; only global steps and downloads change it, and only between batches. Hashing it after each
change, and writing a snapshot for joiners (``state.serve``), read the live tensors in a worker thread
when the state is large: meanwhile the state is *held* (a finished round or download waits to be applied
until the hold ends), never copied in memory. Work that changes the state in a worker thread (an inner
step, applying a round: :meth:`SharedState.off_loop`) keeps snapshots waiting the other way round. A peer
that is behind or diverged downloads the state in the background (``state.download``) and applies it
between two batches; one at most ``statesync.replay_steps`` steps behind, on the trusted lineage, instead
fetches the missed steps' results and replays them (``state.replay``: each step's result is kept here,
served to others, and a replayed one is checked against the trusted digest of the step it leads to).

:class:`SharedState` owns all of that; the optimizer tells it when a step changed the state
(:meth:`SharedState.changed`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import trio

from ...averaging.compression import Compression
from ...config import RunConfig
from ...errors import P2PError, RemoteProtocolError
from ...net.slots import ServingSlots
from ...node import Node
from ..state import capture, chunks, result_codec, serve
from ..state.download import Downloaded, Fetcher, Partial, ProgressFn, fill_from
from ..state.replay import Fetched, Replay, ResultFetcher, ResultStore
from ..state.serve import LiveState, Snapshot, StateServer
from .bookkeeping import RoundStats, Tally
from .buffers import Contribution, ParamBuffer
from .feedback import FEEDBACK
from .local_steps import LocalSteps
from .outer import OuterStep
from .progress import PeerProgress, SwarmView
from .wake import Wake

log = logging.getLogger("p2ptrain.training.swarm_state")  # (its lines, as before)

RETRY_SYNC = 2.0  # seconds before downloading again after every donor failed
AHEAD_POLL = 1.0  # seconds between two looks for steps taken while a state downloads
HASHED_KEPT = 4  # the digests of this many recent steps are kept for the metrics (``hashed``)


@dataclass
class Download:
    """A state download running in the background (see :meth:`SharedState.start_download`)."""

    done: trio.Event
    carry_from: int | None  # diloco: the epoch whose local progress is carried onto the downloaded state
    outcome: Downloaded | Replay | P2PError | None = None
    expected: Callable[[int], bytes] = lambda epoch: b""  # the trusted digest of a step (a replay's check)
    # fetching (or about to fetch) the missed steps' results, not the whole state: compute goes on
    # meanwhile, and the peer may join the round of the step it lands on (``RoundRunner``)
    replaying: bool = False
    target: int = 0  # the step it lands on
    # sync, one step replayed: the gradients computed meanwhile count toward the step it lands on (one
    # step stale); False once they went to a round joined ahead (those computed after it are dropped)
    keep_work: bool = True


class SharedState:
    """Digest, snapshots and downloads of a CollaborativeOptimizer's shared state."""

    # DiLoCo one step behind: a download carries the local progress onto the new state (a replay does
    # either way); a site's does not (its chunks are placed while the training loop waits)
    carries_downloads = True

    def __init__(
        self,
        node: Node,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: RunConfig,
        *,
        params: list[torch.Tensor],
        names: list[str],
        tally: Tally,
        contribution: Contribution,
        outer: OuterStep | None,
        stats: RoundStats,
        wake: Wake,
        clock: Callable[[], float],
        on_download_progress: ProgressFn | None = None,
        local: LocalSteps | None = None,
    ) -> None:
        """``wake`` is set whenever the digest changed (the progress records say it);
        ``on_download_progress`` is called with the bytes received and expected by a download."""
        self.model, self.optimizer, self.params, self.names = model, optimizer, params, names
        self.tally, self.contribution, self.outer, self.stats = tally, contribution, outer, stats
        self.wake, self.clock, self.local = wake, clock, local
        self.param_bytes = sum(p.numel() * p.element_size() for p in params)
        self._nursery: trio.Nursery | None = None
        self._keeping = trio.Event()  # set once the last result kept in the background is kept
        self._keeping.set()
        self._version = 0  # bumped whenever the state changes
        self.holds = 0  # threads reading the live state: nothing may change it meanwhile
        self._released = trio.Event()
        self._local_idle = trio.Event()  # set while no step work runs in a worker thread (off_loop)
        self._local_idle.set()
        self._digest_set = trio.Event()  # set while ``digest`` is known (see ``hashed_digest``)
        self._hashes: tuple[int, list[bytes]] | None = None  # the chunk hashes of a state version
        # The digests of the last few steps, once hashed (a large state is hashed in a thread, after
        # the step's metrics line was written): what the metrics report for comparing peers.
        self.hashed: dict[int, bytes] = {}
        self.digest = b""  # the root of the current state; b"" while it is being hashed
        self.download: Download | None = None  # a state download running in the background
        self.sync_retry_at = 0.0
        self._on_progress = on_download_progress
        self.download_progress = (0, 0)  # bytes received and expected by the download in progress
        s = config.statesync
        # one share of the uplink for every bulk stream this peer serves (state chunks, kept results)
        self.slots = ServingSlots()
        self.server = StateServer(node.host.registry, self.prepare_snapshot, self.slots) if s.serve else None
        self.fetcher = Fetcher(
            node.host,
            max_size=self.max_state_bytes(),
            chunk_timeout=s.chunk_timeout,
            max_donors=s.max_donors,
            on_progress=self._on_download_progress,
        )
        # the last few steps' results, served to peers that are behind (see ``state.replay``). None in a
        # swarm split into regions (``progress.regions``): a round there leaves its members the mean of
        # their states with the mean gradient applied, which no result applied to another state gives
        # (a replay could never reach a digest the trusted records name), so a peer behind downloads
        self.replay_steps = s.replay_steps if config.progress.regions == 1 else 0
        self.results = ResultStore(
            node.host.registry if s.serve else None,
            self.replay_steps,
            lambda epoch: self.hashed.get(epoch, b""),
            self.slots,
        )
        self.replayer = ResultFetcher(node.host, chunk_timeout=s.chunk_timeout)
        compression = config.averaging.compression
        self._compact = {Compression.FP16: [torch.float16], Compression.BF16: [torch.bfloat16]}.get(
            compression, []
        )
        # int8 and top-k results kept in the compact form the round's wire left them in (lossless)
        self._packs: tuple[str, ...] = (
            (result_codec.SPARSE,)
            if compression.sparse
            else (result_codec.INT8,)
            if compression is Compression.INT8
            else ()
        )
        self._replay_failed = -1  # the step a replay was refuted on: the next catch-up downloads
        self.downloads = 0  # full state downloads applied
        self.replayed = 0  # steps caught up by replaying their results
        self.replayed_bytes = 0
        # the chunk hashes of a replayed or downloaded state, checked as it landed
        self._checked: list[bytes] = []
        self._carried = -1  # sync: the step a replay carried gradients onto (not carried again from it)
        self._rehash()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve snapshots, and own the hashing and download tasks, until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self.server is not None:
                nursery.start_soon(self.server.run)
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    def changed(self) -> None:
        """The state changed (a step, a download, a restore): a new version, hashed and served anew."""
        self._version += 1
        if self.server is not None:
            self.server.invalidate()
        checked, self._checked = self._checked, []
        if checked:
            self.set_digest(self.live(), checked)
        else:
            self._rehash()
        self.wake.set()

    def capture(self, copy: bool = True, own: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """See :meth:`CollaborativeOptimizer.capture`."""
        if self.outer is not None:
            global_values = dict(zip(self.names, self.outer.global_params, strict=True))
            feedback = self.outer.feedback
            extra = {FEEDBACK: feedback.residual} if own and feedback is not None else {}
            tensors, meta = capture.capture(
                self.model, {"outer": self.outer.sgd}, values=global_values, extra=extra, copy=copy
            )
        else:
            tensors, meta = capture.capture(self.model, {"inner": self.optimizer}, copy=copy)
        meta["p2ptrain.epoch"] = str(self.tally.epoch)
        meta["p2ptrain.inner_steps"] = str(self.tally.inner_steps)
        return tensors, meta

    def live(self) -> LiveState:
        """The state as it is now, its tensors the live ones (read them before the next change)."""
        tensors, meta = self.capture(copy=False)
        layout = chunks.Layout.of(tensors)
        hashes = self._hashes[1] if self._hashes and self._hashes[0] == self._version else None
        ordered = [tensors[e.name] for e in layout.entries]
        source = self.outer.file if self.outer is not None else None
        return LiveState(self.tally.epoch, layout, ordered, meta, hashes, source=source)

    def state_bytes(self) -> int:
        """The bytes of the state a download fetches (what a replay of missed steps must cost less than)."""
        return self.live().layout.size

    # ---- threads: readers hold the state still, writers keep snapshots waiting ----

    async def unheld(self) -> None:
        """Wait until no thread reads the live state (then it may change)."""
        while self.holds:
            await self._released.wait()

    async def read_in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in a worker thread that reads the live state: it is held meanwhile."""
        self.holds += 1
        try:
            return await trio.to_thread.run_sync(fn, *args)
        finally:
            self.holds -= 1
            if not self.holds:
                self._released.set()
                self._released = trio.Event()

    async def off_loop(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn`` (work over the whole model: an inner step, accumulating gradients, applying a
        round) in a worker thread when the model is large: AdamW over 124M parameters takes about a
        second of CPU, which the event loop would not serve the network in (a donor's upload ran at 58%
        of its link). Meanwhile the training loop waits for ``step``, and a round that forms and a
        snapshot wait for :meth:`idle`."""
        if self.param_bytes < serve.THREAD_BYTES:
            fn(*args)
            return
        self._local_idle = trio.Event()
        try:
            await trio.to_thread.run_sync(fn, *args)
        finally:
            self._local_idle.set()

    async def idle(self) -> None:
        """Wait until no step work runs in a worker thread (see :meth:`off_loop`)."""
        await self._local_idle.wait()

    # ---- the digest ----

    def _rehash(self) -> None:
        """The state changed: its digest is computed now (small states) or in a thread (large ones)."""
        live = self.live()
        if live.layout.size < serve.THREAD_BYTES or self._nursery is None:
            self.set_digest(live, chunks.hash_chunks(live.layout, live.tensors, live.source))
            return
        self.digest = b""  # published as unknown meanwhile: nobody takes us for diverged
        if self._digest_set.is_set():
            self._digest_set = trio.Event()
        self._nursery.start_soon(self.hash_in_thread, live, self._version)

    async def hashed_digest(self) -> bytes:
        """The current state's digest, once known: a large state is hashed in a thread after it
        changes (``digest`` is b"" meanwhile), and a peer that stops reports the digest it stops with."""
        while not self.digest:  # (a hash of the state's latest version is under way)
            await self._digest_set.wait()
        return self.digest

    async def hash_in_thread(self, live: LiveState, version: int) -> None:
        """Hash a large state in a worker thread; the digest is set unless the state changed meanwhile."""
        await self.idle()  # (a step being applied in a worker thread changes the state: after it)
        if version != self._version:
            return  # (the change said since has its own hash)
        hashes = await self.read_in_thread(chunks.hash_chunks, live.layout, live.tensors, live.source)
        if version == self._version:
            self.set_digest(live, hashes)

    def set_digest(self, live: LiveState, hashes: list[bytes]) -> None:
        """``live``'s chunk hashes are in: its digest becomes the current one, and is published."""
        self._hashes = (self._version, hashes)
        self.digest = chunks.root(live.epoch, live.layout, hashes)
        self.hashed[live.epoch] = self.digest
        self._digest_set.set()
        for old in sorted(self.hashed)[: -max(HASHED_KEPT, self.replay_steps + 2)]:
            del self.hashed[old]
        self.wake.set()

    async def prepare_snapshot(self) -> Snapshot | None:
        """A snapshot of the state as it is now, for joiners (see ``StateServer``)."""
        await self.idle()  # a round being applied in a worker thread changes the state
        live = self.live()
        if live.layout.size < serve.THREAD_BYTES:
            snap = serve.write_snapshot(live)
        else:
            snap = await self.read_in_thread(serve.write_snapshot, live)
        return snap

    # ---- loading a state ----

    def restore(
        self,
        tensors: Mapping[str, torch.Tensor],
        meta: Mapping[str, str],
        *,
        epoch: int | None = None,
        owned: bool = False,
    ) -> None:
        """See :meth:`CollaborativeOptimizer.restore` (which then says the state changed)."""
        verified = epoch is not None
        try:
            claimed = int(meta.get("p2ptrain.epoch", ""))
            inner_steps = int(meta.get("p2ptrain.inner_steps", "0"))
        except ValueError:
            raise RemoteProtocolError("the state does not say which step it is") from None
        epoch = claimed if epoch is None else epoch
        if not (0 <= epoch <= 2**53 and 0 <= inner_steps <= 2**53):
            raise RemoteProtocolError(f"implausible step {epoch}")
        outer = self.outer
        if outer is not None:
            # Older checkpoints kept the global parameters apart ("extra.global.*"), the local ones as
            # the model's; now the model entries are the global parameters.
            legacy = bool(self.names) and f"extra.global.{self.names[0]}" in tensors
            old = [f"global.{n}" for n in self.names] if legacy else []
            # a checkpoint's own error feedback (another peer's state never brings one: see feedback)
            mine = not verified and f"extra.{FEEDBACK}" in tensors
            if mine and outer.feedback is not None:
                outer.feedback.check(tensors[f"extra.{FEEDBACK}"])
            extra = capture.restore(
                self.model,
                {"outer": outer.sgd},
                tensors,
                meta,
                extra_names=old + [FEEDBACK] * mine,
                owned=owned,
                tensors_only=verified,
            )
            if outer.feedback is not None:
                outer.feedback.load(extra.get(FEEDBACK))
            with torch.no_grad():
                for i, (g, p) in enumerate(zip(outer.global_params, self.params, strict=True)):
                    if old:
                        p.copy_(extra[old[i]])
                    g.copy_(p)
            outer.rehome_momentum()
        else:
            capture.restore(
                self.model, {"inner": self.optimizer}, tensors, meta, owned=owned, tensors_only=verified
            )
            self.contribution.buffer.zero_()
        self.tally.moved_to(epoch, None if verified else inner_steps)
        self.contribution.fit(self.tally.epoch)
        self.tally.counting_from(self.clock())

    def max_state_bytes(self) -> int:
        """The most a download of this model's state could need (bounds what a donor may send): the model,
        up to three optimizer states per parameter (Adam's moments, amsgrad's maximum) and DiLoCo's
        global copy and momentum, plus headers. Not our own state's size: a joiner's optimizer has no
        state yet."""
        entries = self.model.state_dict()
        model_bytes: int = sum(t.numel() * t.element_size() for t in entries.values())
        headers = (len(entries) + 5 * len(self.params)) * 1024
        return 6 * model_bytes + headers + (1 << 20)

    # ---- downloads ----

    def start_download(
        self,
        view: SwarmView,
        expected: Callable[[int], bytes],
        donors: Callable[[int], Sequence[PeerProgress]] | None = None,
        roots: Callable[[int], frozenset[bytes]] | None = None,
    ) -> None:
        """Catch up with the state most peers hold (we are behind, or diverged), in the background:
        compute goes on meanwhile, and ``step`` applies what came between two batches. A peer at most
        ``replay_steps`` behind whose own state the trusted records vouch for fetches the missed steps'
        results (``state.replay``); otherwise, or when no peer serves them, it downloads the state.
        ``expected(epoch)``: the digest the peers this one trusts vouch for (see ``ProgressBoard``);
        ``donors(epoch)``: the peers that serve the trusted state of ``epoch`` or later, as the records
        read by now say (a replay that waits for a digest asks them again; ``view``'s by default);
        ``roots(epoch)``: where one step has several states (a swarm split into regions), every root the
        trusted peers name, any of which a download may take (see ``Fetcher.fetch``)."""
        nursery = self._nursery
        assert nursery is not None
        epoch = self.tally.epoch
        why = view.reason if view.behind else f"diverged from the majority on step {view.epoch}"
        log.info("catching up: %s", why)
        # DiLoCo, one step behind (this peer missed the last round): its local progress since the global
        # parameters it holds is carried onto the new ones, so the work rolls into the next round.
        carry = self.outer is not None and view.behind and view.newest == epoch + 1
        want = view.newest if view.behind else epoch
        near = view.behind and want - epoch <= self.replay_steps and self._replay_failed != epoch

        def asked() -> Sequence[PeerProgress]:  # (read again at each try of a replay)
            return (donors(want) if donors is not None else ()) or view.donors

        flight = self.download = Download(
            trio.Event(), epoch if carry else None, expected=expected, replaying=near, target=want
        )

        async def run() -> None:
            try:
                # Right after a download or a step, a large state is still being hashed: its digest
                # decides whether a replay may start from it (a 45M joiner, just landed one step behind,
                # downloaded again for want of it).
                start = await self.hashed_digest() if near else b""
                flight.replaying = near and start == expected(epoch)
                if flight.replaying:
                    try:
                        flight.outcome = await self.replayer.fetch(
                            asked,
                            first=epoch,
                            last=want,
                            start=start,
                            expected=expected,
                            layout=self.result_layout,
                            bound=self.results.scale(),
                            budget=self.state_bytes(),
                        )
                        return
                    except P2PError as e:
                        flight.replaying = False
                        log.info("no replay of steps %d-%d (%s): downloading the state", epoch, want - 1, e)
                if not self.carries_downloads:
                    flight.carry_from = None  # (the training loop waits for it: ``step``)
                if donors is not None:
                    nursery.start_soon(self._fetch_ahead, flight, want, expected, donors)
                flight.outcome = await self.fetcher.fetch(
                    view.donors, want_epoch=want, expected=expected, reuse=self.reuse, roots=roots
                )
            except P2PError as e:
                flight.outcome = e
            finally:
                flight.done.set()

        nursery.start_soon(run)

    async def _fetch_ahead(
        self,
        flight: Download,
        want: int,
        expected: Callable[[int], bytes],
        donors: Callable[[int], Sequence[PeerProgress]],
    ) -> None:
        """While step ``want``'s state downloads, fetch the results of the steps the swarm takes meanwhile
        (``ResultFetcher.prefetch``), so that the replay after the download applies them at once: a 45M
        joiner on 50 Mbit/s had the state after 61 s and the swarm's next step only 20 s later, its
        result fetched once the download was in (and by then the swarm had stepped again)."""
        while self.replay_steps:
            with trio.move_on_after(AHEAD_POLL):
                await flight.done.wait()
            if flight.done.is_set():
                return
            last = want
            while last - want < self.replay_steps and expected(last + 1):
                last += 1
            if last > want:
                await self.replayer.prefetch(
                    functools.partial(donors, last),
                    first=want,
                    last=last,
                    expected=expected,
                    layout=self.result_layout,
                    bound=self.results.scale(),
                    budget=self.state_bytes(),
                )

    async def reuse(self, partial: Partial) -> None:
        """Copy the chunks of a new download that this peer's own state holds (``download.fill_from``)."""
        live = self.live()
        if live.hashes is not None:
            await self.read_in_thread(fill_from, partial, live)

    # ---- step results: kept for others, replayed when behind ----

    def result_layout(self, epoch: int) -> tuple[range, int, torch.dtype]:
        """The parameters step ``epoch``'s result updates here, their element count and dtype."""
        slots = self.contribution.fragments[epoch % len(self.contribution.fragments)]
        count = sum(self.params[i].numel() for i in slots)
        dtype = self.params[slots.start].dtype if len(slots) else torch.float32
        return slots, count, dtype

    async def keep_result(self, epoch: int, values: list[torch.Tensor], *, buffered: bool = False) -> None:
        """Keep the result that takes step ``epoch``'s state to the next (the parameters of the step's
        fragment, in order), to serve it to peers that are behind; call it before the step applies it.

        ``buffered``: ``values`` are the views of the contribution's buffer, which nothing writes until
        the next pseudo-gradient (DiLoCo: the outer step only reads it). A large result is then kept in
        the background, beside the outer step and the compute that follows: keeping packs it into the
        round's form (an int8 round's: 4.8 s at 124M, about 45 min at 70B), which held the step back.
        The buffer counts as read meanwhile (``Contribution.reading``: the next pseudo-gradient goes into
        a new one if the keeping has not ended). One keeping runs at a time, and a step whose last
        keeping has not ended waits for it first: a keeping slower than a step would otherwise hold one
        more buffer the size of the step's result at every step."""
        if not self.results.keep_count:
            return
        slots, _, _ = self.result_layout(epoch)
        if len(values) != len(slots):
            return  # (not expected: a result for another fragment is not kept rather than kept wrong)
        keep = functools.partial(self.results.keep, epoch, slots, values, self._compact, packs=self._packs)
        if self.param_bytes < serve.THREAD_BYTES:
            keep()
        elif buffered and self._nursery is not None:
            await self._keeping.wait()
            done = self._keeping = trio.Event()
            self.contribution.reading(done)

            async def in_background() -> None:
                try:
                    await trio.to_thread.run_sync(keep)
                finally:
                    done.set()

            self._nursery.start_soon(in_background)
        else:
            await trio.to_thread.run_sync(keep)

    async def kept(self) -> None:
        """Wait until the results being kept in the background are kept (see :meth:`keep_result`)."""
        await self._keeping.wait()

    def _apply_result(self, got: Fetched) -> None:
        """Apply one replayed step's result, as the step's members applied it (blocking)."""
        self.tally.moved_to(got.epoch)
        self.contribution.fit(got.epoch)
        slot_params = [self.params[i] for i in got.slots]
        outer = self.outer
        buffer = self.contribution.unrelayed() if outer is not None else ParamBuffer(slot_params)
        off = 0
        with torch.no_grad():
            for view in buffer.views:
                view.copy_(got.values[off : off + view.numel()].view(view.shape))
                off += view.numel()
        if outer is not None:
            outer.step()
        else:
            assert self.local is not None
            self.local.apply(buffer)
        self.tally.moved_to(got.epoch + 1)

    async def _replayed(self, flight: Download, got: Fetched, before: bytes, digest: bytes) -> bool:
        """Judge one replayed step by ``digest``, the state's after ``got`` was applied from ``before``:
        True (the holders whose pieces differed are blamed, the result kept to serve peers further
        behind) when it is the trusted digest of the step it leads to; else its reference is blamed and
        the next catch-up downloads the state (False)."""
        trusted = flight.expected(got.epoch + 1) or got.after
        if digest != trusted:
            self.replayer.blamed.add(got.peer)
            self.fetcher.blamed.add(got.peer)
            log.warning(
                "step %d's result from %s does not lead to the state the trusted records name: %s is"
                " blamed, and the state is downloaded",
                got.epoch,
                got.peer.short(),
                got.peer.short(),
            )
            self._replay_failed = got.epoch + 1
            self.sync_retry_at = 0.0
            return False
        for liar in got.contradicted:  # their pieces differed from bytes now proven right
            self.replayer.blamed.add(liar)
            self.fetcher.blamed.add(liar)
            log.warning(
                "%s sent a piece of step %d's result that differs from the one the trusted records"
                " confirm: it is blamed",
                liar.short(),
                got.epoch,
            )
        self.replayed += 1
        self.replayed_bytes += got.size
        chain = (before, digest)  # verified: served on to peers further behind
        if self.param_bytes < serve.THREAD_BYTES:
            self.results.keep(got.epoch, got.slots, [got.values], self._compact, chain, self._packs)
        else:
            await trio.to_thread.run_sync(
                self.results.keep, got.epoch, got.slots, [got.values], self._compact, chain, self._packs
            )
        return True

    async def _replay(self, flight: Download, replay: Replay) -> bool:
        """Apply ``replay``'s results in order, each checked against the trusted digest of the step it
        leads to; True when at least one step was taken. A result the digest refutes leaves the state off
        the swarm's lineage: its sender is blamed, and the next catch-up downloads the state."""
        outer = self.outer
        first = self.tally.epoch
        if replay.first != first:
            return False  # (the state moved meanwhile: not expected, nothing to apply)
        local: list[torch.Tensor] = []
        # sync: only gradients computed on the state replayed from (not ones carried here already)
        carried = len(replay.results) == 1 and (
            flight.carry_from is not None
            if outer is not None
            else flight.keep_work and self._carried != first
        )
        if outer is not None and carried:
            local = [p - g for p, g in zip(self.params, outer.global_params, strict=True)]
        samples, since = self.tally.samples, self.tally.since
        applied = 0
        hashes: list[bytes] = []
        before = self.digest  # the chain so far (the replay began on this, vouched, digest)
        for got in replay.results:
            await self.off_loop(self._apply_result, got)
            live = self.live()
            if live.layout.size < serve.THREAD_BYTES:
                hashes = chunks.hash_chunks(live.layout, live.tensors, live.source)
            else:
                hashes = await self.read_in_thread(chunks.hash_chunks, live.layout, live.tensors, live.source)
            digest = chunks.root(live.epoch, live.layout, hashes)
            if not await self._replayed(flight, got, before, digest):
                hashes = []
                break
            applied += 1
            before = digest
        if outer is not None:
            with torch.no_grad():
                for i in range(len(self.params)):
                    outer.reset_local(i)
                if carried and applied:
                    for p, d in zip(self.params, local, strict=True):
                        p.add_(d)
        elif not (carried and applied):
            self.contribution.buffer.zero_()  # gradients of parameters this peer no longer holds
        self.tally.forget_cohort()  # no round of ours vouches for these steps
        if carried and applied:
            self.tally.carry(samples, since)
            self._carried = self.tally.epoch
        else:
            self.tally.counting_from(self.clock())
        if applied:
            self.stats.note_sync(self.tally.epoch, replay.results[0].peer.short())
            peers = sorted({p.short() for r in replay.results[:applied] for p in r.senders or (r.peer,)})
            log.info(
                "now on step %d: replayed %d step(s) from step %d (%.1f MB from %s in %.1f s)%s",
                self.tally.epoch,
                applied,
                first,
                sum(r.size for r in replay.results[:applied]) / 1e6,
                ", ".join(peers),
                replay.seconds,
                f"; {samples} samples of local progress carried into it" if carried and applied else "",
            )
        self._checked = hashes  # the digest just checked is the new state's: ``changed`` needs no hash
        return True

    async def land_download(self) -> bool:
        """Apply a background download or replay once it is in; True when the state was replaced (the
        caller then says the state changed)."""
        flight = self.download
        if flight is None or not flight.done.is_set() or self.holds:
            return False
        self.download = None
        got = flight.outcome
        if isinstance(got, Replay):
            await self.unheld()
            return await self._replay(flight, got)
        outer = self.outer
        try:
            if not isinstance(got, Downloaded):
                raise got or P2PError("the download ended without an outcome")
            local: list[torch.Tensor] = []
            if flight.carry_from is not None and outer is not None:
                local = [p - g for p, g in zip(self.params, outer.global_params, strict=True)]
                outer.release()
            samples, counting_since = self.tally.samples, self.tally.since
            self.restore(got.tensors, got.metadata, epoch=got.epoch, owned=True)
            self.tally.forget_cohort()  # a download: no round of ours vouches for this state
        except P2PError as e:
            log.warning("could not catch up (%s); retrying in %.0f s", e, RETRY_SYNC)
            self.sync_retry_at = self.clock() + RETRY_SYNC
            return False
        self.downloads += 1
        self._replay_failed = -1
        self._checked = self._verified_hashes(got)
        carried = flight.carry_from is not None and self.tally.epoch == flight.carry_from + 1
        if carried:
            with torch.no_grad():
                for p, d in zip(self.params, local, strict=True):
                    p.add_(d)
            self.tally.carry(samples, counting_since)
        donor = got.donors[0].short() if got.donors else "this peer's own chunks"
        self.stats.note_sync(self.tally.epoch, donor)
        log.info(
            "now on step %d (state from %s)%s",
            self.tally.epoch,
            donor,
            f"; {self.tally.samples} samples of local progress carried into it" if carried else "",
        )
        return True

    def _verified_hashes(self, got: Downloaded) -> list[bytes]:
        """The chunk hashes of the state just restored from ``got``, when they are the download's: the
        download checked every chunk against them and its root against the trusted records, so the new
        state needs no hashing before its digest is known (a replay waits for that digest: after a 45M
        download, a second of hashing on a busy machine). Empty (hash it) unless the restored state has
        the download's very layout and makes its root."""
        if got.layout is None or not got.hashes:
            return []
        live = self.live()
        if live.layout.header != got.layout.header:
            return []
        hashes = list(got.hashes)
        return hashes if chunks.root(live.epoch, live.layout, hashes) == got.root else []

    def _on_download_progress(self, got: int, total: int) -> None:
        self.download_progress = (got, total)
        if self._on_progress is not None:
            self._on_progress(got, total)
