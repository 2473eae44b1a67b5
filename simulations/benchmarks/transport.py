"""Transport benchmark: p2ptrain's encrypted connection against plain TCP and hivemind's P2P, on loopback.

What it measures, with the clients in this process and each server in a child process of its own (as
in a real deployment, so both ends of a connection get a core):

* bulk throughput of one connection: 1 MiB chunks pushed through a streaming call into a sink that
  counts them. p2ptrain: AEGIS-256 records with credit flow control. hivemind: protobuf ``Tensor``
  messages on a libp2p stream, through both peers' p2pd daemons. Plain TCP (``sendall``/``recv_into``,
  no encryption, no framing) is the floor the other two are measured against;
* the round-trip time of a small unary call, one at a time (p50, p99, mean); the plain-TCP floor is an
  8-byte ping-pong between blocking sockets;
* the throughput of many small unary calls in flight at once.

Every client and every server is a process of its own, and all stay up for the whole run. The
systems take turns, phase by phase, for several rounds: a small VM drifts (other work, where the
scheduler puts the processes) by 2x within a minute, and taking turns exposes every system to the
same drift. Each phase records the CPU each side used (cores, and microseconds per call) and the CPU
that other work on the machine took (``others``): a side near 1.0 core is CPU-bound on its event
loop. A round in which other work took more than a quarter of a core is kept in the report but left
out of the medians when an uncontended round of the same phase exists; ``--wait-idle S`` waits for
a quiet machine before each phase.

Usage::

    python -m simulations.bench_transport [--quick] [--json PATH] [--only p2ptrain,tcp,hivemind]

hivemind runs only where it can be imported (``pip install -e .[bench]``, best in a separate
virtualenv); otherwise its rows say 'not installed' and the run still succeeds. The JSON report goes
to stdout (or PATH); a table with the command that reproduces each row goes to stderr.

A server is this module run with ``--serve KIND``: it prints its address as one JSON line and exits
when its stdin closes, so a benchmark that dies leaves no server (and no p2pd) behind. Every loop is
bounded in count and in time; only loopback addresses are used.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import selectors
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import nacl.bindings as sodium
import trio

from p2ptrain.identity import Identity
from p2ptrain.net import Connection, Host, Method, RpcRegistry, RpcStream
from p2ptrain.net.channel import MAX_CHUNK
from p2ptrain.wire import Message, bounded
from simulations.benchmarks.environment import environment as base_environment
from simulations.benchmarks.environment import write_report

MODULE = "simulations.bench_transport"
log = logging.getLogger(MODULE)  # not __name__: that is "__main__" under `python -m`
T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = "127.0.0.1"
MARK = "BENCH-MSG "
RUN_ID = "bench-transport"
CHUNK = MAX_CHUNK  # 1 MiB: the largest record body, so one chunk is one encrypted frame
TARGET_MB_S = 500.0
SYSTEMS = ("p2ptrain", "tcp", "hivemind")
PHASES = ("stream", "rtt", "concurrent")
# The same buffers p2ptrain's TcpTransport asks for, so that the TCP floor differs from p2ptrain only
# by encryption, framing and the event loop, not by socket tuning.
SOCKET_BUFFER = 4 * 1024 * 1024
START_TIMEOUT = 60.0  # hivemind imports torch and starts a Go daemon: slow on a busy machine
STOP_TIMEOUT = 15.0


@dataclass(frozen=True)
class Plan:
    """The work of one round (each phase also stops early once it has run ``budget_s``)."""

    rounds: int
    stream_bytes: int
    warmup_bytes: int
    rtt_calls: int
    rtt_warmup: int
    concurrent_calls: int
    concurrency: int
    budget_s: float


FULL = Plan(
    rounds=3,
    stream_bytes=1 << 30,
    warmup_bytes=32 << 20,
    rtt_calls=2000,
    rtt_warmup=200,
    concurrent_calls=10_000,
    concurrency=1000,
    budget_s=20.0,
)
QUICK = Plan(
    rounds=1,
    stream_bytes=256 << 20,
    warmup_bytes=16 << 20,
    rtt_calls=1000,
    rtt_warmup=100,
    concurrent_calls=4000,
    concurrency=1000,
    budget_s=5.0,
)


# ---- p2ptrain methods ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Echo(Message):
    number: int = bounded(ge=0, le=2**62)


@dataclass(frozen=True)
class SinkOpen(Message):
    label: str = bounded(max_len=64)


@dataclass(frozen=True)
class SinkDone(Message):
    received: int = bounded(ge=0, le=2**62)


ECHO = Method("bench.echo", Echo, Echo)
SINK = Method("bench.sink", SinkOpen, SinkDone, streaming=True)

# hivemind's P2P defaults reach beyond this machine (UPnP port mapping, AutoNAT, relays): switch them off.
HIVEMIND_LOOPBACK_ONLY: dict[str, Any] = {
    "host_maddrs": [f"/ip4/{LOOPBACK}/tcp/0"],
    "nat_port_map": False,
    "auto_nat": False,
    "use_relay": False,
    "use_auto_relay": False,
    "use_ipfs": False,
}


# ---- measuring helpers ---------------------------------------------------------------------------


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    k = math.ceil(q / 100.0 * len(sorted_values)) - 1
    return sorted_values[max(0, min(len(sorted_values) - 1, k))]


def latency_summary(samples_ns: list[int], cpu: dict[str, float]) -> dict[str, Any]:
    if not samples_ns:
        return {"calls": 0}  # the budget ran out during the warm-up: the rows say n/a
    us = sorted(s / 1000.0 for s in samples_ns)
    mean = sum(us) / len(us)
    return {
        "calls": len(us),
        "p50_us": round(percentile(us, 50), 1),
        "p99_us": round(percentile(us, 99), 1),
        "mean_us": round(mean, 1),
        "min_us": round(us[0], 1),
        "max_us": round(us[-1], 1),
        "cpu_cores": cpu,
        # CPU each side spends per call: where a round trip goes when neither side waits.
        "cpu_us_per_call": {s: round(cpu[s] * mean, 1) for s in ("client", "server") if s in cpu},
    }


def _proc_table() -> dict[int, tuple[int, int]] | None:
    """pid -> (parent pid, CPU clock ticks so far) from Linux /proc; None elsewhere."""
    procs = Path("/proc")
    if not procs.is_dir():
        return None
    table: dict[int, tuple[int, int]] = {}
    for d in procs.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # The command name may contain spaces and parentheses: split after the last ')'.
        fields = stat[stat.rindex(")") + 2 :].split()
        table[int(d.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    return table


def _tree_seconds(table: dict[int, tuple[int, int]], root: int) -> float:
    """CPU seconds of ``root`` and its live descendants (hivemind's p2pd daemons included)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    ticks, todo = 0, [root] if root in table else []
    while todo:
        pid = todo.pop()
        ticks += table[pid][1]
        todo += children.get(pid, [])
    return ticks / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float | None:
    """CPU seconds all CPUs have spent busy since boot (Linux /proc/stat; None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # guest time is already in user


class CpuMeter:
    """CPU use over an interval, in cores (1.0 = one busy core): client, server, and other work.

    Measured from inside a client process: the client's share is its own process tree (with
    hivemind's client daemon), the server's is the server's tree, and ``others`` is whatever ran
    outside the benchmark's whole tree (rooted at the orchestrating process).
    """

    def __init__(self, server_pid: int, bench_pid: int) -> None:
        self.server_pid = server_pid
        self.bench_pid = bench_pid
        self._start: tuple[float, ...] | None = None

    def _sample(self) -> tuple[float, ...] | None:
        table, machine = _proc_table(), machine_busy_seconds()
        if table is None or machine is None:
            return None
        return (
            time.perf_counter(),
            _tree_seconds(table, os.getpid()),
            _tree_seconds(table, self.server_pid),
            machine - _tree_seconds(table, self.bench_pid),
        )

    def start(self) -> None:
        self._start = self._sample()

    def stop(self) -> dict[str, float]:
        end = self._sample()
        if self._start is None or end is None:
            return {}
        dt = end[0] - self._start[0]
        client, server, others = ((b - a) / dt for a, b in zip(self._start[1:], end[1:], strict=True))
        # Per-process and machine-wide ticks are sampled apart: keep ``others`` within what can exist.
        others = min(max(0.0, others), float(os.cpu_count() or 1))
        return {"client": round(client, 2), "server": round(server, 2), "others": round(others, 2)}


def wait_for_idle_machine(limit_s: float, busy_below: float = 0.25) -> float | None:
    """Wait (at most ``limit_s``) until a 1 s sample shows under ``busy_below`` busy cores; return the
    last sample. Other work on a 2-core machine takes what either side of the benchmark needs."""
    deadline = time.monotonic() + limit_s
    while True:
        t0, b0 = time.perf_counter(), machine_busy_seconds()
        time.sleep(1.0)
        b1 = machine_busy_seconds()
        if b0 is None or b1 is None:
            return None
        busy = (b1 - b0) / (time.perf_counter() - t0)
        if busy < busy_below or time.monotonic() >= deadline:
            return round(busy, 2)
        log.info("machine busy (%.2f cores used by other work); waiting", busy)


def aead_ceiling() -> dict[str, float]:
    """One core's AEGIS-256 sealing speed on 1 MiB, two ways: into a buffer reused every time (the
    cipher alone), and through pynacl's API as p2ptrain's channel calls it, which allocates a fresh
    output and copies it each time (its speed depends on the allocator, which is the point)."""
    key, nonce, data = os.urandom(32), bytes(32), os.urandom(CHUNK)

    def speed(seal: Callable[[], object]) -> float:
        n, t0 = 0, time.perf_counter()
        while n < 200 and time.perf_counter() - t0 < 1.0:
            seal()
            n += 1
        return round(n * CHUNK / (time.perf_counter() - t0) / 1e6, 1)

    out = {"pynacl_api_mb_s": speed(lambda: sodium.crypto_aead_aegis256_encrypt(data, None, nonce, key))}
    try:
        from nacl._sodium import ffi, lib  # pynacl's private binding: the cipher without allocation
    except ImportError:
        return out
    sealed = bytearray(CHUNK + sodium.crypto_aead_aegis256_ABYTES)
    dst, src, size = ffi.from_buffer(sealed), ffi.from_buffer(data), ffi.new("unsigned long long *")
    out["cipher_only_mb_s"] = speed(
        lambda: lib.crypto_aead_aegis256_encrypt(dst, size, src, CHUNK, ffi.NULL, 0, ffi.NULL, nonce, key)
    )
    return out


# ---- servers (child processes) ---------------------------------------------------------------------


def _emit(message: dict[str, Any]) -> None:
    """One message to the orchestrating process: a marked JSON line (other stdout lines are ignored)."""
    sys.stdout.write(MARK + json.dumps(message) + "\n")
    sys.stdout.flush()


def _wait_stdin_eof() -> None:
    """Block until the parent closes our stdin (or dies)."""
    while sys.stdin.buffer.read(4096):
        pass


def serve(kind: str) -> None:
    if kind == "p2ptrain":
        trio.run(_serve_p2ptrain)
    elif kind == "tcp":
        _serve_tcp()
    elif kind == "hivemind":
        run_like_hivemind(_serve_hivemind())
    else:
        raise SystemExit(f"unknown server kind {kind!r}")


async def _serve_p2ptrain() -> None:
    registry = RpcRegistry()

    async def echo(ctx: Any, req: Echo) -> Echo:
        return req

    async def sink(ctx: Any, req: SinkOpen, stream: RpcStream) -> SinkDone:
        received = 0
        async for chunk in stream:
            received += len(chunk)
        return SinkDone(received)

    registry.add_unary(ECHO, echo)
    registry.add_stream(SINK, sink)
    async with trio.open_nursery() as nursery:
        host = Host(Identity.generate(), RUN_ID, registry=registry)
        await nursery.start(host.run, [(LOOPBACK, 0)])
        _emit({"addr": str(host.listen_addresses[0])})
        await trio.to_thread.run_sync(_wait_stdin_eof, abandon_on_cancel=True)
        nursery.cancel_scope.cancel()


def _tune(sock: socket.socket) -> None:
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as trio sets it for p2ptrain


def _serve_tcp() -> None:
    """Serve one connection at a time; its first byte picks the mode: b"S" sink or b"E" echo."""
    stop = threading.Event()

    def watch_stdin() -> None:
        _wait_stdin_eof()
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    buf = memoryview(bytearray(CHUNK))
    with socket.create_server((LOOPBACK, 0)) as listener:
        listener.settimeout(0.2)  # wake up to notice `stop`
        _emit({"addr": f"{LOOPBACK}:{listener.getsockname()[1]}"})
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                _tune(conn)
                conn.settimeout(120.0)
                mode = conn.recv(1)
                if mode == b"E":
                    while n := conn.recv_into(buf):
                        conn.sendall(buf[:n])
                elif mode == b"S":
                    received = 0
                    while n := conn.recv_into(buf):
                        received += n
                    conn.sendall(received.to_bytes(8, "big"))


async def _serve_hivemind() -> None:
    from hivemind.p2p import P2P, P2PContext
    from hivemind.proto import runtime_pb2, test_pb2

    p2p = await P2P.create(**HIVEMIND_LOOPBACK_ONLY)
    try:

        async def echo(req: test_pb2.TestRequest, ctx: P2PContext) -> test_pb2.TestResponse:
            return test_pb2.TestResponse(number=req.number)

        async def sink(
            requests: AsyncIterator[runtime_pb2.ExpertRequest], ctx: P2PContext
        ) -> runtime_pb2.ExpertResponse:
            received = 0
            async for req in requests:
                received += sum(len(t.buffer) for t in req.tensors)
            return runtime_pb2.ExpertResponse(metadata=str(received).encode())

        await p2p.add_protobuf_handler("bench.echo", echo, test_pb2.TestRequest)
        await p2p.add_protobuf_handler("bench.sink", sink, runtime_pb2.ExpertRequest, stream_input=True)
        maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
        _emit({"addr": maddrs, "peer_id": p2p.peer_id.to_base58()})
        await asyncio.get_running_loop().run_in_executor(None, _wait_stdin_eof)
    finally:
        await p2p.shutdown()


def run_like_hivemind(main: Coroutine[Any, Any, T]) -> T:
    """Run on uvloop, as hivemind's own DHT and averager run their P2P (``switch_to_uvloop``)."""
    with hivemind_runner() as runner:
        return runner.run(main)


