"""``p2ptrain node --shard N`` and ``torchrun ... -m p2ptrain node``: a site that trains a run's task.

Theory of operation. Rank 0 is the node: one p2p identity, the training loop (``SiteTrainer``, the
node's ``Trainer`` with the site's model, optimizer and parts) and the swarm. The other ranks never
open a socket to the outside: they build the same FSDP2 model (every transformer block a unit, the
root the rest; the task's model built with the run's seed, so the initial weights are every peer's),
and follow rank 0's commands (:func:`follow`): a batch and an inner step, a contribution's pieces, a
landing, an evaluation, a checkpoint. One host: rank 0 spawns ranks 1..N-1 (``group.SiteGroup``, the
rendezvous on 127.0.0.1). Several hosts: every process is started by ``torchrun`` and
:func:`launched` says so from its environment; rank 0 (``RANK`` 0) runs the node, the others follow.

Each rank draws its own batches: rank r's seed is the site's data seed (rank 0's, from its peer id,
sent as the first command) plus r. Checkpoints are per rank (``site.checkpoint``, DCP) in
``<data dir>/checkpoints/site``, so a site resumes with any N; with several hosts that folder must be
shared by all of them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...config import RunConfig, TrainingSection
from ...node import Node
from ...tasks import Task, load_task
from ..loop.trainer import Trainer, TrainerOptions
from ..optimizer.collaborative import CollaborativeOptimizer
from . import checkpoint
from .commands import Command, Commands, Op
from .group import SiteGroup
from .peer import SiteRank, check_run

log = logging.getLogger(__name__)

START_TIMEOUT = 300.0
"""The least a site's group waits for a rank (one host): a spawned rank imports torch and builds its
shards first, which takes tens of seconds on a busy host."""
IDLE_TIMEOUT = 1800.0
"""Several hosts: commands are broadcast over the group, so an idle rank waits at most this long for
rank 0 (a round, an evaluation) before the group fails."""


def launched() -> bool:
    """Whether this process is one rank of several started by ``torchrun`` (or its environment)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def shard_model(model: torch.nn.Module, mesh: Any) -> None:
    """FSDP2 units: every module of a ``ModuleList`` (a transformer's blocks), then the root (the rest):
    a rank gathers one block's parameters at a time, never the model's."""
    from torch.distributed.fsdp import fully_shard

    for m in list(model.modules()):
        if isinstance(m, torch.nn.ModuleList):
            for child in m:
                if any(p.requires_grad for p in child.parameters()):
                    fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)


def inner_optimizer(model: torch.nn.Module, t: TrainingSection) -> torch.optim.AdamW:
    """The inner AdamW every peer of a run uses (the node's ``Trainer``'s), over the site's shards."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.lr,
        betas=(0.9, 0.95),
    )


def build_rank(config: RunConfig, task: Task, commands: Commands, world: int, device: str) -> SiteRank:
    """This rank's FSDP2 model (from the run's seed: every peer's initial weights), optimizer, shards."""
    from torch.distributed.device_mesh import init_device_mesh

    check_run(config)
    if config.training.threads:
        torch.set_num_threads(config.training.threads)
    torch.manual_seed(config.run.seed)
    model = task.model()  # (whole for a moment, as on every peer, then sharded)
    shard_model(model, init_device_mesh(torch.device(device).type, (world,)))
    model.to(device)
    return SiteRank(
        model, inner_optimizer(model, config.training), config, commands, world=world, device=device
    )


def evaluate(model: torch.nn.Module, task: Task, config: RunConfig, device: str) -> float:
    """Mean loss over the task's validation batches (every rank runs them: FSDP2's forward is a
    collective of the site)."""
    assert task.validation is not None
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in task.validation(config.eval.batch_size):
            n = task.samples(batch)
            total += float(task.loss(model, task.to_device(batch, torch.device(device)))) * n
            count += n
    model.train()
    return total / max(count, 1)


