"""Replays a scenario (``simulations.replay.scenario``) with real ``p2ptrain node`` processes on this machine.

Theory of operation. The runner merges the scenario's run file and overrides into ``run.toml`` in the
report folder, sets up the emulation, then starts the peers that start at 0 s: the first one alone, and
once its status file gives its address, the others with ``--join`` that address (``--wait-peers``: they
start training together). Then it follows the scenario's clock, once a second: it carries out the events
that are due (SIGKILL, restart on the same data directory with ``--resume`` so a peer keeps its identity
and checkpoint, first start of a late joiner, SIGTERM, cuts, partitions, link changes), reads every
live peer's status file and RSS (``/proc/PID/status``) and the emulator's byte counters into per-peer
time series, and notices peers that died unasked. A (re)started peer joins whichever live peer has run
longest. A hostile peer (its profile's ``adversary``) is started, and restarted, with ``--adversary
KIND``. At ``duration`` every live peer gets SIGTERM (it drains: the round in flight, a last
checkpoint), and SIGKILL if it has not exited after ``STOP_TIMEOUT``. Every peer's ``node.log`` is then
scanned for the lines that name another peer of the scenario (``report.scan_logs``: who accused whom),
and ``simulations.replay.report`` analyses the series, the metrics files and those scans and writes the
report.

Emulation (the report says which one ran):

- ``userspace``: a :class:`simulations.labs.wan.WanSwitch` in a thread of this process. Peer i listens on its
  own loopback address 127.0.0.(10+i), port 0; the switch learns the real port from the status file's
  ``listening`` field (after every restart) and the peer announces the switch's port for it and dials
  from its own address, so every byte between peers crosses the switch and its shaping.
- ``netns``: a :class:`simulations.labs.netns.NetnsLab` (root): one namespace per peer, its link shaped by
  ``tc tbf`` at the peer's rates in both directions; no latency (tbf has none).
- ``none``: plain loopback.

Everything is bounded in time (a peer that prints no address, a stop that does not finish) and cleaned
up on the way out, on an exception or Ctrl-C included: every process the runner started gets SIGTERM
then SIGKILL (each runs in a session of its own, so a terminal's Ctrl-C reaches only the runner), the
switch is stopped, the lab's namespaces are deleted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from p2ptrain.errors import ConfigError
from simulations.replay.scenario import (
    REPO_ROOT,
    Event,
    PeerSpec,
    Scenario,
    merged_run,
    read_run_file,
    to_toml,
)

log = logging.getLogger(__name__)

TICK = 1.0  # seconds between samples
START_TIMEOUT = 120.0  # seconds for a peer to write its address into its status file
STOP_TIMEOUT = 60.0  # seconds a peer may drain after SIGTERM before SIGKILL
PRINT_EVERY = 10.0
UNSHAPED_MBIT = 10_000.0  # what an unshaped ("inf") link becomes under tc tbf


@dataclass(frozen=True)
class RunOptions:
    out: Path  # the report folder
    workdir: Path | None = None  # node folders (default: OUT/nodes)
    quiet: bool = False
    repo_root: Path = REPO_ROOT


class RunnerError(ConfigError):
    """The scenario cannot run here (netns without root, a folder in use, ...)."""


# ---- peers -----------------------------------------------------------------------------------------


@dataclass
class Incarnation:
    """One process of a peer: from its start to its exit."""

    number: int
    pid: int
    started: float  # scenario seconds
    wall_started: float
    how: str  # start, restart
    ended: float | None = None
    wall_ended: float | None = None
    end: str = ""  # killed, stopped, exited N, stopped at the end, killed at the end
    upstream: str | None = None  # the real listening address, once known


@dataclass
class PeerProc:
    spec: PeerSpec
    folder: Path
    proc: subprocess.Popen[bytes] | None = None
    logs: list[IO[bytes]] = field(default_factory=list)
    incarnations: list[Incarnation] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)  # the current incarnation's last status
    expect_exit: bool = False
    series: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    address: str | None = None  # the join address others use (announced)

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def current(self) -> Incarnation | None:
        return self.incarnations[-1] if self.incarnations else None

    def read_status(self) -> dict[str, Any]:
        """The status file, if the current process wrote it (an old one survives a kill)."""
        try:
            status = json.loads((self.folder / "status.json").read_text())
        except (OSError, ValueError):
            return self.status
        if self.proc is not None and status.get("pid") == self.proc.pid:
            self.status = status
        return self.status

    def close_logs(self) -> None:
        for f in self.logs:
            f.close()
        self.logs.clear()


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# ---- emulation backends ----------------------------------------------------------------------------


class Backend:
    """Where peers listen, how they are started and shaped; the base class is plain loopback."""

    name = "none"

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"emulation": "none", "what": "plain loopback: no rates, latency or cuts"}

    def node_args(self, i: int) -> list[str]:
        return ["--listen", "127.0.0.1:0"]

    def popen(self, i: int, argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen(argv, **kw)

    def started(self, i: int, status: dict[str, Any]) -> str | None:
        """A new process of peer i wrote its status: wire it up; return its real listening address."""
        listening = status.get("listening") or []
        return str(listening[0]) if listening else None

    def stats(self) -> list[dict[str, Any]] | None:
        return None

    def cut(self, i: int) -> int:
        raise RunnerError(f"cut needs the userspace emulation, not {self.name}")

    def partition(self, i: int, seconds: float) -> None:
        raise RunnerError(f"partition needs the userspace emulation, not {self.name}")

    def link(self, i: int, changes: dict[str, float]) -> None:
        raise RunnerError(f"link changes need the userspace emulation, not {self.name}")


class UserspaceBackend(Backend):
    name = "userspace"

    def __init__(self, scenario: Scenario) -> None:
        super().__init__(scenario)
        from simulations.labs.wan import LinkProfile, WanSwitch

        profiles = [LinkProfile(**p.link) for p in scenario.peers]
        self._ctx: contextlib.AbstractContextManager[Any] | None = WanSwitch(
            profiles, seed=scenario.seed
        ).in_thread()
        self.switch = self._ctx.__enter__()

    def close(self) -> None:
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(None, None, None)

    def describe(self) -> dict[str, Any]:
        return {
            "emulation": "userspace",
            "what": "simulations.labs.wan.WanSwitch: a userspace relay in front of every peer (token buckets "
            "per peer and direction, one-way latency per access link, random cuts); no root needed",
            "ports": [self.switch.port(i) for i in range(len(self.scenario.peers))],
        }

    def node_args(self, i: int) -> list[str]:
        host = self.switch.source_address(i)
        return [
            "--listen",
            f"{host}:0",
            "--announce",
            self.switch.announce(i),
            "--source-address",
            host,
        ]

    def started(self, i: int, status: dict[str, Any]) -> str | None:
        host = self.switch.source_address(i)
        for addr in status.get("listening") or []:
            parsed = _host_port(str(addr))
            if parsed and parsed[0] == host:
                self.switch.set_upstream(i, parsed)
                return f"{parsed[0]}:{parsed[1]}"
        return None

    def stats(self) -> list[dict[str, Any]] | None:
        return list(self.switch.stats()["peers"])

    def cut(self, i: int) -> int:
        return self.switch.cut(i)

    def partition(self, i: int, seconds: float) -> None:
        self.switch.partition(i, seconds)

    def link(self, i: int, changes: dict[str, float]) -> None:
        self.switch.set_profile(i, dataclasses.replace(self.switch.profile(i), **changes))


class NetnsBackend(Backend):
    name = "netns"

    def __init__(self, scenario: Scenario) -> None:
        super().__init__(scenario)
        from simulations.labs.netns import NetnsLab, unavailable

        why = unavailable()
        if why:
            raise RunnerError(f"emulation 'netns' is not available here: {why} (try --emulation userspace)")
        rates: list[float | tuple[float, float]] = [
            (_finite(p.up_mbit), _finite(p.down_mbit)) for p in scenario.peers
        ]
        self.lab = NetnsLab(len(scenario.peers), rates=rates, prefix="p2pscen")
        self.lab.__enter__()

    def close(self) -> None:
        self.lab.close()

    def describe(self) -> dict[str, Any]:
        return {
            "emulation": "netns",
            "what": "simulations.labs.netns.NetnsLab: one network namespace per peer behind a bridge, each "
            "link shaped with tc tbf at the peer's upload and download rates; tbf has no delay, so latency, "
            "jitter and cuts are not emulated",
            "rates_mbit": [list(self.lab.rate_mbit(i)) for i in range(self.lab.n)],
        }

    def node_args(self, i: int) -> list[str]:
        return ["--listen", f"{self.lab.address(i)}:0"]

    def popen(self, i: int, argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        return self.lab.popen(i, argv, **kw)

    def stats(self) -> list[dict[str, Any]] | None:
        out = []
        for i in range(self.lab.n):
            try:
                b = self.lab.link_bytes(i)
            except (RuntimeError, OSError, subprocess.TimeoutExpired, ValueError, KeyError):
                return None
            out.append({"sent": b["tx"], "received": b["rx"]})
        return out


def _finite(mbit: float) -> float:
    return UNSHAPED_MBIT if math.isinf(mbit) else mbit


def _host_port(addr: str) -> tuple[str, int] | None:
    """'/ip4/H/tcp/P/...' or 'H:P' -> (H, P)."""
    parts = addr.split("/")
    if len(parts) >= 5 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp":
        return parts[2], int(parts[4])
    host, _, port = addr.rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


class HostsBackend(Backend):
    """Each peer on a loopback address of its own (as the switch gives them), with nothing between the
    peers: unshaped links, but every peer a host of its own for the per-address and per-subnet limits
    (connections, DHT storage, group origins) and no switch whose CPU the traffic would load."""

    name = "hosts"

    def describe(self) -> dict[str, Any]:
        return {
            "emulation": "hosts",
            "what": "a loopback address per peer (127.0.0.10 + i), kernel loopback between them: no rates, "
            "latency or cuts",
        }

    def node_args(self, i: int) -> list[str]:
        from simulations.labs.wan import FIRST_HOST

        host = f"127.0.0.{FIRST_HOST + i}"
        return ["--listen", f"{host}:0", "--source-address", host]


def make_backend(scenario: Scenario) -> Backend:
    if scenario.emulation == "userspace":
        return UserspaceBackend(scenario)
    if scenario.emulation == "hosts":
        return HostsBackend(scenario)
    if scenario.emulation == "netns":
        return NetnsBackend(scenario)
    return Backend(scenario)


# ---- the run ---------------------------------------------------------------------------------------


class Runner:
    def __init__(self, scenario: Scenario, options: RunOptions) -> None:
        self.scenario = scenario
        self.options = options
        self.out = options.out
        self.workdir = options.workdir or options.out / "nodes"
        self.peers: list[PeerProc] = []
        self.timeline: list[dict[str, Any]] = []
        self.problems: list[str] = []
        self.notes: list[str] = []
        self.backend: Backend | None = None
        self.t0 = 0.0
        self.wall_t0 = 0.0
        self.run_file = self.out / "run.toml"
        self.run_config: dict[str, Any] = {}
        self.interrupted = False
        self.switch_final: list[dict[str, Any]] | None = None
        self.load_before: list[float] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    def say(self, text: str) -> None:
        if not self.options.quiet:
            print(f"[{self.now():6.1f} s] {text}" if self.t0 else text, flush=True)

    # ---- set-up ----

    def prepare(self) -> None:
        for folder in (self.out, self.workdir):
            if folder.exists() and any(folder.iterdir()):
                raise RunnerError(f"{folder} is not empty: give another --out (or --workdir)")
        self.out.mkdir(parents=True, exist_ok=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.run_config = merged_run(
            self.scenario, read_run_file(self.scenario.run_path(self.options.repo_root))
        )
        self.run_file.write_text(
            f"# {self.scenario.run} merged with the run_overrides of scenario {self.scenario.name}\n\n"
            + to_toml(self.run_config)
        )
        for spec in self.scenario.peers:
            folder = self.workdir / f"peer-{spec.index}"
            folder.mkdir()
            self.peers.append(PeerProc(spec, folder))

    def argv(self, peer: PeerProc, *, join: str | None, resume: bool, wait: int) -> list[str]:
        assert self.backend is not None
        f = peer.folder
        cmd = [sys.executable, "-m", "p2ptrain", "--log-level", "info", "node"]
        cmd += self.backend.node_args(peer.index)
        cmd += ["--config", str(self.run_file), "--data-dir", str(f)]
        cmd += ["--status-file", str(f / "status.json"), "--metrics-file", str(f / "metrics.jsonl")]
        cmd += ["--threads", "1", "--no-live"]
        if peer.spec.slowdown != 1:
            cmd += ["--slowdown", f"{peer.spec.slowdown:g}"]
        # No --bandwidth: each peer measures its own from its rounds, as on real links.
        if wait > 1:
            cmd += ["--wait-peers", str(wait)]
        if peer.spec.adversary:  # a hostile peer on purpose (a hidden flag); every restart keeps it
            cmd += ["--adversary", peer.spec.adversary]
        if resume:
            cmd += ["--resume"]
        if join:
            cmd += ["--join", join]
        return cmd

    # ---- lifecycle of one peer ----

    def launch(self, peer: PeerProc, how: str, *, join: str | None, wait: int = 1) -> None:
        assert self.backend is not None
        argv = self.argv(peer, join=join, resume=how == "restart", wait=wait)
        number = len(peer.incarnations) + 1
        stdout = open(peer.folder / "stdout.log", "ab")  # noqa: SIM115 (closed when the process ends)
        stderr = open(peer.folder / "node.log", "ab")  # noqa: SIM115
        stderr.write(f"\n==== process {number} ({how}) at {self.now():.1f} s: {' '.join(argv)}\n".encode())
        stderr.flush()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        proc = self.backend.popen(
            peer.index,
            argv,
            stdout=stdout,
            stderr=stderr,
            env=env,
            cwd=self.options.repo_root,
            start_new_session=True,  # a terminal's Ctrl-C reaches the runner only; it stops the peers
        )
        peer.proc, peer.logs, peer.expect_exit, peer.status = proc, [stdout, stderr], False, {}
        peer.address = None
        peer.incarnations.append(Incarnation(number, proc.pid, self.now(), time.time(), how))
        peer.events.append({"t": round(self.now(), 2), "action": how, "pid": proc.pid, "join": join})
        with (peer.folder / "command.txt").open("a") as f:
            f.write(" ".join(argv) + "\n")

    def wire_up(self, peer: PeerProc) -> None:
        """Once a new process wrote its status: tell the switch its port, learn its join address."""
        inc = peer.current
        if inc is None or inc.upstream is not None or not peer.alive:
            return
        status = peer.read_status()
        if not status:
            if self.now() - inc.started > START_TIMEOUT and not inc.end:
                inc.end = "no address"
                self.problems.append(f"peer {peer.index} wrote no address within {START_TIMEOUT:.0f} s")
            return
        assert self.backend is not None
        upstream = self.backend.started(peer.index, status)
        addresses = status.get("addresses") or []
        if upstream is None or not addresses:
            return
        inc.upstream = upstream
        peer.address = str(addresses[0])

    def wait_address(self, peer: PeerProc) -> str:
        deadline = time.monotonic() + START_TIMEOUT
        while peer.address is None:
            self.wire_up(peer)
            if peer.address is not None:
                break
            if not peer.alive:
                code = peer.proc.returncode if peer.proc else None
                raise RunnerError(f"peer {peer.index} exited with status {code}; see {peer.folder}/node.log")
            if time.monotonic() > deadline:
                raise RunnerError(f"peer {peer.index} wrote no address within {START_TIMEOUT:.0f} s")
            time.sleep(0.1)
        return peer.address

    def join_address(self, exclude: int) -> str | None:
        """The announced address of the live peer that has run longest (None: nobody is up)."""
        live = [p for p in self.peers if p.index != exclude and p.alive and p.address and p.current]
        live.sort(key=lambda p: p.current.started if p.current else 0.0)
        return live[0].address if live else None

    def ended(self, peer: PeerProc, end: str) -> None:
        inc = peer.current
        if inc is not None and inc.ended is None:
            inc.ended, inc.wall_ended = self.now(), time.time()
            inc.end = end
        peer.close_logs()

    def kill(self, peer: PeerProc, sig: int = signal.SIGKILL) -> None:
        if peer.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(peer.proc.pid, sig)  # its own session: the node and anything it started
        if peer.proc.poll() is None and sig == signal.SIGKILL:
            with contextlib.suppress(ProcessLookupError):
                peer.proc.kill()

    # ---- events ----

    def apply(self, event: Event) -> None:
        peer = self.peers[event.peer]
        record: dict[str, Any] = {
            "at": event.at,
            "t": round(self.now(), 2),
            "action": event.action,
            "peer": event.peer,
            "origin": event.origin,
        }
        assert self.backend is not None
        if event.action in ("start", "restart"):
            if peer.alive:
                record["skipped"] = "the peer is running"
            else:
                if peer.current is not None and peer.current.ended is None:
                    self.ended(peer, "stopped" if peer.expect_exit else "exited")
                join = self.join_address(peer.index)
                self.launch(peer, event.action, join=join)
                record["pid"] = peer.proc.pid if peer.proc else None
                record["join"] = join
        elif event.action in ("kill", "stop"):
            if not peer.alive:
                record["skipped"] = "the peer is not running"
            else:
                peer.expect_exit = True
                if event.action == "kill":
                    self.kill(peer)
                    assert peer.proc is not None
                    peer.proc.wait(10)
                    self.ended(peer, "killed")
                else:
                    assert peer.proc is not None
                    peer.proc.send_signal(signal.SIGTERM)  # ended() when it has drained
        elif event.action == "cut":
            record["connections"] = self.backend.cut(peer.index)
        elif event.action == "partition":
            self.backend.partition(peer.index, event.seconds)
            record["seconds"] = event.seconds
        elif event.action == "link":
            self.backend.link(peer.index, dict(event.link))
            record["link"] = dict(event.link)
        self.timeline.append(record)
        peer.events.append({k: v for k, v in record.items() if k != "peer"})
        self.say(
            f"{event.action} peer {event.peer}" + (f" ({record['skipped']})" if "skipped" in record else "")
        )

    # ---- sampling ----

    def sample(self) -> None:
        assert self.backend is not None
        t = round(self.now(), 2)
        stats = self.backend.stats()
        for peer in self.peers:
            if peer.proc is not None and peer.current is not None and peer.current.ended is None:
                code = peer.proc.poll()
                if code is not None:
                    if peer.expect_exit:
                        self.ended(peer, "stopped" if code == 0 else f"stopped, exit status {code}")
                    else:
                        self.ended(peer, f"exited {code}")
                        self.problems.append(
                            f"peer {peer.index} exited by itself with status {code} at {t:.0f} s; "
                            f"see {peer.folder}/node.log"
                        )
                        peer.events.append({"t": t, "action": "crashed", "code": code})
            alive = peer.alive
            if alive:
                self.wire_up(peer)
                peer.read_status()
            row: dict[str, Any] = {"t": t, "alive": alive}
            if alive and peer.proc is not None:
                row["pid"] = peer.proc.pid
                row["incarnation"] = len(peer.incarnations)
                row["rss_mb"] = rss_mb(peer.proc.pid)
                row |= status_row(peer.status)
            if stats is not None and peer.index < len(stats):
                row["link_sent"] = stats[peer.index].get("sent")
                row["link_received"] = stats[peer.index].get("received")
                if "connections" in stats[peer.index]:
                    row["link_connections"] = stats[peer.index]["connections"]
            peer.series.append(row)
        if stats is not None:
            self.switch_final = stats

    def progress_line(self) -> str:
        steps = []
        for p in self.peers:
            tr = p.status.get("training") or {}
            steps.append(str(tr.get("step", "?")) if p.alive else "-")
        alive = sum(p.alive for p in self.peers)
        losses = [
            float(x)
            for p in self.peers
            if p.alive and (x := (p.status.get("training") or {}).get("loss")) is not None
        ]
        loss = f", loss {min(losses):.3f}" if losses else ""
        return f"{alive}/{len(self.peers)} up, steps [{' '.join(steps)}]{loss}"

    # ---- the whole run ----

    def run(self) -> dict[str, Any]:
        """Run the scenario; return what the report needs (see ``report.write_report``)."""
        self.prepare()
        try:
            with make_backend(self.scenario) as backend:
                self.backend = backend
                try:
                    self._run()
                except KeyboardInterrupt:
                    self.interrupted = True
                    self.problems.append(f"interrupted at {self.now():.0f} s (Ctrl-C or SIGTERM)")
                    self.say("interrupted: stopping every peer")
                finally:
                    self.stop_all(graceful=not self.interrupted)
                    with contextlib.suppress(Exception):
                        stats = backend.stats()
                        if stats is not None:
                            self.switch_final = stats
        finally:
            self.kill_everything()
        return self.collect()

    def _run(self) -> None:
        s = self.scenario
        self.t0, self.wall_t0 = time.monotonic(), time.time()
        self.load_before = [round(x, 2) for x in os.getloadavg()]
        initial = [self.peers[i] for i in s.initial_peers]
        first = initial[0]
        self.say(
            f"scenario {s.name}: {len(s.peers)} peers, {s.duration:g} s, emulation {s.emulation}, "
            f"{len(s.events)} events; report in {self.out}"
        )
        self.launch(first, "start", join=None, wait=s.wait_peers)
        join = self.wait_address(first)
        self.say(f"peer {first.index} listens; {len(initial) - 1} more join it at {join}")
        for peer in initial[1:]:
            self.launch(peer, "start", join=join, wait=s.wait_peers)
        pending = list(s.events)
        next_tick = last_print = 0.0
        while (now := self.now()) < s.duration:
            while pending and pending[0].at <= now:
                self.apply(pending.pop(0))
            if now >= next_tick:
                self.sample()
                next_tick = now + TICK
            if now - last_print >= PRINT_EVERY:
                self.say(self.progress_line())
                last_print = now
            wake = min(next_tick, pending[0].at if pending else math.inf, s.duration)
            time.sleep(max(0.01, min(wake - self.now(), TICK)))
        self.sample()
        self.say(f"duration reached: {self.progress_line()}; stopping every peer (SIGTERM)")

    def stop_all(self, *, graceful: bool) -> None:
        """SIGTERM every live peer, wait for them to drain (bounded), SIGKILL what is left."""
        live = [p for p in self.peers if p.alive]
        for p in live:
            p.expect_exit = True
            if p.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    p.proc.send_signal(signal.SIGTERM if graceful else signal.SIGKILL)
        deadline = time.monotonic() + (STOP_TIMEOUT if graceful else 10.0)
        try:
            for p in live:
                assert p.proc is not None
                try:
                    code = p.proc.wait(max(0.1, deadline - time.monotonic()))
                    self.ended(p, "stopped at the end" if code == 0 else f"stopped at the end, status {code}")
                except subprocess.TimeoutExpired:
                    self.kill(p)
                    p.proc.wait(10)
                    self.ended(p, "killed at the end")
                    self.problems.append(
                        f"peer {p.index} did not stop within {STOP_TIMEOUT:.0f} s of SIGTERM"
                    )
        except KeyboardInterrupt:
            self.interrupted = True
            self.kill_everything()
        for p in self.peers:  # read the last status each wrote
            if p.proc is not None:
                p.read_status()

    def kill_everything(self) -> None:
        for p in self.peers:
            if p.proc is not None and p.proc.poll() is None:
                self.kill(p)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.proc.wait(10)
                self.ended(p, "killed at the end")
            p.close_logs()

    # ---- what the report gets ----

    def collect(self) -> dict[str, Any]:
        from simulations.replay.report import scan_logs

        peers = []
        for p in self.peers:
            peers.append(
                {
                    "index": p.index,
                    "name": p.spec.name,
                    "spec": {k: _json_number(v) for k, v in p.spec.__dict__.items()},
                    "folder": str(p.folder),
                    "peer_id": p.status.get("peer_id"),
                    "incarnations": [i.__dict__ for i in p.incarnations],
                    "events": p.events,
                    "series": p.series,
                    "metrics": read_metrics(p.folder / "metrics.jsonl", self.wall_t0),
                    "final_status": p.status,
                }
            )
        scan_logs(peers)
        return {
            "scenario": self.scenario,
            "run_config": self.run_config,
            "run_file": str(self.run_file),
            "emulation": self.backend.describe() if self.backend else {"emulation": self.scenario.emulation},
            "wall_started": self.wall_t0,
            "seconds": round(self.now(), 1),
            "peers": peers,
            "timeline": self.timeline,
            "problems": self.problems,
            "interrupted": self.interrupted,
            "link_stats": self.switch_final,
            "load": {"before": self.load_before, "after": [round(x, 2) for x in os.getloadavg()]},
        }


def status_row(status: dict[str, Any]) -> dict[str, Any]:
    """The fields of a status file that go into the per-second series."""
    tr = status.get("training") or {}
    rounds = tr.get("rounds") or {}
    row = {
        "state": status.get("state"),
        "members": len(status.get("members") or []),
        "connected": len(status.get("connected_peers") or []),
    }
    for key in (
        "step",
        "loss",
        "val_loss",
        "samples_here",
        "samples_per_s",
        "swarm_samples_per_s",
        "swarm_peers",
        "compute_utilization",
        "bytes_sent",
        "bytes_received",
        "digest",
    ):
        if key in tr:
            row[key] = tr[key]
    for key in ("averaged", "alone", "aborted", "no_group", "synced"):
        if key in rounds:
            row[f"rounds_{key}"] = rounds[key]
    return row


def read_metrics(path: Path, wall_t0: float) -> list[dict[str, Any]]:
    """Every metrics line of every process of a peer, with ``t`` in scenario seconds."""
    out = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            m = json.loads(line)
        except ValueError:
            continue  # cut short by a SIGKILL
        if isinstance(m, dict) and isinstance(m.get("time"), int | float):
            m["t"] = round(m["time"] - wall_t0, 3)
            out.append(m)
    return out


def _json_number(v: Any) -> Any:
    return None if isinstance(v, float) and math.isinf(v) else v


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP unwind like Ctrl-C, so that the peers are stopped and the report written.
    SIGINT too, explicitly: a process started from a shell script's background job inherits SIGINT
    ignored, and Python then installs no Ctrl-C handler of its own, so ``kill -INT`` did nothing (the
    scenario ran on to its end)."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run_scenario(scenario: Scenario, options: RunOptions) -> dict[str, Any]:
    """Run and write the report; returns the summary (``summary["passed"]``: every check passed)."""
    from simulations.replay.report import write_report

    runner = Runner(scenario, options)
    with terminate_as_interrupt():
        data = runner.run()
    return write_report(data, options.out)