def hivemind_runner() -> asyncio.Runner:
    import uvloop  # a dependency of hivemind

    return asyncio.Runner(loop_factory=uvloop.new_event_loop)


class ChildProcess:
    """This module run as ``--serve KIND`` or ``--client KIND``, spoken to in JSON lines.

    Closing its stdin asks it to exit cleanly (so hivemind stops its p2pd); signals are the last resort.
    """

    def __init__(self, role: str, kind: str) -> None:
        self.name = f"{kind} {role}"
        env = dict(os.environ)
        env.setdefault("HIVEMIND_LOGLEVEL", "WARNING")  # read when hivemind is first imported
        self.proc = subprocess.Popen(
            [sys.executable, "-m", MODULE, f"--{role}", kind],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=REPO_ROOT,  # so that `-m simulations...` resolves wherever the benchmark was started
            env=env,
        )
        self._buf = b""

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(message) + "\n").encode())
        self.proc.stdin.flush()

    def receive(self, timeout: float) -> dict[str, Any]:
        """The child's next message; RuntimeError if it exits or stays silent for ``timeout`` s."""
        out = self.proc.stdout
        assert out is not None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(out, selectors.EVENT_READ)
            while True:
                while b"\n" in self._buf:
                    line, _, self._buf = self._buf.partition(b"\n")
                    text = line.decode(errors="replace")
                    if text.startswith(MARK):
                        message: dict[str, Any] = json.loads(text[len(MARK) :])
                        return message
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"{self.name} sent nothing within {timeout:g} s")
                if sel.select(left):
                    data = os.read(out.fileno(), 1 << 16)
                    if not data:
                        raise RuntimeError(f"{self.name} exited (status {self.proc.wait()})")
                    self._buf += data

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %g s; terminating it", self.name, STOP_TIMEOUT)
            self.proc.terminate()
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        log.info("%s stopped", self.name)