def follow(site: SiteRank, task: Task, config: RunConfig, device: str, folder: Path | None) -> None:
    """Ranks 1..N-1: rank 0's commands until STOP."""
    batches: Iterator[Any] | None = None

    def compute() -> None:
        assert batches is not None, "rank 0 sends SEED before TRAIN"
        site.model.train()
        batch = task.to_device(next(batches), torch.device(device))
        task.loss(site.model, batch).backward()  # type: ignore[no-untyped-call]

    while (cmd := site.commands.receive()).op is not Op.STOP:
        if cmd.op is Op.SEED:
            seed = (cmd.a << 31 | cmd.b) + site.rank
            batches = task.batches(seed, config.training.batch_size)
        elif cmd.op is Op.EVAL:
            evaluate(site.model, task, config, device)
        elif cmd.op is Op.SAVE:
            assert folder is not None, "rank 0 checkpoints only with a data folder"
            checkpoint.save(folder, cmd.a, site.model, site.optimizer, site.outer, site.layout)
        elif cmd.op is Op.LOAD:
            assert folder is not None
            checkpoint.load(folder / f"step-{cmd.a}", site.model, site.optimizer, site.outer, site.layout)
        else:
            site.handle(cmd, compute)


def rank_main(
    rank: int,
    world: int,
    generation: int,
    commands: Commands,
    config: RunConfig,
    devices: list[str],
    folder: Path | None,
) -> None:
    """A spawned rank of a site on one host (``SiteGroup``'s worker)."""
    device = devices[rank % len(devices)]
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    task = load_task(config.task.name, config.task.options)
    site = build_rank(config, task, commands, world, device)
    follow(site, task, config, device, folder)


class SiteWorkers:
    """The training loop's view of the other ranks (``trainer.LocalWorkers``): each batch is every
    rank's, the gradients stay where FSDP2 reduce-scattered them."""

    def __init__(self, site: SiteRank, task: Task, group: SiteGroup | None) -> None:
        self.site, self.task, self.group = site, task, group
        self.opt: CollaborativeOptimizer | None = None  # (set once built: it counts the inner steps)

    def backward(
        self, model: torch.nn.Module, compute: Callable[[Any], float], batch: Any
    ) -> tuple[float, int]:
        assert self.opt is not None
        self.site.busy()
        self.site.commands.send(Command(Op.TRAIN, self.opt.inner_steps))
        loss = compute(batch)
        return loss, self.task.samples(batch) * self.site.world  # (every rank's batch has its size)

    def start(self, model: torch.nn.Module, data_seed: int) -> bool:
        self.site.commands.send(Command(Op.SEED, (data_seed >> 31) & (2**31 - 1), data_seed & (2**31 - 1)))
        return True

    def status(self) -> dict[str, Any]:
        return {
            "ranks": self.site.world,
            "generation": self.group.generation if self.group is not None else 1,
            "shard_elements": self.site.layout.shard_numel(0),
        }

    def publish(self, model: torch.nn.Module, changed: bool, stop: bool) -> None:
        """(The ranks hold their own shards: nothing to publish.)"""

    def close(self) -> None:
        if self.group is not None:
            self.group.close(self.site.stop)
        else:
            self.site.stop()


