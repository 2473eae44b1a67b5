"""WAN emulator benchmark: how close the userspace switch (``simulations.labs.wan``) comes to the links
it is set to: rate and latency of single links, a peer's upload cap shared by two connections, and the
two directions of one access link shaped at once.

The tests (``tests/integration/test_wan_emulator.py``) check what the switch guarantees on any machine:
no cap is ever exceeded, latency is never shorter than set, order is kept, cuts and partitions act. How
*close* to the cap a link gets depends on how busy the machine is (a late wake-up of the switch's loop
is time the link stood idle), so that is measured here, as a benchmark, and not asserted in a test.

Cases (``--only``, comma list, default all):

- ``link``: for each ``RATE/LATENCY`` of ``--links`` (Mbit/s, one-way ms), TCP goodput and the round trip
  of small messages through one emulated link (:func:`measure`). Peer 0 is the measuring client
  (unshaped, no latency of its own), peer 1 the sink with the link under test. Goodput: one TCP stream,
  client -> sink, as fast as it goes for ``warmup + seconds``; the sink counts the bytes it receives
  after its first ``warmup`` seconds (so neither the full bucket at the start nor the drain at the end
  counts). The client and the sink are separate processes with plain blocking sockets: they share no
  event loop (nor GIL) with the switch, and this process's CPU time is the switch's. Latency:
  ``pings`` round trips of 32 bytes after two to warm up, by a client and an echo server in the
  switch's own event loop, so that what is timed is the switch and not how late the kernel schedules
  two more processes (each real peer process adds its own such delay); the one-way latency is half
  the median round trip (the client's own link has no latency, so it is the sink's);
- ``shared-upload``: peer 0, its upload capped at ``--shared-mbit``, floods peers 1 and 2 over one
  connection each; the total received against the cap, and the first connection's share (fairness);
- ``directions``: peer 0 with ``--up-mbit`` up and ``--down-mbit`` down uploads to and downloads from
  peer 1 at the same time; each direction against its own cap.

In the last two, servers and clients run in the switch's event loop, counting for ``seconds`` after
``warmup``. Usage::

    python -m simulations.benchmarks.wan_emulator [--quick] [--only link,shared-upload,directions]
        [--links 10/20,50/80,100/40] [--seconds 3] [--pings 30] [--json PATH]

JSON to PATH (default ``simulations/results/wan-emulator.json``; ``-`` for stdout), a table to stderr.
A row's ``within_10pc`` says whether its rates came within 10% of their caps (and, for links, the
one-way latency within 10 ms): on an idle machine they all do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import trio

from simulations.benchmarks.environment import environment, write_report
from simulations.labs.wan import LinkProfile, WanSwitch

MODULE = "simulations.benchmarks.wan_emulator"
CASES = ("link", "shared-upload", "directions")
TOLERANCE = 0.10  # the "within" of a row: rates within 10% of their caps, one-way latency within 10 ms
LATENCY_TOLERANCE_MS = 10.0

# Run with `python -c PROBE MODE ...`: self-contained, every blocking call bounded.
PROBE = r"""
import json, socket, sys, time
mode = sys.argv[1]
if mode == "sink":  # sink FD WARMUP: counts what one connection sends, answers with the result
    srv = socket.socket(fileno=int(sys.argv[2]))
    srv.settimeout(60.0)
    warmup = float(sys.argv[3])
    conn, _ = srv.accept()
    conn.settimeout(60.0)
    buf = bytearray(1 << 20)
    total, first, mark, mark_bytes, last = 0, None, None, 0, None
    while True:
        k = conn.recv_into(buf)
        if not k:
            break
        last = time.perf_counter()
        if first is None:
            first = last
        if mark is None and last - first >= warmup:
            mark, mark_bytes = last, total
        total += k
    counted = total - mark_bytes if mark is not None else 0
    secs = last - mark if mark is not None else 0.0
    conn.sendall(json.dumps({"bytes": total, "counted": counted, "seconds": secs}).encode())
    conn.close()
