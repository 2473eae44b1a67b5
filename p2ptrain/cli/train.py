"""``p2ptrain node --config RUN.toml``: a node that trains with its swarm, with a live view.

The run file says what is trained (task, mode, batch sizes, averaging) and, in its ``[node]`` section,
what this host's node may be started with; the flags say where and for how long (device, data
directory, join address, max steps), and a flag given wins over the run file (see
``config.NodeSection``). Everything a user can get wrong (run file, task path, device) is checked before
the node touches the network, and reported in one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import trio
from rich.console import Console, Group
from rich.live import Live
from rich.logging import RichHandler
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

from ..config import NodeSection, RunConfig, load_config
from ..errors import ConfigError
from ..node import Node, averaging_settings, id_work
from ..nodebase import default_data_dir
from ..tasks import Task, load_task
from ..training.loop.console import node_table
from ..training.loop.trainer import Trainer, TrainerOptions
from .common import (
    UsageError,
    data_folder,
    node_config,
    node_identity,
    node_settings,
    print_join_addresses,
    run_node,
    stop_if_join_refused,
)

if TYPE_CHECKING:
    from ..pipeline.trainer import PipelineTrainer
    from ..training.site.group import SiteGroup
    from ..training.site.peer import SiteRank

log = logging.getLogger("p2ptrain")


def run_config(args: argparse.Namespace) -> RunConfig:
    """The run file with the command line's overrides applied (a flag given wins: ``with_flags``)."""
    flags = {"run": {"authority": args.authority}}
    config = load_config(args.config, flags) if args.config else RunConfig()
    if args.task and args.task != config.task.name:  # another task: the run file's options are its task's
        config = config.replace("task", name=args.task, options={})
    config = config.with_flags("training", mode=args.mode, threads=args.threads)
    config = config.with_flags("averaging", bandwidth=args.bandwidth)
    return config.with_flags("run", authority=args.authority)


def _device(name: str) -> str:
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise UsageError(f"--device {name!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: this torch build sees no CUDA device")
    return name


def _devices(settings: NodeSection) -> list[str]:
    """One device per local rank, rank 0 (this process) first: ``devices``, else ``device`` and, with
    ``local_workers`` N, N more (the host's other GPUs, or CPU processes)."""
    if settings.devices:
        return [_device(d) for d in settings.devices]
    if settings.local_workers == 0:
        return [_device(settings.device)]
    from ..training.local.group import local_devices

    return [_device(d) for d in local_devices(settings.local_workers + 1, settings.device)]


def _site_rank(config: RunConfig, settings: NodeSection) -> tuple[SiteRank, SiteGroup | None] | bool | None:
    """Started by ``torchrun`` (every rank runs this command): rank 0's shards (it runs the node), or
    False on the other ranks once they followed rank 0 to the end; None when not (``--shard`` spawns
    its ranks later, once this node's data folder is known)."""
    from ..training.site.node import join_launched, launched

    if not launched():
        return None
    if settings.shard > 1 or settings.local_workers:
        raise UsageError(
            "under torchrun the launcher starts a site's ranks: give no --shard or --local-workers"
        )
    folder = settings.data_dir or (default_data_dir() if settings.identity is None else None)
    try:
        checkpoints = folder / "checkpoints" / "site" if folder is not None else None
        rank0 = join_launched(config, checkpoints, settings.local_timeout)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    return (rank0, None) if rank0 is not None else False