# ---- clients ----------------------------------------------------------------------------------------


class Client(Protocol):
    """One system's client. Each phase returns one round's measurement, or None if it has no such phase."""

    def stream(self, plan: Plan) -> dict[str, Any] | None: ...
    def rtt(self, plan: Plan) -> dict[str, Any] | None: ...
    def concurrent(self, plan: Plan) -> dict[str, Any] | None: ...
    def close(self) -> None: ...


def stream_result(sent: int, seconds: float, cpu: dict[str, float]) -> dict[str, Any]:
    return {
        "bytes": sent,
        "seconds": round(seconds, 4),
        "mb_s": round(sent / seconds / 1e6, 1),
        "cpu_cores": cpu,
    }


def concurrent_result(plan: Plan, calls: int, seconds: float, cpu: dict[str, float]) -> dict[str, Any]:
    return {
        "in_flight": plan.concurrency,
        "calls": calls,
        "seconds": round(seconds, 3),
        "calls_s": round(calls / seconds),
        "cpu_cores": cpu,
        "cpu_us_per_call": {
            s: round(cpu[s] * seconds / max(calls, 1) * 1e6, 1) for s in ("client", "server") if s in cpu
        },
    }


class P2ptrainClient:
    """A fresh Host and connection per phase (trio runs only inside a phase), warmed up before timing."""

    def __init__(self, info: dict[str, Any], meter: CpuMeter) -> None:
        self.addr: str = info["addr"]
        self.meter = meter
        self.identity = Identity.generate()

    def _run(self, phase: Callable[[Connection, Plan], Coroutine[Any, Any, T]], plan: Plan) -> T:
        async def main() -> T:
            with trio.fail_after(plan.budget_s + 60):  # phases bound themselves; this catches a hang
                async with trio.open_nursery() as nursery:
                    host: Host = await nursery.start(Host(self.identity, RUN_ID).run, [])
                    conn = await host.connect(self.addr)
                    try:
                        return await phase(conn, plan)
                    finally:
                        nursery.cancel_scope.cancel()

        return trio.run(main)

    def stream(self, plan: Plan) -> dict[str, Any]:
        return self._run(self._stream, plan)

    def rtt(self, plan: Plan) -> dict[str, Any]:
        return self._run(self._rtt, plan)

    def concurrent(self, plan: Plan) -> dict[str, Any]:
        return self._run(self._concurrent, plan)

    def close(self) -> None:
        pass

    async def _push(self, conn: Connection, chunk: bytes, total: int, budget: float) -> tuple[int, float]:
        start = time.perf_counter()
        sent = 0
        async with conn.open_stream(SINK, SinkOpen("bench"), timeout=budget + 30) as stream:
            while sent < total and time.perf_counter() - start < budget:
                await stream.send(chunk)
                sent += len(chunk)
            await stream.send_eof()
            done = await stream.response()
        if done.received != sent:
            raise RuntimeError(f"p2ptrain sink received {done.received} bytes, {sent} were sent")
        return sent, time.perf_counter() - start

    async def _stream(self, conn: Connection, plan: Plan) -> dict[str, Any]:
        chunk = os.urandom(CHUNK)
        await self._push(conn, chunk, plan.warmup_bytes, plan.budget_s)
        self.meter.start()
        sent, seconds = await self._push(conn, chunk, plan.stream_bytes, plan.budget_s)
        return stream_result(sent, seconds, self.meter.stop())

    async def _rtt(self, conn: Connection, plan: Plan) -> dict[str, Any]:
        samples: list[int] = []
        start = time.perf_counter()
        for i in range(plan.rtt_warmup + plan.rtt_calls):
            if time.perf_counter() - start > plan.budget_s:
                break
            if i == plan.rtt_warmup:
                self.meter.start()
            t0 = time.perf_counter_ns()
            reply = await conn.call(ECHO, Echo(i), timeout=10.0)
            if i >= plan.rtt_warmup:
                samples.append(time.perf_counter_ns() - t0)
            if reply.number != i:
                raise RuntimeError("p2ptrain echo returned the wrong number")
        return {"samples_ns": samples, "cpu_cores": self.meter.stop()}

    async def _concurrent(self, conn: Connection, plan: Plan) -> dict[str, Any]:
        issued = completed = 0
        start = time.perf_counter()

        async def worker() -> None:
            nonlocal issued, completed
            while issued < plan.concurrent_calls and time.perf_counter() - start < plan.budget_s:
                issued += 1
                await conn.call(ECHO, Echo(issued), timeout=30.0)
                completed += 1

        self.meter.start()
        async with trio.open_nursery() as nursery:
            for _ in range(plan.concurrency):
                nursery.start_soon(worker)
        return concurrent_result(plan, completed, time.perf_counter() - start, self.meter.stop())


