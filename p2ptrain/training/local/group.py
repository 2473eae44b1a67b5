"""This host's data-parallel workers: several devices, one p2p identity, one participant in the swarm.

Theory of operation. A host with N devices runs one node process (rank 0: the p2p node, the trainer, the
CollaborativeOptimizer, on ``devices[0]``) and N - 1 worker processes (``python -m
p2ptrain.training.local.worker``, ranks 1..N-1, one per other device), joined by ``torch.distributed``
inside the host: NCCL when the devices are CUDA, gloo on CPU. The swarm sees one peer whose batches are
N times bigger, as INTELLECT-1's ElasticDeviceMesh keeps the WAN group apart from the local one.

- **Commands go through the store, tensors through collectives.** Rank 0 hosts a TCPStore that listens
  on 127.0.0.1 only (gloo, too, is bound to the loopback interface) and writes numbered commands to it
  (``ctrl/0``, ``ctrl/1``, ... : PARAMS, COMPUTE, DIGEST, STOP flags). Idle workers wait on the store,
  without a timeout, so rank 0 may spend minutes in an averaging round or an evaluation; only once a
  command is out do all ranks enter the collectives it names, so every collective is bounded by the
  group's (short) timeout.
- **Lockstep per batch.** ``backward`` sends COMPUTE (with PARAMS first when rank 0's parameters moved
  since they were last sent), computes rank 0's own batch while the workers compute theirs, then
  all-reduces the sample counts and the gradients, each rank's scaled by its share of the samples, in
  one flat buffer per dtype (split in buckets of ``BUCKET_BYTES``): every rank ends with the
  sample-weighted mean. ``publish`` broadcasts the parameters after the optimizer changed them, so the
  next batch is computed on the same weights everywhere.
- **A worker that fails costs a restart, never the swarm.** Rank 0 waits on every collective in short
  slices and looks at its workers' processes between them (gloo also raises at once when a peer's
  connection drops; NCCL ops are polled, never waited on blindly): a worker that dies is noticed at
  once by gloo or within ``POLL`` (if it died while idle, in the next batch's collective), a hung one
  after ``timeout``. Rank 0 then kills the rest, destroys the process group and
  starts a new generation: a new store on a new port (a restarted group never meets stale workers), new
  processes, the parameters broadcast again once they are ready. Meanwhile rank 0 trains alone; the
  batch in progress counts with rank 0's own gradients only (they are copied into the flat buffer, and
  written back only when the whole reduction succeeded). After ``max_restarts`` failures within
  ``restart_window`` seconds it logs an error and trains on alone.
- **No stray processes.** Workers run in their own session (a Ctrl-C on the terminal reaches rank 0
  only, which drains); they are killed by process group on close, on failure, at interpreter exit, and
  they end themselves when rank 0's process is gone.

One LocalGroup per process: it uses torch.distributed's default process group. Memory: each rank keeps a
flat copy of the parameters and one of the gradients (for the collectives) beside the model's own.
"""

from __future__ import annotations

import atexit
import collections
import datetime
import hashlib
import json
import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore  # torch.distributed.TCPStore, where mypy sees its types

from ...config import RunConfig
from ...errors import ConfigError
from ...tasks import Task
from .processes import (
    GLOO_INTERFACE,
    describe,
    first_line,
    gloo_on_loopback,
    kill,
    loopback_interface,
    loopback_store,
    peek,
)
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
    unpack_gradients,
)

log = logging.getLogger(__name__)

POLL = datetime.timedelta(milliseconds=200)  # rank 0 looks at its workers this often during a collective
STOP_GRACE = 5.0  # seconds workers get to exit after STOP before they are killed
NCCL_ERRORS = "TORCH_NCCL_ASYNC_ERROR_HANDLING"  # rank 0 sets 0: an NCCL error raises, not aborts


def worker_data_seed(data_seed: int, rank: int, generation: int) -> int:
    """The data seed of worker ``rank``: different from rank 0's (which is ``data_seed``), from the other
    workers', and from the same worker's in an earlier generation (a restart does not replay its data)."""
    text = f"{data_seed}/{rank}/{generation}".encode()
    h = hashlib.blake2b(text, digest_size=8, person=b"p2ptrain-local")
    return int.from_bytes(h.digest(), "little") & (2**62 - 1)