def train_node(args: argparse.Namespace) -> int:
    config = run_config(args)
    task = load_task(config.task.name, config.task.options)
    if args.slowdown < 1:
        raise UsageError("--slowdown must be at least 1")
    if args.max_steps is not None and args.max_steps < 0:
        raise UsageError("--max-steps must not be negative")
    settings = node_settings(args, config.node, training=True)
    launched = _site_rank(config, settings)  # a sharded site's rank (docs/sharded-sites.md)
    if launched is False:
        return 0  # (a rank other than 0 of a torchrun site: it followed rank 0 until it stopped)
    site = launched if isinstance(launched, tuple) else None
    # torchrun restarted the site (a rank failed; ``--max-restarts``): it resumes its last checkpoint
    resume = args.resume or (site is not None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0)
    identity = node_identity(settings)
    data_dir = data_folder(settings)
    node_config_ = node_config(
        settings,
        run_id=args.run_id or config.run.id,  # (the node's run id; the run's own stays the run file's)
        authority=config.run.authority,
        averaging=averaging_settings(config),
        peer_list_buckets=config.progress.buckets,
    )
    if config.run.id_work:  # the run prices ids: ours carries the work (found once, kept with the key)
        work = id_work(identity, config.run.id_work, data_dir)
        host = dataclasses.replace(node_config_.host, id_work=config.run.id_work, work=work)
        node_config_ = dataclasses.replace(node_config_, host=host)
    node = Node(identity, node_config_)
    if config.pipeline.enabled:  # one stage of the model, served to the swarm (docs/pipeline.md)
        return _pipeline_node(args, node, config, task, settings, data_dir)
    devices = _devices(settings)
    local = None
    if settings.shard > 1 and site is None:  # this host's site: rank 0 here, ranks 1..N-1 spawned
        from ..training.local.group import local_devices
        from ..training.site.node import start_group

        devices = [_device(d) for d in local_devices(settings.shard, settings.device)]
        checkpoints = data_dir / "checkpoints" / "site" if data_dir is not None else None
        try:
            site = start_group(config, settings.shard, devices, checkpoints, settings.local_timeout)
        except ConfigError as e:
            raise UsageError(str(e)) from None
    elif len(devices) > 1:
        from ..training.local.group import LocalGroup

        local = LocalGroup(config, task, devices, timeout=settings.local_timeout)
    live = sys.stdout.isatty() and not args.no_live
    bar = DownloadBar() if live else None
    options = TrainerOptions(
        device=str(site[0].device) if site is not None else devices[0],  # (a site's: its rank 0's)
        data_dir=data_dir,
        resume=resume,
        max_steps=args.max_steps,
        duration=args.duration,
        slowdown=args.slowdown,
        metrics_file=settings.metrics_file,
        wait_peers=settings.wait_peers,
        tracker=settings.tracker or None,
        local=local,
        on_download_progress=bar.update if bar is not None else _log_progress(),
    )
    if site is not None:
        from ..training.site.node import SiteTrainer

        rank0, group = site
        trainer: Trainer = SiteTrainer(node, config, task, options, rank0, group)
    else:
        trainer = Trainer(node, config, task, options)
    if args.adversary:  # simulations of hostile peers only (a hidden flag)
        from ..testing.adversary import install

        try:
            install(args.adversary, node.averager, trainer=trainer)
        except ValueError as e:
            raise UsageError(f"--adversary: {e}") from None
        log.warning("this node attacks its swarm on purpose: %s", args.adversary)
    run_node(_train, node, trainer, bar)
    if isinstance(launched, tuple):
        # torchrun's rank 0 left the group together with the other ranks (``SiteNode.close``); it ends as
        # they do, without tearing the backend down under its threads. Through the interpreter's
        # shutdown instead it aborted now and then after its last step ("terminate called without an
        # active exception", SIGABRT), and torchrun reported the site failed (the restart test, once
        # in a suite run on a loaded machine).
        from ..training.site.launch import exit_now

        exit_now(0)
    return 0


def _pipeline_node(
    args: argparse.Namespace,
    node: Node,
    config: RunConfig,
    task: Task,
    settings: NodeSection,
    data_dir: Path | None,
) -> int:
    from ..pipeline.trainer import PipelineOptions, PipelineTrainer

    if settings.devices or settings.local_workers:
        raise UsageError("a [pipeline] run serves one stage per node: it takes no local workers")
    if args.resume or args.adversary:
        raise UsageError("a [pipeline] run takes no --resume or --adversary yet (see docs/pipeline.md)")
    if config.training.threads:
        torch.set_num_threads(config.training.threads)
    options = PipelineOptions(
        max_steps=args.max_steps,
        duration=args.duration,
        slowdown=args.slowdown,
        metrics_file=settings.metrics_file,
        wait_peers=settings.wait_peers,
        data_dir=data_dir,
    )
    try:
        trainer = PipelineTrainer(node, config, task, options)
    except ConfigError as e:
        raise UsageError(f"{args.config}: {e}") from None
    live = sys.stdout.isatty() and not args.no_live
    run_node(_train, node, trainer, DownloadBar() if live else None)
    return 0


