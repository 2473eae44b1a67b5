"""All-reduce benchmark: N peer processes average one fp32 vector, round after round, per system.

Scenarios (``--scenario``, default all):

* ``loopback``: 4 peers on 127.0.0.1, 100 MB of fp32 each (``--quick``: 8 MB);
* ``netns``: 4 peers in a network-namespace lab (``simulations.labs.netns``), every link shaped to 100
  Mbit/s in both directions, 25 MB each (quick: 4 MB). Needs root; otherwise the scenario says why it did
  not run;
* ``netns-int8``: the same with int8 compression (p2ptrain; hivemind with its Uniform8BitQuantization);
* ``netns-uneven``: the lab with one slow peer: three links at 100 Mbit/s, the fourth at 25 Mbit/s. p2ptrain
  peers measure their bandwidth and reduce shares in proportion (``--p2ptrain-bandwidth MB/S``: every
  peer announces that instead, so equal shares, for comparison); the first round, before any measurement,
  is the one the median leaves out.

Systems (``--systems``): ``floor`` (``simulations.benchmarks.allreduce_floor``: raw TCP, threads, numpy:
what the machine itself allows), ``p2ptrain`` (``simulations.benchmarks.allreduce_p2ptrain``, reported as
not available while that module does not exist) and ``hivemind``
(``simulations.benchmarks.allreduce_hivemind``: ``DecentralizedAverager`` run by the interpreter of
``--hivemind-python``, default ``.venv-bench/bin/python`` in the repository).

Every peer's vector is a deterministic pattern of its own (:func:`pattern`), so the exact mean is
known; every peer checks its result against it each round (``max_err``). A round's time is the largest of
the peers' own times, each measured from the "go" to the peer holding the average (matchmaking and set-up
come before the "go"). The report gives the first round apart (connections warm up, buffers are
allocated) and the median and minimum of the others, the bytes averaged per second (S / round time), and
how the time compares with a bound: on links of B bytes/s the butterfly needs at least
2 (N-1)/N * S / B (uneven links: see :func:`link_bound_s`); on loopback the bound is the floor's own
median round. In the lab, each peer's link
counters give the bytes each round put on the wire (``link_tx_bytes``: headers and control traffic
included); peers report what they sent themselves (``wire_bytes``) where they know it.

Peer program contract (one JSON object per line; stdout lines that are not JSON objects are ignored):

* argv: ``--index I --peers N --mb S --rounds R --compression none|fp16|bf16|int8 --listen HOST:PORT
  [--join ADDR] [--timeout SECONDS]`` (:func:`peer_parser`); ``--listen`` may give port 0;
* the peer prints ``{"ev":"listening","addr":A}``, A being the address others dial, as a string. The
  harness starts peer 0 first, then the others with ``--join`` its address; once all listen it writes
  ``{"cmd":"peers","addrs":[A0, ...]}`` to every peer's stdin (a system that needs every address, like
  the floor, waits for it; one that bootstraps from ``--join`` may use it or not);
* for each round r: the peer prints ``{"ev":"ready","round":r}`` when it can start the round at once
  (connected, grouped, input in place); when all are ready the harness writes ``{"cmd":"go","round":r}``;
  the peer averages, then prints ``{"ev":"round","round":r,"seconds":t,"wire_bytes":b}`` (t from the
  "go" to holding the average; b: bytes it sent that round, or null; optional: ``cpu_seconds``, its
  process's CPU time in the round, and ``page_faults``, its minor page faults); once every peer has,
  the harness writes ``{"cmd":"check","round":r}`` and the peer prints
  ``{"ev":"checked","round":r,"max_err":e}`` (checking apart, so that a peer that finished early does
  not take the CPU from those still at it);
* ``listening`` may carry ``"notes"`` (strings: what the peer changed or worked around), which the report
  keeps; other extra fields are ignored;
* at the end ``{"ev":"done"}``; on failure ``{"ev":"error","error":"..."}``. A peer exits when its stdin
  closes (the harness is gone) and never waits longer than ``--timeout`` for anything.

Usage::

    python -m simulations.bench_allreduce [--quick] [--scenario loopback|netns|netns-int8|all]
        [--rounds R] [--systems floor,p2ptrain,hivemind] [--hivemind-python PATH] [--json PATH]

The JSON report goes to stdout (or PATH); a table with the command that reproduces each row goes to
stderr. Every wait is bounded; every peer runs in a process group of its own, killed at the end (p2pd
daemons included); the lab's namespaces are deleted whatever happens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from simulations.benchmarks.environment import REPO_ROOT, write_report
from simulations.benchmarks.environment import environment as base_environment
from simulations.labs.netns import NetnsLab, unavailable

MODULE = "simulations.bench_allreduce"
LOOPBACK = "127.0.0.1"
SYSTEMS = ("floor", "p2ptrain", "hivemind")
PEER_MODULES = {
    "floor": "simulations.benchmarks.allreduce_floor",
    "p2ptrain": "simulations.benchmarks.allreduce_p2ptrain",
    "hivemind": "simulations.benchmarks.allreduce_hivemind",
}
COMPRESSIONS = ("none", "fp16", "bf16", "int8")
MB = 1_000_000


@dataclass(frozen=True)
class Scenario:
    name: str
    peers: int
    mb: float
    quick_mb: float
    netns: bool
    compression: str = "none"
    rate_mbit: float = 100.0
    rates: tuple[float, ...] | None = None  # Mbit/s per peer (both directions), instead of rate_mbit


SCENARIOS = {
    "loopback": Scenario("loopback", 4, 100.0, 8.0, netns=False),
    "netns": Scenario("netns", 4, 25.0, 4.0, netns=True),
    "netns-int8": Scenario("netns-int8", 4, 25.0, 4.0, netns=True, compression="int8"),
    "netns-uneven": Scenario("netns-uneven", 4, 25.0, 4.0, netns=True, rates=(100.0, 100.0, 100.0, 25.0)),
}


# ---- peer side: what every peer program shares -----------------------------------------------------


def peer_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--peers", type=int, required=True)
    p.add_argument("--mb", type=float, required=True, help="fp32 megabytes (10^6) averaged per peer")
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--compression", choices=COMPRESSIONS, default="none")
    p.add_argument("--listen", required=True, help="HOST:PORT (port 0: any)")
    p.add_argument("--join", help="address of a peer already listening (peer 0)")
    p.add_argument("--timeout", type=float, default=600.0, help="longest wait for anything (s)")
    return p


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host, int(port)


def numel_for(mb: float) -> int:
    return int(mb * MB) // 4


def pattern(index: int, numel: int) -> Any:
    """Peer ``index``'s vector: a permutation of (j - 2048) / 1024 (j < 4096) of its own, plus ``index``.

    Every value and every sum of up to thousands of them is exact in fp32. Each peer permutes the base
    differently (``k * (37 + 64 index) mod 4096``): were the vectors equal up to a constant, each
    peer's difference to the mean would be a constant too, a degenerate input for quantizers (with it,
    hivemind's 8-bit quantization left whole parts unaveraged: max error 1.5).
    """
    import numpy as np

    k = np.arange(numel, dtype=np.int32) % 4096
    base = ((k * (37 + 64 * index)) % 4096 - 2048).astype(np.float32) / np.float32(1024)
    return base + np.float32(index)


def exact_mean(peers: int, numel: int) -> Any:
    """The mean of all peers' patterns: the fp32 sum is exact, so the one rounding is the division."""
    import numpy as np

    total = np.zeros(numel, dtype=np.float32)
    for i in range(peers):
        np.add(total, pattern(i, numel), out=total)
    return total / np.float32(peers)