def local_devices(count: int, device: str = "cpu") -> list[str]:
    """``count`` devices for a LocalGroup whose rank 0 runs on ``device``: that many CPU ranks, or rank 0
    on ``cuda:K`` and the workers on the other GPUs in index order."""
    if count < 2:
        raise ConfigError(f"a local group needs at least 2 ranks, not {count}")
    dev = torch.device(device)
    if dev.type == "cpu":
        return ["cpu"] * count
    if dev.type != "cuda":
        raise ConfigError(f"local workers run on CPU or CUDA devices, not {device!r}")
    available = torch.cuda.device_count()
    if count > available:
        raise ConfigError(f"{count} local ranks need {count} GPUs; torch sees {available}")
    first = dev.index if dev.index is not None else 0
    others = [f"cuda:{i}" for i in range(available) if i != first]
    return [f"cuda:{first}", *others[: count - 1]]


# ---- rank 0 ----------------------------------------------------------------------------------------


class _State(Enum):
    OFF = "off"  # no workers (not started yet, or abandoned after an error on rank 0)
    STARTING = "starting"  # workers spawned, not all ready yet: rank 0 trains alone meanwhile
    UP = "up"  # the process group is formed and every worker waits for a command
    ALONE = "alone"  # too many failures: rank 0 trains alone from now on
    CLOSED = "closed"


class _Failure(Exception):
    """The local group broke (a worker died, hung or could not start); handled by a restart."""


