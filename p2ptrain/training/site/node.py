"""``p2ptrain node --shard N`` and ``torchrun ... -m p2ptrain node``: a site that trains a run's task.

Theory of operation. Rank 0 is the node: one p2p identity, the training loop (``SiteTrainer``, the
node's ``Trainer`` with the site's model, optimizer and parts) and the swarm. The other ranks never
open a socket to the outside: they build the same FSDP2 model (every transformer block a unit, the
root the rest; the task's model built with the run's seed, so the initial weights are every peer's, on
the meta device where the task gives its ``initial_values``: see :func:`sharded_model`),
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
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import trio

from ...config import RunConfig
from ...errors import ConfigError
from ...node import Node
from ...tasks import Task, load_task
from ..loop.trainer import Trainer, TrainerOptions, TrainerParts, default_optimizer
from . import checkpoint
from .commands import Command, Commands, Op
from .group import SiteGroup
from .launch import exit_now, leave_together, return_freed_memory
from .peer import SNAPSHOT_PREFIX, SiteRank, SiteState, check_run

log = logging.getLogger(__name__)

START_TIMEOUT = 300.0
"""The least a site's group waits for a rank (one host) until every rank has built its shards: a spawned
rank imports torch and builds them first, which takes tens of seconds on a busy host. From then on rank 0
bounds each command's collectives by ``--local-timeout`` (``commands.Deadlines``)."""
IDLE_TIMEOUT = 1800.0
"""Several hosts: commands are broadcast over the group, so an idle rank waits at most this long for
rank 0 (a round, an evaluation) before the group fails."""


def launched() -> bool:
    """Whether this process is a rank of a site started by ``torchrun`` (or its environment): one of
    several, or the only rank of a site of one (``torchrun --nproc-per-node 1``: one GPU, the model
    under FSDP2 on a group of one; the same site, with its checkpoints and NCCL, as on more GPUs)."""
    if "RANK" not in os.environ:
        return False
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 or "TORCHELASTIC_RUN_ID" in os.environ


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


def inner_optimizer(model: torch.nn.Module, config: RunConfig) -> torch.optim.AdamW:
    """The inner AdamW every peer of a run uses (the node's ``Trainer``'s), over the site's shards."""
    return default_optimizer(model, config)


def site_parts(site: SiteRank) -> TrainerParts:
    """What the node's ``Trainer`` trains on a site's rank 0: its shards, its inner optimizer, and the
    collaborative optimizer's site parts (``SiteRank.parts``)."""
    return TrainerParts(site.model, site.optimizer, site.parts())


def build_rank(
    config: RunConfig,
    task: Task,
    commands: Commands,
    world: int,
    device: str,
    folder: Path | None = None,
    local_timeout: float | None = None,
) -> SiteRank:
    """This rank's FSDP2 model (from the run's seed: every peer's initial weights), optimizer, shards;
    ``folder``: the site's checkpoints, beside which rank 0 makes its snapshot files
    (:func:`snapshot_folder`); ``local_timeout``: rank 0's bound on a collective from then on
    (``SiteRank.ready``; the node's ``--local-timeout``), None: the group's own timeout."""
    from torch.distributed.device_mesh import init_device_mesh

    check_run(config)
    return_freed_memory()  # (every rank: rank 0 of ``--shard N``, its spawned ranks, torchrun's)
    if config.training.threads:
        torch.set_num_threads(config.training.threads)
    mesh = init_device_mesh(torch.device(device).type, (world,))
    model = sharded_model(task, config.run.seed, mesh, device)
    snapshots = snapshot_folder(folder) if commands.rank == 0 else None
    site = SiteRank(
        model,
        inner_optimizer(model, config),
        config,
        commands,
        world=world,
        device=device,
        snapshots=snapshots,
    )
    site.ready(local_timeout)  # (every rank built: rank 0's collectives bounded from here)
    return site


