"""The training loop a node runs: a task's model and data, a CollaborativeOptimizer, metrics, checkpoints.

Theory of operation: ``Trainer.run`` builds the task's model from the run's seed (every peer starts from
the same weights), resumes from the newest checkpoint when asked, then loops: draw a batch, compute the
loss and gradients in a worker thread (so the node keeps serving the network meanwhile), hand the sample
count to the optimizer, which decides when the swarm steps. After every global step it evaluates (every
``eval.every_steps``), checkpoints (every ``checkpoint.every_steps``) and appends one JSON line of metrics.
It stops at ``max_steps`` global steps, after ``duration`` seconds, or when cancelled, and then writes a
final checkpoint and a summary line. Stopped before ``max_steps`` (``request_stop``, SIGTERM; or
``duration``), it drains first: the averaging round it takes part in (a group forming or formed, a round
running in the background) finishes on every member and is applied here, within ``drain_timeout``, so
the last checkpoint holds the state after it and the group loses neither the round nor its coordinator.

``slowdown`` (>= 1) makes this peer's compute that many times slower than this machine at its best (the
quickest batch seen), by idling after each batch for the difference: the simulations use it to emulate
GPUs of different speeds on one machine. Measured against the best batch rather than the last one, the
emulated speed does not also drop when the peers contend for the same cores (the idling absorbs it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import trio

from ...averaging.averager import MAX_PARTNERS
from ...averaging.grouping import JOIN_GRACE
from ...config import RunConfig
from ...identity import PeerID
from ...node import Node
from ...tasks import Task
from ..optimizer.collaborative import CollaborativeOptimizer, Parts
from ..state import checkpoint
from .data_swarm import reading_for
from .trackers import Tracker, open_tracker, scalars

log = logging.getLogger(__name__)

LOSS_SMOOTHING = 0.9
DIGEST_WAIT = 60.0  # seconds a stopping peer waits for its last state's digest (large ones hash in a thread)


class LocalWorkers(Protocol):
    """This host's other data-parallel workers (several GPUs, one p2p identity), as the training loop
    sees them. Both methods run in the compute thread and block until the workers answered; a worker
    that fails is the implementation's business (it restarts its group and carries on)."""

    def backward(
        self, model: torch.nn.Module, compute: Callable[[Any], float], batch: Any
    ) -> tuple[float, int]:
        """Compute this worker's batch with ``compute`` (forward and backward), with the other workers
        doing theirs; leave in ``model``'s gradients the sample-weighted mean over all of them; return
        the mean loss and the total samples."""
        ...

    def start(self, model: torch.nn.Module, data_seed: int) -> bool:
        """Start the workers from ``model``'s parameters (they draw data from seeds derived from
        ``data_seed``); True once they are up."""
        ...

    def status(self) -> dict[str, Any]: ...

    def publish(self, model: torch.nn.Module, changed: bool, stop: bool) -> None:
        """After the optimizer's step: give the workers the parameters if ``changed``; tell them to stop
        if ``stop``."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class TrainerOptions:
    """How one node runs the run's training (the run file says what is trained; this says where, how long)."""

    device: str = "cpu"
    data_dir: Path | None = None  # checkpoints go to data_dir/checkpoints
    resume: bool = False
    max_steps: int | None = None  # overrides training.max_steps
    duration: float = 0.0  # seconds; 0: no limit
    slowdown: float = 1.0
    metrics_file: Path | None = None
    wait_peers: int = 1  # wait until this many peers (this one included) are in the run
    wait_timeout: float = 120.0
    tracker: str | None = None  # "tensorboard" or "mlflow": the per-step metrics go there too
    local: LocalWorkers | None = None  # this host's other data-parallel workers, if it has several
    # called with the bytes received and expected as a state download goes on (a progress bar, a log)
    on_download_progress: Callable[[int, int], None] | None = None


