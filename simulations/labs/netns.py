"""A network-namespace lab: N peers behind one Linux bridge, each link rate-limited with ``tc tbf``.

Layout (all of it inside namespaces this module creates; nothing is added to the host's own namespace)::

    hub namespace:   bridge br0 <- h0, h1, ... (bridge side of each veth pair; egress = the peer's download)
    peer namespace i: eth0 198.18.0.{i+1}/24 (peer side; egress = the peer's upload), lo up
                      (``subnets=True``: 198.18.{i+1}.1/15, each peer in a /24 of its own, as peers
                      behind different home connections are; still one bridge)

Addresses are in 198.18.0.0/15, the range set aside for benchmarking; test traffic never leaves the
lab. Each direction of each link is shaped with a token bucket (``tbf``: this kernel has tbf and htb, not
netem), at one rate for every peer or at per-peer rates for uneven links.

Names are ``{prefix}-{pid}-{serial}-{hub|i}``: two labs (in one process or in two) never collide, and a
lab left behind by a run that crashed (its pid is gone) is deleted when the next lab with the same prefix
starts. A lab always cleans up on exit, exceptions included: the processes it started are killed, then
every process still inside its namespaces, then the namespaces (which takes their veths and the bridge).

Usage::

    with NetnsLab(4, rate_mbit=100.0) as lab:
        server = lab.popen(1, [sys.executable, "-m", "some.server", "--listen", lab.address(1)])
        lab.run(0, ["ping", "-c", "1", lab.address(1)])

    python -m simulations.labs.netns check [--rate 100] [--seconds 3]   # measures TCP goodput through a link

Needs root, ``ip`` and ``tc``; :func:`unavailable` says why a lab cannot be built here (or None).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from functools import cache
from pathlib import Path
from types import TracebackType
from typing import Any, Self

REPO_ROOT = Path(__file__).resolve().parents[2]
SUBNET = "198.18.0"  # in 198.18.0.0/15 (RFC 2544 benchmarking range): the only addresses a lab uses
PREFIX_LEN = 24
WIDE_PREFIX_LEN = 15  # ``subnets``: one /24 per peer, all of 198.18.0.0/15 on the bridge
PEER_DEV = "eth0"
BRIDGE = "br0"
IP_TIMEOUT = 20.0  # seconds for one ip/tc command (they take milliseconds; the machine may be loaded)
MAX_PEERS = 250
ALLOWED_CC = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")

# tbf: the bucket must hold a few milliseconds of traffic (a few GSO packets of up to 64 KB): a bucket
# of one packet under-shoots the rate badly. The queue behind it (``latency``) is kept short: a long one
# is bufferbloat and delays the acknowledgements of traffic going the other way. Measured with
# `python -m simulations.labs.netns check` (goodput / rate, 2 s of one TCP stream): at 100 Mbit/s any bucket
# from 16 KB to 256 KB gives 0.96 (the rest is TCP/IP headers); at 1 Gbit/s a 16 KB bucket gives 0.75 and
# 64 KB+ 0.95; at 10 Mbit/s a 1 MB bucket over-shoots (1.17). Hence a bucket of a few ms, at least 64 KB.
DEFAULT_BURST_MS = 4.0  # bucket size in milliseconds of the link's rate ...
MIN_BURST_KB = 64.0  # ... but at least this (one full-size GSO packet)
DEFAULT_LATENCY_MS = 20.0

_serial = itertools.count()


def _ip(*args: str, timeout: float = IP_TIMEOUT, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done


def _tc(*args: str) -> None:
    done = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=IP_TIMEOUT)
    if done.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)}: {done.stderr.strip() or done.returncode}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces() -> list[str]:
    done = _ip("netns", "list", check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _kill_inside(name: str) -> None:
    """SIGKILL every process still inside namespace ``name`` (all of them were started by a lab)."""
    done = _ip("netns", "pids", name, check=False)
    for word in done.stdout.split():
        with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
            os.kill(int(word), signal.SIGKILL)


def _delete(name: str) -> None:
    _kill_inside(name)
    _ip("netns", "del", name, check=False)


def remove_stale(prefix: str) -> list[str]:
    """Delete the namespaces of labs with this prefix whose creating process is gone."""
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)-")
    removed = []
    for name in list_namespaces():
        m = pattern.match(name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            _delete(name)
            removed.append(name)
    return removed


@cache
def unavailable() -> str | None:
    """Why a lab cannot be built on this machine (not root, no ``ip``/``tc``, no namespaces), or None."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' not found (install iproute2)"
    name = f"p2pprobe-{os.getpid()}-{next(_serial)}-0"
    try:
        remove_stale("p2pprobe")
        _ip("netns", "add", name)
        _ip("-n", name, "link", "add", "pa", "type", "veth", "peer", "name", "pb")
        _tc(
            "-n",
            name,
            "qdisc",
            "add",
            "dev",
            "pa",
            "root",
            "tbf",
            "rate",
            "10mbit",
            "burst",
            "64kb",
            "latency",
            "20ms",
        )
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        return f"cannot build a network namespace with a shaped veth: {e}"
    finally:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            _delete(name)
    return None


