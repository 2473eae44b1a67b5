"""``p2ptrain simulate``: a local swarm of real ``p2ptrain node`` processes on this machine.

Node 0 listens on a free loopback port; every other node joins it by its address (exactly what a user
on another machine would paste). The simulation watches the nodes' status files, pings each node over
the network from its own process, shows a live table, and at the end stops every node with SIGTERM and
checks that each one shut down cleanly. It exits non-zero if the swarm did not form or a node failed.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
from rich.console import Console
from rich.live import Live
from rich.table import Table

from .errors import P2PError
from .identity import Identity
from .net.address import PeerAddress
from .net.host import Host
from .node import PING, PingRequest

FORM_TIMEOUT = 60.0
STOP_TIMEOUT = 10.0


@dataclass
class SimNode:
    index: int
    folder: Path
    proc: subprocess.Popen[bytes]
    log_file: Any
    status: dict[str, Any] = field(default_factory=dict)
    rtt_ms: float | None = None

    @property
    def status_file(self) -> Path:
        return self.folder / "status.json"

    def read_status(self) -> dict[str, Any]:
        try:
            self.status = json.loads(self.status_file.read_text())
        except (OSError, ValueError):
            pass  # not written yet, or being replaced: keep the last good one
        return self.status


def _start(index: int, workdir: Path, run_id: str, join: str | None) -> SimNode:
    folder = workdir / f"node{index}"
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "p2ptrain", "node", "--listen", "127.0.0.1:0", "--run-id", run_id]
    cmd += ["--data-dir", str(folder), "--status-file", str(folder / "status.json")]
    if join:
        cmd += ["--join", join]
    log_file = open(folder / "node.log", "wb")  # noqa: SIM115 (closed in run_simulation)
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    return SimNode(index, folder, proc, log_file)


async def _wait_for(nodes: list[SimNode], ready: Any, what: str) -> None:
    with trio.move_on_after(FORM_TIMEOUT) as scope:
        while not all(ready(n.read_status()) for n in nodes):
            for n in nodes:
                if n.proc.poll() is not None:
                    raise P2PError(
                        f"node {n.index} exited with status {n.proc.returncode}; see {n.folder}/node.log"
                    )
            await trio.sleep(0.1)
    if scope.cancelled_caught:
        raise P2PError(f"the swarm did not {what} within {FORM_TIMEOUT:.0f} s")


async def _ping_all(host: Host, nodes: list[SimNode]) -> None:
    for n in nodes:
        try:
            conn = await host.connect(PeerAddress.parse(n.status["addresses"][0]), timeout=5)
            t0 = trio.current_time()
            await conn.call(PING, PingRequest(b"x"), timeout=5)
            n.rtt_ms = (trio.current_time() - t0) * 1e3
        except P2PError:
            n.rtt_ms = None


def _table(nodes: list[SimNode], elapsed: float, observer: str = "") -> Table:
    t = Table(title=f"p2ptrain local swarm: {len(nodes)} nodes, {elapsed:.0f} s")
    for col in ("node", "peer id", "address", "state", "members", "connected", "sent", "received", "ping"):
        t.add_column(col)
    for n in nodes:
        s = n.status
        conns = s.get("connections", [])
        t.add_row(
            str(n.index),
            s.get("peer_id", "?")[:12],
            "/".join((s.get("addresses") or ["///?/?"])[0].split("/")[2:5:2]).replace("/", ":"),
            s.get("state", "starting"),
            str(len(s.get("members", []))),
            str(len(set(s.get("connected_peers", [])) - {observer})),
            f"{sum(c['bytes_sent'] for c in conns) / 1e3:.1f} kB",
            f"{sum(c['bytes_received'] for c in conns) / 1e3:.1f} kB",
            f"{n.rtt_ms:.2f} ms" if n.rtt_ms is not None else "-",
        )
    return t


async def _watch(nodes: list[SimNode], run_id: str, duration: float, console: Console) -> None:
    await _wait_for(nodes, lambda s: bool(s.get("addresses")), "start")
    await _wait_for(nodes, lambda s: len(s.get("connected_peers", [])) >= min(1, len(nodes) - 1), "connect")
    first = nodes[0]
    await _wait_for(
        nodes, lambda s: len(s.get("members", [])) >= len(nodes), "form (every node listing every member)"
    )
    console.print(
        f"[green]swarm formed[/]: {len(nodes)} nodes joined through {first.status['addresses'][0]}, "
        "and each lists every member through the DHT"
    )
    host = Host(Identity.generate(), run_id)
    async with trio.open_nursery() as nursery:
        await nursery.start(host.run, [])
        start = trio.current_time()
        with Live(_table(nodes, 0), console=console, auto_refresh=False) as live:
            while (elapsed := trio.current_time() - start) < duration:
                for n in nodes:
                    n.read_status()
                await _ping_all(host, nodes)
                live.update(_table(nodes, elapsed, str(host.peer_id)), refresh=True)
                await trio.sleep(1.0)
        nursery.cancel_scope.cancel()
    if any(n.rtt_ms is None for n in nodes):
        raise P2PError("some nodes did not answer pings")


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
        n.log_file.close()
        if code != 0:
            problems.append(f"node {n.index} exited with status {code}")
        elif n.read_status().get("state") != "stopped":
            problems.append(f"node {n.index} did not write its final status")
    return problems


def run_simulation(*, peers: int, duration: float, workdir: str | None, run_id: str) -> int:
    """Run the swarm; return the process exit status."""
    if not 1 <= peers <= 64:
        raise P2PError("--peers must be between 1 and 64")
    console = Console()
    logging.getLogger("p2ptrain.net").setLevel(logging.WARNING)  # keep the live table readable
    folder = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="p2ptrain-sim-"))
    nodes = [_start(0, folder, run_id, None)]
    try:
        trio.run(_wait_for, nodes, lambda s: bool(s.get("addresses")), "start")
        join = nodes[0].status["addresses"][0]
        nodes += [_start(i, folder, run_id, join) for i in range(1, peers)]
        trio.run(_watch, nodes, run_id, duration, console)
    finally:
        problems = _stop(nodes)
        if not workdir:
            shutil.rmtree(folder, ignore_errors=True)
    for p in problems:
        console.print(f"[red]{p}[/]")
    if problems:
        return 1
    console.print(f"[green]all {peers} nodes stopped cleanly[/]")
    return 0
