"""Starting a site's ranks on one host: N processes joined by ``torch.distributed``.

``spawn`` runs ``fn(rank, world, *args)`` in N fresh processes (``torch.multiprocessing``'s spawn: no
fork of a process that may hold threads), each with the site's process group initialised: gloo for
``device="cpu"`` (the default, whatever the host has: a CPU site or test on a GPU host stays on gloo),
NCCL for ``device="cuda"`` (rank r on device r), the rendezvous on 127.0.0.1 only (the ranks never face
the network; rank 0 alone runs the p2p node). Several hosts use torch's own launcher
instead (``torchrun``), which sets the same environment; :func:`init_from_env` joins either way.
"""

from __future__ import annotations

import datetime
import faulthandler
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._C._distributed_c10d import PrefixStore, TCPStore  # torch.distributed's, typed for mypy

from ...malloc import M_MMAP_THRESHOLD, mallopt

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 1 << 20
"""Allocations of at least this many bytes get their own mapping, returned to the system when freed."""


def return_freed_memory(threshold: int = MMAP_THRESHOLD) -> None:
    """Freed buffers of ``threshold`` bytes or more go back to the system at once (glibc's
    ``M_MMAP_THRESHOLD``; ``MALLOC_MMAP_THRESHOLD_``, if set, wins; no effect on other C libraries).

    Why: glibc serves a large allocation from its own mapping only above a threshold that it raises, up
    to 32 MiB, every time such a mapping is freed; below it, freed blocks stay in its heaps. A site's rank
    allocates and frees FSDP2's gathered unit (a transformer block's parameters, then their gradients)
    many times a step, and at mid sizes that block is under 32 MiB: measured at 124M parameters (20 MB
    blocks), every rank of a site of 4 peaked at 3.8-5.0x its fp32 parameter bytes with glibc's default
    and at 1.8-1.9x with this (target 2.25x; at 350M, 50 MB blocks, the default was already within it).
    Fixing the threshold also stops the raising."""
    mallopt(M_MMAP_THRESHOLD, threshold, "MALLOC_MMAP_THRESHOLD_")


def backend_for(device: str | None = None) -> str:
    """NCCL for CUDA devices, gloo otherwise."""
    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return "nccl" if kind.startswith("cuda") else "gloo"


def host_store(world: int, timeout: float) -> TCPStore:
    """The site's rendezvous store, hosted by the launcher on a port the kernel picks and the store holds
    from then on; ranks join it as clients (``store.port``). A port found free and let go before a rank
    bound it could be taken in between (an outgoing connection's ephemeral port, another test's
    listener): a spawned site's rank 0 then failed with EADDRINUSE (one CI run). The caller keeps the
    store until its ranks are done."""
    return TCPStore(
        "127.0.0.1",
        0,
        world,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
    )


def init_from_env(timeout: float = 600.0, device: str | None = None) -> tuple[int, int]:
    """Join the site's process group from the launcher's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``: ``torchrun`` and :func:`spawn` set them); returns (rank, world)."""
    return_freed_memory()
    backend = backend_for(device)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
    wait = datetime.timedelta(seconds=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group(backend, timeout=wait)
        return dist.get_rank(), dist.get_world_size()
    # Under torchrun the store outlives a restart of the workers (``--max-restarts``): the group's keys
    # go under the attempt's prefix, or the new ranks read the old ones' addresses (and gloo's full
    # mesh fails with "Connection refused").
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=not agent and rank == 0,
        timeout=wait,
        multi_tenant=not agent,
    )
    dist.init_process_group(
        backend,
        store=PrefixStore(f"p2ptrain/attempt-{attempt}/", store),
        rank=rank,
        world_size=world,
        timeout=wait,
    )
    return rank, world


def _entry(
    rank: int,
    fn: Callable[..., Any],
    world: int,
    port: int,
    timeout: float,
    device: str,
    args: tuple[Any, ...],
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        # (the launcher hosts the store, as torchrun's agent does: every rank joins it as a client)
        TORCHELASTIC_USE_AGENT_STORE=str(True),
    )
    faulthandler.enable()  # a rank that crashes in C++ prints where its Python was
    init_from_env(timeout, device)
    try:
        fn(rank, world, *args)
        leave_together()
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_now()


def exit_now(code: int = 0) -> NoReturn:
    """End a rank that is done, once every rank is (:func:`leave_together`): its output flushed, then
    straight out, with no teardown of the process group and no interpreter shutdown. Both tear down the
    backend's C++ state while its threads may still run, and both crashed ranks that had finished their
    work, now and then: a gloo group destroyed on one rank while another closed its own aborted that
    process ("terminate called without an active exception": a torchrun site's rank 0, 2 of 9 runs), and
    a spawned rank of a sharded test died of SIGSEGV in one CI run (its work raised nothing; where it
    crashed is unknown: ``faulthandler`` now prints that). After the barrier no collective is in flight:
    nothing is lost by leaving the sockets to the kernel."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def leave_together() -> None:
    """Wait until every rank is done before this one closes its connections (a rank that failed is not
    waited for: ``spawn`` ends the others). A rank that exited while a peer's backend still had traffic
    to or from it reset the connection under that peer's I/O thread, which then aborted its process at
    exit ("terminate called without an active exception", SIGABRT: a spawned checkpoint test, once)."""
    dist.barrier()


def spawn(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 600.0, device: str = "cpu"
) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` local ranks and wait for them all; raises if one
    failed (``torch.multiprocessing.ProcessRaisedException`` / ``ProcessExitedException``). ``device``:
    "cpu" (gloo) or "cuda" (NCCL, rank r on GPU r)."""
    if world < 1:
        raise ValueError("a site has at least one rank")
    store = host_store(world, timeout)  # (held here until every rank is done)
    mp.spawn(_entry, args=(fn, world, store.port, timeout, device, args), nprocs=world, join=True)  # type: ignore[attr-defined,no-untyped-call]
