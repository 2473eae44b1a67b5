"""A node's training loop for a ``[pipeline]`` run: what ``p2ptrain node --config RUN.toml`` runs.

Theory of operation: a :class:`PipelineTrainer` wraps a :class:`~.peer.PipelinePeer` around a running
node and drives it step after step with the task's data (micro-batches of ``pipeline.micro_batch``
windows, ``training.batch_size`` samples per step and peer), until ``max_steps``, ``duration`` or a
stop request, writing a status section and one metrics line per step (what ``p2ptrain simulate``
shows). Which stage this peer serves is decided in :meth:`PipelineTrainer.take_stage`:

- **a swarm that starts together** (``--wait-peers N``, what ``simulate`` uses): every peer announces
  itself as joining (a directory record with ``joining`` set: it serves nothing yet) and waits until
  N peers are in the directory; then, while no peer has taken a step, the peers sorted by id take the
  stages in turn (rank modulo the number of stages): a pure function of the set, so peers that read
  the same set agree without talking, and every stage gets a peer when N >= stages. (No throughput is
  measured before the first step; peers measured slow move later: see ``rebalance``.)
- **a peer joining a running swarm** takes the stage that limits the swarm's throughput
  (``directory.choose_stage``) and downloads that stage's state from its peers (``transfer``: weights,
  optimizer state and step, verified per chunk) before it serves.

After every step the peer checks that it is still on its stage's lineage (``transfer.behind``): a
stage-mate on a later step, or a majority of its mates on the same step with other weights, means this
peer fell out (it was slow, or its own average aborted while theirs did not); it downloads the stage's
state again instead of training a second lineage of the stage's weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from ..errors import ConfigError, P2PError
from ..tasks.gpt import GPT, GPTConfig
from .catchup import behind, download_state
from .directory import choose_stage, plan_move
from .peer import PipelinePeer, StepReport
from .transfer import (
    Snapshot,
    StateUnavailable,
    load_checkpoint,
    save_checkpoint,
    state_size,
)

if TYPE_CHECKING:
    from ..config import RunConfig
    from ..node import Node
    from ..tasks import Task

log = logging.getLogger(__name__)

LOSS_SMOOTHING = 0.9
WAIT_POLL = 0.5  # seconds between directory reads while waiting for the swarm to start
RATE_WINDOW = 8  # steps the samples-per-second figures are measured over
SETTLE_STEPS = 3  # steps after a move before this peer moves again
EMPTY_SAY_EVERY = 30.0  # seconds between the warnings while the swarm waits for an empty stage


@dataclass(frozen=True)
class PipelineOptions:
    max_steps: int | None = None  # overrides training.max_steps
    duration: float = 0.0  # seconds; 0: no limit
    slowdown: float = 1.0  # this peer's stage computes this many times slower (an emulated slow device)
    metrics_file: Path | None = None
    wait_peers: int = 1
    wait_timeout: float = 300.0
    interval: float = 2.0  # seconds between directory refreshes
    refill_after: float = 120.0  # seconds a stage stays empty before a spare peer moves in afresh
    data_dir: Path | None = None  # this peer's stage checkpoint goes to data_dir/pipeline/stage.ckpt


def model_config(task: Task) -> GPTConfig:
    """The GPT a pipeline run splits: the task's model must be the built-in GPT (``tiny-gpt``)."""
    model = task.model()
    if not isinstance(model, GPT):
        raise ConfigError(
            f"[pipeline] splits the built-in GPT by layer; task {task.name!r} builds a"
            f" {type(model).__name__}, which a pipeline cannot split"
        )
    return model.config


def assign_at_start(ids: list[bytes], me: bytes, num_stages: int) -> int:
    """A swarm that starts together: the stage of peer ``me`` among ``ids`` (every peer's id, ``me``
    included), the same on every peer that read the same set (see the module docstring)."""
    ranked = sorted(set(ids))
    return ranked.index(me) % num_stages


