"""``p2ptrain simulate``: a local swarm of real ``p2ptrain node`` processes training one model together.

Node 0 listens on a free loopback port; every other node joins it by the address it printed (exactly
what a user on another machine would paste). Each node has its own loopback address where the machine
allows it (``node_host``), as hosts on a network have. Each node trains the run's task, writes its status file
every second and one line of metrics per global step. The simulation shows every node's row live
(step, loss, samples/s here and in the swarm, rounds, bytes), ends when every node reached
``--max-steps`` (or after ``--duration``, or on Ctrl-C: then it stops the nodes with SIGTERM, and each
writes a last checkpoint), and writes a report folder: ``peer-N.json`` per node (its metrics and final
status), ``loss.png`` (every peer's loss against time) and ``summary.json``. It exits non-zero when a node
failed, or when the nodes that finished on the same step do not hold the same parameters.

``--private`` makes the local swarm a private one (what a run with top-k compression needs: a run file
refuses top-k in an open swarm): the simulation mints a throwaway authority, gives each node a key of
its own and a membership certificate for it in the node's folder, and starts every node with that
authority (over the run file's, which may be a placeholder). The authority's secret key is never
written: nothing outside the simulation can issue certificates for it.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live

from .authority import authority_key_text, issue_certificate, save_certificate
from .config import load_config
from .errors import ConfigError, P2PError
from .identity import Identity, load_or_create_identity
from .pipeline.console import is_pipeline, pipeline_summary, pipeline_table
from .training.loop.console import swarm_table

FORM_TIMEOUT = 120.0  # seconds for node 0 to print its address
STOP_TIMEOUT = 120.0  # seconds a node may take to drain after SIGTERM (a last round, a checkpoint)
POLL = 0.5
CERT_LIFETIME = 30 * 86400.0  # seconds a private simulation's certificates are valid
PRIVATE = "(the simulation's own)"  # the authority a run file is checked with in a private simulation


@dataclass(frozen=True)
class SimulationOptions:
    peers: int = 4
    config: str | None = None  # run file; None: the built-in defaults
    mode: str | None = None
    max_steps: int = 40
    duration: float = 0.0  # 0: until every node reached max_steps
    slowdown: tuple[float, ...] = ()  # per node (cycled); empty: all 1
    threads: int = 1  # torch threads per node: the nodes share this machine's cores
    workdir: str | None = None
    report: str | None = None  # default: WORKDIR/report
    run_id: str | None = None  # None: the run file's
    live: bool = True
    extra: tuple[str, ...] = ()  # more flags for every node
    private: bool = False  # a private swarm under a throwaway authority (see the module docstring)

    def __post_init__(self) -> None:
        if not 1 <= self.peers <= 64:
            raise ConfigError("--peers must be between 1 and 64")
        if self.max_steps < 0 or self.duration < 0:
            raise ConfigError("--max-steps and --duration must not be negative")
        if not self.max_steps and not self.duration:
            raise ConfigError("give --max-steps or --duration: the simulation must end")
        if any(s < 1 for s in self.slowdown):
            raise ConfigError("--slowdown factors must be at least 1")
        if self.config:  # a missing or broken run file: said here, not in every node's log
            load_config(self.config, {"run": {"authority": PRIVATE if self.private else None}})


@dataclass
class SimNode:
    index: int
    folder: Path
    proc: subprocess.Popen[bytes]
    log_file: Any
    status: dict[str, Any] = field(default_factory=dict)

    @property
    def status_file(self) -> Path:
        return self.folder / "status.json"

    @property
    def metrics_file(self) -> Path:
        return self.folder / "metrics.jsonl"

    def read_status(self) -> dict[str, Any]:
        try:
            self.status = json.loads(self.status_file.read_text())
        except (OSError, ValueError):
            pass  # not written yet, or being replaced: keep the last good one
        return self.status

    def address(self) -> str | None:
        """The join address the node printed on its first line of output."""
        try:
            for line in (self.folder / "stdout.log").read_text().splitlines():
                if "/p2p/" in line:
                    return line.strip()
        except OSError:
            pass
        return None


@functools.cache
def _own_addresses() -> bool:
    """Whether this machine lets a process bind loopback addresses other than 127.0.0.1 (Linux routes
    all of 127.0.0.0/8 to the loopback interface; macOS, only 127.0.0.1 unless aliased)."""
    try:
        with socket.socket() as sock:
            sock.bind(("127.0.0.2", 0))
    except OSError:
        return False
    return True


def node_host(index: int) -> str:
    """Node ``index``'s address: 127.0.0.(2 + index) where the machine allows it, else 127.0.0.1.

    Its own address, for listening and as the source of what it dials, as peers on a network have:
    the DHT counts the replicas that answered a read by address (free ids on one subnet count once,
    a loopback address on its own), so with one address for all, no read ever met its quorum and
    each went on to a full lookup, several times the bytes a swarm of separate hosts sends.
    """
    return f"127.0.0.{2 + index}" if _own_addresses() else "127.0.0.1"


def _membership(authority: Identity, sub: Path) -> list[str]:
    """A node's flags in a private simulation: its key (created in its folder, where the node finds it)
    and a certificate for it signed by ``authority``."""
    identity, _ = load_or_create_identity(sub / "identity.key")
    now = time.time()
    cert = issue_certificate(authority, identity.peer_id, not_before=now - 60.0, expires=now + CERT_LIFETIME)
    save_certificate(cert, sub / "membership.cert", overwrite=True)
    key = authority_key_text(authority.public_key)
    return ["--authority", key, "--certificate", str(sub / "membership.cert")]


def _start(
    opts: SimulationOptions, index: int, folder: Path, join: str | None, authority: Identity | None = None
) -> SimNode:
    sub = folder / f"node{index}"
    sub.mkdir(parents=True, exist_ok=True)
    host = node_host(index)
    cmd = [sys.executable, "-m", "p2ptrain", "--log-level", "info", "node", "--listen", f"{host}:0"]
    cmd += ["--source-address", host] if host != "127.0.0.1" else []
    cmd += [
        "--data-dir",
        str(sub),
        "--status-file",
        str(sub / "status.json"),
        "--wait-peers",
        str(opts.peers),
    ]
    cmd += ["--run-id", opts.run_id] if opts.run_id else []
    cmd += ["--metrics-file", str(sub / "metrics.jsonl"), "--threads", str(opts.threads), "--no-live"]
    cmd += ["--config", opts.config] if opts.config else ["--task", "tiny-gpt"]
    if opts.mode:
        cmd += ["--mode", opts.mode]
    if opts.max_steps:
        cmd += ["--max-steps", str(opts.max_steps)]
    if opts.slowdown:
        cmd += ["--slowdown", str(opts.slowdown[index % len(opts.slowdown)])]
    if join:
        cmd += ["--join", join]
    if authority is not None:
        cmd += _membership(authority, sub)
    cmd += list(opts.extra)
    stdout = open(sub / "stdout.log", "wb")  # noqa: SIM115 (closed in _stop)
    env = {**os.environ, "OMP_NUM_THREADS": str(opts.threads)}
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=open(sub / "node.log", "wb"), env=env)  # noqa: SIM115
    return SimNode(index, sub, proc, stdout)


def _wait_address(node: SimNode) -> str:
    deadline = time.monotonic() + FORM_TIMEOUT
    while (addr := node.address()) is None:
        if node.proc.poll() is not None:
            raise P2PError(_exited(node, node.proc.returncode))
        if time.monotonic() > deadline:
            raise P2PError(f"node {node.index} printed no address within {FORM_TIMEOUT:.0f} s")
        time.sleep(0.1)
    return addr


def _watch(nodes: list[SimNode], opts: SimulationOptions, console: Console) -> None:
    """Show the swarm until every node exited, or the duration passed."""
    start = time.monotonic()

    def table() -> Any:
        for n in nodes:
            n.read_status()
        done = sum(n.proc.poll() is not None for n in nodes)
        title = f"p2ptrain local swarm: {len(nodes)} nodes, {time.monotonic() - start:.0f} s"
        title += f", {done} finished" if done else ""
        statuses = [n.status for n in nodes]
        return pipeline_table(statuses, title) if is_pipeline(statuses) else swarm_table(statuses, title)

    last_print = 0.0
    with (
        Live(table(), console=console, auto_refresh=False, transient=False) if opts.live else _Quiet() as live
    ):
        while any(n.proc.poll() is None for n in nodes):
            if opts.duration and time.monotonic() - start >= opts.duration:
                break
            failed = [n for n in nodes if n.proc.poll() not in (None, 0)]
            if failed:
                raise P2PError(_exited(failed[0], failed[0].proc.returncode))
            if opts.live:
                live.update(table(), refresh=True)
            elif time.monotonic() - last_print >= 10:
                console.print(table())
                last_print = time.monotonic()
            time.sleep(POLL)
        if opts.live:
            live.update(table(), refresh=True)


class _Quiet:
    def __enter__(self) -> _Quiet:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, *args: object, **kwargs: object) -> None:
        return None


def _stop(nodes: list[SimNode]) -> list[str]:
    problems = []
    for n in nodes:
        if n.proc.poll() is None:
            n.proc.send_signal(signal.SIGTERM)
    for n in nodes:
        try:
            code = n.proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            n.proc.kill()
            n.proc.wait()
            problems.append(f"node {n.index} did not stop within {STOP_TIMEOUT:.0f} s")
            continue
        finally:
            n.log_file.close()
        if code != 0:
            problems.append(_exited(n, code))
    return problems


def _exited(node: SimNode, code: int | None) -> str:
    """Why a node stopped: its status and the last line it logged (the error, for a node that failed)."""
    try:
        lines = (node.folder / "node.log").read_text(errors="replace").strip().splitlines()
    except OSError:
        lines = []
    last = f": {lines[-1].strip()[:300]}" if lines else ""
    return f"node {node.index} exited with status {code}{last} (log: {node.folder}/node.log)"


@contextmanager
def _interruptible() -> Iterator[None]:
    """Ctrl-C (``kill -INT``) interrupts, even in a process that inherited SIGINT ignored (started from
    a shell script's background job): Python installs no handler of its own then, and the swarm would
    train on to its end."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run_simulation(opts: SimulationOptions) -> int:
    """Run the swarm and write the report; return the process exit status."""
    console = Console() if opts.live else Console(width=200)
    logging.getLogger("p2ptrain.net").setLevel(logging.WARNING)
    folder = Path(opts.workdir) if opts.workdir else Path(tempfile.mkdtemp(prefix="p2ptrain-sim-"))
    report = Path(opts.report) if opts.report else folder / "report"
    started = time.time()
    nodes: list[SimNode] = []
    problems: list[str] = []
    authority = Identity.generate() if opts.private else None
    if authority is not None:
        key = authority_key_text(authority.public_key)
        console.print(f"a private swarm: every node holds a certificate of the throwaway authority {key}")
    try:
        with _interruptible():
            nodes.append(_start(opts, 0, folder, None, authority))
            join = _wait_address(nodes[0])
            console.print(f"node 0 listens at [bold]{join}[/]; {opts.peers - 1} more join through it")
            nodes += [_start(opts, i, folder, join, authority) for i in range(1, opts.peers)]
            _watch(nodes, opts, console)
    except KeyboardInterrupt:
        console.print("interrupted: stopping the nodes (each writes a last checkpoint)")
    except P2PError as e:
        problems.append(str(e))
    finally:
        problems += _stop(nodes)
    if problems and not any(_metrics(n) for n in nodes):  # nobody took a step: nothing to report
        for p in dict.fromkeys(problems):
            console.print(f"[red]{p}[/]")
        console.print(f"no node trained: no report written (node folders in {folder})")
        return 1
    summary = write_report(nodes, report, started, opts)
    for p in problems + summary["problems"]:
        console.print(f"[red]{p}[/]")
    console.print(
        f"report in {report}: {summary['finished']} of {len(nodes)} nodes reached step "
        f"{summary['last_step']}, final loss {summary['final_loss']} (validation "
        f"{summary['final_val_loss']}), parameters identical: {summary['identical']}"
    )
    if summary["diverged_steps"]:
        console.print(f"[red]nodes held different parameters on steps {summary['diverged_steps']}[/]")
    if not opts.workdir and not opts.report:
        # a temporary folder: the nodes' logs and metrics stay, their checkpoints (most of it) go
        for n in nodes:
            shutil.rmtree(n.folder / "checkpoints", ignore_errors=True)
        console.print(f"(node logs and metrics kept in {folder})")
    return 1 if problems or summary["problems"] else 0


def _metrics(node: SimNode) -> list[dict[str, Any]]:
    try:
        lines = node.metrics_file.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a kill
    return out


def _diverged_steps(series: Sequence[Sequence[dict[str, Any]]]) -> list[int]:
    """The steps that two nodes' metrics lines name with different state digests (a step's digest is
    the parameters a node held on it; "" while a large state was being hashed). In a pipeline run a
    digest is of one stage's weights: only nodes of the same stage are compared."""
    held: dict[tuple[Any, int], set[str]] = {}
    for lines in series:
        for line in lines:
            named = dict(line.get("digests") or {})
            if isinstance(line.get("step"), int):
                named[str(line["step"])] = line.get("digest")
            for step, digest in named.items():
                if isinstance(digest, str) and digest and step.isdigit():
                    held.setdefault((line.get("stage"), int(step)), set()).add(digest)
    return sorted({step for (_, step), digests in held.items() if len(digests) > 1})


def write_report(
    nodes: Sequence[SimNode], report: Path, started: float, opts: SimulationOptions
) -> dict[str, Any]:
    """peer-N.json, loss.png and summary.json; returns the summary."""
    report.mkdir(parents=True, exist_ok=True)
    series = []
    for n in nodes:
        metrics = _metrics(n)
        final = n.read_status()
        series.append(metrics)
        (report / f"peer-{n.index}.json").write_text(
            json.dumps(
                {
                    "index": n.index,
                    "peer_id": final.get("peer_id"),
                    "metrics": metrics,
                    "final_status": final,
                },
                indent=1,
            )
        )
    finals = [n.status.get("training") or {} for n in nodes]
    steps = [f.get("step", 0) for f in finals]
    last_step = max(steps, default=0)
    at_last = [f for f in finals if f.get("step") == last_step]
    # (a pipeline run: each stage's peers hold that stage's weights, compared stage by stage)
    stages = {f.get("stage") for f in at_last}
    digests = {(f.get("stage"), f.get("digest")) for f in at_last}
    problems = []
    if len(digests) > len(stages):
        problems.append(f"nodes on step {last_step} hold different parameters: {sorted(map(str, digests))}")
    forks = _diverged_steps(series)
    losses = [float(f["loss"]) for f in at_last if f.get("loss") is not None]
    val_losses = [float(f["val_loss"]) for f in at_last if f.get("val_loss") is not None]
    summary = {
        "peers": len(nodes),
        "config": opts.config or "built-in tiny-gpt",
        "mode": opts.mode or (finals[0].get("mode") if finals else None),
        "seconds": round(time.time() - started, 1),
        "last_step": last_step,
        "finished": len(at_last),
        "identical": len(digests) == len(stages),
        # steps on which two nodes held different parameters at some time (forks, repaired or not)
        "diverged_steps": forks,
        "final_loss": round(min(losses), 4) if losses else None,  # training loss (smoothed)
        "final_val_loss": round(min(val_losses), 4) if val_losses else None,  # on the validation windows
        "steps": steps,
        "samples_per_s": [round(f.get("samples_per_s", 0.0), 2) for f in finals],
        "compute_utilization": [round(f.get("compute_utilization", 0.0), 3) for f in finals],
        "rounds": [f.get("rounds") for f in finals],
        "bytes_sent": [f.get("bytes_sent") for f in finals],
        "problems": problems,
    }
    statuses = [n.status for n in nodes]
    if is_pipeline(statuses):  # each peer's stage, queue and throughput
        summary["pipeline"] = pipeline_summary(statuses)
    (report / "summary.json").write_text(json.dumps(summary, indent=1))
    plot_losses(series, report / "loss.png", started)
    return summary


def plot_losses(series: Sequence[Sequence[dict[str, Any]]], path: Path, started: float) -> None:
    """Every peer's training loss (and validation loss, dots) against seconds since the start."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for i, metrics in enumerate(series):
        pts = [
            (m["time"] - started, m["loss"])
            for m in metrics
            if m.get("loss") is not None and "event" not in m
        ]
        if pts:
            line = ax.plot(*zip(*pts, strict=True), label=f"peer {i}", linewidth=1.2)[0]
            val, seen = [], None
            for m in metrics:
                if m.get("val_loss") is not None and m["val_loss"] != seen:  # each evaluation once
                    seen = m["val_loss"]
                    val.append((m["time"] - started, seen))
            if val:
                ax.plot(*zip(*val, strict=True), "o", color=line.get_color(), markersize=3)
    ax.set_xlabel("seconds since the start")
    ax.set_ylabel("loss (lines: training, dots: validation)")
    ax.set_title("p2ptrain local swarm")
    ax.grid(alpha=0.3)
    if series:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