class SiteTrainer(Trainer):
    """The node's training loop on a site's rank 0: the site's FSDP2 model and optimizer, the
    collaborative optimizer built from the site's parts, each batch every rank's, evaluation and
    checkpoints collectives of the site."""

    def __init__(
        self,
        node: Node,
        config: RunConfig,
        task: Task,
        options: TrainerOptions,
        site: SiteRank,
        group: SiteGroup | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        # (Trainer's own __init__ builds the whole model and an unsharded optimizer: the site's instead)
        workers = SiteWorkers(site, task, group)
        self.site = site
        self.node, self.config, self.task = node, config, task
        self.options = dataclasses.replace(options, local=workers)
        self.clock = clock
        self.device = torch.device(options.device)
        if not isinstance(site.optimizer, torch.optim.AdamW):
            raise TypeError("a node's site trains with the run's AdamW (inner_optimizer)")
        self.model, self.optimizer = site.model, site.optimizer
        self.summed = False
        self.opt = CollaborativeOptimizer(
            node,
            self.model,
            self.optimizer,
            config,
            clock=clock,
            on_download_progress=options.on_download_progress,
            parts=site.parts(),
        )
        workers.opt = self.opt
        t = config.training
        self.max_steps = t.max_steps if options.max_steps is None else options.max_steps
        self.loss: float | None = None
        self.val_loss: float | None = None
        self.compute_seconds = 0.0
        self.started = 0.0
        self.local_samples = 0
        self.finished = False
        self._fastest = float("inf")
        self._stop_requested = False
        self.tracker = None
        self.node.status_sections["training"] = self.status

    @property
    def site_checkpoints(self) -> Path | None:
        return self.checkpoints / "site" if self.checkpoints is not None else None

    def evaluate(self) -> float:
        self.site.busy()
        self.site.commands.send(Command(Op.EVAL))
        return evaluate(self.model, self.task, self.config, str(self.device))

    def save_checkpoint(self) -> None:
        folder = self.site_checkpoints
        if folder is None:
            return
        step = self.opt.epoch
        if (folder / f"step-{step}" / checkpoint.MARK).is_file():
            return  # (this step's is written: the last one at a stop, say)
        self.site.busy()
        self.site.commands.send(Command(Op.SAVE, step))
        where = checkpoint.save(folder, step, self.model, self.optimizer, self.site.outer, self.site.layout)
        log.info("checkpoint of step %d written to %s (every rank its shards)", step, where)
        keep = self.config.checkpoint.keep
        whole = sorted(
            (int(p.name.split("-")[1]), p)
            for p in folder.glob("step-*")
            if (p / checkpoint.MARK).is_file() and p.name.split("-")[1].isdigit()
        )
        for _, old in whole[:-keep] if keep > 0 else ():
            shutil.rmtree(old, ignore_errors=True)

    def resume(self) -> bool:
        folder = self.site_checkpoints
        found = checkpoint.latest(folder) if folder is not None else None
        if found is None:
            log.info("no site checkpoint to resume from%s", f" in {folder}" if folder else "")
            return False
        step, where = found
        self.site.busy()
        self.site.commands.send(Command(Op.LOAD, step))
        checkpoint.load(where, self.model, self.optimizer, self.site.outer, self.site.layout)
        self.opt.tally.epoch = step
        self.opt.contribution.fit(step)
        self.opt.state_changed()
        log.info("resumed from the site checkpoint of step %d (written by %s)", step, where)
        return True


def start_group(
    config: RunConfig, world: int, devices: list[str], folder: Path | None, timeout: float
) -> tuple[SiteRank, SiteGroup]:
    """One host: spawn ranks 1..N-1, join their group, build rank 0's shards."""
    check_run(config)
    backend = "nccl" if devices[0].startswith("cuda") else "gloo"
    wait = max(timeout, START_TIMEOUT)
    group = SiteGroup(world, rank_main, config, devices, folder, timeout=wait, backend=backend)
    group.start()
    task = load_task(config.task.name, config.task.options)
    return build_rank(config, task, group.commands, world, devices[0]), group


def join_launched(config: RunConfig, folder: Path | None) -> SiteRank | None:
    """Several hosts (``torchrun``): join the group from the environment; rank 0 gets its shards back
    (it runs the node), every other rank follows rank 0 until it stops, then gets None."""
    from .launch import init_from_env

    check_run(config)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rank, world = init_from_env(IDLE_TIMEOUT, device)
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    task = load_task(config.task.name, config.task.options)
    site = build_rank(config, task, Commands(rank, device=device), world, device)
    if rank == 0:
        return site
    try:
        follow(site, task, config, device, folder)
    finally:
        dist.destroy_process_group()
    return None