class LocalGroup:
    """Rank 0 of this host's local data-parallel group; a ``LocalWorkers`` for ``TrainerOptions.local``.

    ``devices`` holds one device per rank, rank 0's (the trainer's) first; see :func:`local_devices`.
    ``data_seed`` is the trainer's own data seed (workers derive theirs from it); ``start`` may give it
    instead. ``timeout`` bounds every collective (it must exceed the slowest rank's batch compute time),
    ``startup_timeout`` a worker's start (imports, the task's data, the model).
    """

    def __init__(
        self,
        config: RunConfig,
        task: Task,
        devices: Sequence[str],
        *,
        data_seed: int | None = None,
        timeout: float = 30.0,
        startup_timeout: float = 300.0,
        max_restarts: int = 5,
        restart_window: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if len(devices) < 2:
            raise ConfigError(f"a local group needs at least 2 devices (ranks), not {len(devices)}")
        if not (timeout > 0 and startup_timeout > 0 and max_restarts >= 0):
            raise ConfigError("local group timeouts must be positive and max_restarts not negative")
        self.config, self.task, self.devices = config, task, list(devices)
        self.backend = backend_for(self.devices)
        if dist.is_initialized():
            raise ConfigError("a local group needs torch.distributed's default process group, already in use")
        for rank, name in enumerate(self.devices[1:], 1):
            if torch.device(name).type == "cuda" and torch.device(name).index is None:
                raise ConfigError(f"local rank {rank}'s device {name!r} needs an index (cuda:{rank})")
        try:
            self._task_options = json.dumps(dict(config.task.options))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"task.options must be plain JSON values for local workers: {e}") from None
        self.data_seed = data_seed
        # CPU ranks share the cores rather than fight over them (training.threads, when set, wins).
        self.threads = config.training.threads
        if not self.threads and self.backend == "gloo":
            self.threads = max(1, torch.get_num_threads() // self.world_size)
        self.timeout, self.startup_timeout = timeout, startup_timeout
        self.max_restarts, self.restart_window, self.clock = max_restarts, restart_window, clock
        self.restarts = 0
        self.params_sent = 0  # parameter broadcasts (group formations included)
        self._lock = threading.RLock()
        self._state = _State.OFF
        self._procs: list[subprocess.Popen[bytes]] = []
        self._store: TCPStore | None = None
        self._pg_up = False
        self._generation = 0
        self._spawned_at = 0.0
        self._seq = self._forgotten = 0  # next command's number; commands below _forgotten are deleted
        self._failures: collections.deque[float] = collections.deque()
        self._model: torch.nn.Module | None = None
        self._atexit = False
        self._nccl_errors = os.environ.get(NCCL_ERRORS)

    # ---- the LocalWorkers protocol ----

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def active(self) -> bool:
        """Whether the workers take part in the batches now."""
        return self._state is _State.UP

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def generation(self) -> int:
        """How many times workers were spawned (the workers' data seeds depend on it)."""
        return self._generation

    def start(self, model: torch.nn.Module, data_seed: int | None = None, *, wait: bool = True) -> bool:
        """Spawn the workers for ``model`` (the trainer's); with ``wait``, until they are up (or the
        restart budget is spent). Returns whether the group is up. ``backward`` starts it lazily
        otherwise, and trains alone until the workers are ready."""
        with self._lock:
            if self._state is _State.CLOSED:
                raise RuntimeError("this local group is closed")
            if data_seed is not None:
                self.data_seed = data_seed
            self._bind(model)
            self._advance()
            while wait and self._state is _State.STARTING:
                self._advance(block=True)
            return self._state is _State.UP

    def backward(
        self, model: torch.nn.Module, compute: Callable[[Any], float], batch: Any
    ) -> tuple[float, int]:
        with self._lock:
            try:
                return self._backward(model, compute, batch)
            except BaseException:
                self._abandon()  # the workers may be mid-batch: the next call starts a new group
                raise

    def publish(self, model: torch.nn.Module, changed: bool, stop: bool) -> None:
        with self._lock:
            if stop:
                self._close()
                return
            try:
                self._bind(model)
                if self._state is _State.UP and (changed or self._params_moved()):
                    self._attempt(lambda: self._command(PARAMS), "the parameter broadcast")
            except BaseException:
                self._abandon()
                raise

    def close(self) -> None:
        """Tell the workers to stop, give them ``STOP_GRACE`` seconds, kill what is left."""
        with self._lock:
            self._close()

    def digests(self) -> list[bytes]:
        """For tests and debugging: a digest of each rank's parameters as that rank holds them now, rank
        0's first; only rank 0's when the group is not up."""
        with self._lock:
            if self._model is None:
                raise RuntimeError("start the local group with a model first")
            own = parameter_digest(self._model)
            if self._state is not _State.UP:
                return [own]
            got = self._attempt(self._collect_digests, "the digest request")
            return [own, *got] if got is not None else [own]

    def status(self) -> dict[str, Any]:
        return {
            "ranks": self.world_size,
            "state": self._state.value,
            "restarts": self.restarts,
            "generation": self._generation,
            "params_sent": self.params_sent,
        }

    # ---- one batch ----

    def _backward(
        self, model: torch.nn.Module, compute: Callable[[Any], float], batch: Any
    ) -> tuple[float, int]:
        self._bind(model)
        self._advance()
        seq = None
        if self._state is _State.UP:
            flags = COMPUTE | (PARAMS if self._params_moved() else 0)
            seq = self._attempt(lambda: self._command(flags), "the compute command")
        loss = compute(batch)
        samples = self.task.samples(batch)
        if seq is None:
            return loss, samples
        device = self._device
        reduced = self._attempt(
            lambda: reduce_gradients(self._grads, self._grad_space, loss, samples, device, self._wait),
            "the gradient all-reduce",
        )
        if reduced is None:  # the group failed: this batch counts with rank 0's gradients alone
            return loss, samples
        self._forget(seq)
        if reduced.nonfinite:
            raise FloatingPointError(
                f"the loss is not finite on {reduced.nonfinite} of {self.world_size} local ranks: "
                "training diverged"
            )
        unpack_gradients(self._grads, self._grad_space)
        return reduced.loss, reduced.samples

    def _bind(self, model: torch.nn.Module) -> None:
        if model is self._model:
            return
        first = next(model.parameters())
        want = torch.device(self.devices[0])
        if first.device.type != want.type or want.index not in (None, first.device.index):
            raise ConfigError(f"the model is on {first.device} but local rank 0's device is {want}")
        if self._state is _State.UP:  # another model: the workers' buffers no longer fit
            self._abandon()
        self._model, self._device = model, first.device
        self._sync = sync_tensors(model)
        self._grads = grad_params(model)
        self._param_space = FlatSpace(self._sync, self._device)
        self._grad_space = FlatSpace(self._grads, self._device)
        self._sent_versions: list[int] = []

    def _params_moved(self) -> bool:
        """Whether rank 0's parameters changed in place since they were last sent: a safety net under
        ``publish(changed=...)`` (a state download, a restore)."""
        return [t._version for t in self._sync] != self._sent_versions

    # ---- commands and collectives ----

    def _command(self, flags: int) -> int:
        assert self._store is not None
        seq = self._seq
        self._seq += 1
        self._store.set(ctrl_key(seq), str(flags))
        if flags & PARAMS:
            broadcast_tensors(self._sync, self._param_space, self._wait, root=True)
            self._sent_versions = [t._version for t in self._sync]
            self.params_sent += 1
        return seq

    def _collect_digests(self) -> list[bytes]:
        assert self._store is not None
        seq = self._command(DIGEST)
        keys = [digest_key(seq, rank) for rank in range(1, self.world_size)]
        self._wait_keys(keys, "the digests", self.timeout)
        got = [bytes.fromhex(self._store.get(key).decode()) for key in keys]
        for key in keys:
            self._store.delete_key(key)
        self._forget(seq)
        return got

    def _forget(self, seq: int) -> None:
        """Every worker has read the commands up to ``seq``: drop them from the store."""
        assert self._store is not None
        for old in range(self._forgotten, seq + 1):
            self._store.delete_key(ctrl_key(old))
        self._forgotten = seq + 1

    def _wait(self, work: Any) -> None:
        """Wait for a collective in slices, looking at the workers in between; bounded by ``timeout``."""
        deadline = time.monotonic() + self.timeout
        pause = 1e-4
        while True:
            if self.backend == "nccl":  # never block the CPU on a stream that may never finish
                if work.is_completed():
                    work.wait()
                    return
                time.sleep(pause)
                pause = min(2 * pause, 2e-3)
            else:
                try:
                    work.wait(POLL)
                    return
                except RuntimeError:
                    if work.is_completed():  # finished with an error (or just now): wait() says which
                        try:
                            work.wait()
                            return
                        except RuntimeError as e:
                            raise _Failure(first_line(e)) from e
            self._check_workers()
            if time.monotonic() > deadline:
                raise _Failure(f"a collective took more than {self.timeout:g} s")

    def _wait_keys(self, keys: list[str], what: str, limit: float) -> None:
        assert self._store is not None
        deadline = time.monotonic() + limit
        while not self._store.check(keys):
            self._check_workers()
            if time.monotonic() > deadline:
                raise _Failure(f"no {what} after {limit:g} s")
            time.sleep(0.01)

    def _check_workers(self) -> None:
        for rank, proc in enumerate(self._procs, 1):
            status = peek(proc)
            if status is not None:
                raise _Failure(f"local worker {rank} (pid {proc.pid}) {describe(status)}")

    def _attempt(self, action: Callable[[], Any], what: str) -> Any:
        """``action()``, or None after handling the group's failure (a restart, or training alone)."""
        try:
            return action()
        except (_Failure, RuntimeError) as e:  # torch's DistError and its kin are RuntimeErrors
            self._failed(f"{what} failed: {e if isinstance(e, _Failure) else first_line(e)}")
            return None

    # ---- starting, failing, restarting, stopping ----

    def _advance(self, *, block: bool = False) -> None:
        """Start the workers if there are none; form the group once they are all ready."""
        if self._state is _State.OFF:
            self._attempt(self._spawn, "starting the local workers")
        if self._state is not _State.STARTING:
            return
        self._attempt(lambda: self._join(block), "forming the local group")

    def _spawn(self) -> None:
        if self.data_seed is None:
            self.data_seed = secrets.randbits(62)
            log.info("local workers draw their data from a random seed (none was given)")
        if not self._atexit:
            atexit.register(self._kill_all)
            self._atexit = True
            if self.threads and self.threads != torch.get_num_threads():
                log.info("local rank 0 computes with %d threads", self.threads)
                torch.set_num_threads(self.threads)
        self._generation += 1
        self._state = _State.STARTING  # from here on, a failure tears down what was started
        self._store = loopback_store(self.world_size, self.timeout)
        port = self._store.port
        env = dict(os.environ)  # without the NCCL setting rank 0 made for itself (see _join)
        env.pop(NCCL_ERRORS, None)
        if self._nccl_errors is not None:
            env[NCCL_ERRORS] = self._nccl_errors
        if self.backend == "gloo" and (lo := loopback_interface()):
            env[GLOO_INTERFACE] = lo
        for rank in range(1, self.world_size):
            command = self._worker_command(rank, port)
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
            self._procs.append(proc)
        self._spawned_at = time.monotonic()
        log.info(
            "starting %d local worker(s) on %s (generation %d, pids %s)",
            self.world_size - 1,
            ", ".join(self.devices[1:]),
            self._generation,
            ", ".join(map(str, self.worker_pids)),
        )

    def _worker_command(self, rank: int, port: int) -> list[str]:
        assert self.data_seed is not None
        training = self.config.training
        args = {
            "--rank": rank,
            "--world-size": self.world_size,
            "--store": f"127.0.0.1:{port}",
            "--parent": os.getpid(),
            "--device": self.devices[rank],
            "--task": self.config.task.name,
            "--task-options": self._task_options,
            "--seed": self.config.run.seed,
            "--batch-size": training.batch_size,
            "--data-seed": worker_data_seed(self.data_seed, rank, self._generation),
            "--threads": self.threads,
            "--timeout": self.timeout,
            "--sys-path": json.dumps([os.path.abspath(p) if p else os.getcwd() for p in sys.path]),
            "--log-level": log.getEffectiveLevel(),
        }
        command = [sys.executable, "-m", "p2ptrain.training.local.worker"]
        for flag, value in args.items():
            command += [flag, str(value)]
        return command

    def _join(self, block: bool) -> None:
        """Form the process group when every worker is ready (with ``block``, wait for that)."""
        assert self._store is not None
        keys = [ready_key(rank) for rank in range(1, self.world_size)]
        while not self._store.check(keys):
            self._check_workers()
            if time.monotonic() - self._spawned_at > self.startup_timeout:
                raise _Failure(f"the workers were not ready after {self.startup_timeout:g} s")
            if not block:
                return
            time.sleep(0.05)
        if dist.is_initialized():
            raise _Failure("torch.distributed's default process group is already in use in this process")
        self._store.set(GO_KEY, "run")
        if self.backend == "nccl":  # a failed collective must raise here, not tear the node process down
            os.environ[NCCL_ERRORS] = "0"
        timeout = datetime.timedelta(seconds=self.timeout)
        with gloo_on_loopback(self.backend):
            dist.init_process_group(
                self.backend, store=self._store, rank=0, world_size=self.world_size, timeout=timeout
            )
        self._pg_up = True
        self._seq = self._forgotten = 0
        self._state = _State.UP
        self._command(PARAMS)  # everyone computes on rank 0's weights
        log.info("local group up: %d ranks (%s), %s", self.world_size, ", ".join(self.devices), self.backend)

    def _failed(self, reason: str) -> None:
        """The group broke: tear it down and start a new generation, unless that happened too often."""
        reason += self._casualties()
        self._teardown(graceful=False)
        self._state = _State.OFF
        now = self.clock()
        while self._failures and self._failures[0] <= now - self.restart_window:
            self._failures.popleft()
        self._failures.append(now)
        if len(self._failures) > self.max_restarts:
            log.error(
                "local group: %s; it failed %d times in %.0f s: this process trains on alone, without "
                "its local workers",
                reason,
                len(self._failures),
                self.restart_window,
            )
            self._state = _State.ALONE
            return
        log.warning("local group: %s; restarting it", reason)
        self.restarts += 1
        try:
            self._spawn()
        except (OSError, RuntimeError) as e:  # cannot even start processes: no use retrying at once
            log.error("local group: cannot start workers (%s): this process trains on alone", e)
            self._teardown(graceful=False)
            self._state = _State.ALONE

    def _casualties(self) -> str:
        """Which workers are dead, for the log line (gloo may report a dead peer a moment before the
        kernel lets us see the process's exit)."""
        deadline = time.monotonic() + 0.5
        while True:
            dead = [(r, p, s) for r, p in enumerate(self._procs, 1) if (s := peek(p)) is not None]
            if dead or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        return "".join(f" (local worker {r}, pid {p.pid}, {describe(s)})" for r, p, s in dead)

    def _abandon(self) -> None:
        """An error on rank 0 left the workers in an unknown state: kill them; start again next time."""
        if self._state in (_State.STARTING, _State.UP):
            self._teardown(graceful=False)
            self._state = _State.OFF

    def _close(self) -> None:
        if self._state is _State.CLOSED:
            return
        self._teardown(graceful=self._state is _State.UP)
        self._state = _State.CLOSED
        if self._atexit:
            atexit.unregister(self._kill_all)
            self._atexit = False

    def _teardown(self, *, graceful: bool) -> None:
        procs = self._procs
        # Workers still starting have joined nothing: killing them is their clean stop.
        if graceful and procs and self._store is not None and self._state is _State.UP:
            try:
                self._store.set(ctrl_key(self._seq), str(STOP))
                self._seq += 1
            except RuntimeError as e:
                log.debug("could not tell the local workers to stop: %s", e)
            deadline = time.monotonic() + STOP_GRACE
            for proc in procs:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning(
                        "local worker pid %d did not stop within %g s: killing it", proc.pid, STOP_GRACE
                    )
        self._kill_all()
        if self._pg_up:
            self._pg_up = False
            try:
                if self.backend == "nccl" and not graceful:
                    dist.distributed_c10d._abort_process_group()
                else:
                    dist.destroy_process_group()
            except (RuntimeError, ValueError) as e:
                log.warning("local group: destroying the process group failed: %s", e)
        self._store = None  # the last reference: its server stops

    def _kill_all(self) -> None:
        procs, self._procs = self._procs, []
        for proc in procs:
            kill(proc)