class TcpClient:
    """Blocking sockets, no encryption, no framing: the floor for bulk bytes and for one round trip."""

    def __init__(self, info: dict[str, Any], meter: CpuMeter) -> None:
        host, port = info["addr"].rsplit(":", 1)
        self.addr = (host, int(port))
        self.meter = meter

    def _connect(self, mode: bytes, timeout: float) -> socket.socket:
        sock = socket.create_connection(self.addr, timeout=timeout)
        _tune(sock)
        sock.sendall(mode)
        return sock

    def _push(self, chunk: bytes, total: int, budget: float) -> tuple[int, float]:
        start = time.perf_counter()
        sent = 0
        with self._connect(b"S", budget + 30) as sock:
            while sent < total and time.perf_counter() - start < budget:
                sock.sendall(chunk)
                sent += len(chunk)
            sock.shutdown(socket.SHUT_WR)
            reply = _recv_exactly(sock, 8)
        if int.from_bytes(reply, "big") != sent:
            raise RuntimeError(f"tcp sink acknowledged {reply!r}, {sent} bytes were sent")
        return sent, time.perf_counter() - start

    def stream(self, plan: Plan) -> dict[str, Any]:
        chunk = os.urandom(CHUNK)
        self._push(chunk, plan.warmup_bytes, plan.budget_s)
        self.meter.start()
        sent, seconds = self._push(chunk, plan.stream_bytes, plan.budget_s)
        return stream_result(sent, seconds, self.meter.stop())

    def rtt(self, plan: Plan) -> dict[str, Any]:
        samples: list[int] = []
        start = time.perf_counter()
        with self._connect(b"E", 10.0) as sock:
            for i in range(plan.rtt_warmup + plan.rtt_calls):
                if time.perf_counter() - start > plan.budget_s:
                    break
                if i == plan.rtt_warmup:
                    self.meter.start()
                t0 = time.perf_counter_ns()
                sock.sendall(i.to_bytes(8, "big"))
                if _recv_exactly(sock, 8) != i.to_bytes(8, "big"):
                    raise RuntimeError("tcp echo returned the wrong bytes")
                if i >= plan.rtt_warmup:
                    samples.append(time.perf_counter_ns() - t0)
        return {"samples_ns": samples, "cpu_cores": self.meter.stop()}

    def concurrent(self, plan: Plan) -> None:
        return None  # no RPC layer to load

    def close(self) -> None:
        pass


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n and (part := sock.recv(n - len(data))):
        data += part
    return data


