"""A local data-parallel worker: one of ranks 1..N-1 of a local group, in a process of its own.

Rank 0 (:class:`~.group.LocalGroup`, in the node process) starts the workers as ``python -m
p2ptrain.training.local.worker --rank R --world-size N --store HOST:PORT ...`` (see
``LocalGroup._worker_command``); nobody runs this by hand.

Theory of operation: a worker builds the task and the model exactly as the trainer does (the run's
seed, then ``task.model()``), draws batches from its own data seed, writes ``ready/R`` to rank 0's store
and waits for ``go``; joins the process group; then obeys rank 0's numbered commands (``ctrl/0``,
``ctrl/1``, ...) in order: PARAMS (receive rank 0's parameters), DIGEST (write a digest of its own to the
store), STOP (leave), COMPUTE (compute the next batch, join the gradient all-reduce). Waiting for a
command has no timeout (rank 0 may be in a long averaging round); the collectives after it have the
group's. Any error ends the process with a traceback on stderr and a non-zero status: rank 0 notices, and
restarts its group. A watchdog thread ends the process as soon as rank 0's process is gone. The
commands, the store's keys and the collectives are :mod:`.protocol`'s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore  # torch.distributed.TCPStore, where mypy sees its types

from ...tasks import load_task
from .protocol import (
    COMPUTE,
    DIGEST,
    GO_KEY,
    PARAMS,
    STOP,
    FlatSpace,
    backend_for,
    broadcast_tensors,
    ctrl_key,
    digest_key,
    grad_params,
    parameter_digest,
    ready_key,
    reduce_gradients,
    sync_tensors,
)

log = logging.getLogger(__name__)

IDLE_WAIT = datetime.timedelta(minutes=10)  # one store wait; a timeout just means: wait again


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m p2ptrain.training.local.worker", description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--store", required=True, help="HOST:PORT of rank 0's TCPStore")
    p.add_argument("--parent", type=int, required=True, help="rank 0's pid: exit when it is gone")
    p.add_argument("--device", default="cpu")
    p.add_argument("--task", required=True)
    p.add_argument("--task-options", default="{}", help="JSON object")
    p.add_argument("--seed", type=int, default=0, help="the run's seed (initial weights)")
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--data-seed", type=int, required=True)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--sys-path", default="[]", help="JSON list: rank 0's import path")
    p.add_argument("--log-level", type=int, default=logging.WARNING, help="a logging level number")
    return p.parse_args(argv)


def watch_parent(parent: int) -> None:
    """End this process when rank 0's is gone (this one was re-parented), even mid-collective."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


class Worker:
    """One worker rank: its model, its batches, its end of rank 0's store."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.rank, self.world_size = args.rank, args.world_size
        self.device = torch.device(args.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if args.threads:
            torch.set_num_threads(args.threads)
        self.task = load_task(args.task, json.loads(args.task_options))
        torch.manual_seed(args.seed)  # as the trainer does; rank 0's parameters follow anyway
        self.model = self.task.model().to(self.device)
        self.batches = self.task.batches(args.data_seed, args.batch_size)
        self.sync = sync_tensors(self.model)
        self.grads = grad_params(self.model)
        self.param_space = FlatSpace(self.sync, self.device)
        self.grad_space = FlatSpace(self.grads, self.device)
        host, _, port = args.store.rpartition(":")
        timeout = datetime.timedelta(seconds=args.timeout)
        self.store = TCPStore(host, int(port), self.world_size, is_master=False, timeout=timeout)
        self.backend = backend_for([args.device])
        self.timeout = timeout

    def wait_key(self, key: str) -> bytes:
        while True:
            try:
                self.store.wait([key], IDLE_WAIT)
                return self.store.get(key)
            except dist.DistStoreError:  # a timeout: rank 0 is busy elsewhere (a lost store raises otherwise)
                continue

    def run(self) -> int:
        self.store.set(ready_key(self.rank), str(os.getpid()))
        if self.wait_key(GO_KEY) != b"run":
            return 0
        dist.init_process_group(
            self.backend, store=self.store, rank=self.rank, world_size=self.world_size, timeout=self.timeout
        )
        log.info("joined the local group as rank %d of %d on %s", self.rank, self.world_size, self.device)
        seq = 0
        while True:
            flags = int(self.wait_key(ctrl_key(seq)))
            if flags & PARAMS:
                broadcast_tensors(self.sync, self.param_space, _wait, root=False)
            if flags & DIGEST:
                self.store.set(digest_key(seq, self.rank), parameter_digest(self.model).hex())
            if flags & STOP:
                dist.destroy_process_group()  # only here: after an error, exiting is the cleanup
                return 0
            if flags & COMPUTE:
                loss, samples = self.compute()
                reduce_gradients(self.grads, self.grad_space, loss, samples, self.device, _wait)
            seq += 1

    def compute(self) -> tuple[float, int]:
        """This rank's next batch, forward and backward, as the trainer computes rank 0's. A non-finite
        loss is reported (rank 0 raises), not applied."""
        batch = next(self.batches)
        self.model.zero_grad(set_to_none=True)
        self.model.train()
        loss = self.task.loss(self.model, self.task.to_device(batch, self.device))
        value = float(loss.detach())
        if math.isfinite(value):
            loss.backward()  # type: ignore[no-untyped-call]
        return value, self.task.samples(batch)


def _wait(work: Any) -> None:
    work.wait()  # bounded by the process group's timeout (gloo), or by NCCL's watchdog


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format=f"%(asctime)s local worker {args.rank} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    watch_parent(args.parent)
    for entry in json.loads(args.sys_path):  # rank 0's task module may live on a path added at run time
        if isinstance(entry, str) and entry not in sys.path:
            sys.path.append(entry)
    try:
        return Worker(args).run()
    except dist.DistNetworkError as e:  # rank 0's store is gone: rank 0 ended or restarts its group
        log.info("rank 0 is gone (%s): leaving", str(e).splitlines()[0] if str(e) else e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