def snapshot_folder(folder: Path | None) -> str | None:
    """Where rank 0 makes the site's snapshot files: ``snapshots`` in the site's checkpoint folder (the
    data folder's; under torchrun, shared by the hosts), where every rank that can open them writes its
    own chunks (``ShardedState.hash_into``); None without a data folder (the system's temporary
    folder). A file left there is a hash's that a crash cut short (each is unlinked as soon as it is
    written): removed, as it may be the size of the state."""
    if folder is None:
        return None
    snapshots = folder / "snapshots"
    for left in snapshots.glob(f"{SNAPSHOT_PREFIX}*"):
        log.info("removing %s, a snapshot file a crash left behind", left)
        left.unlink(missing_ok=True)
    return str(snapshots)


def sharded_model(task: Task, seed: int, mesh: Any, device: str) -> torch.nn.Module:
    """The task's model, sharded over ``mesh``, with every peer's initial weights (from ``seed``).

    With the task's ``initial_values``: built on the meta device, sharded, and each parameter's full
    initial values made on the CPU one parameter at a time, in the order the task draws them, this
    rank's rows kept: no rank holds more than its shards and one parameter. Without them (or where the
    model has buffers, which the meta device cannot fill): built whole once, then sharded."""
    torch.manual_seed(seed)
    if task.initial_values is not None:
        with torch.device("meta"):
            model = task.model()
        if next(model.buffers(), None) is None:
            shard_model(model, mesh)
            model.to_empty(device=device)
            torch.manual_seed(seed)
            fill_shards(model, task, mesh.size(), mesh.get_local_rank())
            return model
        log.info("task %r: its model has buffers; built whole, then sharded", task.name)
        torch.manual_seed(seed)
    model = task.model()  # (whole for a moment, as on every peer, then sharded)
    shard_model(model, mesh)
    model.to(device)
    return model


