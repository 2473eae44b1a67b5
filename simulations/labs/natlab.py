"""A NAT lab: one public peer and home peers, each behind its own router doing MASQUERADE.

Layout (namespaces this module creates; nothing is added to the host's own namespace)::

    hub:        bridge br0 198.18.0.1/24, the "internet": it routes between every two peers (one hop,
                so a packet's TTL drops on the way, as on the internet)
    public:     eth0 198.18.0.2/24, default route via the hub
    router i:   wan 198.18.0.{10+i}/24 on the bridge, lan 198.19.{i}.1/24; forwards, MASQUERADEs what
                leaves by wan, and forwards nothing new that arrives on wan (FORWARD policy DROP). A SYN
                from a stranger addressed to the router itself: ``router="drop"`` drops it too (an INPUT
                rule: no answer), ``router="reset"`` has no such rule, so the router's own TCP stack
                answers it with a reset (most home routers: OpenWrt's REJECT on its WAN zone, any Linux
                router without an INPUT drop), and that reset also closes the entry the stranger's router
                opened for its own host's attempt (what makes hole punching hard, see ``p2ptrain.net.punch``)
    home i:     eth0 198.19.{i}.2/24, default route via its router

The routers' mappings are endpoint-independent by default (Linux MASQUERADE keeps the source port when
it can); ``symmetric=True`` adds ``--random-fully`` (a fresh port per connection); ``nat=False`` makes
them plain routers (no MASQUERADE, nothing dropped, every LAN routed): the same topology with every peer
public, for comparisons. ``rate_mbit`` shapes every peer's link to the internet (the public peer's, and
each router's wan) with ``tc tbf`` both ways, as ``simulations.labs.netns`` does. Addresses are in
198.18.0.0/15, set aside for benchmarking. Names and cleanup follow ``simulations.labs.netns``.

Usage::

    python -m simulations.natlab relay-join [--symmetric] [--router drop|reset] [--leave S] [--json PATH]

``relay-join``: real ``p2ptrain node`` processes: the public peer P; home 1 joins P and prints the
address others join it with (through a relay: nobody can dial it); home 2 pastes only that address.
It reports whether home 2 got in (connected to home 1 through P, and to the swarm), how long each step
took, and whether home 2's connection to home 1 was then upgraded by a hole punch (``p2ptrain.net.punch``:
expected behind endpoint-independent NATs of either router kind, not behind symmetric ones). With
``--leave S`` the public peer then stops, and it reports whether the two homes stayed connected
directly for S seconds (their status files list each other at the other's router). JSON first, then
a table.

Needs root, ``ip`` and ``iptables``; :func:`unavailable` says why a lab cannot be built (or None).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from simulations.labs.netns import (
    DEFAULT_BURST_MS,
    DEFAULT_LATENCY_MS,
    MIN_BURST_KB,
    Lab,
    _ip,
    _tc,
    read_line,
    remove_stale,
)
from simulations.labs.netns import unavailable as netns_unavailable

PREFIX = "p2pnat"
PUBLIC = "198.18.0.2"
HUB = "198.18.0.1"  # the internet's one router, between every two peers
IPT_TIMEOUT = 20.0
ROUTERS = ("drop", "reset")  # what a router does with a stranger's SYN to itself (see the module docstring)


def unavailable() -> str | None:
    """Why a NAT lab cannot be built here, or None."""
    why = netns_unavailable()
    if why is not None:
        return why
    if shutil.which("iptables") is None:
        return "'iptables' not found (install iptables)"
    return None


def _ipt(ns: str, *args: str) -> None:
    done = subprocess.run(
        ["ip", "netns", "exec", ns, "iptables", *args], capture_output=True, text=True, timeout=IPT_TIMEOUT
    )
    if done.returncode != 0:
        raise RuntimeError(f"iptables {' '.join(args)}: {done.stderr.strip() or done.returncode}")


class NatLab(Lab):
    """``homes`` home peers behind routers and one public peer (see the module docstring)."""

    def __init__(
        self,
        homes: int = 2,
        *,
        symmetric: bool = False,
        nat: bool = True,
        rate_mbit: float | None = None,
        router: str = "drop",
    ) -> None:
        if not 1 <= homes <= 50:
            raise ValueError("homes must be between 1 and 50")
        if router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}")
        self.router = router
        super().__init__(PREFIX)
        self.homes = homes
        self.symmetric = symmetric
        self.nat = nat
        self.rate_mbit = rate_mbit

    def _ns(self, name: str) -> str:
        full = f"{self.base}-{name}"
        self._add_ns(full)
        _ip("-n", full, "link", "set", "lo", "up")
        return full

    def _wire(self, ns: str, dev: str, addr: str) -> None:
        """A veth from the hub's bridge to ``ns`` (``dev`` there, with ``addr``), shaped both ways."""
        hub_dev = f"v{len(self._created)}"
        _ip("-n", self.hub, "link", "add", hub_dev, "type", "veth", "peer", "name", dev, "netns", ns)
        _ip("-n", self.hub, "link", "set", hub_dev, "master", "br0")
        _ip("-n", self.hub, "link", "set", hub_dev, "up")
        # no route of its own to the others on the bridge: everything goes through the hub's router, one
        # hop (as on the internet: a packet's TTL drops between any two peers)
        _ip("-n", ns, "addr", "add", addr, "dev", dev, "noprefixroute")
        _ip("-n", ns, "link", "set", dev, "up")
        _ip("-n", ns, "route", "add", HUB, "dev", dev, "scope", "link")
        _ip("-n", ns, "route", "add", "default", "via", HUB, "dev", dev)
        if self.rate_mbit:
            for where, d in ((ns, dev), (self.hub, hub_dev)):
                burst = max(MIN_BURST_KB, self.rate_mbit * 1e6 / 8 * DEFAULT_BURST_MS / 1e3 / 1024)
                rate = f"{self.rate_mbit * 1000:.0f}kbit"
                _tc(
                    "-n",
                    where,
                    "qdisc",
                    "replace",
                    "dev",
                    d,
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    f"{burst:.0f}kb",
                    "latency",
                    f"{DEFAULT_LATENCY_MS:g}ms",
                )

    def _build(self) -> None:
        remove_stale(PREFIX)
        self.hub = self._ns("hub")
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "addr", "add", f"{HUB}/24", "dev", "br0")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for setting in ("net.ipv4.ip_forward=1", "net.ipv4.conf.all.send_redirects=0"):
            _ip("netns", "exec", self.hub, "sysctl", "-q", "-w", setting)
        _ip("netns", "exec", self.hub, "sysctl", "-q", "-w", "net.ipv4.conf.br0.send_redirects=0")
        self.public = self._ns("public")
        self._wire(self.public, "eth0", f"{PUBLIC}/24")
        self.home_ns: list[str] = []
        for i in range(1, self.homes + 1):
            router, home = self._ns(f"r{i}"), self._ns(f"h{i}")
            self._wire(router, "wan", f"198.18.0.{10 + i}/24")
            _ip("-n", router, "link", "add", "lan", "type", "veth", "peer", "name", "eth0", "netns", home)
            _ip("-n", router, "addr", "add", f"198.19.{i}.1/24", "dev", "lan")
            _ip("-n", router, "link", "set", "lan", "up")
            _ip("-n", home, "addr", "add", f"198.19.{i}.2/24", "dev", "eth0")
            _ip("-n", home, "link", "set", "eth0", "up")
            _ip("-n", home, "route", "add", "default", "via", f"198.19.{i}.1")
            _ip("netns", "exec", router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
            self.home_ns.append(home)
            if not self.nat:
                continue
            masq = ["-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE"]
            _ipt(router, *masq, *(["--random-fully"] if self.symmetric else []))
            _ipt(
                router,
                "-A",
                "FORWARD",
                "-i",
                "wan",
                "-m",
                "conntrack",
                "--ctstate",
                "ESTABLISHED,RELATED",
                "-j",
                "ACCEPT",
            )
            _ipt(router, "-A", "FORWARD", "-i", "lan", "-j", "ACCEPT")
            _ipt(router, "-P", "FORWARD", "DROP")  # nothing unsolicited gets in
            if self.router == "drop":
                # ... nor to the router itself: it does not answer a stranger's SYN with a reset (which
                # would also close the entry a home peer's own attempt left towards that stranger)
                established = ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"]
                _ipt(router, "-A", "INPUT", "-i", "wan", *established)
                _ipt(router, "-A", "INPUT", "-i", "wan", "-j", "DROP")
            # "reset": no rule for what is addressed to the router itself, so its own TCP stack answers a
            # stranger's SYN (to a port it does not listen on) with a reset, as most home routers do
        if not self.nat:  # every LAN routed from everywhere: the homes are public peers
            for i in range(1, self.homes + 1):
                _ip("-n", self.hub, "route", "add", f"198.19.{i}.0/24", "via", f"198.18.0.{10 + i}")

    def router_address(self, i: int) -> str:
        """Router i's address on the internet (1-based): where the world sees home i."""
        return f"198.18.0.{10 + i}"

    def home_address(self, i: int) -> str:
        """Home i's LAN address (1-based): what it sees itself as, and what nobody outside can dial."""
        return f"198.19.{i}.2"


def _node(lab: NatLab, ns: str, workdir: Path, name: str, *extra: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "p2ptrain", "--log-level", "info", "node", "--run-id", "natlab"]
    argv += ["--data-dir", str(workdir / name), *extra]
    with (workdir / f"{name}.log").open("w") as log:  # (the child keeps its own copy of the descriptor)
        return lab.popen_in(ns, argv, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)


def _wait_for(path: Path, text: str, timeout: float) -> float | None:
    """Seconds until ``text`` appears in the file at ``path``, or None after ``timeout``."""
    found = _wait_for_any(path, [text], timeout)
    return None if found is None else found[1]


def _wait_for_any(path: Path, texts: list[str], timeout: float) -> tuple[str, float] | None:
    """The first of ``texts`` to appear in the file at ``path`` and after how many seconds, or None."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        content = path.read_text(errors="replace") if path.exists() else ""
        for text in texts:
            if text in content:
                return text, time.monotonic() - began
        time.sleep(0.2)
    return None


def _status(workdir: Path, name: str) -> dict[str, Any]:
    try:
        out: dict[str, Any] = json.loads((workdir / name / "status.json").read_text())
        return out
    except (OSError, ValueError):
        return {}


def _direct_to(workdir: Path, name: str, peer: str, at: str) -> bool:
    """Does node ``name``'s status file list a connection to ``peer`` (its id) at host ``at`` (not
    through a relay, which would show the relay's address)?"""
    conns = _status(workdir, name).get("connections", [])
    return any(c["peer_id"] == peer and c["remote"].startswith(f"{at}:") for c in conns)


def relay_join(
    workdir: Path,
    timeout: float = 120.0,
    *,
    symmetric: bool = False,
    router: str = "drop",
    leave_s: float = 0.0,
) -> dict[str, Any]:
    """The ``relay-join`` scenario (see the module docstring). ``leave_s``: once the homes punched,
    the public peer stops, and the report says whether the two homes stayed connected directly for
    that many seconds after."""
    nat = "symmetric" if symmetric else "endpoint-independent"
    out: dict[str, Any] = {"scenario": "relay-join", "nat": nat, "router": router, "ok": False}
    with NatLab(2, symmetric=symmetric, router=router) as lab:
        began = time.monotonic()
        public = _node(lab, lab.public, workdir, "public", "--listen", f"{PUBLIC}:4001")
        p_addr = read_line(public, timeout).strip()
        out["public_address"] = p_addr
        status = ["--status-file", str(workdir / "home1" / "status.json")]
        home1 = _node(
            lab, lab.home_ns[0], workdir, "home1", "--listen", "0.0.0.0:4001", "--join", p_addr, *status
        )
        pasted = read_line(home1, timeout).strip()  # printed once nobody could dial it back
        out["home1_address"] = pasted
        out["home1_address_s"] = round(time.monotonic() - began, 1)
        out["home1_relayed"] = "/p2p-circuit/" in pasted and pasted.startswith(f"/ip4/{PUBLIC}/")
        status = ["--status-file", str(workdir / "home2" / "status.json")]
        home2 = _node(
            lab, lab.home_ns[1], workdir, "home2", "--listen", "0.0.0.0:4001", "--join", pasted, *status
        )
        joined = _wait_for(workdir / "home2.log", "joined the swarm through", timeout)
        out["home2_joined_s"] = None if joined is None else round(joined, 1)
        p_id = p_addr.rsplit("/", 1)[-1][:6]
        met = _wait_for(workdir / "home2.log", f"connected to {p_id}", timeout)
        out["home2_met_public_s"] = None if met is None else round(met, 1)
        home2_addr = read_line(home2, timeout).strip()
        out["home2_address"] = home2_addr
        # home2 reached home1 through the relay: the hole punch that follows, and how it went
        punch = _wait_for_any(workdir / "home2.log", ["hole punched", "staying relayed"], timeout)
        how = {"hole punched": "direct", "staying relayed": "relayed"}
        out["home2_punch"] = None if punch is None else how[punch[0]]
        out["home2_punch_s"] = None if punch is None else round(punch[1], 1)
        expected = "relayed" if symmetric else "direct"
        out["ok"] = bool(out["home1_relayed"] and joined and met and out["home2_punch"] == expected)
        if leave_s and out["home2_punch"] == "direct":
            # the public peer (the homes' only relay) stops: are the homes still connected directly?
            ids = {n: _status(workdir, n).get("peer_id", "") for n in ("home1", "home2")}

            def both_direct() -> bool:
                return _direct_to(workdir, "home2", ids["home1"], lab.router_address(1)) and _direct_to(
                    workdir, "home1", ids["home2"], lab.router_address(2)
                )

            # The status files are rewritten every second: the punch is logged before they list the
            # direct connection, and a public peer stopped in between made the first look fail.
            listed = time.monotonic() + 10.0
            while not both_direct() and time.monotonic() < listed:
                time.sleep(0.2)
            public.terminate()
            public.wait(timeout)
            began = time.monotonic()
            stayed = True
            while stayed and time.monotonic() - began < leave_s:
                stayed = both_direct()
                time.sleep(0.5)
            out["homes_direct_after_public_left_s"] = round(time.monotonic() - began, 1) if stayed else None
            out["ok"] = out["ok"] and stayed
        for proc in (home2, home1, public):
            proc.terminate()
    return out


def workdir_for(path: str | None) -> Path | None:
    """The folder a lab run keeps its logs in (``path``, else a new temp folder), or None after saying
    on stderr why no NAT lab can be built here."""
    why = unavailable()
    if why is not None:
        print(f"cannot build a NAT lab here: {why}", file=sys.stderr)
        return None
    import tempfile

    workdir = Path(path or tempfile.mkdtemp(prefix="natlab-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    return workdir


def print_report(report: dict[str, Any], json_path: str | None) -> None:
    """The report as JSON on stdout, and in ``json_path`` if given."""
    text = json.dumps(report, indent=2)
    print(text)
    if json_path:
        Path(json_path).write_text(text + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulations.natlab", description=__doc__.split("\n")[0])
    parser.add_argument("scenario", choices=["relay-join"])
    parser.add_argument("--symmetric", action="store_true", help="routers map each connection anew")
    parser.add_argument(
        "--router",
        choices=ROUTERS,
        default="drop",
        help="what the routers do with a stranger's SYN to themselves: drop it, or answer with a reset",
    )
    parser.add_argument(
        "--leave",
        type=float,
        default=0.0,
        metavar="S",
        help="once the homes punched, stop the public peer and check they stay connected for S seconds",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the JSON report here")
    parser.add_argument("--workdir", metavar="DIR", help="node logs and data (default: a new temp folder)")
    args = parser.parse_args(argv)
    workdir = workdir_for(args.workdir)
    if workdir is None:
        return 2
    report = relay_join(workdir, symmetric=args.symmetric, router=args.router, leave_s=args.leave) | {
        "workdir": str(workdir)
    }
    print_report(report, args.json)
    rows = [(k, str(v)) for k, v in report.items()]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k.ljust(width)}  {v}", file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