else:  # send HOST PORT SOURCE SECONDS
    host, port, source, seconds = sys.argv[2], int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
    sock = socket.create_connection((host, port), timeout=60.0, source_address=(source, 0))
    chunk = memoryview(bytearray(1 << 16))
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sock.sendall(chunk)
    sock.shutdown(socket.SHUT_WR)
    reply = b""
    while part := sock.recv(4096):
        reply += part
    print(reply.decode(), flush=True)
    sock.close()
"""

CHUNK = bytes(1 << 16)
FLOOD, COUNT = b"F", b"C"  # the first byte of a connection tells a server what to do


async def _probe(*args: object) -> Any:
    done = await trio.run_process(
        [sys.executable, "-c", PROBE, *map(str, args)], capture_stdout=True, capture_stderr=True
    )
    return json.loads(done.stdout)


async def _echo(stream: trio.SocketStream) -> None:
    async with stream:
        while data := await stream.receive_some(1024):
            await stream.send_all(data)


async def _pings(switch: WanSwitch, n: int) -> list[float]:
    """Round trips (ms) of 32-byte messages from peer 0 to peer 1, after two to warm up."""
    stream = await trio.open_tcp_stream(*switch.endpoint(1), local_address=switch.source_address(0))
    msg, rtts = b"x" * 32, []
    async with stream:
        for _ in range(n + 2):
            t0 = trio.current_time()
            await stream.send_all(msg)
            got = b""
            while len(got) < len(msg):
                if not (part := await stream.receive_some(64)):
                    raise ConnectionError("the echo connection closed")
                got += part
            rtts.append((trio.current_time() - t0) * 1e3)
    return rtts[2:]


async def measure(
    rate_mbit: float,
    latency_ms: float,
    *,
    jitter_ms: float = 0.0,
    seconds: float = 3.0,
    pings: int = 30,
    warmup: float = 0.5,
) -> dict[str, Any]:
    """Goodput and latency of a link of ``rate_mbit`` and ``latency_ms`` (one way) through a switch."""
    switch = WanSwitch([LinkProfile(), LinkProfile(rate_mbit, rate_mbit, latency_ms, jitter_ms)])
    with socket.create_server(("127.0.0.1", 0)) as server:
        async with trio.open_nursery() as nursery:
            await nursery.start(switch.run)
            switch.set_upstream(1, server.getsockname()[:2])
            sink = [sys.executable, "-c", PROBE, "sink", str(server.fileno()), str(warmup)]
            nursery.start_soon(partial(trio.run_process, sink, pass_fds=(server.fileno(),)))
            host, port = switch.endpoint(1)
            cpu, wall = time.process_time(), time.perf_counter()
            goodput = await _probe("send", host, port, switch.source_address(0), warmup + seconds)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            echo = await nursery.start(partial(trio.serve_tcp, _echo, 0, host="127.0.0.1"))
            switch.set_upstream(1, echo[0].socket.getsockname()[:2])
            rtts = await _pings(switch, pings)
            stats = switch.stats()
            nursery.cancel_scope.cancel()
    mbit = goodput["counted"] * 8 / goodput["seconds"] / 1e6 if goodput["seconds"] > 0 else 0.0
    rtt = statistics.median(rtts)
    return {
        "case": "link",
        "rate_mbit": rate_mbit,
        "goodput_mbit": round(mbit, 2),
        "ratio": round(mbit / rate_mbit, 3),
        "latency_ms": latency_ms,
        "jitter_ms": jitter_ms,
        "rtt_median_ms": round(rtt, 2),
        "one_way_ms": round(rtt / 2, 2),
        "one_way_error_ms": round(rtt / 2 - latency_ms, 2),
        "rtt_min_ms": round(min(rtts), 2),
        "rtt_max_ms": round(max(rtts), 2),
        "pings": len(rtts),
        "goodput_seconds": round(goodput["seconds"], 3),
        "bytes": goodput["bytes"],
        "switch_bytes": stats["peers"][1]["received"],
        "switch_cpu_percent": round(100 * cpu / wall, 1),
        "within_10pc": abs(mbit / rate_mbit - 1) <= TOLERANCE
        and abs(rtt / 2 - latency_ms) <= LATENCY_TOLERANCE_MS,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


# ---- in-loop flows: the shared upload cap, the two directions ------------------------------------------


class _Counter:
    """A peer's real listener: counts what it receives (C) or floods its client (F)."""

    def __init__(self) -> None:
        self.received = 0

    async def serve(self, stream: trio.SocketStream) -> None:
        async with stream:
            try:
                mode = await stream.receive_some(1)
                if mode == FLOOD:
                    while True:
                        await stream.send_all(CHUNK)
                while data := await stream.receive_some(1 << 16):
                    self.received += len(data)
            except trio.BrokenResourceError:
                pass