class PipelineTrainer:
    """Trains one stage of a pipeline run with the swarm; see the module docstring."""

    def __init__(
        self,
        node: Node,
        config: RunConfig,
        task: Task,
        options: PipelineOptions | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not config.pipeline.enabled:
            raise ConfigError("this run file has no [pipeline] section")
        self.node, self.config, self.task = node, config, task
        self.options = options or PipelineOptions()
        if not (math.isfinite(self.options.slowdown) and self.options.slowdown >= 1):
            raise ValueError("slowdown must be at least 1")
        self.clock = clock
        self.pipeline = config.pipeline
        self.model = model_config(task)
        self.pipeline.bounds(self.model.n_layer)  # (a ConfigError now, not at the first step)
        self.per_step = max(1, config.training.batch_size // self.pipeline.micro_batch)
        self.peer = PipelinePeer(
            node,
            self.pipeline,
            self.model,
            seed=config.run.seed,
            lr=config.training.lr,
            interval=self.options.interval,
            slowdown=self.options.slowdown,
            diloco=config.diloco if config.training.mode == "diloco" else None,
            local_steps=self.pipeline.local_steps,
        )
        self.max_steps = self.options.max_steps if self.options.max_steps is not None else 0
        self.max_steps = self.max_steps or config.training.max_steps
        self.loss: float | None = None
        self.started = 0.0
        self.finished = False
        self.resyncs = 0
        self.moves = 0
        self._settled = SETTLE_STEPS  # no move for throughput before this step (speeds are measured)
        self._empty_since: dict[int, float] = {}  # stage -> when this peer first saw it empty
        self.last: StepReport | None = None
        self._stop_requested = False
        self._times: list[tuple[float, int, float]] = []  # (when, samples sent here, samples in the swarm)
        self.rounds = {"averaged": 0, "alone": 0, "aborted": 0, "synced": 0}
        self.waiting: list[int] = []  # the empty stages this peer is waiting for (none: it trains)
        data = self.options.data_dir
        self.checkpoint = data / "pipeline" / "stage.ckpt" if data is not None else None
        self.node.status_sections["training"] = self.status
        self.node.status_sections["pipeline"] = self.pipeline_status

    # ---- stopping (what the command's signal handler calls) ----

    @property
    def stopping(self) -> bool:
        return self._stop_requested

    def request_stop(self) -> None:
        """Stop after the step in progress (its micro-batches and its stage average)."""
        self._stop_requested = True

    @property
    def drain_timeout(self) -> float:
        """The longest a step's end may take: the callers' done wait and the stage's average."""
        return 2 * self.pipeline.timeout + max(30.0, 3 * self.pipeline.timeout)

    @property
    def step(self) -> int:
        return self.peer.step_number

    def _done(self) -> bool:
        if self._stop_requested:
            return True
        if self.max_steps and self.peer.step_number >= self.max_steps:
            return True
        return bool(self.options.duration) and self.clock() - self.started >= self.options.duration

    def _data_seed(self) -> int:
        """Different data on every peer, the same for a peer across restarts."""
        h = hashlib.blake2b(self.node.peer_id.digest + str(self.config.run.seed).encode(), digest_size=8)
        return int.from_bytes(h.digest(), "little") & (2**62 - 1)

    # ---- the run ----

    async def take_stage(self) -> None:
        """Choose this peer's stage and serve it (see the module docstring)."""
        peer, me = self.peer, self.node.peer_id
        peer.announcing = True
        await peer.warm_up()
        if self.options.wait_peers > 1:
            log.info("waiting for %d pipeline peers to start together", self.options.wait_peers)
        with trio.move_on_after(self.options.wait_timeout) as waited:
            while True:
                await peer.refresh()
                serving = [p for p in peer.directory if not p.record.joining]
                if any(p.record.step > 0 for p in serving):
                    break  # a running swarm: join it
                if len(peer.directory) >= self.options.wait_peers:
                    break
                await trio.sleep(WAIT_POLL)
        if waited.cancelled_caught:
            log.warning(
                "only %d of %d pipeline peers appeared within %.0f s: starting with those",
                len(peer.directory),
                self.options.wait_peers,
                self.options.wait_timeout,
            )
        serving = [p for p in peer.directory if not p.record.joining]
        if not any(p.record.step > 0 for p in serving):
            ids = [p.peer.digest for p in peer.directory] + [me.digest]
            stage = assign_at_start(ids, me.digest, self.pipeline.num_stages)
            peer.why = f"stage {stage}: the swarm starts together (peer {sorted(set(ids)).index(me.digest)})"
            log.info("serving %s", peer.why)
            await peer.join(stage)
            await self._wait_for_every_stage()
            return
        saved = load_checkpoint(self.checkpoint) if self.checkpoint is not None else None
        if saved is not None:  # a restart: back to the stage it served (from its peers, or its own disk)
            stage, why = saved[0], f"stage {saved[0]}, the one this peer served before it restarted"
            if not 0 <= stage < self.pipeline.num_stages:
                saved, (stage, why) = (
                    None,
                    choose_stage(serving, self.pipeline.num_stages, me=me, link_bytes=peer.link_bytes),
                )
        else:
            stage, why = choose_stage(serving, self.pipeline.num_stages, me=me, link_bytes=peer.link_bytes)
        peer.why = why
        log.info("joining a running swarm: serving %s", why)
        await self._download_and_join(stage, saved[1] if saved is not None and saved[0] == stage else None)

    def _state_size(self, stage: int) -> int:
        peer = self.peer
        if peer.server is not None and peer.server.index == stage:
            return state_size(peer.server.params)
        return state_size([p for p in peer.prepare(stage).parameters() if p.requires_grad])

    async def _download_and_join(
        self, stage: int, saved: Snapshot | None = None, *, fresh: bool = True
    ) -> None:
        """Serve ``stage`` with its state downloaded from its peers (``transfer``), asking again while
        the download fails and the stage has peers; with none, a peer already serving it keeps its
        weights, one that kept a checkpoint of it (``saved``) restores that, and a newcomer starts it
        from the run's initial weights; each said out loud."""
        peer, me = self.peer, self.node.peer_id
        size = self._state_size(stage)
        while not self._stop_requested:
            try:
                snapshot = await download_state(peer, stage, size)
            except StateUnavailable as e:
                if not [c for c in peer.candidates(stage) if c.peer != me]:
                    if peer.server is not None and peer.server.index == stage:
                        log.warning("stage %d: no other peer to download its state from: keeping ours", stage)
                        return
                    if peer.server is not None and not fresh:
                        log.warning("stage %d has no peer to download its state from: not moving", stage)
                        return
                    if saved is None:
                        saved = self._kept(stage)
                    if saved is not None:
                        now = max((p.record.step for p in peer.directory), default=saved.step)
                        log.warning(
                            "stage %d has no peer to download its state from: restoring this peer's"
                            " checkpoint of step %d (the swarm is on step %d)",
                            stage,
                            saved.step,
                            now,
                        )
                        await peer.join(stage, dataclasses.replace(saved, step=max(now, saved.step)))
                        return
                    log.warning(
                        "stage %d has no peer to download its state from (%s): it starts from the run's"
                        " initial weights, its training so far is lost",
                        stage,
                        e,
                    )
                    await peer.join(stage)
                    return
                log.warning("stage %d's state: %s; asking again", stage, e)
                await trio.sleep(WAIT_POLL)
                await peer.refresh()
                continue
            await peer.join(stage, snapshot)
            return

    async def _wait_for_every_stage(self) -> None:
        """Before the first step: until every stage has a peer and every peer the swarm waits for serves
        its stage in this peer's directory (or the wait times out). A peer that started with a part of
        the directory would end its first step without the callers it did not see, and close the step
        on them."""
        with trio.move_on_after(self.options.wait_timeout) as waited:
            while True:
                await self.peer.refresh()
                serving = [p for p in self.peer.directory if not p.record.joining]
                if not self.peer.empty_stages and len(serving) >= self.options.wait_peers:
                    return
                await trio.sleep(WAIT_POLL)
        if waited.cancelled_caught:
            log.warning(
                "starting with %d serving peer(s) of the %d waited for", len(serving), self.options.wait_peers
            )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        peer = self.peer
        try:
            await self.take_stage()
            task_status.started()
            if self.peer.server is None:  # stopped before it served (a signal during its download)
                return
            async with trio.open_nursery() as nursery:
                nursery.start_soon(peer.keep_fresh)
                await self._loop()
                nursery.cancel_scope.cancel()
            with trio.move_on_after(self.pipeline.timeout):
                await peer.leave()
        finally:  # no await here: this runs even when cancelled
            self.finished = True
            self._save_checkpoint(now=True)
            self._write_metrics({"event": "stopped", **self.status()})

    async def _loop(self) -> None:
        peer = self.peer
        batches: Iterator[Any] = self.task.batches(self._data_seed(), self.pipeline.micro_batch)
        self.started = self.clock()
        log.info(
            "training stage %d of %d (layers %s) of %s from step %d, %d micro-batches of %d per step",
            peer.stage.index,
            self.pipeline.num_stages,
            self.pipeline.bounds(self.model.n_layer)[peer.stage.index],
            self.task.name,
            peer.step_number,
            self.per_step,
            self.pipeline.micro_batch,
        )
        while not self._done():
            if peer.empty_stages:  # no micro-batch can pass: wait for the stage, do not burn steps
                await self._wait_for_empty_stages()
                continue
            micro = [await trio.to_thread.run_sync(next, batches) for _ in range(self.per_step)]
            report = await peer.step(micro)
            self._account(report)
            self._save_checkpoint()
            if await self._maybe_move():
                continue
            if behind(peer):
                self.resyncs += 1
                self.rounds["synced"] += 1
                log.warning(
                    "stage %d's other peers hold other weights or a later step: downloading the stage's"
                    " state again",
                    peer.stage.index,
                )
                await self._download_and_join(peer.stage.index)

    async def _wait_for_empty_stages(self) -> None:
        """While a stage has no peer, no micro-batch passes: rather than run steps that give every one
        of them up (and count steps nobody trained), this peer waits on its step, its stage server open,
        saying so every ``EMPTY_SAY_EVERY`` seconds, until the stage is served again (its restarted
        peers come back, a joiner takes it, or after ``refill_after`` a spare peer moves in:
        :meth:`_maybe_move`, checked every interval)."""
        peer = self.peer
        said = -math.inf
        while peer.empty_stages and not self._done():
            now = self.clock()
            if now - said >= EMPTY_SAY_EVERY:
                said = now
                log.warning(
                    "waiting on step %d: no peer serves stage %s, so no micro-batch can pass (its peers"
                    " come back with its state, a joiner takes it first, or a spare peer moves in after"
                    " %.0f s)",
                    peer.step_number,
                    ", ".join(map(str, peer.empty_stages)),
                    self.options.refill_after,
                )
            self.waiting = list(peer.empty_stages)
            await trio.sleep(self.options.interval)
            if await self._maybe_move():
                break
        self.waiting = []

    async def _maybe_move(self) -> bool:
        """After a step: move to another stage if ``plan_move`` says so and the swarm is in a state to
        judge. A stage no peer serves is refilled only once it has been empty for ``refill_after``
        seconds (its restarting peers come back with its state meanwhile: a spare peer has none); a
        move for throughput only in a settled swarm (every stage served, nobody joining, every peer on
        this step, this peer's last move ``SETTLE_STEPS`` ago), and only with the new stage's state
        downloaded (else it stays). Also catches up with the swarm's step (see ``catch_up``)."""
        peer = self.peer
        now = self.clock()
        for s in list(self._empty_since):
            if s not in peer.empty_stages:
                del self._empty_since[s]
        for s in peer.empty_stages:
            self._empty_since.setdefault(s, now)
        self.catch_up()
        move = plan_move(peer.directory, self.node.peer_id, self.pipeline.num_stages, peer.link_bytes)
        if move is None:
            return False
        stage, why = move
        if peer.empty_stages:
            waited = now - self._empty_since.get(stage, now)
            if stage not in peer.empty_stages or waited < self.options.refill_after:
                return False
        else:
            records = [p.record for p in peer.directory]
            settled = all(not r.joining and r.step == peer.step_number for r in records)
            if not settled or peer.step_number < self._settled:
                return False
        self._settled = peer.step_number + SETTLE_STEPS
        log.warning("moving from stage %d to stage %d: %s", peer.stage.index, stage, why)
        self._keep(peer.stage.index)
        self.moves += 1
        peer.why = why
        await self._download_and_join(stage, fresh=bool(peer.empty_stages))
        return True

    def catch_up(self) -> None:
        """A peer whose step is behind the swarm's (the median of the serving peers' steps: one claim
        cannot drag the swarm) and whose stage-mates cannot hand it a later state (it is its stage's
        only peer, or they are behind too) jumps to the swarm's step with the weights it holds: its
        calls of an old step would be refused everywhere, and everyone's calls to it would wait."""
        peer = self.peer
        if peer.server is None:
            return
        steps = sorted(p.record.step for p in peer.directory if not p.record.joining)
        if not steps:
            return
        swarm = steps[len(steps) // 2]
        me = self.node.peer_id
        mates_ahead = any(
            p.record.step > peer.step_number
            for p in peer.directory
            if p.peer != me and not p.record.joining and p.record.stage == peer.server.index
        )
        if swarm > peer.step_number and not mates_ahead:
            log.warning("the swarm is on step %d, this peer on %d: catching up", swarm, peer.step_number)
            peer.server.close_step()
            peer.step_number = swarm
            peer.server.open_step(swarm)
            self.rounds["synced"] += 1

    def _kept_path(self, stage: int) -> Path | None:
        return self.checkpoint.with_name(f"stage-{stage}.ckpt") if self.checkpoint is not None else None

    def _keep(self, stage: int) -> None:
        """Before a move: this peer's state of the stage it leaves, kept on its disk (``stage-N.ckpt``):
        if that stage later loses every peer and this one refills it, it restores that instead of
        starting the stage from the run's initial weights."""
        path, peer = self._kept_path(stage), self.peer
        if path is None or peer.server is None or peer.optimizer is None:
            return
        try:
            save_checkpoint(path, stage, peer.state_snapshot())
        except (OSError, ValueError) as e:
            log.warning("cannot keep stage %d's state in %s: %s", stage, path, e)

    def _kept(self, stage: int) -> Snapshot | None:
        """This peer's kept state of ``stage`` (see :meth:`_keep`), if it has one."""
        path = self._kept_path(stage)
        saved = load_checkpoint(path) if path is not None else None
        return saved[1] if saved is not None and saved[0] == stage else None

    def _save_checkpoint(self, *, now: bool = False) -> None:
        """This peer's stage state on its disk every ``checkpoint.every_steps`` steps (and at a stop)."""
        peer, every = self.peer, self.config.checkpoint.every_steps
        if self.checkpoint is None or peer.server is None or peer.optimizer is None:
            return
        if not now and not (every and peer.step_number % every == 0):
            return
        try:
            snap = peer.state_snapshot()
            save_checkpoint(self.checkpoint, peer.server.index, snap)
        except (OSError, ValueError) as e:
            log.warning("cannot write the stage checkpoint %s: %s", self.checkpoint, e)

    def _account(self, r: StepReport) -> None:
        if r.losses:
            loss = sum(r.losses) / len(r.losses)
            smooth = LOSS_SMOOTHING
            self.loss = loss if self.loss is None else smooth * self.loss + (1 - smooth) * loss
        if r.average.applied:
            self.rounds["averaged" if r.average.members > 1 else "alone"] += 1
        else:
            self.rounds["aborted"] += 1
        sent = (r.micro_batches - r.given_up) * self.pipeline.micro_batch
        swarm = r.average.samples if r.average.applied else 0.0
        self._times = [*self._times[-RATE_WINDOW:], (self.clock(), sent, swarm)]
        self.last = r
        status = self.status()
        self._write_metrics(status)
        log.info(
            "step %d: stage %d, loss %s, %d micro-batches (%d given up, %d retries), %.1f samples/s here,"
            " %.1f in the swarm, queue %d, stage throughput %.1f samples/s",
            r.step,
            r.stage,
            "-" if self.loss is None else f"{self.loss:.4f}",
            r.micro_batches,
            r.given_up,
            r.retries,
            status["samples_per_s"],
            status["swarm_samples_per_s"],
            r.queue,
            r.throughput,
        )

    def _rates(self) -> tuple[float, float]:
        t = self._times
        if len(t) < 2 or t[-1][0] <= t[0][0]:
            return 0.0, 0.0
        span = t[-1][0] - t[0][0]
        return sum(x[1] for x in t[1:]) / span, sum(x[2] for x in t[1:]) / span

    # ---- what the status file, the live view and the metrics say ----

    def status(self) -> dict[str, Any]:
        here, swarm = self._rates()
        sent, received = self.node.host.traffic()
        server = self.peer.server
        stage = server.index if server is not None else None
        return {
            "time": self.clock(),
            "task": self.task.name,
            "mode": "pipeline",
            "step": self.peer.step_number,
            "loss": self.loss,
            "val_loss": None,  # (a validation pass needs every stage: not run by a pipeline peer)
            "samples_per_s": here,
            "swarm_samples_per_s": swarm,
            "swarm_peers": len([p for p in self.peer.directory if not p.record.joining]) or 1,
            "stage": stage,
            "queue": server.queue if server is not None else 0,
            "throughput": self.peer.throughput(),
            "rounds": dict(self.rounds),
            # the stage's weights: equal on every peer of the same stage after every step
            "digest": self.peer.weights_digest()[:16] if server is not None else "",
            "bytes_sent": sent,
            "bytes_received": received,
            "finished": self.finished,
        }

    def pipeline_status(self) -> dict[str, Any]:
        peer, router = self.peer, self.peer.router
        per_stage: list[dict[str, Any]] = []
        for s in range(self.pipeline.num_stages):
            cands = peer.candidates(s)
            per_stage.append(
                {
                    "peers": len(cands),
                    "throughput": round(sum(c.throughput for c in cands), 2),
                    "queue": sum(c.queue for c in cands),
                }
            )
        last = self.last
        return {
            "stage": peer.server.index if peer.server is not None else None,
            "stages": self.pipeline.num_stages,
            "why": peer.why,
            "per_stage": per_stage,
            "empty_stages": list(peer.empty_stages),
            "waiting_for_stages": list(self.waiting),
            "micro_batches": router.stats.micro_batches if router else 0,
            "given_up": router.stats.given_up if router else 0,
            "retries": router.stats.retries if router else 0,
            "checks": router.stats.checks if router else 0,
            "mismatches": router.stats.mismatches if router else 0,
            "dropped_peers": {p.short(): why for p, why in (router.stats.bans.items() if router else [])},
            "bytes_per_micro_batch": (
                round((last.bytes_sent + last.bytes_received) / max(1, last.micro_batches))
                if last is not None
                else 0
            ),
            "resyncs": self.resyncs,
            "moves": self.moves,
            "downloads": peer.downloads,
        }

    def _write_metrics(self, line: dict[str, Any]) -> None:
        path = self.options.metrics_file
        if path is None:
            return
        import json

        try:
            with open(path, "a") as f:
                f.write(json.dumps({**line, "pipeline": self.pipeline_status()}) + "\n")
        except (OSError, P2PError) as e:
            log.warning("cannot write metrics to %s: %s", path, e)