class HivemindClient:
    """hivemind's P2P (with its own p2pd), kept across phases on one uvloop event loop."""

    def __init__(self, info: dict[str, Any], meter: CpuMeter) -> None:
        from hivemind.p2p import P2P, PeerID

        self.meter = meter
        self.peer = PeerID.from_base58(info["peer_id"])
        self.runner = hivemind_runner()
        try:
            self.p2p = self.runner.run(P2P.create(initial_peers=info["addr"], **HIVEMIND_LOOPBACK_ONLY))
        except BaseException:
            self.runner.close()
            raise
        log.info("hivemind client daemon started")

    def _run(self, phase: Callable[[Plan], Coroutine[Any, Any, T]], plan: Plan) -> T:
        async def main() -> T:
            async with asyncio.timeout(plan.budget_s + 60):  # phases bound themselves; this catches a hang
                return await phase(plan)

        return self.runner.run(main())

    def stream(self, plan: Plan) -> dict[str, Any]:
        return self._run(self._stream, plan)

    def rtt(self, plan: Plan) -> dict[str, Any]:
        return self._run(self._rtt, plan)

    def concurrent(self, plan: Plan) -> dict[str, Any]:
        return self._run(self._concurrent, plan)

    def close(self) -> None:
        try:
            self.runner.run(self.p2p.shutdown())
        finally:
            self.runner.close()
        log.info("hivemind client daemon stopped")

    async def _push(self, total: int, budget: float) -> tuple[int, float]:
        from hivemind.proto import runtime_pb2

        # One message built once and sent again and again, as p2ptrain's client reuses one buffer: this
        # measures the transport, not tensor building (hivemind's averager builds a message per part).
        message = runtime_pb2.ExpertRequest(
            uid="bench", tensors=[runtime_pb2.Tensor(buffer=os.urandom(CHUNK))]
        )
        start = time.perf_counter()
        sent = 0

        async def requests() -> AsyncIterator[runtime_pb2.ExpertRequest]:
            nonlocal sent
            while sent < total and time.perf_counter() - start < budget:
                sent += CHUNK
                yield message

        reply = await self.p2p.call_protobuf_handler(
            self.peer, "bench.sink", requests(), runtime_pb2.ExpertResponse
        )
        if int(reply.metadata) != sent:
            raise RuntimeError(f"hivemind sink received {reply.metadata!r} bytes, {sent} were sent")
        return sent, time.perf_counter() - start

    async def _stream(self, plan: Plan) -> dict[str, Any]:
        await self._push(plan.warmup_bytes, plan.budget_s)
        self.meter.start()
        sent, seconds = await self._push(plan.stream_bytes, plan.budget_s)
        return stream_result(sent, seconds, self.meter.stop())

    async def _call_echo(self, number: int) -> int:
        from hivemind.proto import test_pb2

        request = test_pb2.TestRequest(number=number % 2**31)
        reply = await self.p2p.call_protobuf_handler(self.peer, "bench.echo", request, test_pb2.TestResponse)
        return int(reply.number)

    async def _rtt(self, plan: Plan) -> dict[str, Any]:
        samples: list[int] = []
        start = time.perf_counter()
        for i in range(plan.rtt_warmup + plan.rtt_calls):
            if time.perf_counter() - start > plan.budget_s:
                break
            if i == plan.rtt_warmup:
                self.meter.start()
            t0 = time.perf_counter_ns()
            number = await self._call_echo(i)
            if i >= plan.rtt_warmup:
                samples.append(time.perf_counter_ns() - t0)
            if number != i:
                raise RuntimeError("hivemind echo returned the wrong number")
        return {"samples_ns": samples, "cpu_cores": self.meter.stop()}

    async def _concurrent(self, plan: Plan) -> dict[str, Any]:
        issued = completed = 0
        start = time.perf_counter()

        async def worker() -> None:
            nonlocal issued, completed
            while issued < plan.concurrent_calls and time.perf_counter() - start < plan.budget_s:
                issued += 1
                await self._call_echo(issued)
                completed += 1

        self.meter.start()
        async with asyncio.TaskGroup() as group:
            for _ in range(plan.concurrency):
                group.create_task(worker())
        return concurrent_result(plan, completed, time.perf_counter() - start, self.meter.stop())