async def _listen(nursery: trio.Nursery, switch: WanSwitch, i: int) -> _Counter:
    counter = _Counter()
    listeners = await nursery.start(partial(trio.serve_tcp, counter.serve, 0, host="127.0.0.1"))
    switch.set_upstream(i, listeners[0].socket.getsockname()[:2])
    return counter


async def _dial(switch: WanSwitch, src: int, dst: int, mode: bytes) -> trio.SocketStream:
    stream = await trio.open_tcp_stream(*switch.endpoint(dst), local_address=switch.source_address(src))
    await stream.send_all(mode)
    return stream


async def _flood(stream: trio.SocketStream) -> None:
    async with stream:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            while True:
                await stream.send_all(CHUNK)


async def _drain(stream: trio.SocketStream, into: list[int]) -> None:
    async with stream:
        while data := await stream.receive_some(1 << 16):
            into[0] += len(data)


async def _rates_mbit(counters: list[Callable[[], int]], warmup: float, seconds: float) -> list[float]:
    """Mbit/s of byte counters over ``seconds``, after ``warmup`` seconds."""
    await trio.sleep(warmup)
    bytes0, t0 = [count() for count in counters], trio.current_time()
    await trio.sleep(seconds)
    elapsed = trio.current_time() - t0
    return [(count() - b) * 8 / elapsed / 1e6 for count, b in zip(counters, bytes0, strict=True)]


