"""Connection flood benchmark: what a flood of silent TCP connections costs the node it floods.

A node (a real :class:`p2ptrain.net.Host`, in its own process, listening on loopback) is flooded by
``--flooders`` processes, each from its own loopback address, each holding ``--sockets`` connections
that never say a word and re-opening each one a second after the node closes it (the hostile-peers
benchmark's ``conn-flood`` attacker, without the rest of a node). It reports the CPU time the node
spent per second of flood, and how many connections the flooders opened, twice: with the node's
defences as they are (new connections past a rate per address and subnet are told busy and held
open, unread, for ``HostConfig.refused_hold`` seconds) and without them (no rate, refused connections
closed at once: the node before). Usage::

    python -m simulations.bench_connflood [--flooders 2] [--sockets 600] [--seconds 60] [--json PATH]

JSON to PATH (default ``simulations/results/connflood.json``; ``-`` for stdout), a table to stderr.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from typing import Any

import trio

from simulations.benchmarks.environment import environment, write_report

MODULE = "simulations.bench_connflood"
FIRST_FLOODER = 20  # flooder k dials from 127.0.0.(FIRST_FLOODER + k)
SETTLE_S = 5.0  # seconds of flood before the node starts counting (the first burst is in it)


def _serve(port: int, seconds: float, defended: bool) -> None:
    """The flooded node: listen, let the flood settle, then measure its own CPU for ``seconds``."""
    from p2ptrain.identity import Identity
    from p2ptrain.net import Host, HostConfig, linger

    config = HostConfig() if defended else HostConfig(inbound_rate=1e9, refused_hold=0.0)
    linger.raise_fd_limit()

    async def main() -> None:
        host = Host(Identity.generate(), "flood", config=config)
        async with trio.open_nursery() as nursery:
            await nursery.start(host.run, [("127.0.0.1", port)])
            print("ready", flush=True)
            await trio.sleep(SETTLE_S)
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
            await trio.sleep(seconds)
            r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
            cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
            print(json.dumps({"cpu_s": cpu, "wall_s": t1 - t0}), flush=True)
            nursery.cancel_scope.cancel()

    trio.run(main)


def _flood(port: int, sockets: int, source: str) -> None:
    """One flooding process: ``sockets`` silent connections, each re-opened a second after it closes."""
    from p2ptrain.net import linger

    linger.raise_fd_limit()
    opened = 0

    async def one() -> None:
        nonlocal opened
        while True:
            try:
                stream = await trio.open_tcp_stream("127.0.0.1", port, local_address=source)
            except OSError:
                await trio.sleep(1.0)
                continue
            opened += 1
            async with stream:
                try:
                    while await stream.receive_some(4096):
                        pass
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass
            await trio.sleep(1.0)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(sockets):
                nursery.start_soon(one)
            with trio.open_signal_receiver(15) as signals:  # SIGTERM: report and stop
                async for _ in signals:
                    print(json.dumps({"opened": opened}), flush=True)
                    nursery.cancel_scope.cancel()
                    return

    trio.run(main)


def run_one(flooders: int, sockets: int, seconds: float, defended: bool, port: int) -> dict[str, Any]:
    node = subprocess.Popen(
        [sys.executable, "-m", MODULE, "--_serve", str(port), str(seconds), str(int(defended))],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert node.stdout is not None
    if node.stdout.readline().strip() != "ready":
        node.kill()
        raise RuntimeError("the node did not start")
    floods = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                MODULE,
                "--_flood",
                str(port),
                str(sockets),
                f"127.0.0.{FIRST_FLOODER + k}",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for k in range(flooders)
    ]
    try:
        measured = json.loads(node.stdout.readline())
        node.wait(timeout=60)
    finally:
        opened = 0
        for f in floods:
            f.terminate()
            try:
                out, _ = f.communicate(timeout=30)
                opened += json.loads(out.strip().splitlines()[-1])["opened"] if out.strip() else 0
            except (subprocess.TimeoutExpired, ValueError, KeyError):
                f.kill()
        if node.poll() is None:
            node.kill()
    return {
        "defended": defended,
        "node_cpu_share": round(measured["cpu_s"] / measured["wall_s"], 4),
        "node_cpu_s": round(measured["cpu_s"], 3),
        "seconds": round(measured["wall_s"], 1),
        "connections_opened": opened,
        "connections_per_s": round(opened / (measured["wall_s"] + SETTLE_S), 1),
    }


def table(runs: list[dict[str, Any]], flooders: int, sockets: int) -> str:
    lines = [
        f"{flooders} flooder(s) x {sockets} silent sockets, each re-opened 1 s after it is closed",
        f"{'node':<22} {'node CPU (share of a core)':>27} {'connections opened':>19} {'per s':>7}",
    ]
    for r in runs:
        name = "as it is (defended)" if r["defended"] else "no rate, no hold"
        lines.append(
            f"{name:<22} {r['node_cpu_share']:>27.3f} {r['connections_opened']:>19} "
            f"{r['connections_per_s']:>7}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--_serve":
        _serve(int(argv[1]), float(argv[2]), argv[3] == "1")
        return 0
    if argv and argv[0] == "--_flood":
        _flood(int(argv[1]), int(argv[2]), argv[3])
        return 0
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    parser.add_argument("--flooders", type=int, default=2)
    parser.add_argument("--sockets", type=int, default=600, help="silent connections per flooder")
    parser.add_argument("--seconds", type=float, default=60.0, help="measured seconds per run")
    parser.add_argument("--port", type=int, default=47391)
    parser.add_argument("--json", metavar="PATH", default="simulations/results/connflood.json")
    args = parser.parse_args(argv)
    runs = [
        run_one(args.flooders, args.sockets, args.seconds, d, args.port + i)
        for i, d in enumerate((True, False))
    ]
    report = {
        "benchmark": "connflood",
        "command": (
            f"python -m {MODULE} --flooders {args.flooders} --sockets {args.sockets} "
            f"--seconds {args.seconds:g}"
        ),
        "flooders": args.flooders,
        "sockets": args.sockets,
        "environment": environment(("trio",)),
        "results": runs,
    }
    write_report(report, None if args.json == "-" else args.json, table(runs, args.flooders, args.sockets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
