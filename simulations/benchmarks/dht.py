"""DHT benchmark: store and get success rate and latency of N p2ptrain DHT nodes, beside hivemind's DHT.

The workload (as in hivemind's ``benchmarks/benchmark_dht.py``, one key per operation): N nodes join one
swarm on this host; K keys are each stored by a random node, with ``--concurrency`` operations in flight
in the whole swarm (16 by default: enough to keep both cores busy, few enough that the latency is mostly
the operation's own and not a queue's); after every store has finished (a barrier), each key is read by
a random node that did not store it (for p2ptrain: a node in another process). A store succeeds when at
least one replica accepted it; a get succeeds when it returns exactly the stored value. Every
operation's latency is recorded; the report gives success rates and mean / p50 / p99 latencies, the CPU
the swarm spent per operation, the bootstrap time and the total run time.

Each phase has a time budget (``--store-budget``, ``--get-budget``): once it is spent no new operation
starts, the ones in flight finish, and only the keys whose store was attempted are read. The report
says how many keys each run got through (``keys``, of ``keys_planned``); on a small machine K = 4,096
does not fit in the time a full run may take.

p2ptrain: N real nodes over real TCP on 127.0.0.1, spread over P worker processes (each runs N/P nodes in
one trio loop), so that both cores are used as a real swarm would use them. The parent process only
coordinates, with one JSON line per message over each worker's stdin/stdout. Node 0 (in worker 0) is
the seed; every other node joins through the seed and a random node with a lower index. Nodes keep
their defaults but for two settings a one-host swarm needs: the per-IP inbound cap is the total cap
(every peer is 127.0.0.1), and connections idle for 30 s close (``--idle-timeout``; with the default
120 s a node keeps most of the swarm connected, each connection with its keepalive pings).

Garbage collection (``--gc``): a worker holds N/P nodes and their thousands of connections (each a few
trio tasks), so its heap is hundreds of times a deployed node's, and each full collection walks all of
it, stopping every node of the worker for up to a second. Measured at 128 nodes with Python's default
thresholds, collection took about half the workers' CPU and set the p99. ``relaxed`` (the default here)
raises the thresholds so that full collections are rare, which is roughly what a one-node process with
its small heap pays; ``default`` keeps Python's. At hivemind's size p2ptrain runs with both, and each
phase reports the collector's time (``gc_s``) and longest pause, so the artifact is in the report.

hivemind: M ``hivemind.DHT`` instances, each its own process with its own p2pd daemon (as deployed),
driven from one driver process. Each operation runs inside the DHT process that owns the node
(``DHT.run_coroutine``) and is timed there (row ``hivemind``), so its latency, like p2ptrain's, has no
pipe in it; it is also timed at the caller (row ``hivemind@caller``), through the pipe that every user
of a ``hivemind.DHT`` goes through and that hivemind's own benchmark times. On this machine, with 2M
hivemind processes sharing two cores, that pipe costs far more than it would in a deployment. hivemind's DHT
keeps its defaults (k = 20, 5 replicas, local caching), p2ptrain's keeps its own (k = 20, 20 replicas,
get quorum 2). A hivemind node costs ~90-100 MB here (a Python process and a Go daemon), so M is the largest
power of two up to N that fits in the memory available (``--hivemind-nodes`` overrides it), and
p2ptrain also runs at M, just before hivemind, so that the two compare at the same size and under the
same background load; hivemind then gets the keys p2ptrain got through at M (``--hivemind-keys``
overrides it) and the same time budgets.

Usage::

    python -m simulations.bench_dht [--nodes 256,1024] [--keys 4096] [--procs 4] [--concurrency 16]
                                    [--store-budget S] [--get-budget S] [--hivemind-nodes M]
                                    [--hivemind-python PATH] [--quick] [--json PATH] [--profile DIR]

hivemind runs where it can be imported by the interpreter given with ``--hivemind-python`` (default: this
one, else ``$P2PTRAIN_BENCH_PYTHON``, else ``.venv-bench/bin/python`` in the repository, the virtualenv
made with ``pip install -e '.[bench]'``); otherwise its rows say 'not installed'. The JSON report goes
to stdout (or PATH); a table with the command that reproduces each row goes to stderr. Every phase is
bounded in time; every child runs in a process group of its own that is killed at the end, p2pd
daemons included, and children exit by themselves when their parent's pipe closes.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import platform
import queue
import random
import resource
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from simulations.benchmarks.environment import write_report

MODULE = "simulations.bench_dht"
log = logging.getLogger(MODULE)  # not __name__: that is "__main__" under `python -m`

REPO_ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = "127.0.0.1"
RUN_ID = "bench-dht"
MSG = "DHTB "  # prefix of protocol lines on a child's stdout: anything else there is ignored
TTL = 900.0  # longer than any run: no record may expire before it is read
VALUE_BYTES = 32
HIVEMIND_MB_PER_NODE = 110  # measured here: 88-99 MB PSS per hivemind.DHT (Python ~22 MB + p2pd ~70 MB)
MEMORY_RESERVE_MB = 4096  # left to the rest of the machine (other people's tests run beside this)
HIVEMIND_JOIN_WAVE = 8  # hivemind nodes started at once (each starts a Go daemon: ~1 s of CPU)

# hivemind's P2P defaults reach beyond this machine (UPnP port mapping, AutoNAT, relays): switch them off.
HIVEMIND_LOOPBACK_ONLY: dict[str, Any] = {
    "host_maddrs": [f"/ip4/{LOOPBACK}/tcp/0"],
    "nat_port_map": False,
    "auto_nat": False,
    "use_relay": False,
    "use_auto_relay": False,
    "use_ipfs": False,
}


@dataclass(frozen=True)
class Plan:
    """One run's sizes and time bounds (seconds)."""

    nodes: tuple[int, ...]
    keys: int
    procs: int
    concurrency: int  # operations in flight in the whole swarm (spread over the worker processes)
    hivemind_nodes: int | None  # None: choose from the memory available
    hivemind_keys: int | None  # None: as many as p2ptrain attempted at the same size
    seed: int
    replication: int = 5  # replicas per key on both sides: hivemind's default num_replicas
    gc: str = "relaxed"  # the workers' garbage collector: "relaxed" or Python's "default" (see GcClock)
    join_concurrency: int = 8  # p2ptrain nodes bootstrapping at once in each worker
    idle_timeout: float = 30.0  # p2ptrain connections idle this long close (bounds open sockets)
    store_budget: float = 60.0  # no new store starts after this; the keys stored so far are read
    get_budget: float = 30.0
    op_timeout: float = 60.0
    start_timeout: float = 180.0

    @property
    def phase_timeout(self) -> float:
        """How long the parent waits for a phase: its budget, the last operations, and slack."""
        return max(self.store_budget, self.get_budget) + self.op_timeout + 60.0


# ---- shared helpers ------------------------------------------------------------------------------