def emit(ev: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"ev": ev, **fields}, separators=(",", ":")) + "\n")
    sys.stdout.flush()


class Commands:
    """The harness's commands, read from stdin by a thread. When stdin closes the process exits soon.

    The thread reads a duplicate of the stdin descriptor, unbuffered: ``sys.stdin`` has a lock that the
    reading thread holds, and a child forked meanwhile (hivemind forks its DHT and averager processes,
    and multiprocessing closes ``sys.stdin`` in each child) would wait on that lock forever.
    """

    EXIT_GRACE_S = 10.0

    def __init__(self) -> None:
        self._q: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with os.fdopen(os.dup(sys.stdin.fileno()), "rb", buffering=0) as raw:
            for line in iter(raw.readline, b""):
                with contextlib.suppress(ValueError):
                    self._q.put(json.loads(line))
        self._q.put(None)
        # The harness is gone: leave even if the main thread is stuck in I/O (daemon threads die with us).
        threading.Timer(self.EXIT_GRACE_S, os._exit, (3,)).start()

    def wait(self, cmd: str, timeout: float, **match: Any) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no '{cmd}' command in {timeout:g} s") from None
            if msg is None:
                raise SystemExit(3)
            if msg.get("cmd") == cmd and all(msg.get(k) == v for k, v in match.items()):
                return msg


