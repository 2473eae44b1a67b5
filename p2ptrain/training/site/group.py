"""Rank 0's side of a site on one host: it starts ranks 1..N-1, joins their group, and restarts the
group when a rank fails, without the site leaving the swarm.

Theory of operation. Rank 0 is the node's own process; :meth:`SiteGroup.start` spawns the other ranks
(``torch.multiprocessing``'s spawn context: no fork of a process that holds threads), each running the
site's worker function, and joins them in a process group on a fresh port of 127.0.0.1 (a restarted
group never meets a stale rank). Everything rank 0 does with the group goes through
:meth:`SiteGroup.call`: if it raises because the group broke (gloo raises at once when a rank's
connection drops; a hung rank runs into the group's timeout), or a rank's process is gone, rank 0 kills
every other rank, destroys the process group, starts a new generation, and raises
:class:`GroupRestarted`. The caller then rebuilds its shards (the model's FSDP2 mesh belonged to the old
group) and reloads the site's last whole checkpoint on every rank (``checkpoint``): whatever the failed
call had done on some ranks (a landing that stepped two ranks of three) is gone everywhere, so no rank
ever goes on from half a step. Meanwhile the node is still in the swarm: the round the site was in is
aborted on its side, exactly as a round that failed on an unsharded peer.

A live node's site (``node.SiteTrainer``) runs its collectives where the training loop and the
collaborative optimizer need them, not inside one ``call``: when something raises there,
:meth:`SiteGroup.failure` says whether the group broke, and :meth:`SiteGroup.restart` starts the next
generation; the node then builds the site's parts anew and resumes.

After ``max_restarts`` failures within ``window`` seconds, :class:`GroupRestarted` says so and the group
stays down (:attr:`SiteGroup.up` is False): the site stops training rather than restart forever.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

import torch.distributed as dist
import torch.multiprocessing as mp
from torch._C._distributed_c10d import (
    PrefixStore,
    TCPStore,
)  # torch.distributed's, where mypy sees their types

from .commands import Commands

log = logging.getLogger(__name__)
T = TypeVar("T")


START_WAIT = 300.0
"""The least the site's store waits for a rank (its start: a spawned rank imports torch and joins, tens of
seconds on a busy host); the group's own timeout bounds its collectives."""


def _rendezvous(timeout: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(timeout, START_WAIT))


class GroupRestarted(RuntimeError):
    """The site's group broke during a call and was started again (or, after too many failures, not):
    the call's effects must be discarded on every rank (reload the last checkpoint)."""


def _worker(
    rank: int,
    world: int,
    port: int,
    timeout: float,
    generation: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    backend: str = "gloo",
) -> None:
    wait = datetime.timedelta(seconds=timeout)
    store = TCPStore("127.0.0.1", port, world, is_master=False, timeout=_rendezvous(timeout))
    store.set(f"up/{rank}", "")  # (rank 0 joins the group once every rank is here: ``SiteGroup.start``)
    dist.init_process_group(
        backend, store=PrefixStore("pg/", store), rank=rank, world_size=world, timeout=wait
    )
    try:
        fn(rank, world, generation, Commands(rank, store=store), *args)
    finally:
        dist.destroy_process_group()


BACKEND_MARKS = ("third_party/gloo", "gloo/transport", "NCCL", "ProcessGroup")
"""What the message of a collective's failure carries when the backend raises a plain RuntimeError
(gloo does, for a dropped connection, "Read error ... Connection reset by peer", and for its timeout,
"Timed out waiting 3000ms for recv operation", both from its sources under ``third_party/gloo``)."""