def key_of(nonce: int, i: int) -> bytes:
    return b"bench-dht/%d/%d" % (nonce, i)


def value_of(nonce: int, i: int) -> bytes:
    return hashlib.blake2b(b"value/%d/%d" % (nonce, i), digest_size=VALUE_BYTES).digest()


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    k = math.ceil(q / 100.0 * len(sorted_values)) - 1
    return sorted_values[max(0, min(len(sorted_values) - 1, k))]


def summarize(results: list[list[Any]], elapsed: float) -> dict[str, Any]:
    """Results are [key, ok, latency_ms, detail]; latencies of all operations, failed ones included."""
    lat = sorted(float(r[2]) for r in results)
    ok = sum(1 for r in results if r[1])
    out: dict[str, Any] = {
        "ops": len(results),
        "ok": ok,
        "success_pct": round(100.0 * ok / max(1, len(results)), 3),
    }
    if lat:
        out |= {
            "mean_ms": round(sum(lat) / len(lat), 3),
            "p50_ms": round(percentile(lat, 50), 3),
            "p99_ms": round(percentile(lat, 99), 3),
            "max_ms": round(lat[-1], 3),
        }
    out["wall_s"] = round(elapsed, 3)
    out["ops_per_s"] = round(len(results) / elapsed, 1) if elapsed > 0 else None
    failures = Counter(str(r[3]) for r in results if not r[1])
    if failures:
        out["failures"] = dict(failures.most_common(10))
    return out


def raise_fd_limit() -> int:
    """Raise the soft limit on open files to the hard limit: every connection holds a socket."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def mem_available_mb() -> int:
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    return 0


def process_stats() -> dict[str, Any]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    try:
        fds = len(os.listdir("/proc/self/fd"))
    except OSError:
        fds = -1
    return {
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "peak_rss_mb": usage.ru_maxrss // 1024,
        "fds": fds,
    }


def emit(obj: dict[str, Any]) -> None:
    """One protocol line to the parent (stdout is reserved for these)."""
    sys.stdout.write(MSG + json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


class LogCounter(logging.Handler):
    """Counts log records by logger and message template; prints only the first few of each."""

    def __init__(self, show: int = 3) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.show = show

    def emit(self, record: logging.LogRecord) -> None:
        tag = f"{record.levelname} {record.name}: {record.msg}"
        self.counts[tag] += 1
        if record.levelno >= logging.WARNING and self.counts[tag] <= self.show:
            with contextlib.suppress(Exception):
                sys.stderr.write(f"[{os.getpid()}] {record.name}: {record.getMessage()[:300]}\n")
                if record.exc_info and self.counts[tag] == 1:  # the first traceback of each kind
                    sys.stderr.write(logging.Formatter().formatException(record.exc_info)[-3000:] + "\n")


def install_log_counter(level: int) -> LogCounter:
    handler = LogCounter()
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    return handler


def start_watchdog(deadline_s: float, *, watch_stdin: bool) -> None:
    """A child that outlives its time limit (or, with ``watch_stdin``, its parent) kills its process group.

    The parent holds our stdin: EOF means it is gone. Runs in threads, so a busy or hung event loop
    cannot keep the child (or the p2pd daemons in its group) alive.
    """

    def die(why: str) -> None:
        with contextlib.suppress(Exception):
            sys.stderr.write(f"[{os.getpid()}] {MODULE} child exits: {why}\n")
        with contextlib.suppress(OSError):
            os.killpg(os.getpgid(0), signal.SIGKILL)
        os._exit(3)

    def watch_time() -> None:
        time.sleep(deadline_s)
        die(f"time limit of {deadline_s:.0f} s reached")

    def watch_parent() -> None:
        # os.read on a duplicate, not sys.stdin: a thread blocked inside sys.stdin holds its lock, and a
        # process forked meanwhile (hivemind's DHT is a fork) would deadlock closing its copy of stdin.
        fd = os.dup(sys.stdin.fileno())
        while os.read(fd, 4096):
            pass
        die("the parent closed our stdin")

    threading.Thread(target=watch_time, daemon=True).start()
    if watch_stdin:
        threading.Thread(target=watch_parent, daemon=True).start()


# ---- p2ptrain worker (a child process running N/P nodes in one trio loop) -----------------------


def p2ptrain_worker(index: int, procs: int, count: int, cfg: dict[str, Any]) -> None:
    import trio

    counter = install_log_counter(logging.INFO if cfg["log_info"] else logging.WARNING)
    start_watchdog(cfg["deadline_s"], watch_stdin=False)  # the trio loop reads stdin (its end stops us)
    fd_limit = raise_fd_limit()
    global GC_CLOCK
    GC_CLOCK = GcClock()
    if cfg.get("gc") == "relaxed":
        # Fewer collections (each of them still complete): see GcClock for why this is a packing artifact.
        gc.set_threshold(*RELAXED_GC)
    trio.run(_p2ptrain_worker, index, procs, count, cfg, counter, fd_limit)


class GcClock:
    """Time spent in the cyclic garbage collector (total and longest pause) since the last reset.

    Its pauses stop the whole trio loop, so with hundreds of nodes (and thousands of connections) in one
    process a full collection stalls every node of the worker at once: a cost of packing nodes into few
    processes that a deployment (one node per process) does not pay to that extent.
    """

    def __init__(self) -> None:
        self.total = self.longest = self._started = 0.0
        self.full = 0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        self.total += pause
        self.longest = max(self.longest, pause)
        self.full += info["generation"] == 2

    def take(self) -> dict[str, Any]:
        out = {
            "gc_s": round(self.total, 3),
            "gc_longest_ms": round(1000 * self.longest, 1),
            "gc_full": self.full,
        }
        self.total = self.longest = 0.0
        self.full = 0
        return out


GC_CLOCK: GcClock | None = None
RELAXED_GC = (50_000, 20, 100)  # gen0 allocations; gen0 runs per gen1 run; gen1 runs per full run


@contextlib.contextmanager
def measured(cfg: dict[str, Any], phase: str, index: int, events: Counter[str]) -> Iterator[dict[str, Any]]:
    """CPU seconds and connections opened during a phase (and its cProfile, with ``--profile``)."""
    out: dict[str, Any] = {}
    prof = None
    if cfg.get("profile"):
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    cpu0, opened0 = time.process_time(), events["opened"]
    if GC_CLOCK is not None:
        GC_CLOCK.take()
    try:
        yield out
    finally:
        out["cpu_s"] = round(time.process_time() - cpu0, 3)
        out["connections_opened"] = events["opened"] - opened0
        if GC_CLOCK is not None:
            out |= GC_CLOCK.take()
        if prof is not None:
            prof.disable()
            folder = Path(cfg["profile"])
            folder.mkdir(parents=True, exist_ok=True)
            prof.dump_stats(folder / f"p2ptrain-n{cfg['nodes']}-{phase}-worker{index}.prof")


async def _p2ptrain_worker(
    index: int, procs: int, count: int, cfg: dict[str, Any], counter: LogCounter, fd_limit: int
) -> None:
    import trio

    from p2ptrain.dht import DHT, DHTConfig
    from p2ptrain.identity import Identity
    from p2ptrain.net import ConnectionConfig, Host, HostConfig

    # Every node is on 127.0.0.1: the per-IP inbound cap (meant for one remote host) would refuse the
    # swarm itself, so here it equals the total cap.
    host_cfg = HostConfig(
        max_inbound=4096,
        max_inbound_per_ip=4096,
        connection=ConnectionConfig(idle_timeout=cfg["idle_timeout"]),
    )
    dhts: list[DHT] = []
    peak = {"connections": 0, "fds": 0}
    closes: Counter[str] = Counter()  # why connections closed: tells churn from idle closes

    def on_connection(conn: Any, opened: bool) -> None:
        closes["opened" if opened else _close_kind(conn.close_reason)] += 1

    commands_send, commands = trio.open_memory_channel[dict[str, Any]](16)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_read_commands, commands_send, nursery.cancel_scope)
        nursery.start_soon(_sample_peaks, dhts, peak)
        for _ in range(count):
            host = Host(Identity.generate(), RUN_ID, config=host_cfg)
            host.on_connection(on_connection)
            await nursery.start(host.run, [(LOOPBACK, 0)])
            dhts.append(DHT(host, config=DHTConfig(replication=cfg["replication"])))
        emit({"ev": "listening", "addrs": [str(d.advertised_address()) for d in dhts], "fd_limit": fd_limit})
        async for cmd in commands:
            if cmd["cmd"] == "boot":
                with measured(cfg, "boot", index, closes) as m:
                    res = await _boot(nursery, dhts, cmd["boot"], cfg["join_concurrency"])
                emit({"ev": "booted", **res, **m})
            elif cmd["cmd"] == "ops":
                with measured(cfg, cmd["phase"], index, closes) as m:
                    res = await _run_ops(dhts, cmd, cfg)
                emit({"ev": "done", "phase": cmd["phase"], **res, **m})
            elif cmd["cmd"] == "stop":
                emit({"ev": "stats", **_worker_stats(dhts, peak, counter), "connection_events": dict(closes)})
                break
        nursery.cancel_scope.cancel()


def _close_kind(reason: str) -> str:
    """A close reason without the peer ids and numbers in it, so that reasons can be counted."""
    words = [w for w in reason.replace(":", " ").split() if ".." not in w and not w.strip("[]()").isdigit()]
    return "closed: " + " ".join(words)[:80]


async def _read_commands(send: Any, scope: Any) -> None:
    """Parse JSON lines from stdin into commands; stdin's end (the parent is gone) stops the worker."""
    import trio

    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    buf = b""
    async with send:
        while chunk := await stdin.receive_some(1 << 20):
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.strip():
                    await send.send(json.loads(line))
    scope.cancel()