# ---- harness side: peer processes -------------------------------------------------------------------


class Peer:
    """One peer process (in its own process group); its JSON lines are read by a thread into a queue."""

    def __init__(self, name: str, argv: list[str], lab: NetnsLab | None, index: int, log: IO[bytes]) -> None:
        self.name, self.log = name, log
        kw: dict[str, Any] = dict(
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=REPO_ROOT, start_new_session=True
        )
        self.proc = lab.popen(index, argv, **kw) if lab else subprocess.Popen(argv, **kw)
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            with contextlib.suppress(ValueError):
                msg = json.loads(raw)
                if isinstance(msg, dict) and "ev" in msg:
                    self.lines.put(msg)
        self.lines.put(None)

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(obj, separators=(",", ":")) + "\n").encode())
        self.proc.stdin.flush()

    def expect(self, event: str, deadline: float, **match: Any) -> dict[str, Any]:
        while True:
            try:
                msg = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{self.name}: no '{event}' in time") from None
            if msg is None:
                raise RuntimeError(f"{self.name} exited (code {self.proc.wait(10)}) before '{event}'")
            if msg["ev"] == "error":
                raise RuntimeError(f"{self.name}: {msg.get('error')}")
            if msg["ev"] == event and all(msg.get(k) == v for k, v in match.items()):
                return msg

    def kill(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(3.0)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5.0)
        # A daemon that left the group (in a session of its own) may still hold the pipe: then the reader
        # never sees the end, and closing under it would block; it is a daemon thread, left to the exit.
        self.reader.join(5.0)
        if self.proc.stdout is not None and not self.reader.is_alive():
            self.proc.stdout.close()

    def log_tail(self, chars: int = 1500) -> str:
        with contextlib.suppress(OSError):
            self.log.flush()
            return Path(self.log.name).read_bytes()[-chars:].decode(errors="replace")
        return ""


def gather(peers: list[Peer], event: str, timeout: float, **match: Any) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    return [p.expect(event, deadline, **match) for p in peers]


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ---- harness side: one system in one scenario -------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    scenarios: tuple[str, ...]
    systems: tuple[str, ...]
    rounds: int
    quick: bool
    hivemind_python: str | None
    hivemind_dial: str  # "auto" (quick: try without first), "always", "never"
    start_timeout: float = 180.0  # a peer's start (hivemind: a Go daemon, a DHT, an averager process)
    ready_timeout: float = 120.0  # from the previous round to every peer ready (hivemind: matchmaking)
    congestion: str | None = None  # TCP congestion control in the lab (None: the namespaces' default)
    p2ptrain_bandwidth: float | None = None  # MB/s every p2ptrain peer announces (None: each measures)


def mb_of(sc: Scenario, plan: Plan) -> float:
    return sc.quick_mb if plan.quick else sc.mb


def link_bound_s(sc: Scenario, nbytes: float) -> float:
    """The shortest round a butterfly allows over the scenario's links, whatever the partition.

    A member with share p of the vector (S bytes) and a link of B bytes/s each way sends (1 - p) S of
    its own and (N - 1) p S of results, and receives as much: it needs (1 + (N - 2) p) S / B. The bound
    is the least T for which shares summing to 1 all fit: 2 (N-1)/N * S / B on equal links; on uneven
    ones a slow member may get no share and still needs S / B.
    """
    rates = [r * 1e6 / 8 for r in (sc.rates or (sc.rate_mbit,) * sc.peers)]
    n = sc.peers
    if n <= 2:
        return nbytes / min(rates)

    def fits(t: float) -> bool:
        return sum(max(0.0, (t * b / nbytes - 1) / (n - 2)) for b in rates) >= 1

    lo = nbytes / min(rates)
    if fits(lo):
        return lo
    hi = lo
    while not fits(hi):
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def round_timeout(sc: Scenario, plan: Plan) -> float:
    nbytes = numel_for(mb_of(sc, plan)) * 4
    if sc.netns:
        return 120.0 + 20 * link_bound_s(sc, nbytes)
    return 120.0 + 2.0 * nbytes / MB  # loopback: 2 s per MB is ~100x slower than hivemind here