CLIENTS: dict[str, Callable[[dict[str, Any], CpuMeter], Client]] = {
    "p2ptrain": P2ptrainClient,
    "tcp": TcpClient,
    "hivemind": HivemindClient,
}


def hivemind_version() -> str | None:
    if importlib.util.find_spec("hivemind") is None:
        return None
    return importlib.metadata.version("hivemind")


def client_main(kind: str) -> None:
    """A client child: set up from the first line on stdin, then measure one phase per request line.

    Each client has a process of its own, so what one system's client imported or allocated (hivemind
    brings torch) cannot change another's numbers through the shared heap or allocator state.
    """
    line = sys.stdin.readline()
    if not line:
        return
    setup = json.loads(line)
    try:
        client = CLIENTS[kind](setup["server"], CpuMeter(setup["server_pid"], setup["bench_pid"]))
    except Exception as e:
        log.exception("%s client could not start", kind)
        _emit({"error": f"{type(e).__name__}: {e}"})
        return
    try:
        _emit({"ready": True})
        for line in sys.stdin:
            request = json.loads(line)
            try:
                result = getattr(client, request["phase"])(Plan(**request["plan"]))
            except Exception as e:
                log.exception("%s %s failed", kind, request["phase"])
                _emit({"error": f"{request['phase']}: {type(e).__name__}: {e}"})
            else:
                _emit({"result": result})
    finally:
        client.close()


# ---- aggregation and report --------------------------------------------------------------------------


CONTENDED_CORES = 0.25
"""A phase during which other work took more CPU than this is 'contended'."""


def _contended(measured: dict[str, Any]) -> bool:
    return float(measured.get("cpu_cores", {}).get("others", 0.0)) > CONTENDED_CORES