def fill_shards(model: torch.nn.Module, task: Task, world: int, rank: int) -> None:
    """This rank's rows of every parameter's initial values (``Task.initial_values``), made one full
    parameter at a time on the CPU (as every unsharded peer makes them)."""
    from .layout import rows_of
    from .outer import local_of

    assert task.initial_values is not None
    params = dict(model.named_parameters())
    filled: set[str] = set()
    with torch.no_grad():
        for name, fill in task.initial_values(model):
            p = params.get(name)
            if p is None or name in filled:
                raise ConfigError(
                    f"Task.initial_values of task {task.name!r} names {name!r}, which is "
                    + ("named twice" if p is not None else "not one of the model's parameters")
                )
            full = torch.empty(p.shape, dtype=p.dtype)
            fill(full)
            if p.dim():  # (FSDP2 shards dim 0: this rank's rows)
                rows = rows_of(p.shape[0], world, rank)
                full = full[rows.start : rows.stop]
            local_of(p).copy_(full)
            filled.add(name)
            del full
    missing = sorted(set(params) - filled)
    if missing:
        raise ConfigError(
            f"Task.initial_values of task {task.name!r} leaves {len(missing)} parameters unfilled: "
            + ", ".join(missing[:5])
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
    rank's, the gradients stay where FSDP2 reduce-scattered them. ``inner_steps()``: the inner step the
    next batch is for (the collaborative optimizer's count)."""

    def __init__(
        self, site: SiteRank, task: Task, group: SiteGroup | None, inner_steps: Callable[[], int]
    ) -> None:
        self.site, self.task, self.group, self.inner_steps = site, task, group, inner_steps

    def backward(
        self, model: torch.nn.Module, compute: Callable[[Any], float], batch: Any
    ) -> tuple[float, int]:
        self.site.start_batch(self.inner_steps())  # (waits for a hash of the state in progress)
        loss = compute(batch)
        return loss, self.task.samples(batch) * self.site.world  # (every rank's batch has its size)

    def start(self, model: torch.nn.Module, data_seed: int) -> bool:
        generation = self.group.generation if self.group is not None else 1
        if generation > 1:  # (a restarted group's ranks do not draw their predecessors' batches again)
            h = hashlib.blake2b(f"{data_seed}/{generation}".encode(), digest_size=8)
            data_seed = int.from_bytes(h.digest(), "little") & (2**62 - 1)
        with self.site.section():
            self.site.send(Command(Op.SEED, (data_seed >> 31) & (2**31 - 1), data_seed & (2**31 - 1)))
        return True

    def status(self) -> dict[str, Any]:
        return {
            "ranks": self.site.world,
            "generation": self.group.generation if self.group is not None else 1,
            "restarts": self.group.generation - 1 if self.group is not None else 0,
            "shard_elements": self.site.layout.shard_numel(0),
            **self._device_memory(),
        }

    def _device_memory(self) -> dict[str, int]:
        """On a GPU: rank 0's peak device memory (allocated by tensors, and reserved by torch's caching
        allocator) and the pinned host memory its piece channel holds."""
        device = self.site.device
        if device.type != "cuda":
            return {}
        return {
            "cuda_peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "cuda_peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
            "pinned_bytes": self.site.channel.pinned_bytes,
        }

    def publish(self, model: torch.nn.Module, changed: bool, stop: bool) -> None:
        """(The ranks hold their own shards: nothing to publish.)"""

    def close(self) -> None:
        if self.group is not None:
            self.group.close(self.site.stop)
            return
        # torchrun's site: rank 0 tells the others to end, then leaves the group with them (they wait in
        # ``join_launched``); a rank that exits while the others' backend still talks to it aborts them.
        # Rank 0 then exits with its group up: destroyed on rank 0 too, the ranks aborted at exit (2 of
        # 9 runs of the torchrun restart test).
        self.site.stop()
        leave(self.site.rank)


class SiteTrainer(Trainer):
    """The node's training loop on a site's rank 0: the node's ``Trainer`` over the site's parts (its
    FSDP2 model and inner optimizer, the collaborative optimizer's site parts), each batch every rank's,
    evaluation and checkpoints collectives of the site.

    A rank that fails (one host: ``SiteGroup``) does not end the node. Whatever raised on rank 0 while
    the group was broken (a collective of a batch, a round's pieces, a hash, a checkpoint) ends the
    training session, not the node: :meth:`_recover` restarts the group (a new generation of ranks),
    builds the site's parts anew on it, resumes from the site's last checkpoint (or from the initial
    weights when it has none), and the session starts again; the collaborative optimizer then finds the
    site behind the swarm and downloads its state into the new shards, as for any peer that is behind.
    Nothing of the failed generation is kept on any rank, so no rank goes on from half a step; the round
    the site was in saw all of its contribution or none of it (rank 0 sends it only once every rank's
    pieces are in its wire buffer), and aborts or excludes it, as a round does any peer that failed.
    Under ``torchrun`` the launcher restarts the whole site instead (``--max-restarts``), and its rank
    0 resumes from the site's checkpoint (``cli.train``)."""

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
        if not isinstance(site.optimizer, torch.optim.AdamW):
            raise TypeError("a node's site trains with the run's AdamW (inner_optimizer)")
        self.site, self.group = site, group
        self.workers = SiteWorkers(site, task, group, lambda: self.opt.inner_steps)
        options = dataclasses.replace(options, local=self.workers)
        super().__init__(node, config, task, options, clock=clock, parts=site_parts(site))

    @property
    def site_checkpoints(self) -> Path | None:
        return self.checkpoints / "site" if self.checkpoints is not None else None

    async def _session(self, batches: Iterator[Any], task_status: trio.TaskStatus[None]) -> None:
        """The node's training session, started again on a new generation of the site's group after a
        rank failed (see the class's docstring)."""
        status = task_status
        reason: str | None = None
        while True:
            try:
                if reason is not None:  # (a failure while recovering is the group's too: restarted again)
                    await self._recover(reason)
                await super()._session(batches, status)
                return
            except Exception as e:  # (an exception group too; trio's Cancelled is no Exception)
                reason = self.group.failure(e) if self.group is not None else None
                if reason is None:
                    raise
                log.warning("the site's group broke (%s)", reason, exc_info=e)
            status = trio.TASK_STATUS_IGNORED  # (reported once, by the first session)
            # (the peers it waited for to start together are in the swarm with it already)
            self.options = dataclasses.replace(self.options, wait_peers=1)

    async def _recover(self, reason: str) -> None:
        """A new generation of the group, the site's parts built on it, its last checkpoint resumed."""
        group = self.group
        assert group is not None
        old = self.opt.shared
        if isinstance(old, SiteState):
            old.close()  # (its RPC methods: the next generation's state serves them)
        # (the ranks start and join in tens of seconds: the node keeps serving meanwhile)
        await trio.to_thread.run_sync(group.restart, reason)  # GroupRestarted: the group stays down
        world, device = self.site.world, str(self.device)
        local = self.site.deadlines.local if self.site.deadlines is not None else None  # (the node's)
        site = await trio.to_thread.run_sync(
            build_rank, self.config, self.task, group.commands, world, device, self.site_checkpoints, local
        )
        self.site = self.workers.site = site
        self.node.averager.unfollow()  # (the next collaborative optimizer hands it the run's rules)
        self._take(site_parts(site))
        self.node.status_sections["training"] = self.status
        log.warning(
            "site group generation %d is up (%d ranks): its parts rebuilt; the site stays in the swarm",
            group.generation,
            world,
        )
        if not self.resume():
            log.warning(
                "no site checkpoint: the site starts again from the initial weights, and catches up"
                " with the swarm by downloading its state"
            )

    def evaluate(self) -> float:
        with self.site.section():  # (in a worker thread: after a hash of the state in progress)
            self.site.send(Command(Op.EVAL))
            return evaluate(self.model, self.task, self.config, str(self.device))

    def save_checkpoint(self) -> None:
        folder = self.site_checkpoints
        if folder is None:
            return
        if self.group is not None and (not self.group.up or self.group.dead() is not None):
            log.warning("no checkpoint of step %d: the site's group is down", self.opt.epoch)
            return
        step = self.opt.epoch
        if (folder / f"step-{step}" / checkpoint.MARK).is_file():
            return  # (this step's is written: the last one at a stop, say)
        with self.site.section():
            self.site.send(Command(Op.SAVE, step))
            where = checkpoint.save(
                folder, step, self.model, self.optimizer, self.site.outer, self.site.layout
            )
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
        with self.site.section():
            self.site.send(Command(Op.LOAD, step))
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
    site = build_rank(config, task, group.commands, world, devices[0], folder, timeout)
    return site, group


def join_launched(
    config: RunConfig, folder: Path | None, local_timeout: float | None = None
) -> SiteRank | None:
    """Several hosts (``torchrun``): join the group from the environment; rank 0 gets its shards back
    (it runs the node; ``local_timeout`` bounds its collectives once every rank is built), every other
    rank follows rank 0 until it stops, then gets None."""
    from .launch import init_from_env

    check_run(config)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rank, world = init_from_env(IDLE_TIMEOUT, device)
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    if folder is not None and world > 1:
        checkpoint.check_shared(folder, device)  # (every rank reads what rank 0 writes there)
    task = load_task(config.task.name, config.task.options)
    commands = Commands(rank, device=device)
    site = build_rank(config, task, commands, world, device, folder, local_timeout)
    if rank == 0:
        return site
    try:
        follow(site, task, config, device, folder)
        # (not after a failure here: the others are busy with rank 0, and torchrun ends them)
        together = leave(rank)
    except BaseException:
        dist.destroy_process_group()
        raise
    if together:
        exit_now()  # (as a spawned rank does: no teardown of the backend under its threads)
    dist.destroy_process_group()
    return None


def leave(rank: int) -> bool:
    """A torchrun site's rank, at the end: every rank leaves together (rank 0 after its STOP, the others
    once they received it); False when a rank was gone already. Rank 0 used to exit with the group up
    while rank 1 destroyed its own: rank 1's backend then aborted its process at exit now and then
    ("terminate called without an active exception", SIGABRT: 1 of 12 runs of the torchrun restart
    test), and the launcher reported the site failed. Ranks 1..N-1 that left together then exit at once
    (``launch.exit_now``)."""
    try:
        leave_together()
        return True
    except (RuntimeError, dist.DistError) as e:  # a rank is gone already: torchrun ends the rest
        log.warning("site rank %d: the other ranks did not leave with it (%s)", rank, e)
        return False