def run_peers(
    sc: Scenario, plan: Plan, python: str, module: str, extra: list[str], timeout: float | None = None
) -> dict[str, Any]:
    """Start N peers of one system, run the rounds, collect their lines; raises on any failure."""
    mb = mb_of(sc, plan)
    per_round = timeout or round_timeout(sc, plan)
    argv = [
        python,
        "-m",
        module,
        "--peers",
        str(sc.peers),
        "--mb",
        f"{mb:g}",
        "--rounds",
        str(plan.rounds),
        "--compression",
        sc.compression,
        "--timeout",
        f"{max(per_round, plan.ready_timeout):g}",
        *extra,
    ]
    began = time.perf_counter()
    with contextlib.ExitStack() as stack:
        rates = list(sc.rates) if sc.rates else None
        lab = NetnsLab(sc.peers, sc.rate_mbit, rates=rates, congestion=plan.congestion) if sc.netns else None
        congestion = stack.enter_context(lab).congestion_control(0) if lab else None
        logdir = os.environ.get("BENCH_LOGDIR") or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="bench-allreduce-")
        )
        peers: list[Peer] = []

        def stop_all() -> None:
            for p in peers:
                p.kill()

        stack.callback(stop_all)

        def start(i: int, join: str | None) -> Peer:
            host = lab.address(i) if lab else LOOPBACK
            log = stack.enter_context(open(Path(logdir) / f"peer{i}.log", "w+b"))
            args = [*argv, "--index", str(i), "--listen", f"{host}:0", *(["--join", join] if join else [])]
            peers.append(Peer(f"peer {i}", args, lab, i, log))
            return peers[-1]

        try:
            hello = [start(0, None).expect("listening", time.monotonic() + plan.start_timeout)]
            for i in range(1, sc.peers):
                start(i, hello[0]["addr"])
            hello += gather(peers[1:], "listening", plan.start_timeout)
            addrs = [m["addr"] for m in hello]
            for p in peers:
                p.send({"cmd": "peers", "addrs": addrs})
            setup_s = time.perf_counter() - began
            rounds = []
            for r in range(plan.rounds):
                gather(peers, "ready", plan.ready_timeout, round=r)
                before = [lab.link_bytes(i) for i in range(sc.peers)] if lab else None
                sent = time.perf_counter()
                for p in peers:
                    p.send({"cmd": "go", "round": r})
                lines = gather(peers, "round", per_round, round=r)
                harness_s = time.perf_counter() - sent
                for p in peers:
                    p.send({"cmd": "check", "round": r})
                for line, checked in zip(lines, gather(peers, "checked", per_round, round=r), strict=True):
                    line["max_err"] = checked["max_err"]
                tx = (
                    [lab.link_bytes(i)["tx"] - b["tx"] for i, b in enumerate(before)]
                    if lab and before
                    else None
                )
                rounds.append({"lines": lines, "harness_s": harness_s, "link_tx": tx})
            gather(peers, "done", 60.0)
        except Exception as e:
            tails = {p.name: p.log_tail() for p in peers}
            raise PeerFailure(f"{type(e).__name__}: {e}", tails) from e
    notes = sorted({str(n) for m in hello for n in m.get("notes") or ()})
    return {"setup_s": setup_s, "rounds": rounds, "mb": mb, "notes": notes, "congestion": congestion}


class PeerFailure(RuntimeError):
    def __init__(self, message: str, log_tails: dict[str, str]) -> None:
        super().__init__(message)
        self.log_tails = log_tails


def _per_peer_round(raw: dict[str, Any], field: str) -> float | None:
    """The median of a field every peer reports every round (the first round left out), or None when
    some peer or round lacks it."""
    values = [m.get(field) for r in raw["rounds"][1:] for m in r["lines"]]
    if not values or any(v is None for v in values):
        return None
    return float(statistics.median(values))