@dataclass(frozen=True)
class TrainerParts:
    """What a ``Trainer`` trains, built by its caller: the model, its (inner) optimizer, and what the
    collaborative optimizer builds its model-sized state from when the model is not held whole
    (``collaborative.Parts``; None: the usual parts)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    optimizer_parts: Parts | None = None


def default_optimizer(model: torch.nn.Module, config: RunConfig) -> torch.optim.AdamW:
    """The run's AdamW over ``model``'s trainable parameters (every peer's, sharded or not): weight decay
    on matrices only."""
    t = config.training
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.lr,
        betas=(0.9, 0.95),
    )


class Trainer:
    """Trains the task's model with the swarm; see the module docstring."""

    def __init__(
        self,
        node: Node,
        config: RunConfig,
        task: Task,
        options: TrainerOptions | None = None,
        *,
        clock: Callable[[], float] = time.time,
        parts: TrainerParts | None = None,
    ) -> None:
        """``parts``: the model and optimizer to train, from a caller that builds them its own way (a
        sharded site: ``training.site.node``); None: the task's model, built whole from the run's seed,
        and the run's AdamW (:func:`default_optimizer`)."""
        self.node, self.config, self.task = node, config, task
        self.options = options or TrainerOptions()
        if not (math.isfinite(self.options.slowdown) and self.options.slowdown >= 1):
            raise ValueError("slowdown must be at least 1")
        self.clock = clock
        self.device = torch.device(self.options.device)
        t = config.training
        if parts is None:
            if t.threads:
                torch.set_num_threads(t.threads)
            torch.manual_seed(config.run.seed)  # every peer builds the same initial weights
            model = task.model().to(self.device)
            parts = TrainerParts(model, default_optimizer(model, config))
        self._take(parts)
        self.max_steps = t.max_steps if self.options.max_steps is None else self.options.max_steps
        self.loss: float | None = None  # smoothed training loss
        self.val_loss: float | None = None
        self.compute_seconds = 0.0
        self.started = 0.0
        self.local_samples = 0
        self.finished = False
        self._fastest = math.inf  # the quickest batch so far: this machine's speed without contention
        self._stop_requested = False
        self.tracker: Tracker | None = None
        self.node.status_sections["training"] = self.status

    def _take(self, parts: TrainerParts) -> None:
        """Train ``parts``: its model and optimizer, and a collaborative optimizer built over them (with
        its ``optimizer_parts`` where the model is not held whole). A sharded site calls it again with
        the parts of its group's next generation (``training.site``)."""
        self.model, self.optimizer = parts.model, parts.optimizer
        # Sync mode on one worker: each backward adds samples x its mean gradient straight into the
        # swarm's accumulator (the parameters' .grad), no separate gradient tensor. (Local workers hand
        # over their mean gradient instead.)
        self.summed = self.config.training.mode == "sync" and self.options.local is None
        self.opt = CollaborativeOptimizer(
            self.node,
            self.model,
            self.optimizer,
            self.config,
            clock=self.clock,
            summed_grads=self.summed,
            on_download_progress=self.options.on_download_progress,
            parts=parts.optimizer_parts,
        )

    @property
    def checkpoints(self) -> Path | None:
        return self.options.data_dir / "checkpoints" if self.options.data_dir else None

    def _data_seed(self) -> int:
        """Different data on every peer, the same for a peer across restarts."""
        h = hashlib.blake2b(self.node.peer_id.digest + str(self.config.run.seed).encode(), digest_size=8)
        return int.from_bytes(h.digest(), "little") & (2**62 - 1)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if self.options.resume:
            self.resume()
        batches = self.task.batches(self._data_seed(), self.config.training.batch_size)
        folder = self.options.data_dir or Path.cwd()
        params = {"task": self.task.name, "mode": self.config.training.mode, "peer": str(self.node.peer_id)}
        self.tracker = open_tracker(
            self.options.tracker, folder, f"{self.config.run.id}-{self.node.peer_id.short()}", params
        )
        try:
            await self._session(batches, task_status)
        finally:  # no await here: this runs even when cancelled
            self.finished = True
            self.save_checkpoint()
            self._write_metrics({"event": "stopped", **self.status()})
            if self.tracker is not None:
                self.tracker.close()
            if self.options.local is not None:
                self.options.local.close()

    async def _session(self, batches: Iterator[Any], task_status: trio.TaskStatus[None]) -> None:
        """The collaborative optimizer's tasks and the training loop, to the end of training (then the
        drain, the last digest, leaving the swarm's records)."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.opt.run)
            task_status.started()
            if self.options.local is not None:  # after a resume: the workers start from its weights
                await trio.to_thread.run_sync(self.options.local.start, self.model, self._data_seed())
            if self.options.wait_peers > 1:
                log.info("waiting for %d peers to start together", self.options.wait_peers)
                seen = await self.opt.wait_for_peers(self.options.wait_peers, self.options.wait_timeout)
                log.info("%d peer(s) in the run: starting", seen)
            with reading_for(self.node, self.options.data_dir, self.opt.trusted):
                await self._loop(batches)
            await self._drain()
            # The last step's digest, hashed in a thread for a large state: the final metrics line
            # names it (it was "" there, and `simulate` took the peers for diverged).
            with trio.move_on_after(DIGEST_WAIT):
                await self.opt.hashed_digest()
            await self.opt.leave()
            nursery.cancel_scope.cancel()

    async def _loop(self, batches: Iterator[Any]) -> None:
        self.started = self.clock()
        log.info(
            "training %s (%s mode) from step %d, %s",
            self.task.name,
            self.config.training.mode,
            self.opt.epoch,
            ", ".join(f"{k}={v}" for k, v in self.task.info.items()),
        )
        local = self.options.local
        while not self._done():
            # in a thread: a slow dataset (or one whose shards are claimed in the DHT, see
            # ``integrations.data``) does not hold up the node's event loop meanwhile
            batch = await trio.to_thread.run_sync(next, batches)
            began = time.perf_counter()
            if local is None:
                samples = self.task.samples(batch)
                loss = await trio.to_thread.run_sync(self._compute, batch, samples if self.summed else 1)
            else:  # this host's other workers computed too; the gradients are their sample-weighted mean
                loss, samples = await trio.to_thread.run_sync(
                    local.backward, self.model, self._compute, batch
                )
            spent = time.perf_counter() - began
            if self.options.slowdown > 1:  # a device ``slowdown`` times slower than this one at its best
                self._fastest = min(self._fastest, spent)
                emulated = max(spent, self._fastest * self.options.slowdown)
                await trio.sleep(emulated - spent)
                spent = emulated
            self.compute_seconds += spent
            self.local_samples += samples
            self.loss = (
                loss if self.loss is None else LOSS_SMOOTHING * self.loss + (1 - LOSS_SMOOTHING) * loss
            )
            stepped = await self.opt.step(samples)
            self.node.report_throughput(self.opt.rate.rate)  # what the peer list says (samples/s here)
            if local is not None:  # the workers compute the next batches on the parameters as they are now
                changed = stepped or self.opt.diloco
                await trio.to_thread.run_sync(local.publish, self.model, changed, self._done())
            if stepped:
                await self._after_step()

    @property
    def drain_timeout(self) -> float:
        """The longest a drain waits for its round: a group being formed forms or gives up within the
        matchmaking time and the joiners' grace, and a round ends within the averaging timeout."""
        a = self.config.averaging
        return a.matchmaking_time + JOIN_GRACE + a.timeout

    async def _drain(self) -> None:
        """Stopping early: let the round in progress finish (see ``CollaborativeOptimizer.drain``); if
        it took a step, that step is logged and counted like any other. At ``max_steps`` a round for the
        next step is none of this peer's business."""
        if self.max_steps and self.opt.epoch >= self.max_steps:
            return
        epoch = self.opt.epoch
        await self.opt.drain(self.drain_timeout)
        if self.opt.epoch != epoch:
            await self._after_step()

    @property
    def stopping(self) -> bool:
        return self._stop_requested

    def request_stop(self) -> None:
        """Stop after the batch (and the averaging round) in progress: a drain, not a cut."""
        self._stop_requested = True

    def _done(self) -> bool:
        if self._stop_requested:
            return True
        if self.max_steps and self.opt.epoch >= self.max_steps:
            return True
        return bool(self.options.duration) and self.clock() - self.started >= self.options.duration

    def _compute(self, batch: Any, scale: int = 1) -> float:
        """Forward and backward over ``batch``; the gradient is the mean loss's, times ``scale``."""
        self.model.train()
        loss = self.task.loss(self.model, self.task.to_device(batch, self.device))
        if not torch.isfinite(loss):
            raise FloatingPointError(f"the loss is {float(loss)}: training diverged")
        (loss * scale if scale != 1 else loss).backward()  # type: ignore[no-untyped-call]
        return float(loss.detach())

    async def _after_step(self) -> None:
        epoch = self.opt.epoch
        ev = self.config.eval
        if ev.every_steps and self.task.validation is not None and epoch % ev.every_steps == 0:
            self.val_loss = await trio.to_thread.run_sync(self.evaluate)
        every = self.config.checkpoint.every_steps
        if every and epoch % every == 0:
            await trio.to_thread.run_sync(self.save_checkpoint)
        status = self.status()
        self._write_metrics(status)
        if self.tracker is not None:
            self.tracker.log(epoch, scalars(status))
        last = self.opt.stats.last
        log.info(
            "step %d: loss %s%s, %s, %.1f samples/s here, %.1f in the swarm",
            epoch,
            # (a synced step: the loss so far is of the state the download replaced; not shown)
            "-" if self.loss is None or last.get("outcome") == "synced" else f"{self.loss:.4f}",
            f", val {self.val_loss:.4f}" if self.val_loss is not None else "",
            last.get("outcome", "?"),
            self.opt.rate.rate,
            self.opt.view.swarm_rate if self.opt.view else 0.0,
        )

    def evaluate(self) -> float:
        """Mean loss over the task's validation batches (the same on every peer)."""
        assert self.task.validation is not None
        self.model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for batch in self.task.validation(self.config.eval.batch_size):
                n = self.task.samples(batch)
                total += float(self.task.loss(self.model, self.task.to_device(batch, self.device))) * n
                count += n
        return total / max(count, 1)

    # ---- checkpoints ----

    def save_checkpoint(self) -> None:
        folder = self.checkpoints
        if folder is None:
            return
        # The live tensors, not a copy (3x the parameters in sync mode): this runs while the training
        # loop waits for it, and nothing else changes the state between two of its steps.
        tensors, meta = self.opt.capture(copy=False, own=True)
        info = {
            "peer": str(self.node.peer_id),
            "run": self.config.run.id,
            "time": self.clock(),
            # whom a restart may trust to move it to a later state (see CollaborativeOptimizer.trusted)
            "partners": sorted(str(p) for p in self.node.averager.partners)[:MAX_PARTNERS],
        }
        keep = self.config.checkpoint.keep
        # (a file-backed outer state is read from its file, not through its mapping: see state.file_tensors)
        path = checkpoint.save(
            folder, self.opt.epoch, tensors, meta, info, keep=keep, source=self.opt.outer_file
        )
        log.info("checkpoint of step %d written to %s", self.opt.epoch, path)

    def resume(self) -> bool:
        folder = self.checkpoints
        found = checkpoint.latest(folder) if folder is not None else None
        if found is None:
            log.info("no checkpoint to resume from%s", f" in {folder}" if folder else "")
            return False
        step, tensors, meta, info = found
        self.opt.restore(tensors, meta, owned=True)
        partners = info.get("partners")
        remembered = []
        for text in partners[:MAX_PARTNERS] if isinstance(partners, list) else ():
            try:
                remembered.append(PeerID.from_string(text))
            except (TypeError, ValueError):
                log.warning("the checkpoint names a partner %r that is no peer id", text)
        self.node.averager.remember_partners(remembered)
        log.info("resumed from the checkpoint of step %d", step)
        return True

    # ---- metrics ----

    def status(self) -> dict[str, Any]:
        opt, view = self.opt, self.opt.view
        wall = self.clock() - self.started if self.started else 0.0
        sent, received = self.node.host.traffic()
        return {
            "time": self.clock(),
            "task": self.task.name,
            "mode": self.config.training.mode,
            "step": opt.epoch,
            "loss": self.loss,
            "val_loss": self.val_loss,
            "lr": opt.lr(),
            "samples_here": self.local_samples,
            "samples_per_s": opt.rate.rate,
            "swarm_samples_per_s": view.swarm_rate if view else 0.0,
            "swarm_peers": view.peers if view else 1,
            "epoch_samples": view.samples if view else 0.0,
            "target": self.config.training.target_batch_size,
            # forward/backward passes, and DiLoCo's inner optimizer steps: compute, not communication
            "compute_utilization": (self.compute_seconds + opt.inner_seconds) / wall if wall > 0 else 0.0,
            "rounds": {
                "averaged": opt.stats.averaged,
                "alone": opt.stats.solo,
                "aborted": opt.stats.aborted,
                "no_group": opt.stats.no_group,
                "synced": opt.stats.syncs,
                "last": opt.stats.last,
            },
            "digest": opt.digest.hex()[:16],
            # the last steps' digests once known ("digest" is "" while a large state is being hashed)
            "digests": {str(epoch): d.hex()[:16] for epoch, d in opt.hashed.items()},
            "state_sync": dict(zip(("received", "total"), opt.download_progress, strict=True)),
            "banned": {p.short(): why for p, why in self.node.averager.auditor.banned.items()},
            "local": self.options.local.status() if self.options.local is not None else None,
            "bytes_sent": sent,
            "bytes_received": received,
            "bandwidth": self.node.averager.bandwidth,
            "finished": self.finished,
        }

    def _write_metrics(self, line: dict[str, Any]) -> None:
        path = self.options.metrics_file
        if path is None:
            return
        try:
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError as e:
            log.warning("cannot write metrics to %s: %s", path, e)