async def _train(node: Node, trainer: Trainer | PipelineTrainer, bar: DownloadBar | None) -> None:
    """``bar``: the live view's download bar (None: no live view, log lines instead)."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            nursery.start_soon(print_join_addresses, node)
            with trio.CancelScope() as training:
                nursery.start_soon(stop_if_join_refused, node, training)

                async def stop_on_signal() -> None:
                    """First signal: drain (finish the batch and round in progress, checkpoint, tell the
                    swarm); a second one, or a drain that takes too long, cuts it short. The grace is
                    the round's own bound plus time for the batch in progress."""
                    grace = trainer.drain_timeout + 30.0
                    async for signum in signals:
                        if trainer.stopping:
                            log.warning("second %s: stopping now", signal.Signals(signum).name)
                            break
                        log.info(
                            "received %s: draining (finishing the current step, up to %.0f s), then a last"
                            " checkpoint",
                            signal.Signals(signum).name,
                            grace,
                        )
                        trainer.request_stop()
                        training.deadline = trio.current_time() + grace
                    training.cancel()

                nursery.start_soon(stop_on_signal)
                if bar is not None:
                    await _train_live(node, trainer, bar)
                else:
                    await trainer.run()
            if not training.cancelled_caught:
                with trio.move_on_after(trainer.config.averaging.timeout):
                    await node.averager.wait_idle()  # slower members may still fetch from us
                await node.leave()
            nursery.cancel_scope.cancel()
    log.info("node stopped at step %d", trainer.status()["step"])


def _log_progress() -> Callable[[int, int], None]:
    """A log line at every tenth of a state download: how far, how fast, and how long it still takes."""
    marks: list[float] = []
    began = [0.0, 0.0]  # when the download began, and the bytes it already had then (a resumed one)

    def report(got: int, total: int) -> None:
        if not marks or got < began[1]:  # a new download (or a resumed one)
            marks[:] = [i / 10 for i in range(1, 11)]
            began[:] = [time.monotonic(), float(got)]
        while marks and got >= marks[0] * total:
            marks.pop(0)
            rate = (got - began[1]) / max(time.monotonic() - began[0], 1e-3)
            eta = (total - got) / rate if rate > 0 else float("inf")
            log.info(
                "downloading the swarm's state: %.0f%% of %.1f MB at %.1f MB/s, %.0f s to go",
                100 * got / total,
                total / 1e6,
                rate / 1e6,
                eta,
            )

    return report


class DownloadBar:
    """The live view's state download bar: its ``update`` goes to the trainer's optimizer when it is
    built, the view shows it."""

    def __init__(self) -> None:
        self.console = Console()
        self.progress = Progress(
            "state download",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=self.console,
        )
        self._task = self.progress.add_task("download", total=None, visible=False)

    def update(self, got: int, total: int) -> None:
        self.progress.update(self._task, completed=got, total=total, visible=got < total)


async def _train_live(node: Node, trainer: Trainer | PipelineTrainer, bar: DownloadBar) -> None:
    console, progress = bar.console, bar.progress
    root = logging.getLogger()
    handlers = root.handlers[:]
    root.handlers = [RichHandler(console=console, show_path=False, log_time_format="%H:%M:%S")]
    peer = node.peer_id.short()

    def view() -> Group:
        return Group(
            node_table(peer, trainer.status(), f"p2ptrain node {peer}, run {node.config.run_id!r}"), progress
        )

    try:
        with Live(view(), console=console, auto_refresh=False) as screen:
            async with trio.open_nursery() as nursery:

                async def refresh() -> None:
                    while True:
                        screen.update(view(), refresh=True)
                        await trio.sleep(0.5)

                nursery.start_soon(refresh)
                await trainer.run()
                nursery.cancel_scope.cancel()
    finally:
        root.handlers = handlers