def _leaves(error: BaseException) -> list[BaseException]:
    """``error``'s leaves (an exception group's, its causes')."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for e in error.exceptions for leaf in _leaves(e)]
    return [error] + (_leaves(error.__cause__) if error.__cause__ is not None else [])


class SiteGroup:
    """Ranks 1..N-1 of a site as processes of this host, and the process group rank 0 shares with them."""

    def __init__(
        self,
        world: int,
        worker: Callable[..., Any],
        *args: Any,
        timeout: float = 60.0,
        max_restarts: int = 3,
        window: float = 600.0,
        backend: str = "gloo",
    ) -> None:
        """``worker(rank, world, generation, commands, *args)`` runs on every other rank (a module-level
        function: the spawn context imports it by name); its ``commands`` receive rank 0's through the
        site's store (:attr:`commands` sends them), so an idle rank waits as long as rank 0 takes."""
        if world < 1:
            raise ValueError("a site has at least one rank")
        self.world, self.worker, self.args, self.timeout = world, worker, args, timeout
        self.max_restarts, self.window, self.backend = max_restarts, window, backend
        self.generation = 0
        self.failures: list[float] = []
        self._procs: list[BaseProcess] = []
        self._store: TCPStore | None = None
        self.commands = Commands(0)  # (bound to each generation's store by start())
        self.up = False

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def start(self) -> None:
        """Spawn the other ranks and join the group with them (rank 0)."""
        wait = datetime.timedelta(seconds=self.timeout)
        self._store = TCPStore(  # (on a port the kernel picks and the store holds: see launch.host_store)
            "127.0.0.1",
            0,
            self.world,
            is_master=True,
            timeout=_rendezvous(self.timeout),
            wait_for_workers=False,
        )
        port = self._store.port
        self.commands = Commands(0, store=self._store)
        ctx = mp.get_context("spawn")
        self.generation += 1
        for rank in range(1, self.world):
            p = ctx.Process(
                target=_worker,
                args=(
                    rank,
                    self.world,
                    port,
                    self.timeout,
                    self.generation,
                    self.worker,
                    self.args,
                    self.backend,
                ),
                daemon=True,
            )
            p.start()
            self._procs.append(p)
        try:
            self._await_ranks()
        except BaseException:
            self._teardown()  # (the ranks that did start are not left running)
            raise
        dist.init_process_group(
            self.backend, store=PrefixStore("pg/", self._store), rank=0, world_size=self.world, timeout=wait
        )
        self.up = True

    def _await_ranks(self) -> None:
        """Wait until every rank's process reached the store (up to :data:`START_WAIT`): gloo's join
        waits for the other ranks only as long as the group's timeout, and a rank spawned on a busy host
        took longer than that to import torch (a test's 15 s group failed to start: "wait timeout after
        15000ms"). A rank whose process ended meanwhile fails the start at once."""
        assert self._store is not None
        keys = [f"up/{rank}" for rank in range(1, self.world)]
        end = time.monotonic() + START_WAIT
        while not self._store.check(keys):
            gone = self.dead()
            if gone is not None:
                raise RuntimeError(f"the site's group did not start: {gone}")
            if time.monotonic() > end:
                raise TimeoutError(f"the site's ranks did not start within {START_WAIT:g} s")
            time.sleep(0.05)

    def call(self, action: Callable[[], T]) -> T:
        """``action()`` (collectives of the site); :class:`GroupRestarted` if the group broke meanwhile."""
        if not self.up:
            raise GroupRestarted("the site's group is down")
        try:
            result = action()
        except (RuntimeError, dist.DistError) as e:  # gloo: a rank's connection closed, or a timeout
            self.restart(f"{type(e).__name__}: {e}")
            raise GroupRestarted(
                f"generation {self.generation - 1} failed ({type(e).__name__}: {e}); generation"
                f" {self.generation} is up"
            ) from e
        gone = self.dead()
        if gone is not None:
            self.restart(gone)
            raise GroupRestarted(
                f"generation {self.generation - 1} failed ({gone}); generation {self.generation} is up"
            )
        return result

    def dead(self) -> str | None:
        """Which rank's process is gone, if one is (None while all of them run)."""
        for rank, p in enumerate(self._procs, start=1):
            if not p.is_alive():
                return f"rank {rank}'s process {p.pid} exited with {p.exitcode}"
        return None

    def failure(self, error: BaseException) -> str | None:
        """Why ``error``, raised on rank 0 while it worked with the group, means that the group broke: a
        rank's process is gone, or a collective failed (a ``DistError``, or the backend's RuntimeError:
        gloo raises one when a rank's connection drops, or when a hung rank runs into the group's
        timeout, see :data:`BACKEND_MARKS`); None when it is not the group's (rank 0's own error: it is
        raised on)."""
        leaves = _leaves(error)
        if any(isinstance(leaf, GroupRestarted) for leaf in leaves):
            return None  # (the group stays down: restarting it again is what that says not to do)
        gone = self.dead()
        if gone is not None:
            return gone
        for leaf in leaves:
            if isinstance(leaf, dist.DistError) or (
                isinstance(leaf, RuntimeError) and any(m in str(leaf) for m in BACKEND_MARKS)
            ):
                return f"{type(leaf).__name__}: {leaf}"
        return None

    def restart(self, reason: str) -> None:
        """Every rank killed, the process group destroyed, a new generation started (rank 0 joins it);
        :class:`GroupRestarted` instead when this is failure ``max_restarts + 1`` within ``window``
        seconds: the group stays down."""
        now = time.monotonic()
        self.failures = [t for t in self.failures if now - t < self.window] + [now]
        log.warning("site group generation %d failed (%s): restarting it", self.generation, reason)
        self._teardown()
        if len(self.failures) > self.max_restarts:
            raise GroupRestarted(
                f"{len(self.failures)} failures within {self.window:g} s (the last: {reason}): the site's"
                " group stays down"
            )
        self.start()

    def _teardown(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=30)
        self._procs = []
        if self.up:
            self.up = False
            try:
                dist.destroy_process_group()
            except (RuntimeError, ValueError) as e:
                log.warning("destroying the site's process group failed: %s", e)
        self._store = None  # the last reference: its server stops

    def close(self, stop: Callable[[], None] | None = None) -> None:
        """``stop()`` (tells the ranks to end, e.g. a STOP command), then the ranks are joined or killed."""
        if self.up and stop is not None:
            try:
                stop()
            except (RuntimeError, dist.DistError) as e:
                log.warning("could not tell the site's ranks to stop: %s", e)
            for p in self._procs:
                p.join(timeout=10)
        self._teardown()