async def _sample_peaks(dhts: list[Any], peak: dict[str, int]) -> None:
    import trio

    while True:
        await trio.sleep(1.0)
        peak["connections"] = max(peak["connections"], sum(len(d.host.connections()) for d in dhts))
        with contextlib.suppress(OSError):
            peak["fds"] = max(peak["fds"], len(os.listdir("/proc/self/fd")))


async def _boot(nursery: Any, dhts: list[Any], boot: list[list[str]], parallel: int) -> dict[str, Any]:
    """Start every node's DHT (bootstrapping through the given addresses), lowest global index first."""
    import trio

    from p2ptrain.net import PeerAddress

    limit = trio.Semaphore(parallel)  # FIFO: nodes join roughly in index order
    times: list[float] = []

    async def one(dht: Any, addrs: list[str]) -> None:
        async with limit:
            started = time.perf_counter()
            await nursery.start(dht.run, [PeerAddress.parse(a) for a in addrs] or None)
            # run() reports readiness at once and joins in the background: wait until it has joined.
            joined = getattr(dht, "bootstrapped", None)
            if joined is not None:
                await joined.wait()
            times.append(time.perf_counter() - started)

    began = time.perf_counter()
    async with trio.open_nursery() as joins:
        for dht, addrs in zip(dhts, boot, strict=True):
            joins.start_soon(one, dht, addrs)
            await trio.lowlevel.checkpoint()  # keep the start order
    tables = sorted(len(d.table) for d in dhts)
    return {
        "wall_s": round(time.perf_counter() - began, 3),
        "join_mean_s": round(sum(times) / len(times), 3),
        "join_max_s": round(max(times), 3),
        "table_min": tables[0],
        "table_median": tables[len(tables) // 2],
        "empty_tables": sum(1 for t in tables if t == 0),
        "client_only": sum(1 for d in dhts if d.client_only),
    }


async def _run_ops(dhts: list[Any], cmd: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Run the given (key, node) operations with ``concurrency`` in flight; one result per operation."""
    import trio

    from p2ptrain.errors import P2PError

    ops: list[list[int]] = cmd["ops"]
    nonce, phase = cfg["nonce"], cmd["phase"]
    results: list[list[Any]] = []
    pending = iter(ops)
    started = time.perf_counter()

    async def one(key_i: int, node_j: int) -> list[Any]:
        dht, key, value = dhts[node_j], key_of(nonce, key_i), value_of(nonce, key_i)
        started = time.perf_counter()
        ok, detail = False, "timeout"
        try:
            with trio.move_on_after(cfg["op_timeout"]):
                if phase == "store":
                    replicas = await dht.store(key, value, ttl=TTL)
                    ok, detail = replicas > 0, replicas
                else:
                    entry = (await dht.get(key)).get(b"")
                    ok = entry is not None and entry.value == value
                    detail = "ok" if ok else ("not found" if entry is None else "wrong value")
        except P2PError as e:
            detail = f"{type(e).__name__}: {str(e)[:120]}"
        except Exception as e:  # a benchmark reports a crash of one operation and goes on
            detail = f"crash {type(e).__name__}: {str(e)[:120]}"
            log.exception("%s of key %d crashed", phase, key_i)
        return [key_i, ok, round((time.perf_counter() - started) * 1000.0, 3), detail]

    async def runner() -> None:
        for key_i, node_j in pending:
            if time.perf_counter() - started > cmd["budget_s"]:
                break  # out of time: the rest of this phase's keys are not attempted (not failures)
            results.append(await one(key_i, node_j))

    async def progress() -> None:
        # Lets the parent say how far a phase got when it runs out of time.
        while True:
            await trio.sleep(5.0)
            emit({"ev": "progress", "phase": phase, "done": len(results), "of": len(ops)})

    async with trio.open_nursery() as nursery:
        nursery.start_soon(progress)
        async with trio.open_nursery() as runners:
            for _ in range(max(1, cmd["concurrency"])):
                runners.start_soon(runner)
        nursery.cancel_scope.cancel()
    return {"results": results, "wall_s": round(time.perf_counter() - started, 3)}


def _worker_stats(dhts: list[Any], peak: dict[str, int], counter: LogCounter) -> dict[str, Any]:
    conns = sorted(len(d.host.connections()) for d in dhts)
    tables = sorted(len(d.table) for d in dhts)
    records = sorted(len(d.records) for d in dhts)
    return {
        "nodes": len(dhts),
        "connections_now": sum(conns),
        "connections_per_node_max": conns[-1],
        "peak_connections": peak["connections"],
        "peak_fds": peak["fds"],
        "table_median": tables[len(tables) // 2],
        "table_min": tables[0],
        "records_median": records[len(records) // 2],
        "records_max": records[-1],
        "log_counts": dict(counter.counts.most_common(25)),
        **process_stats(),
    }


# ---- parent side: children speaking JSON lines ----------------------------------------------------


class Child:
    """A child process in its own process group; its protocol lines are read by a thread into a queue.

    Reading in a thread (never blocking on one child) matters: a worker that cannot write its results
    would stop serving the other workers' requests.
    """

    def __init__(self, argv: list[str], name: str, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=REPO_ROOT,  # so that `-m simulations...` resolves wherever the benchmark was started from
            env=env,
            start_new_session=True,  # its own process group: killed as a whole at the end
        )
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.progress: dict[str, Any] | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace")
            if line.startswith(MSG):
                self.lines.put(json.loads(line[len(MSG) :]))
        self.lines.put(None)

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(obj, separators=(",", ":")) + "\n").encode())
        self.proc.stdin.flush()

    def expect(self, event: str, deadline: float) -> dict[str, Any]:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                seen = f" (last progress: {self.progress})" if self.progress else ""
                raise TimeoutError(f"{self.name}: no '{event}' in time{seen}")
            try:
                msg = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if msg is None:
                raise RuntimeError(f"{self.name} exited (code {self.proc.wait()}) before '{event}'")
            if msg.get("ev") == event:
                return msg
            if msg.get("ev") == "progress":
                self.progress = msg
            if msg.get("ev") == "error":
                raise RuntimeError(f"{self.name}: {msg.get('error')}")

    def kill(self, grace: float = 10.0) -> None:
        """Close stdin (asks for a clean exit), then kill the whole process group (p2pd included)."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5.0)


@contextlib.contextmanager
def children(argvs: list[tuple[list[str], str]], env: dict[str, str] | None = None) -> Iterator[list[Child]]:
    kids: list[Child] = []
    try:
        for argv, name in argvs:
            kids.append(Child(argv, name, env))
        yield kids
    finally:
        with ThreadPoolExecutor(max(1, len(kids))) as pool:
            list(pool.map(Child.kill, kids))


def gather(kids: list[Child], event: str, timeout: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    return [k.expect(event, deadline) for k in kids]


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ---- parent side: the p2ptrain swarm --------------------------------------------------------------


def plan_workload(
    n: int, keys: int, owner: Callable[[int], int], rng: random.Random
) -> list[tuple[int, int, int]]:
    """(key, storing node, reading node): the reader is a random node whose owner differs from the storer's.

    ``owner`` maps a node to its process; where every node shares one process, any other node reads.
    """
    distinct_owners = len({owner(g) for g in range(min(n, 64))}) > 1
    out = []
    for i in range(keys):
        s = rng.randrange(n)
        while True:
            r = rng.randrange(n)
            if r != s and (owner(r) != owner(s) or not distinct_owners):
                break
        out.append((i, s, r))
    return out


def run_p2ptrain(n: int, plan: Plan, log_info: bool, profile: str | None, gc_mode: str) -> dict[str, Any]:
    procs = max(1, min(plan.procs, n))
    counts = [len(range(w, n, procs)) for w in range(procs)]  # node g lives in worker g % procs
    rng = random.Random(plan.seed * 1_000_003 + n)
    nonce = rng.getrandbits(48)
    cfg = {
        "nonce": nonce,
        "op_timeout": plan.op_timeout,
        "idle_timeout": plan.idle_timeout,
        "join_concurrency": plan.join_concurrency,
        "log_info": log_info,
        "profile": str(Path(profile).resolve()) if profile else None,
        "gc": gc_mode,
        "nodes": n,
        "replication": plan.replication,
        "deadline_s": plan.start_timeout + 3 * plan.phase_timeout + 60,
    }
    argvs = [
        (
            [sys.executable, "-m", MODULE, "--p2ptrain-worker", json.dumps([w, procs, counts[w], cfg])],
            f"worker {w}",
        )
        for w in range(procs)
    ]
    out: dict[str, Any] = {"nodes": n, "gc": gc_mode, "procs": procs, "keys_planned": plan.keys}
    out["load_before"] = loadavg()
    began = time.perf_counter()
    with children(argvs) as kids:
        listening = gather(kids, "listening", plan.start_timeout)
        addrs = [""] * n
        for w, msg in enumerate(listening):
            for j, a in enumerate(msg["addrs"]):
                addrs[j * procs + w] = a
        out["fd_limit"] = listening[0]["fd_limit"]
        out["bootstrap"] = _p2ptrain_boot(kids, addrs, rng, plan)
        work = plan_workload(n, plan.keys, lambda g: g % procs, rng)
        concurrency = math.ceil(plan.concurrency / procs)
        for phase, col, budget in (("store", 1, plan.store_budget), ("get", 2, plan.get_budget)):
            per_worker: list[list[list[int]]] = [[] for _ in range(procs)]
            for op in work:
                per_worker[op[col] % procs].append([op[0], op[col] // procs])
            started = time.perf_counter()
            for kid, ops in zip(kids, per_worker, strict=True):
                cmd = {
                    "cmd": "ops",
                    "phase": phase,
                    "ops": ops,
                    "concurrency": concurrency,
                    "budget_s": budget,
                }
                kid.send(cmd)
            done = gather(kids, "done", plan.phase_timeout)  # the barrier: every store ends before any get
            results = [r for d in done for r in d["results"]]
            out[phase] = summarize(results, time.perf_counter() - started)
            out[phase] |= _phase_costs(done, len(results))
            if phase == "store":
                replicas = sorted(int(r[3]) for r in results if r[1])
                if replicas:
                    out[phase]["replicas_median"] = replicas[len(replicas) // 2]
                    out[phase]["replicas_min"] = replicas[0]
                # Out of time, a store phase leaves some keys unattempted: only the attempted are read.
                attempted = {r[0] for r in results}
                work = [op for op in work if op[0] in attempted]
                out["keys"] = len(attempted)
            log.info(
                "p2ptrain n=%d %s: %s", n, phase, {k: v for k, v in out[phase].items() if k != "failures"}
            )
        for kid in kids:
            kid.send({"cmd": "stop"})
        out["workers"] = gather(kids, "stats", 60.0)
    out["total_s"] = round(time.perf_counter() - began, 2)
    out["load_after"] = loadavg()
    out["concurrency"] = concurrency * procs
    return out


def _phase_costs(events: list[dict[str, Any]], ops: int) -> dict[str, Any]:
    """CPU and new connections per operation, summed over the workers (the swarm's cost of one op)."""
    cpu = sum(e["cpu_s"] for e in events)
    opened = sum(e["connections_opened"] for e in events)
    return {
        "cpu_s": round(cpu, 2),
        "cpu_ms_per_op": round(1000.0 * cpu / max(1, ops), 2),
        # Each connection is counted at both of its ends (both are in the swarm): halve it.
        "new_connections_per_op": round(opened / 2 / max(1, ops), 2),
        "gc_s": round(sum(e.get("gc_s", 0.0) for e in events), 2),
        "gc_longest_ms": max(e.get("gc_longest_ms", 0.0) for e in events),
        "gc_full": sum(e.get("gc_full", 0) for e in events),
    }


def _p2ptrain_boot(kids: list[Child], addrs: list[str], rng: random.Random, plan: Plan) -> dict[str, Any]:
    procs = len(kids)
    boot: list[list[list[str]]] = [[] for _ in range(procs)]
    for g, _ in enumerate(addrs):
        if g == 0:
            via: list[str] = []
        else:
            other = rng.randrange(g)
            via = [addrs[0]] + ([addrs[other]] if other else [])
        boot[g % procs].append(via)
    started = time.perf_counter()
    for kid, b in zip(kids, boot, strict=True):
        kid.send({"cmd": "boot", "boot": b})
    booted = gather(kids, "booted", plan.phase_timeout)
    return {
        "wall_s": round(time.perf_counter() - started, 3),
        "join_mean_s": round(sum(b["join_mean_s"] for b in booted) / len(booted), 3),
        "join_max_s": max(b["join_max_s"] for b in booted),
        "table_min": min(b["table_min"] for b in booted),
        "empty_tables": sum(b["empty_tables"] for b in booted),
        "client_only": sum(b["client_only"] for b in booted),
        **_phase_costs(booted, len(addrs)),
    }


# ---- hivemind driver (a child process under an interpreter that has hivemind) ----------------------


async def _hm_store(key: bytes, value: bytes, expiration: float, _dht: Any, node: Any) -> tuple[bool, float]:
    """Runs inside the hivemind DHT process that owns ``node``: timed there, without the driver's pipe."""
    started = time.perf_counter()
    ok = await node.store(key, value, expiration)
    return bool(ok), time.perf_counter() - started


async def _hm_get(key: bytes, _dht: Any, node: Any) -> tuple[bytes | None, float]:
    started = time.perf_counter()
    found = await node.get(key)
    value = found.value if found is not None else None
    return (value if isinstance(value, bytes) else None), time.perf_counter() - started


def hivemind_driver(cfg: dict[str, Any]) -> None:
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")  # read when hivemind is first imported
    start_watchdog(cfg["deadline_s"], watch_stdin=True)
    raise_fd_limit()
    import hivemind

    dhts: list[Any] = []
    try:
        out = {"version": hivemind.__version__, "nodes": cfg["nodes"], "keys_planned": cfg["keys"]}
        out["bootstrap"] = _hm_join(hivemind, dhts, cfg)
        emit({"ev": "booted", "bootstrap": out["bootstrap"]})
        out |= _hm_workload(hivemind, dhts, cfg)
        out["alive_after"] = sum(1 for d in dhts if d.is_alive())
        out["memory"] = _hm_memory(dhts)
        emit({"ev": "result", "result": out})
    except Exception as e:  # the parent reports it; the finally below still stops every node
        log.exception("hivemind run failed")
        emit({"ev": "error", "error": f"{type(e).__name__}: {e}"})
    finally:
        with ThreadPoolExecutor(16) as pool:  # each shutdown waits for its p2pd: in parallel
            list(pool.map(lambda d: d.shutdown(), dhts))


def _hm_join(hivemind: Any, dhts: list[Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Start the nodes in waves: each joins through the first node and a random node already running."""
    rng = random.Random(cfg["seed"])
    started = time.perf_counter()
    dhts.append(hivemind.DHT(start=True, num_replicas=cfg["replication"], **HIVEMIND_LOOPBACK_ONLY))
    maddrs = [[str(m) for m in dhts[0].get_visible_maddrs()]]
    while len(dhts) < cfg["nodes"]:
        if mem_available_mb() < cfg["min_free_mb"]:
            raise MemoryError(f"less than {cfg['min_free_mb']} MB free after {len(dhts)} hivemind nodes")
        wave = []
        for _ in range(min(HIVEMIND_JOIN_WAVE, cfg["nodes"] - len(dhts))):
            peers = maddrs[0] + maddrs[rng.randrange(len(maddrs))]
            wave.append(
                hivemind.DHT(
                    initial_peers=list(dict.fromkeys(peers)),
                    start=True,
                    await_ready=False,
                    num_replicas=cfg["replication"],
                    **HIVEMIND_LOOPBACK_ONLY,
                )
            )
        for d in wave:
            d.wait_until_ready(timeout=cfg["start_timeout"])
            dhts.append(d)
            maddrs.append([str(m) for m in d.get_visible_maddrs()])
        emit(
            {
                "ev": "progress",
                "phase": "join",
                "done": len(dhts),
                "s": round(time.perf_counter() - started, 1),
            }
        )
    return {"wall_s": round(time.perf_counter() - started, 3)}


def _hm_workload(hivemind: Any, dhts: list[Any], cfg: dict[str, Any]) -> dict[str, Any]:
    from hivemind.utils import get_dht_time

    rng = random.Random(cfg["seed"] + 1)
    nonce = rng.getrandbits(48)
    work = plan_workload(len(dhts), cfg["keys"], lambda g: g, rng)
    expiration = get_dht_time() + TTL
    out: dict[str, Any] = {}

    deadline = {"store": 0.0, "get": 0.0}

    def store(op: tuple[int, int, int]) -> list[Any] | None:
        if time.perf_counter() > deadline["store"]:
            return None  # out of time: not attempted (not a failure)
        i, s, _ = op
        coro = partial(_hm_store, key_of(nonce, i), value_of(nonce, i), expiration)
        return _hm_timed(dhts[s], coro, cfg["op_timeout"], lambda r: (bool(r), "rejected"), i)

    def get(op: tuple[int, int, int]) -> list[Any] | None:
        if time.perf_counter() > deadline["get"]:
            return None
        i, _, r = op
        want = value_of(nonce, i)
        return _hm_timed(
            dhts[r],
            partial(_hm_get, key_of(nonce, i)),
            cfg["op_timeout"],
            lambda v: (v == want, "not found" if v is None else "wrong value"),
            i,
        )

    phases: list[tuple[str, Callable[[tuple[int, int, int]], list[Any] | None]]] = [
        ("store", store),
        ("get", get),
    ]
    for phase, fn in phases:
        started, cpu0 = time.perf_counter(), group_cpu_s()
        deadline[phase] = started + cfg[f"{phase}_budget"]
        with ThreadPoolExecutor(cfg["concurrency"]) as pool:  # the barrier: the pool drains before gets
            results = [r for r in pool.map(fn, work) if r is not None]
        elapsed = time.perf_counter() - started
        if phase == "store":
            attempted = {r[0] for r in results}
            work = [op for op in work if op[0] in attempted]
            out["keys"] = len(attempted)
        out[phase] = summarize([r[:4] for r in results], elapsed)
        cpu = group_cpu_s() - cpu0  # the DHT processes and their p2pd daemons (and this driver)
        out[phase] |= {"cpu_s": round(cpu, 2), "cpu_ms_per_op": round(1000.0 * cpu / max(1, len(results)), 2)}
        client = sorted(r[4] for r in results)
        out[phase]["driver_side_mean_ms"] = round(sum(client) / len(client), 3)
        out[phase]["driver_side_p50_ms"] = round(percentile(client, 50), 3)
        out[phase]["driver_side_p99_ms"] = round(percentile(client, 99), 3)
    out["concurrency"] = cfg["concurrency"]
    return out


def _hm_timed(
    dht: Any, coro: Any, timeout: float, check: Callable[[Any], tuple[bool, str]], key_i: int
) -> list[Any]:
    """[key, ok, node-side ms, detail, driver-side ms] for one operation run inside ``dht``'s process."""
    started = time.perf_counter()
    try:
        answer, inside = dht.run_coroutine(coro, return_future=True).result(timeout=timeout)
    except Exception as e:  # a timeout or an error inside hivemind: that operation failed
        ms = (time.perf_counter() - started) * 1000.0
        return [key_i, False, round(ms, 3), f"{type(e).__name__}: {str(e)[:120]}", round(ms, 3)]
    ok, why = check(answer)
    driver_ms = (time.perf_counter() - started) * 1000.0
    return [key_i, ok, round(inside * 1000.0, 3), "ok" if ok else why, round(driver_ms, 3)]


def group_cpu_s() -> float:
    """CPU seconds used so far by the live processes of our process group (p2pd daemons included)."""
    tick = os.sysconf("SC_CLK_TCK")
    me, total = os.getpgid(0), 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == me:  # process group
                    total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def _hm_memory(dhts: list[Any]) -> dict[str, Any]:
    """Proportional set size of the DHT processes and their p2pd daemons (shared pages split fairly)."""

    def pss_mb(pid: int) -> float:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    dht_pids = {d.pid for d in dhts if d.pid}
    daemons = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) in dht_pids:  # parent pid
                    daemons.append(int(entry.name))
    python_mb = sum(pss_mb(p) for p in dht_pids)
    daemon_mb = sum(pss_mb(p) for p in daemons)
    return {
        "per_node_mb": round((python_mb + daemon_mb) / max(1, len(dht_pids)), 1),
        "python_per_node_mb": round(python_mb / max(1, len(dht_pids)), 1),
        "p2pd_per_node_mb": round(daemon_mb / max(1, len(daemons)), 1),
        "p2pd_count": len(daemons),
    }


# ---- parent side: hivemind -------------------------------------------------------------------------


def find_hivemind_python(explicit: str | None) -> str | None:
    candidates = [explicit] if explicit else [sys.executable, os.environ.get("P2PTRAIN_BENCH_PYTHON")]
    if not explicit:
        candidates.append(str(REPO_ROOT / ".venv-bench" / "bin" / "python"))
    for python in candidates:
        if python and Path(python).exists() and hivemind_version(python):
            return python
    return None


def hivemind_version(python: str) -> str | None:
    try:
        done = subprocess.run(
            [python, "-c", "import importlib.metadata as m; print(m.version('hivemind'))"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def choose_hivemind_nodes(nodes: tuple[int, ...], explicit: int | None) -> tuple[int, str]:
    if explicit:
        return explicit, "set with --hivemind-nodes"
    free = mem_available_mb()
    fit = max(2, (free - MEMORY_RESERVE_MB) // HIVEMIND_MB_PER_NODE)
    for n in sorted(nodes, reverse=True):
        if n <= fit:
            return n, f"{n} nodes fit: {free} MB available, ~{HIVEMIND_MB_PER_NODE} MB per hivemind node"
    m = 2 ** int(math.log2(fit))
    return m, (
        f"{free} MB available less {MEMORY_RESERVE_MB} MB reserve fits ~{fit} hivemind nodes at "
        f"~{HIVEMIND_MB_PER_NODE} MB each (a Python process and a p2pd daemon): the largest power of two, {m}"
    )


def run_hivemind(m: int, plan: Plan, python: str) -> dict[str, Any]:
    cfg = {
        "nodes": m,
        "keys": plan.hivemind_keys or plan.keys,
        "seed": plan.seed,
        "replication": plan.replication,
        "concurrency": plan.concurrency,
        "op_timeout": plan.op_timeout,
        "store_budget": plan.store_budget,
        "get_budget": plan.get_budget,
        "start_timeout": plan.start_timeout,
        "min_free_mb": 1024,
        "deadline_s": plan.start_timeout + 3 * plan.phase_timeout + 60,
    }
    env = dict(os.environ)
    env.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    began = time.perf_counter()
    load_before = loadavg()
    with children(
        [([python, "-m", MODULE, "--hivemind-driver", json.dumps(cfg)], "hivemind driver")], env
    ) as kids:
        booted = kids[0].expect("booted", time.monotonic() + plan.start_timeout + m * 2.0)
        log.info("hivemind m=%d bootstrapped: %s", m, booted["bootstrap"])
        result: dict[str, Any] = kids[0].expect("result", time.monotonic() + 2 * plan.phase_timeout)["result"]
        # Let it stop its nodes (and their p2pd) itself; closing its stdin first would kill them at once.
        with contextlib.suppress(subprocess.TimeoutExpired):
            kids[0].proc.wait(60.0)
    result["load_before"] = load_before
    result["load_after"] = loadavg()
    result["total_s"] = round(time.perf_counter() - began, 2)
    return result


# ---- report ----------------------------------------------------------------------------------------


def _ratio(a: Any, b: Any) -> float | None:
    if isinstance(a, float | int) and isinstance(b, float | int) and b:
        return round(a / b, 3)
    return None


def build_rows(report: dict[str, Any], base: str) -> list[dict[str, Any]]:
    rows = []
    for run in report["p2ptrain"]:
        if "status" in run:
            continue
        command = f"{base} --nodes {run['nodes']} --hivemind-nodes 0 --gc {run['gc']}"
        rows.append(_row("p2ptrain", run, command) | {"gc": run["gc"]})
    hm = report.get("hivemind") or {}
    if "store" in hm:
        command = f"{base} --nodes {hm['nodes']} --hivemind-nodes {hm['nodes']} --gc {report['plan']['gc']}"
        rows.append(_row("hivemind", hm, command) | {"gc": "default"})
        # The same operations timed at the caller, through the pipe every hivemind.DHT user goes through.
        caller = hm | {
            phase: hm[phase] | {k: hm[phase].get(f"driver_side_{k}") for k in ("mean_ms", "p50_ms", "p99_ms")}
            for phase in ("store", "get")
        }
        rows.append(_row("hivemind@caller", caller, command) | {"gc": "default"})
    return rows


def _row(system: str, run: dict[str, Any], command: str) -> dict[str, Any]:
    row: dict[str, Any] = {"system": system, "nodes": run["nodes"], "keys": run["keys"]}
    for phase in ("store", "get"):
        s = run.get(phase, {})
        for k in ("success_pct", "mean_ms", "p50_ms", "p99_ms", "ops_per_s", "cpu_ms_per_op"):
            row[f"{phase}_{k}"] = s.get(k)
    row["bootstrap_s"] = run.get("bootstrap", {}).get("wall_s")
    row["total_s"] = run.get("total_s")
    row["command"] = command
    return row


def comparisons(report: dict[str, Any]) -> list[dict[str, Any]]:
    """p2ptrain over hivemind at the same size, once per GC mode p2ptrain ran with (the plan's first)."""
    hm = report.get("hivemind") or {}
    if "get" not in hm:
        return []
    return [_compare(p, hm) for p in report["p2ptrain"] if p.get("nodes") == hm["nodes"] and "get" in p]


def _compare(p: dict[str, Any], hm: dict[str, Any]) -> dict[str, Any]:
    """Ratios against hivemind timed in its node (no pipe) and at its caller (as its users and its own
    benchmark see it: a hivemind.DHT is always a separate process, reached through a pipe)."""
    out: dict[str, Any] = {"nodes": hm["nodes"], "p2ptrain_gc": p["gc"]}
    out |= {"p2ptrain_keys": p["keys"], "hivemind_keys": hm["keys"]}
    for phase in ("store", "get"):
        for k in ("mean_ms", "p99_ms"):
            out[f"{phase}_{k}_p2ptrain_over_hivemind"] = _ratio(p[phase].get(k), hm[phase].get(k))
            theirs = hm[phase].get(f"driver_side_{k}")
            out[f"{phase}_{k}_p2ptrain_over_hivemind_caller"] = _ratio(p[phase].get(k), theirs)
        out[f"{phase}_ops_per_s_p2ptrain_over_hivemind"] = _ratio(
            p[phase]["ops_per_s"], hm[phase]["ops_per_s"]
        )
        out[f"{phase}_cpu_per_op_p2ptrain_over_hivemind"] = _ratio(
            p[phase]["cpu_ms_per_op"], hm[phase].get("cpu_ms_per_op")
        )
    full = p["get"]["success_pct"] == 100.0 and p["store"]["success_pct"] == 100.0
    out["target_met"] = full and (out["get_mean_ms_p2ptrain_over_hivemind"] or math.inf) < 1.0
    out["target_met_vs_caller"] = (
        full and (out["get_mean_ms_p2ptrain_over_hivemind_caller"] or math.inf) < 1.0
    )
    return out


def format_table(report: dict[str, Any]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:,.1f}" if v < 1000 else f"{v:,.0f}"
        return str(v)

    head = ["system", "gc", "N", "keys", "store ok%", "store mean/p50/p99 ms", "get ok%",
            "get mean/p50/p99 ms", "ops/s st/get", "boot s", "total s", "reproduce"]  # fmt: skip
    lines = [head]
    for r in report["rows"]:
        lines.append(
            [
                r["system"],
                r["gc"],
                str(r["nodes"]),
                str(r["keys"]),
                cell(r["store_success_pct"]),
                "/".join(cell(r[f"store_{k}"]) for k in ("mean_ms", "p50_ms", "p99_ms")),
                cell(r["get_success_pct"]),
                "/".join(cell(r[f"get_{k}"]) for k in ("mean_ms", "p50_ms", "p99_ms")),
                "/".join(cell(r[f"{phase}_ops_per_s"]) for phase in ("store", "get")),
                cell(r["bootstrap_s"]),
                cell(r["total_s"]),
                r["command"],
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    for cmp in report["comparisons"]:
        text.append(
            f"At N={cmp['nodes']}, p2ptrain with {cmp['p2ptrain_gc']} gc over hivemind (below 1: p2ptrain "
            f"faster): mean store {cmp['store_mean_ms_p2ptrain_over_hivemind']}x, mean get "
            f"{cmp['get_mean_ms_p2ptrain_over_hivemind']}x against hivemind timed in its node (target "
            f"{'MET' if cmp['target_met'] else 'MISSED'}); mean store "
            f"{cmp['store_mean_ms_p2ptrain_over_hivemind_caller']}x, mean get "
            f"{cmp['get_mean_ms_p2ptrain_over_hivemind_caller']}x against hivemind timed at its caller "
            f"(target {'MET' if cmp['target_met_vs_caller'] else 'MISSED'}); get throughput "
            f"{cmp['get_ops_per_s_p2ptrain_over_hivemind']}x, CPU per get "
            f"{cmp['get_cpu_per_op_p2ptrain_over_hivemind']}x."
        )
    hm = report.get("hivemind") or {}
    if "status" in hm or "error" in hm:
        text.append(f"hivemind: {hm.get('status', '')} {hm.get('error', '')}".rstrip())
    text.append(
        f"load average before/after: {report['load_before']} / {report['load_after']} ({os.cpu_count()} cpus)"
    )
    return "\n".join(text)


def environment() -> dict[str, Any]:
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return done.stdout.strip()

    commit = git("rev-parse", "--short", "HEAD")
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "mem_available_mb": mem_available_mb(),
        "git_commit": commit or None,
        # Uncommitted changes to the code under test make the commit alone not reproduce the numbers.
        "git_dirty": bool(git("status", "--porcelain", "--", "p2ptrain")) if commit else None,
        "versions": {d: version(d) for d in ("p2ptrain", "trio", "pynacl", "msgpack")},
    }


def run(
    plan: Plan, base: str, hivemind_python: str | None, log_info: bool, profile: str | None
) -> tuple[dict[str, Any], bool]:
    report: dict[str, Any] = {"benchmark": "dht", "command": base, "plan": asdict(plan)}
    report["environment"] = environment()
    report["load_before"] = loadavg()
    began = time.perf_counter()
    ok = True
    hm_nodes, why = (
        (0, "not run") if plan.hivemind_nodes == 0 else choose_hivemind_nodes(plan.nodes, plan.hivemind_nodes)
    )
    python = find_hivemind_python(hivemind_python) if hm_nodes else None
    # p2ptrain at hivemind's size first, then hivemind: the pair that is compared runs back to back (under
    # the same background load), with the same keys; then p2ptrain at that size with the other GC mode (so
    # the packing artifact is measured too); then the other sizes.
    other_gc = "default" if plan.gc == "relaxed" else "relaxed"
    runs = [(hm_nodes, plan.gc), (hm_nodes, "hivemind"), (hm_nodes, other_gc)] if hm_nodes and python else []
    runs += [(n, plan.gc) for n in plan.nodes if n != hm_nodes or not python]
    report["p2ptrain"] = []
    for n, mode in runs:
        if mode == "hivemind":
            ok = _run_hivemind_beside(report, plan, n, why, python or "") and ok
            continue
        print(f"running p2ptrain, {n} nodes, {mode} gc ...", file=sys.stderr, flush=True)
        try:
            report["p2ptrain"].append(run_p2ptrain(n, plan, log_info, profile, mode))
        except Exception as e:  # one size failing must not hide the others' numbers
            log.exception("p2ptrain run at %d nodes failed", n)
            error = {"nodes": n, "gc": mode, "status": "error", "error": f"{type(e).__name__}: {e}"}
            report["p2ptrain"].append(error)
            ok = False
    if not hm_nodes:
        report["hivemind"] = {"status": "not run (--hivemind-nodes 0)"}
    elif python is None:
        report["hivemind"] = {"status": "not installed (pip install -e '.[bench]' in its own virtualenv)"}
    report["comparisons"] = comparisons(report)
    report["rows"] = build_rows(report, base)
    report["load_after"] = loadavg()
    report["total_s"] = round(time.perf_counter() - began, 1)
    return report, ok


def _run_hivemind_beside(report: dict[str, Any], plan: Plan, m: int, why: str, python: str) -> bool:
    """hivemind at ``m`` nodes, with as many keys as p2ptrain attempted at ``m`` (unless set)."""
    twin = report["p2ptrain"][-1]
    if plan.hivemind_keys is None and "keys" in twin:
        plan = replace(plan, hivemind_keys=twin["keys"])
    print(f"running hivemind, {m} nodes ({why}) ...", file=sys.stderr, flush=True)
    try:
        report["hivemind"] = run_hivemind(m, plan, python) | {"nodes_chosen_because": why}
    except Exception as e:
        log.exception("hivemind run failed")
        report["hivemind"] = {"nodes": m, "status": "error", "error": f"{type(e).__name__}: {e}"}
        return False
    return True


def parse_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError("comma-separated node counts, e.g. 256,1024") from None
    if not sizes or min(sizes) < 2:
        raise argparse.ArgumentTypeError("each node count must be at least 2")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=parse_sizes, help="comma-separated swarm sizes (default 256,1024)")
    parser.add_argument("--keys", type=int, help="keys stored and read (default 4096)")
    parser.add_argument("--procs", type=int, default=4, help="p2ptrain worker processes (default 4)")
    parser.add_argument("--concurrency", type=int, default=16, help="operations in flight in the swarm")
    parser.add_argument(
        "--hivemind-nodes", type=int, help="hivemind swarm size (0: skip; default: what fits)"
    )
    parser.add_argument("--hivemind-keys", type=int, help="keys for hivemind (default: the same as --keys)")
    parser.add_argument("--hivemind-python", metavar="PATH", help="interpreter that can import hivemind")
    parser.add_argument(
        "--idle-timeout", type=float, default=30.0, help="p2ptrain connections' idle close (s)"
    )
    parser.add_argument(
        "--gc",
        choices=("relaxed", "default"),
        default="relaxed",
        help="p2ptrain workers' garbage collector (relaxed: fewer full collections; see the module doc)",
    )
    parser.add_argument(
        "--replication", type=int, default=5, help="replicas per key, both systems (default 5, hivemind's)"
    )
    parser.add_argument("--seed", type=int, default=1, help="random seed of the workload")
    parser.add_argument("--store-budget", type=float, help="seconds of stores per run (default 60)")
    parser.add_argument("--get-budget", type=float, help="seconds of gets per run (default 30)")
    parser.add_argument(
        "--quick", action="store_true", help="16 nodes, 512 keys, 10 s budgets: under a minute"
    )
    parser.add_argument("--json", metavar="PATH", help="write the JSON report here instead of stdout")
    parser.add_argument("-v", "--verbose", action="store_true", help="log each phase's results as it ends")
    parser.add_argument(
        "--count-info-logs", action="store_true", help="count p2ptrain's INFO log lines too (costs some CPU)"
    )
    parser.add_argument("--profile", metavar="DIR", help="write a cProfile of each p2ptrain worker here")
    parser.add_argument("--p2ptrain-worker", help=argparse.SUPPRESS)  # internal: a worker child
    parser.add_argument("--hivemind-driver", help=argparse.SUPPRESS)  # internal: the hivemind child
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)8.0f ms %(name)s: %(message)s")
    if args.p2ptrain_worker:
        p2ptrain_worker(*json.loads(args.p2ptrain_worker))
        return 0
    if args.hivemind_driver:
        hivemind_driver(json.loads(args.hivemind_driver))
        return 0
    if args.verbose:
        log.setLevel(logging.INFO)
    nodes = args.nodes or ((16,) if args.quick else (256, 1024))
    keys = args.keys or (512 if args.quick else 4096)
    hm_nodes = args.hivemind_nodes if args.hivemind_nodes is not None else (16 if args.quick else None)
    plan = Plan(
        nodes=nodes,
        keys=keys,
        procs=args.procs,
        concurrency=args.concurrency,
        hivemind_nodes=hm_nodes,
        hivemind_keys=args.hivemind_keys,
        seed=args.seed,
        replication=args.replication,
        idle_timeout=args.idle_timeout,
        gc=args.gc,
    )
    if args.quick:
        plan = replace(plan, store_budget=10.0, get_budget=10.0, op_timeout=20.0, start_timeout=60.0)
    if args.store_budget:
        plan = replace(plan, store_budget=args.store_budget)
    if args.get_budget:
        plan = replace(plan, get_budget=args.get_budget)
    base = f"python -m {MODULE}" + (" --quick" if args.quick else "")
    base += f" --keys {plan.keys} --procs {plan.procs} --concurrency {plan.concurrency}"
    base += f" --replication {plan.replication}"
    base += "".join(
        f" --{k}-budget {v:g}" for k, v in (("store", args.store_budget), ("get", args.get_budget)) if v
    )
    report, ok = run(plan, base, args.hivemind_python, args.count_info_logs, args.profile)
    write_report(report, args.json, format_table(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
