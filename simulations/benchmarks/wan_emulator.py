"""Measures one emulated link through the WAN switch: TCP goodput and the round trip of small messages.

Two peers: 0 is the measuring client (unshaped, no latency of its own), 1 the sink with the link under
test.

- goodput: one TCP stream, client -> sink, as fast as it goes for ``warmup + seconds``; the sink counts
  the bytes it receives after its first ``warmup`` seconds (so neither the full bucket at the start nor
  the drain at the end counts) and divides by that time. The client and the sink are separate processes
  with plain blocking sockets: they share no event loop (nor GIL) with the switch, and this process's CPU
  time is the switch's;
- latency: ``pings`` round trips of 32 bytes after two to warm up, by a client and an echo server in the
  switch's own event loop, so that what is timed is the switch and not how late the kernel schedules two
  more processes on a loaded machine (each real peer process adds its own such delay); the one-way
  latency is half the median round trip (the client's own link has no latency, so it is the sink's).

Run with ``python -m simulations.labs.wan check --rate 50 --latency 80``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from functools import partial
from typing import Any

import trio

from simulations.labs.wan import LinkProfile, WanSwitch

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
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m simulations.labs.wan", description="Measure one emulated link through the WAN switch."
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("check", help="measure goodput and latency of one emulated link through the switch")
    p.add_argument("--rate", type=float, default=50.0, help="the sink's link rate, Mbit/s (default 50)")
    p.add_argument("--latency", type=float, default=80.0, help="the sink's one-way latency, ms (default 80)")
    p.add_argument("--jitter", type=float, default=0.0, help="the sink's jitter, ms (default 0)")
    p.add_argument("--seconds", type=float, default=3.0, help="goodput measurement time (default 3)")
    p.add_argument("--pings", type=int, default=30, help="small round trips to time (default 30)")
    args = parser.parse_args(argv)
    result = trio.run(
        partial(
            measure,
            args.rate,
            args.latency,
            jitter_ms=args.jitter,
            seconds=args.seconds,
            pings=args.pings,
        )
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