async def shared_upload(cap_mbit: float, *, seconds: float = 3.0, warmup: float = 0.5) -> dict[str, Any]:
    """Peer 0's upload, capped at ``cap_mbit``, flooding peers 1 and 2 over a connection each."""
    switch = WanSwitch([LinkProfile(up_mbit=cap_mbit, latency_ms=5), *[LinkProfile(latency_ms=5)] * 2])
    async with trio.open_nursery() as nursery:
        await nursery.start(switch.run)
        sinks = [await _listen(nursery, switch, i) for i in (1, 2)]
        for dst in (1, 2):
            nursery.start_soon(_flood, await _dial(switch, 0, dst, COUNT))
        rates = await _rates_mbit([lambda s=s: s.received for s in sinks], warmup, seconds)
        nursery.cancel_scope.cancel()
    total = sum(rates)
    return {
        "case": "shared-upload",
        "cap_mbit": cap_mbit,
        "connections": 2,
        "total_mbit": round(total, 2),
        "ratio": round(total / cap_mbit, 3),
        "first_share": round(rates[0] / total, 3) if total else None,
        "within_10pc": abs(total / cap_mbit - 1) <= TOLERANCE,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


async def directions(
    up_mbit: float, down_mbit: float, *, seconds: float = 3.0, warmup: float = 0.5
) -> dict[str, Any]:
    """Peer 0 uploads to and downloads from peer 1 at once: each direction against its own cap."""
    switch = WanSwitch([LinkProfile(up_mbit=up_mbit, down_mbit=down_mbit, latency_ms=5), LinkProfile()])
    async with trio.open_nursery() as nursery:
        await nursery.start(switch.run)
        sink = await _listen(nursery, switch, 1)
        nursery.start_soon(_flood, await _dial(switch, 0, 1, COUNT))
        downloaded = [0]
        nursery.start_soon(_drain, await _dial(switch, 0, 1, FLOOD), downloaded)
        up, down = await _rates_mbit([lambda: sink.received, lambda: downloaded[0]], warmup, seconds)
        nursery.cancel_scope.cancel()
    return {
        "case": "directions",
        "up_cap_mbit": up_mbit,
        "down_cap_mbit": down_mbit,
        "up_mbit": round(up, 2),
        "down_mbit": round(down, 2),
        "up_ratio": round(up / up_mbit, 3),
        "down_ratio": round(down / down_mbit, 3),
        "within_10pc": abs(up / up_mbit - 1) <= TOLERANCE and abs(down / down_mbit - 1) <= TOLERANCE,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


# ---- the report ---------------------------------------------------------------------------------------


def parse_links(text: str) -> list[tuple[float, float]]:
    """``"10/20,50/80"`` -> [(10.0, 20.0), (50.0, 80.0)]: Mbit/s and one-way ms of each link."""
    links = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        rate, sep, latency = part.partition("/")
        if not sep:
            raise argparse.ArgumentTypeError(f"a link is RATE/LATENCY (Mbit/s and ms), not {part!r}")
        links.append((float(rate), float(latency)))
    return links


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'case':<14} {'set to':<24} {'measured':<34} {'ratio':>12}  within 10%"]
    for r in rows:
        if r["case"] == "link":
            setting = f"{r['rate_mbit']:g} Mbit/s, {r['latency_ms']:g} ms"
            measured = f"{r['goodput_mbit']:g} Mbit/s, {r['one_way_ms']:g} ms one way"
            ratio = f"{r['ratio']:.3f}"
        elif r["case"] == "shared-upload":
            setting = f"{r['cap_mbit']:g} Mbit/s up, 2 conns"
            measured = f"{r['total_mbit']:g} Mbit/s (first: {r['first_share']})"
            ratio = f"{r['ratio']:.3f}"
        else:
            setting = f"{r['up_cap_mbit']:g} up / {r['down_cap_mbit']:g} down"
            measured = f"{r['up_mbit']:g} up / {r['down_mbit']:g} down Mbit/s"
            ratio = f"{r['up_ratio']:.2f}/{r['down_ratio']:.2f}"
        lines.append(f"{r['case']:<14} {setting:<24} {measured:<34} {ratio:>12}  {r['within_10pc']}")
    return "\n".join(lines)


async def run_cases(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    if "link" in args.only:
        for rate, latency in args.links:
            rows.append(await measure(rate, latency, seconds=args.seconds, pings=args.pings))
    if "shared-upload" in args.only:
        rows.append(await shared_upload(args.shared_mbit, seconds=args.seconds))
    if "directions" in args.only:
        rows.append(await directions(args.up_mbit, args.down_mbit, seconds=args.seconds))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one link (50/80), 1.5 s per measurement")
    parser.add_argument("--only", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    parser.add_argument("--links", default="10/20,50/80,100/40", help="RATE/LATENCY,... (Mbit/s, one-way ms)")
    parser.add_argument("--shared-mbit", type=float, default=20.0, help="shared-upload: the cap (default 20)")
    parser.add_argument("--up-mbit", type=float, default=40.0, help="directions: upload cap (default 40)")
    parser.add_argument("--down-mbit", type=float, default=10.0, help="directions: download cap (default 10)")
    parser.add_argument("--seconds", type=float, default=3.0, help="counted seconds per rate (default 3)")
    parser.add_argument("--pings", type=int, default=30, help="link: small round trips to time (default 30)")
    parser.add_argument("--json", metavar="PATH", default="simulations/results/wan-emulator.json")
    args = parser.parse_args(argv)
    args.only = [c.strip() for c in args.only.split(",") if c.strip()]
    if unknown := set(args.only) - set(CASES):
        parser.error(f"unknown cases {sorted(unknown)}; choose from {', '.join(CASES)}")
    try:
        args.links = parse_links("50/80" if args.quick else args.links)
    except argparse.ArgumentTypeError as e:
        parser.error(str(e))
    if args.quick:
        args.seconds, args.pings = min(args.seconds, 1.5), min(args.pings, 15)
    rows = trio.run(run_cases, args)
    command = " ".join(["python -m", MODULE, *(sys.argv[1:] if argv is None else argv)])
    report = {
        "benchmark": "wan-emulator",
        "command": command,
        "environment": environment(("trio",)),
        "results": rows,
    }
    write_report(report, None if args.json == "-" else args.json, table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