def summarize(sc: Scenario, raw: dict[str, Any]) -> dict[str, Any]:
    nbytes = numel_for(raw["mb"]) * 4
    times = [max(float(m["seconds"]) for m in r["lines"]) for r in raw["rounds"]]
    rest = times[1:]
    median = statistics.median(rest) if rest else times[0]
    out: dict[str, Any] = {
        "status": "ok",
        "peers": sc.peers,
        "mb": raw["mb"],
        "bytes_per_peer": nbytes,
        "compression": sc.compression,
        "tcp_congestion": raw.get("congestion"),
        "setup_s": round(raw["setup_s"], 3),
        "first_round_s": round(times[0], 4),
        "median_s": round(median, 4),
        "min_s": round(min(rest), 4) if rest else None,
        "rounds_s": [round(t, 4) for t in times],
        "harness_round_s": [round(r["harness_s"], 4) for r in raw["rounds"]],
        "max_err": max(float(m["max_err"]) for r in raw["rounds"] for m in r["lines"]),
        "bytes_averaged_per_s": round(nbytes / median),
    }
    cpu = _per_peer_round(raw, "cpu_seconds")
    if cpu is not None:
        out["cpu_s_per_peer_round"] = round(cpu, 4)
    faults = _per_peer_round(raw, "page_faults")
    if faults is not None:
        out["page_faults_per_peer_round"] = int(faults)
    phases = [[m.get("phases") for m in r["lines"]] for r in raw["rounds"][1:]]
    if phases and all(isinstance(p, dict) and p for row in phases for p in row):
        # when the last peer reached each phase, seconds from the go (median over rounds)
        names = list(phases[0][0])
        out["phases_s"] = {
            n: round(statistics.median(max(p[n] for p in row) for row in phases), 4) for n in names
        }
        if {"scattered", "decided"} <= set(names):
            # control messages under load: from the last member's scatter to the last one's decision
            gaps = [max(p["decided"] for p in row) - max(p["scattered"] for p in row) for row in phases]
            out["decision_gap_s"] = round(statistics.median(gaps), 4)
    last = raw["rounds"][-1]["lines"]
    if all("share" in m for m in last):  # how the last round split the vector, and why
        out["shares_last_round"] = [round(float(m["share"]), 4) for m in last]
        out["announced_mb_s"] = [m.get("announced_mb_s") for m in last]
    if raw["notes"]:
        out["notes"] = raw["notes"]
    wire = [[m.get("wire_bytes") for m in r["lines"]] for r in raw["rounds"]]
    if all(b is not None for row in wire for b in row):
        out["wire_bytes_per_peer_round"] = int(statistics.median(max(row) for row in wire))
    if raw["rounds"][0]["link_tx"] is not None:
        tx = [max(r["link_tx"]) for r in raw["rounds"]]
        out["link_tx_bytes_per_peer_round"] = int(statistics.median(tx))
    if sc.netns:
        bound = link_bound_s(sc, nbytes)
        out["link_bound_s"] = round(bound, 4)
        out["fraction_of_link_bound"] = round(bound / median, 3)
        if "link_tx_bytes_per_peer_round" in out and not sc.rates:  # the bound for the bytes on the wire
            wire_bound = out["link_tx_bytes_per_peer_round"] / (sc.rate_mbit * 1e6 / 8)
            out["fraction_of_wire_bound"] = round(wire_bound / median, 3)
    return out