def summarize(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """One system's rounds -> per phase, medians over its uncontended rounds (over all if none is).

    Every round stays in the report (``rounds``) with the CPU that other work took during it.
    """
    out: dict[str, Any] = {}
    for phase, measured in rounds.items():
        if phase == "rtt":
            measured = [latency_summary(r["samples_ns"], r["cpu_cores"]) for r in measured if r["samples_ns"]]
        if not measured:
            continue
        clean = [r for r in measured if not _contended(r)]
        used = clean or measured
        keys = {"stream": ("mb_s",), "rtt": ("p50_us", "p99_us", "mean_us"), "concurrent": ("calls_s",)}[
            phase
        ]
        summary: dict[str, Any] = {k: round(statistics.median(r[k] for r in used), 1) for k in keys}
        if phase == "rtt":
            summary["cpu_us_per_call"] = _median_dict([r.get("cpu_us_per_call", {}) for r in used])
        summary["rounds_used"] = len(used)
        summary["contended"] = not clean  # every round of this phase had other work competing
        summary["rounds"] = measured
        out[phase] = summary
    return out


def _median_dict(dicts: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for d in dicts for k in d}
    return {k: round(statistics.median(d[k] for d in dicts if k in d), 1) for k in sorted(keys)}


# (key, label, unit, better, how to read the value from a system's summary)
METRICS: list[tuple[str, str, str, str, Callable[[dict[str, Any]], float]]] = [
    ("stream_mb_s", "stream, 1 MiB chunks", "MB/s", "higher", lambda r: r["stream"]["mb_s"]),
    ("rtt_p50_us", "unary RTT p50", "us", "lower", lambda r: r["rtt"]["p50_us"]),
    ("rtt_p99_us", "unary RTT p99", "us", "lower", lambda r: r["rtt"]["p99_us"]),
    ("rtt_mean_us", "unary RTT mean", "us", "lower", lambda r: r["rtt"]["mean_us"]),
    (
        "concurrent_calls_s",
        "unary calls, {in_flight:,} in flight",
        "calls/s",
        "higher",
        lambda r: r["concurrent"]["calls_s"],
    ),
]


def _value(results: dict[str, Any], system: str, read: Callable[[dict[str, Any]], float]) -> float | str:
    r = results.get(system)
    if r is None:
        return "not run"
    if "status" in r:
        return str(r["status"])
    try:
        return read(r)
    except KeyError:
        return "n/a"


def _ratio(a: Any, b: Any) -> float | None:
    if isinstance(a, float | int) and isinstance(b, float | int) and b:
        return round(a / b, 3)
    return None


def build_rows(results: dict[str, Any], plan: Plan, base_command: str) -> list[dict[str, Any]]:
    rows = []
    for key, label, unit, better, read in METRICS:
        # Plain TCP has no RPC layer: it is the floor for bulk bytes and for one round trip only.
        systems = ("p2ptrain", "hivemind") if key == "concurrent_calls_s" else SYSTEMS
        row: dict[str, Any] = {
            "metric": key,
            "label": label.format(in_flight=plan.concurrency),
            "unit": unit,
            "better": better,
        }
        for system in SYSTEMS:
            row[system] = _value(results, system, read) if system in systems else None
        row["p2ptrain_over_hivemind"] = _ratio(row["p2ptrain"], row["hivemind"])
        row["p2ptrain_over_tcp"] = _ratio(row["p2ptrain"], row["tcp"])
        row["command"] = f"{base_command} --only {','.join(systems)}"
        rows.append(row)
    return rows


def contended_phases(results: dict[str, Any]) -> list[str]:
    """The phases whose every round had other work competing (their numbers are suspect)."""
    return [
        f"{system} {phase}"
        for system, summary in results.items()
        for phase in PHASES
        if summary.get(phase, {}).get("contended")
    ]


def max_others(results: dict[str, Any]) -> float:
    """The most CPU (cores) that work outside the benchmark took during any measured phase."""
    seen = [0.0]
    for summary in results.values():
        for phase in PHASES:
            for r in summary.get(phase, {}).get("rounds", []):
                seen.append(r.get("cpu_cores", {}).get("others", 0.0))
    return max(seen)


def format_table(report: dict[str, Any]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float | int):
            return f"{v:,.1f}" if isinstance(v, float) and v < 100 else f"{v:,.0f}"
        return str(v)

    def ratio(v: float | None) -> str:
        return f"{v:.2f}x" if v is not None else "-"

    head = ["metric", "unit", "p2ptrain", "plain TCP", "hivemind", "p2p/hm", "p2p/tcp", "reproduce"]
    lines = [head]
    for row in report["rows"]:
        values = [cell(row[s]) for s in SYSTEMS]
        ratios = [ratio(row["p2ptrain_over_hivemind"]), ratio(row["p2ptrain_over_tcp"])]
        lines.append([row["label"], row["unit"], *values, *ratios, row["command"]])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    stream = report["results"].get("p2ptrain", {}).get("stream")
    if stream:
        verdict = "meets" if stream["mb_s"] >= TARGET_MB_S else "MISSES"
        text.append(f"p2ptrain stream {verdict} the {TARGET_MB_S:.0f} MB/s target.")
    if suspect := contended_phases(report["results"]):
        text.append(
            f"WARNING: other work on this machine competed in every round of: {', '.join(suspect)}; "
            "those numbers are contended (see rounds[].cpu_cores.others): rerun on a quiet machine."
        )
    text.append("Ratios are p2ptrain / other: above 1 is better for MB/s and calls/s, below 1 for RTT.")
    text.append(
        f"Values are medians over the rounds in which other work took at most {CONTENDED_CORES} cores."
    )
    text.append("hivemind rows need the bench extra: pip install -e '.[bench]' (in its own virtualenv).")
    return "\n".join(text)


def environment() -> dict[str, Any]:
    env = base_environment(("p2ptrain", "trio", "pynacl", "msgpack", "hivemind", "protobuf"))
    env["aead_aegis256_seal_1mib_one_core"] = aead_ceiling()
    return env


# ---- the run --------------------------------------------------------------------------------------------


def connect_clients(
    servers: dict[str, ChildProcess], clients: dict[str, ChildProcess], results: dict[str, Any]
) -> dict[str, ChildProcess]:
    """Hand each client its server's address; a system that cannot start gets an error status."""
    live: dict[str, ChildProcess] = {}
    for system, server in servers.items():
        try:
            info = server.receive(START_TIMEOUT)
            log.info("%s ready", server.name)
            clients[system].send({"server": info, "server_pid": server.proc.pid, "bench_pid": os.getpid()})
            reply = clients[system].receive(START_TIMEOUT)
            if "error" in reply:
                raise RuntimeError(reply["error"])
            live[system] = clients[system]
        except Exception as e:  # one system failing must not hide the others' numbers
            log.exception("%s could not start", system)
            results[system] = {"status": "error", "error": f"{type(e).__name__}: {e}"}
    return live


def measure(
    plan: Plan, clients: dict[str, ChildProcess], results: dict[str, Any], wait_idle_s: float
) -> dict[str, Any]:
    """Run the rounds; the systems take turns phase by phase (never at once: they would share cores).

    With ``wait_idle_s``, each phase of each round first waits (that long at most) for other work on
    the machine to stop, so that intermittent load elsewhere spoils fewer measurements.
    """
    rounds: dict[str, dict[str, list[dict[str, Any]]]] = {s: {p: [] for p in PHASES} for s in clients}
    for r in range(plan.rounds):
        for phase in PHASES:
            if wait_idle_s > 0:
                wait_for_idle_machine(wait_idle_s)
            for system, client in list(clients.items()):
                log.info("round %d/%d: %s %s", r + 1, plan.rounds, system, phase)
                try:
                    client.send({"phase": phase, "plan": asdict(plan)})
                    # A phase is a warm-up and a measurement, each bounded by budget_s.
                    reply = client.receive(2 * plan.budget_s + 120)
                    if "error" in reply:
                        raise RuntimeError(reply["error"])
                except (RuntimeError, OSError) as e:  # OSError: the child is gone (broken pipe)
                    results[system] = {"status": "error", "error": str(e)}
                    log.error("%s: %s", system, e)
                    del clients[system]
                    continue
                if reply["result"] is not None:
                    rounds[system][phase].append(reply["result"])
    return {system: summarize(r) for system, r in rounds.items()}


def run(plan: Plan, systems: list[str], base_command: str, wait_idle_s: float) -> tuple[dict[str, Any], bool]:
    results: dict[str, Any] = {}
    if "hivemind" in systems and hivemind_version() is None:
        results["hivemind"] = {"status": "not installed"}
        systems = [s for s in systems if s != "hivemind"]
    busy_before = wait_for_idle_machine(wait_idle_s)
    started = time.perf_counter()
    servers: dict[str, ChildProcess] = {}
    clients: dict[str, ChildProcess] = {}
    try:
        for system in systems:  # every child at once: their slow start-ups (imports, p2pd) overlap
            servers[system] = ChildProcess("serve", system)
            clients[system] = ChildProcess("client", system)
        live = connect_clients(servers, clients, results)
        for system, summary in measure(plan, live, results, wait_idle_s).items():
            results.setdefault(system, summary)
    finally:
        for child in [*clients.values(), *servers.values()]:
            child.stop()
    report: dict[str, Any] = {
        "benchmark": "transport",
        "command": base_command,
        "target_stream_mb_s": TARGET_MB_S,
        "plan": asdict(plan),
        "wall_s": round(time.perf_counter() - started, 1),
        "environment": environment(),
        "machine_busy_cores_before": busy_before,
        "max_other_cores_during": max_others(results),
        "contended_phases": contended_phases(results),
        "rows": build_rows(results, plan, base_command),
        "results": results,
    }
    ok = not any(r.get("status") == "error" for r in results.values())
    return report, ok


def parse_systems(text: str) -> list[str]:
    systems = [s.strip() for s in text.split(",") if s.strip()]
    if not systems or any(s not in SYSTEMS for s in systems):
        raise argparse.ArgumentTypeError(f"choose from {', '.join(SYSTEMS)} (comma-separated)")
    return [s for s in SYSTEMS if s in systems]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small round: well under 30 s")
    parser.add_argument("--json", metavar="PATH", help="write the JSON report here instead of stdout")
    parser.add_argument(
        "--only", type=parse_systems, default=list(SYSTEMS), help=f"comma-separated subset of {SYSTEMS}"
    )
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="S",
        help="before the run and each phase, wait up to S seconds for other work on the machine to stop",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log the progress of each phase")
    parser.add_argument("--serve", choices=SYSTEMS, help=argparse.SUPPRESS)  # internal: a server child
    parser.add_argument("--client", choices=SYSTEMS, help=argparse.SUPPRESS)  # internal: a client child
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)8.0f ms %(name)s: %(message)s")
    if args.verbose:
        log.setLevel(logging.INFO)
    if args.serve:
        serve(args.serve)
        return 0
    if args.client:
        client_main(args.client)
        return 0
    base_command = f"python -m {MODULE}" + (" --quick" if args.quick else "")
    report, ok = run(QUICK if args.quick else FULL, args.only, base_command, args.wait_idle)
    write_report(report, args.json, format_table(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