class Lab:
    """What every lab shares: the namespaces it made and the processes it started, all of them gone at
    ``close`` (an exception while building included). Subclasses build in ``_build``."""

    def __init__(self, prefix: str) -> None:
        self.base = f"{prefix}-{os.getpid()}-{next(_serial)}"
        self._created: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []

    def __enter__(self) -> Self:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _build(self) -> None:
        raise NotImplementedError

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)

    def popen_in(self, ns: str, argv: list[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside namespace ``ns`` (killed at the latest when the lab closes)."""
        kw.setdefault("cwd", REPO_ROOT)
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], **kw)
        self._procs.append(proc)
        return proc

    def close(self) -> None:
        """Kill what this lab started and everything left in its namespaces; delete the namespaces."""
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    if _own_group(proc):
                        os.killpg(proc.pid, signal.SIGKILL)  # its children (daemons) too
                    else:
                        proc.kill()
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5.0)
            if proc.stdout is not None:
                proc.stdout.close()
        self._procs.clear()
        for name in reversed(self._created):
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                _delete(name)
        self._created.clear()


class NetnsLab(Lab):
    """N peer namespaces joined by a bridge in a hub namespace; each link shaped in both directions."""

    def __init__(
        self,
        n: int,
        rate_mbit: float = 100.0,
        *,
        rates: list[float | tuple[float, float]] | None = None,
        burst_kb: float | None = None,
        latency_ms: float = DEFAULT_LATENCY_MS,
        prefix: str = "p2pb",
        congestion: str | None = None,
        subnets: bool = False,
    ) -> None:
        """``rates``: per peer, one rate (Mbit/s, both directions) or (upload, download); else ``rate_mbit``.

        ``burst_kb``: the token bucket (default: DEFAULT_BURST_MS of the link's rate, at least
        MIN_BURST_KB); ``latency_ms``: the longest a packet may wait in the shaper's queue.
        ``congestion``: the TCP congestion control inside the peers' namespaces (``cubic``, ``bbr``...;
        default: what a new namespace gets here). It decides how competing flows share a shaped link.
        ``subnets``: each peer in a /24 of its own (the swarm tells peers' origins apart by /24: one
        lab /24 makes every peer one origin, so that excluding one leader's /24 excludes them all).
        """
        if not 1 <= n <= MAX_PEERS:
            raise ValueError(f"1 to {MAX_PEERS} peers")
        if rates is not None and len(rates) != n:
            raise ValueError("one rate per peer")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,11}", prefix):
            raise ValueError("prefix: a short lowercase name")
        super().__init__(prefix)
        self.n = n
        self.prefix = prefix
        self.latency_ms = latency_ms
        self.congestion = congestion
        self.subnets = subnets
        self._allowed_before: str | None = None  # the host's allowed list, to restore (see _allow)
        self._burst_kb = burst_kb
        self.rates: list[tuple[float, float]] = [
            (float(r), float(r)) if isinstance(r, int | float) else (float(r[0]), float(r[1]))
            for r in (rates if rates is not None else [rate_mbit] * n)
        ]
        self.hub = f"{self.base}-hub"

    # ---- set-up and tear-down ----

    def burst_kb(self, rate_mbit: float) -> float:
        if self._burst_kb is not None:
            return self._burst_kb
        return max(MIN_BURST_KB, rate_mbit * 1e6 / 8 * DEFAULT_BURST_MS / 1e3 / 1024)

    def _shape(self, ns: str, dev: str, rate_mbit: float) -> None:
        _tc(
            "-n",
            ns,
            "qdisc",
            "replace",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            f"{rate_mbit * 1000:.0f}kbit",
            "burst",
            f"{self.burst_kb(rate_mbit):.0f}kb",
            "latency",
            f"{self.latency_ms:g}ms",
        )

    def _build(self) -> None:
        remove_stale(self.prefix)
        self._add_ns(self.hub)
        _ip("-n", self.hub, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", self.hub, "link", "set", BRIDGE, "up")
        for i in range(self.n):
            ns = self.netns_name(i)
            self._add_ns(ns)
            hub_dev = f"h{i}"
            _ip("-n", self.hub, "link", "add", hub_dev, "type", "veth", "peer", "name", PEER_DEV, "netns", ns)
            _ip("-n", self.hub, "link", "set", hub_dev, "master", BRIDGE)
            _ip("-n", self.hub, "link", "set", hub_dev, "up")
            length = WIDE_PREFIX_LEN if self.subnets else PREFIX_LEN
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/{length}", "dev", PEER_DEV)
            _ip("-n", ns, "link", "set", PEER_DEV, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if self.congestion:
                self._allow(self.congestion)
                _ip(
                    "netns",
                    "exec",
                    ns,
                    "sysctl",
                    "-q",
                    "-w",
                    f"net.ipv4.tcp_congestion_control={self.congestion}",
                )
            up, down = self.rates[i]
            self._shape(ns, PEER_DEV, up)
            self._shape(self.hub, hub_dev, down)

    def close(self) -> None:
        """As :meth:`Lab.close`, and the host's list of allowed congestion controls is restored."""
        super().close()
        if self._allowed_before is not None:
            with contextlib.suppress(OSError):
                ALLOWED_CC.write_text(self._allowed_before)
            self._allowed_before = None

    def _allow(self, name: str) -> None:
        """A namespace may only pick a congestion control the host allows: allow ``name`` for the lab's
        lifetime (the host's own default is untouched; close restores the list)."""
        allowed = ALLOWED_CC.read_text().split()
        if name not in allowed and self._allowed_before is None:
            self._allowed_before = " ".join(allowed)
            ALLOWED_CC.write_text(" ".join([*allowed, name]))

    # ---- using the lab ----

    def netns_name(self, i: int) -> str:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return f"{self.base}-{i}"

    def address(self, i: int) -> str:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return f"198.18.{i + 1}.1" if self.subnets else f"{SUBNET}.{i + 1}"

    def rate_mbit(self, i: int) -> tuple[float, float]:
        """(upload, download) of peer i's link, Mbit/s."""
        return self.rates[i]

    def command(self, i: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns_name(i), *argv]

    def popen(self, i: int, argv: list[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside peer i's namespace (killed at the latest when the lab closes)."""
        return self.popen_in(self.netns_name(i), argv, **kw)

    def run(
        self, i: int, argv: list[str], *, timeout: float = 60.0, **kw: Any
    ) -> subprocess.CompletedProcess[Any]:
        kw.setdefault("cwd", REPO_ROOT)
        return subprocess.run(self.command(i, argv), timeout=timeout, **kw)

    def link_bytes(self, i: int) -> dict[str, int]:
        """Bytes peer i's interface has sent (``tx``) and received (``rx``), headers included."""
        done = _ip("-n", self.netns_name(i), "-s", "-j", "link", "show", "dev", PEER_DEV)
        stats = json.loads(done.stdout)[0]["stats64"]
        return {"tx": int(stats["tx"]["bytes"]), "rx": int(stats["rx"]["bytes"])}

    def congestion_control(self, i: int) -> str:
        """The TCP congestion control peer i's connections use."""
        done = _ip("netns", "exec", self.netns_name(i), "cat", "/proc/sys/net/ipv4/tcp_congestion_control")
        return done.stdout.strip()

    def exists(self) -> bool:
        names = set(list_namespaces())
        return self.hub in names or any(self.netns_name(i) in names for i in range(self.n))


def _own_group(proc: subprocess.Popen[Any]) -> bool:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        return os.getpgid(proc.pid) == proc.pid
    return False


# ---- measuring a link ---------------------------------------------------------------------------------

# Run with `python -c` inside a namespace: self-contained, every blocking call bounded.
SINK = r"""
import json, socket, sys, time
srv = socket.create_server((sys.argv[1], 0))
srv.settimeout(30.0)
print(json.dumps({"port": srv.getsockname()[1]}), flush=True)
conn, _ = srv.accept()
conn.settimeout(30.0)
buf = bytearray(1 << 20)
total, first, last = 0, None, None
while True:
    k = conn.recv_into(buf)
    if not k:
        break
    last = time.perf_counter()
    if first is None:
        first = last
    total += k
secs = (last - first) if first is not None and last > first else 0.0
print(json.dumps({"bytes": total, "seconds": secs}), flush=True)
"""

SOURCE = r"""
import socket, sys, time
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
sock = socket.create_connection((host, port), timeout=30.0)
chunk = memoryview(bytearray(1 << 18))
end = time.perf_counter() + seconds
while time.perf_counter() < end:
    sock.sendall(chunk)
sock.shutdown(socket.SHUT_WR)
sock.recv(1)
sock.close()
"""


def measure_goodput(lab: NetnsLab, src: int, dst: int, seconds: float = 3.0) -> dict[str, Any]:
    """One TCP stream from peer ``src`` to peer ``dst`` for about ``seconds``; goodput at the receiver."""
    timeout = seconds + 30.0
    sink = lab.popen(dst, [sys.executable, "-c", SINK, lab.address(dst)], stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout is not None
        port = json.loads(read_line(sink, timeout))["port"]
        lab.run(
            src,
            [sys.executable, "-c", SOURCE, lab.address(dst), str(port), str(seconds)],
            timeout=timeout,
            check=True,
            capture_output=True,
        )
        result = json.loads(read_line(sink, timeout))
    finally:
        if sink.poll() is None:
            sink.kill()
        sink.wait(5.0)
        if sink.stdout is not None:
            sink.stdout.close()
    mbit = result["bytes"] * 8 / result["seconds"] / 1e6 if result["seconds"] > 0 else 0.0
    return {"bytes": result["bytes"], "seconds": round(result["seconds"], 3), "goodput_mbit": round(mbit, 2)}


def read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """One line from a child's stdout, or TimeoutError (a reader thread: pipes have no timeouts)."""
    import queue
    import threading

    box: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    stdout = proc.stdout
    threading.Thread(target=lambda: box.put(stdout.readline()), daemon=True).start()
    try:
        line = box.get(timeout=timeout)
    except queue.Empty:
        raise TimeoutError("no answer from the child in time") from None
    if not line:
        raise RuntimeError(f"child exited (code {proc.wait(5.0)}) without answering")
    return line


def check(rate_mbit: float, seconds: float, burst_kb: float | None, latency_ms: float) -> dict[str, Any]:
    began = time.perf_counter()
    with NetnsLab(2, rate_mbit, burst_kb=burst_kb, latency_ms=latency_ms, prefix="p2pcheck") as lab:
        built = time.perf_counter() - began
        result = measure_goodput(lab, 0, 1, seconds)
        burst = lab.burst_kb(rate_mbit)
    return {
        "rate_mbit": rate_mbit,
        "goodput_mbit": result["goodput_mbit"],
        "ratio": round(result["goodput_mbit"] / rate_mbit, 3),
        "seconds": result["seconds"],
        "burst_kb": round(burst, 1),
        "latency_ms": latency_ms,
        "lab_build_s": round(built, 2),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m simulations.labs.netns", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("check", help="build a 2-peer lab and measure TCP goodput through one shaped link")
    p.add_argument("--rate", type=float, default=100.0, help="link rate, Mbit/s (default 100)")
    p.add_argument("--seconds", type=float, default=3.0, help="transfer time (default 3)")
    p.add_argument("--burst-kb", type=float, help="tbf bucket (default: 4 ms of the rate, at least 64 KB)")
    p.add_argument("--latency-ms", type=float, default=DEFAULT_LATENCY_MS, help="tbf queue bound")
    args = parser.parse_args(argv)
    why = unavailable()
    if why:
        print(json.dumps({"status": "unavailable", "reason": why}))
        return 2
    print(json.dumps(check(args.rate, args.seconds, args.burst_kb, args.latency_ms)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