def find_hivemind_python(explicit: str | None) -> tuple[str | None, str]:
    python = explicit or str(REPO_ROOT / ".venv-bench" / "bin" / "python")
    if not Path(python).exists():
        return None, f"not installed: no interpreter at {'--hivemind-python' if explicit else '.venv-bench'}"
    try:
        done = subprocess.run(
            [python, "-c", "import hivemind; print(hivemind.__version__)"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"hivemind interpreter failed: {e}"
    if done.returncode != 0:
        return None, f"hivemind does not import: {done.stderr.strip()[-300:]}"
    return python, done.stdout.strip()


def run_system(sc: Scenario, system: str, plan: Plan, base: str) -> dict[str, Any]:
    head: dict[str, Any] = {"scenario": sc.name, "system": system}
    head["command"] = f"{base} --scenario {sc.name} --systems {system} --rounds {plan.rounds}"
    if system == "hivemind" and plan.hivemind_python:
        head["command"] += f" --hivemind-python {plan.hivemind_python}"
    python = sys.executable
    if sc.netns and (why := unavailable()):
        return head | {"status": f"not run: {why}"}
    if system == "floor" and sc.compression != "none":
        return head | {"status": "not run: the floor averages fp32 only"}
    if system == "p2ptrain" and not Path(__file__).with_name("allreduce_p2ptrain.py").exists():
        return head | {
            "status": "not available (simulations/benchmarks/allreduce_p2ptrain.py does not exist yet)"
        }
    extra: list[str] = []
    if system == "p2ptrain" and plan.p2ptrain_bandwidth is not None:
        extra = ["--bandwidth", f"{plan.p2ptrain_bandwidth:g}"]
        head["command"] += f" --p2ptrain-bandwidth {plan.p2ptrain_bandwidth:g}"
    attempts: list[tuple[list[str], float | None]] = [([], None)]
    if system == "hivemind":
        python_or_none, version = find_hivemind_python(plan.hivemind_python)
        if python_or_none is None:
            return head | {"status": version}
        python, head["hivemind_version"] = python_or_none, version
        # Peers in the lab stall unless each first dials every other (see allreduce_hivemind); quick runs
        # try without it first, with a short time limit, to see whether that is still so.
        dial = plan.hivemind_dial == "always" or (plan.hivemind_dial == "auto" and sc.netns)
        attempts = [(["--dial-all"] if dial else [], None)]
        if sc.netns and plan.hivemind_dial == "auto" and plan.quick:
            attempts.insert(0, ([], 60.0))
    print(f"running {system} in {sc.name} ...", file=sys.stderr, flush=True)
    head["load_before"] = loadavg()
    tried: list[dict[str, Any]] = []
    for flags, limit in attempts:
        try:
            raw = run_peers(sc, plan, python, PEER_MODULES[system], extra + flags, limit)
        except PeerFailure as e:
            tried.append({"flags": flags, "error": str(e), "log_tails": e.log_tails})
            continue
        out = head | summarize(sc, raw) | {"load_after": loadavg()}
        if system == "hivemind":
            out["workaround"] = "dial-all" if "--dial-all" in flags else None
            out["attempts"] = tried
        return out
    return head | {"status": "error", "error": tried[-1]["error"], "attempts": tried, "load_after": loadavg()}


# ---- the report -------------------------------------------------------------------------------------


def _ratio(a: Any, b: Any) -> float | None:
    return round(a / b, 3) if isinstance(a, int | float) and isinstance(b, int | float) and b > 0 else None


def add_comparisons(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for name in dict.fromkeys(r["scenario"] for r in results):
        med = {r["system"]: r.get("median_s") for r in results if r["scenario"] == name}
        floor = med.get("floor")
        for r in results:
            if r["scenario"] == name and not SCENARIOS[name].netns and r.get("median_s"):
                r["fraction_of_floor"] = _ratio(floor, r["median_s"])
        out.append(
            {
                "scenario": name,
                "hivemind_over_p2ptrain": _ratio(med.get("hivemind"), med.get("p2ptrain")),
                "p2ptrain_over_floor": _ratio(med.get("p2ptrain"), floor),
                "hivemind_over_floor": _ratio(med.get("hivemind"), floor),
            }
        )
    return out


def format_table(report: dict[str, Any]) -> str:
    def cell(v: Any, fmt: str = "{:.3g}") -> str:
        return "-" if v is None else fmt.format(v) if isinstance(v, float) else str(v)

    head = [
        "scenario",
        "system",
        "N",
        "MB",
        "comp",
        "first s",
        "median s",
        "min s",
        "MB/s avg",
        "bound s",
        "of bound",
        "max err",
        "wire MB",
        "status",
        "reproduce",
    ]
    lines = [head]
    for r in report["results"]:
        wire = r.get("link_tx_bytes_per_peer_round") or r.get("wire_bytes_per_peer_round")
        frac = r.get("fraction_of_link_bound", r.get("fraction_of_floor"))
        lines.append(
            [
                r["scenario"],
                r["system"],
                cell(r.get("peers")),
                cell(r.get("mb"), "{:g}"),
                cell(r.get("compression")),
                cell(r.get("first_round_s")),
                cell(r.get("median_s")),
                cell(r.get("min_s")),
                cell(r["bytes_averaged_per_s"] / MB if "bytes_averaged_per_s" in r else None, "{:.1f}"),
                cell(r.get("link_bound_s")),
                cell(frac, "{:.2f}"),
                cell(r.get("max_err"), "{:.2g}"),
                cell(wire / MB if wire else None, "{:.2f}"),
                r["status"][:40],
                r["command"],
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    text.append("of bound: link bound / median (netns), floor median / median (loopback); wire MB: sent per")
    text.append("peer per round (netns: interface counter, headers and control traffic included)")
    for c in report["comparisons"]:
        text.append(
            f"{c['scenario']}: hivemind/p2ptrain {cell(c['hivemind_over_p2ptrain'])}x, p2ptrain/floor "
            f"{cell(c['p2ptrain_over_floor'])}x, hivemind/floor {cell(c['hivemind_over_floor'])}x"
        )
    for r in report["results"]:
        if r.get("system") == "hivemind" and SCENARIOS[r["scenario"]].netns and "workaround" in r:
            failed = [a["error"][:120] for a in r.get("attempts", [])]
            text.append(f"hivemind in {r['scenario']}: workaround {r['workaround']}; failed before: {failed}")
    text.append(
        f"load average before/after: {report['load_before']} / {report['load_after']} ({os.cpu_count()} cpus)"
    )
    return "\n".join(text)


def run(plan: Plan, base: str) -> tuple[dict[str, Any], bool]:
    env = base_environment(("p2ptrain", "numpy", "torch"))
    hm_python, hm_version = (
        find_hivemind_python(plan.hivemind_python) if "hivemind" in plan.systems else (None, "")
    )
    env["versions"]["hivemind"] = hm_version if hm_python else None
    report: dict[str, Any] = {
        "benchmark": "allreduce",
        "command": base,
        "plan": asdict(plan),
        "environment": env,
    }
    report["scenarios"] = {
        n: asdict(SCENARIOS[n]) | {"mb_used": mb_of(SCENARIOS[n], plan)} for n in plan.scenarios
    }
    report["load_before"] = loadavg()
    began = time.perf_counter()
    results = []
    for name in plan.scenarios:
        for system in plan.systems:
            try:
                results.append(run_system(SCENARIOS[name], system, plan, base))
            except Exception as e:  # one system failing must not hide the others' numbers
                results.append(
                    {
                        "scenario": name,
                        "system": system,
                        "status": "error",
                        "command": base,
                        "error": f"{type(e).__name__}: {e}",
                    }
                )
    report["results"] = results
    report["comparisons"] = add_comparisons(results)
    report["load_after"] = loadavg()
    report["total_s"] = round(time.perf_counter() - began, 1)
    return report, all(r["status"] == "ok" or r["status"].startswith("not") for r in results)


def parse_list(choices: tuple[str, ...]) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(s.strip() for s in text.split(",") if s.strip())
        if "all" in items:
            return choices
        bad = [s for s in items if s not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)} (comma-separated) or all")
        return items

    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small vectors (8 MB loopback, 4 MB netns)")
    parser.add_argument("--scenario", type=parse_list(tuple(SCENARIOS)), default=tuple(SCENARIOS))
    parser.add_argument("--systems", type=parse_list(SYSTEMS), default=SYSTEMS)
    parser.add_argument(
        "--rounds", type=int, default=5, help="rounds per system (default 5; the first apart)"
    )
    parser.add_argument("--hivemind-python", metavar="PATH", help="interpreter that imports hivemind")
    parser.add_argument(
        "--hivemind-dial",
        choices=("auto", "always", "never"),
        default="auto",
        help="hivemind peers dial each other first (auto: in the lab; quick runs try without)",
    )
    parser.add_argument(
        "--congestion",
        metavar="NAME",
        help="TCP congestion control in the netns lab, e.g. cubic or bbr (default: the system's)",
    )
    parser.add_argument(
        "--p2ptrain-bandwidth",
        type=float,
        metavar="MB/S",
        help="every p2ptrain peer announces this bandwidth instead of measuring its own (equal shares)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the JSON report here instead of stdout")
    args = parser.parse_args(argv)
    if args.p2ptrain_bandwidth is not None and not args.p2ptrain_bandwidth > 0:
        parser.error("--p2ptrain-bandwidth: must be positive")
    if args.rounds < 1:
        parser.error("--rounds: at least 1")
    plan = Plan(
        args.scenario,
        args.systems,
        args.rounds,
        args.quick,
        args.hivemind_python,
        args.hivemind_dial,
        congestion=args.congestion,
        p2ptrain_bandwidth=args.p2ptrain_bandwidth,
    )
    base = f"python -m {MODULE}" + (" --quick" if args.quick else "")
    base += f" --congestion {args.congestion}" if args.congestion else ""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: peers killed, lab deleted
    report, ok = run(plan, base)
    write_report(report, args.json, format_table(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
