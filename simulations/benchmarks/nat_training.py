"""Training behind home NATs in the NAT lab (``simulations.labs.natlab``): round times; the public peer
leaving.

Real ``p2ptrain node`` processes train ``configs/tiny-gpt.toml`` (sync mode: every global step is a
round that averages the swarm's gradients) on links shaped to ``--rate-mbit`` both ways.

``rounds``: one public peer and three home peers, three ways on the same links and topology: every
router a plain router (all public), endpoint-independent NATs (the home peers punch holes to each other,
``p2ptrain.net.punch``), and symmetric NATs (no punching: the home peers stay client-only, the public
peer reduces everything). Per way: the median round time over the rounds after ``--warmup`` seconds,
the share of those rounds each peer reduced part of, and the hole punches the logs report. Target: with
endpoint-independent NATs, round time within 15% of the all-public swarm's, every peer reducing.

``public-leaves``: one public peer and two home peers train; the public peer stops for good. Then
``public-returns``: it stops, stays away ``--away`` seconds, and comes back on the same address. Both
report whether the home peers kept identical parameters on every step they share (the digests in their
metrics files) and, for the return, how long until all three were on one step again.

Usage::

    python -m simulations.nat_scenarios rounds|public-leaves|public-returns [--router R] [--json PATH]
    python -m simulations.nat_scenarios rounds --router reset --homes 2 --no-symmetric [--repeat N]

``--router reset``: home routers that answer a stranger's SYN to themselves with a reset (see
``simulations.labs.natlab``); the default drops it.

JSON first, then a table. Needs what ``simulations.labs.natlab`` needs (root, ``ip``, ``iptables``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from simulations.benchmarks.training_runs import read_jsonl
from simulations.labs.natlab import PUBLIC, ROUTERS, NatLab, print_report, workdir_for
from simulations.labs.netns import read_line
from simulations.replay.report import digest_lines, divergence

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-gpt.toml"
PORT = 4001
START_TIMEOUT = 120.0


class _Node:
    """One node process in a namespace: its folder holds node.log and metrics.jsonl."""

    def __init__(
        self,
        lab: NatLab,
        ns: str,
        folder: Path,
        listen: str,
        join: str | None,
        wait_peers: int = 1,
        resume: bool = False,
    ) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "p2ptrain", "--log-level", "info", "node", "--config", str(CONFIG)]
        argv += ["--run-id", "natlab", "--listen", listen, "--data-dir", str(folder / "data")]
        argv += ["--metrics-file", str(folder / "metrics.jsonl"), "--threads", "1", "--no-live"]
        argv += ["--join", join] if join else []
        argv += ["--wait-peers", str(wait_peers)] if wait_peers > 1 else []
        argv += ["--resume"] if resume else []
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with (folder / "node.log").open("ab") as log:  # (the child keeps its own copy)
            self.proc = lab.popen_in(
                ns, argv, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True, env=env
            )
        self.address = read_line(self.proc, START_TIMEOUT).strip()

    def stop(self, sig: int = signal.SIGTERM, grace: float = 60.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def metrics(self) -> list[dict[str, Any]]:
        """The metrics lines, each with ``t`` (its wall-clock time) as ``simulations.replay.report`` reads
        it."""
        return [m | {"t": m.get("time", 0.0)} for m in read_jsonl(self.folder / "metrics.jsonl")]

    def log_count(self, text: str) -> int:
        path = self.folder / "node.log"
        return path.read_text(errors="replace").count(text) if path.exists() else 0


def _swarm(lab: NatLab, workdir: Path, homes: int) -> list[_Node]:
    """The public peer and the home peers, all starting at step 0 once all are in (a joiner of a running
    sync-mode swarm chases its state on these links: that is not what is measured here)."""
    n = homes + 1
    public = _Node(lab, lab.public, workdir / "public", f"{PUBLIC}:{PORT}", None, n)
    nodes = [public]
    for i in range(homes):
        home = lab.home_ns[i]
        nodes.append(_Node(lab, home, workdir / f"home{i + 1}", f"0.0.0.0:{PORT}", public.address, n))
    return nodes


def _round_stats(nodes: list[_Node], since: float) -> dict[str, Any]:
    """Median round seconds and, per peer, the share of its averaged rounds it reduced part of (each
    round once: a node's last metrics line repeats its last round)."""
    seconds: list[float] = []
    per_peer = []
    for n in nodes:
        by_epoch = {
            m["rounds"]["last"]["epoch"]: m["rounds"]["last"]
            for m in n.metrics()
            if m.get("t", 0) >= since and (m.get("rounds") or {}).get("last", {}).get("outcome") == "averaged"
        }
        rounds = list(by_epoch.values())
        seconds += [r["seconds"] for r in rounds]
        reduced = sum(1 for r in rounds if r.get("reduced", 0) > 0)
        per_peer.append(
            {
                "peer": n.folder.name,
                "rounds": len(rounds),
                "reduced_in": round(reduced / len(rounds), 2) if rounds else None,
                "hole_punches": n.log_count("hole punched"),
            }
        )
    return {
        "median_round_s": round(statistics.median(seconds), 3) if seconds else None,
        "rounds_measured": len(seconds),
        "peers": per_peer,
        "_seconds": seconds,
    }


def rounds(
    workdir: Path,
    *,
    rate_mbit: float,
    seconds: float,
    warmup: float,
    router: str = "drop",
    homes: int = 3,
    symmetric: bool = True,
    repeat: int = 1,
) -> dict[str, Any]:
    """The ``rounds`` scenario (see the module docstring). ``repeat``: the ways run that many times,
    interleaved (all public, NATs, all public, NATs...), their rounds pooled: on a shared machine the
    load drifts, and a way run once after the other may see another load."""
    out: dict[str, Any] = {"scenario": "rounds", "rate_mbit": rate_mbit, "seconds": seconds, "warmup": warmup}
    out |= {"router": router, "homes": homes, "repeat": repeat, "ways": {}}
    ways: list[tuple[str, dict[str, Any]]] = [
        ("all public", {"nat": False}),
        ("endpoint-independent NATs", {"router": router}),
    ]
    ways += [("symmetric NATs", {"symmetric": True, "router": router})] if symmetric else []
    runs: dict[str, list[dict[str, Any]]] = {way: [] for way, _ in ways}
    for r in range(repeat):
        for way, kw in ways:
            with NatLab(homes, rate_mbit=rate_mbit, **kw) as lab:
                folder = workdir / (way.replace(" ", "-") + (f"-{r + 1}" if repeat > 1 else ""))
                nodes = _swarm(lab, folder, homes)
                began = time.time()
                time.sleep(seconds)
                for n in nodes:
                    n.stop()
                runs[way].append(_round_stats(nodes, began + warmup) | {"load": os.getloadavg()[0]})
    for way, stats in runs.items():
        out["ways"][way] = _pooled(stats)
    ways = out["ways"]
    for r in ways.values():
        r.pop("_seconds", None)
    base = ways["all public"]["median_round_s"]
    punched = ways["endpoint-independent NATs"]
    ratio = punched["median_round_s"] / base if base and punched["median_round_s"] else None
    out["punched_vs_public"] = None if ratio is None else round(ratio, 3)
    everyone = all((p["reduced_in"] or 0) >= 0.9 for p in punched["peers"])
    out["ok"] = ratio is not None and ratio <= 1.15 and everyone
    return out


def _pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One way's repeated runs as one: the median of all their rounds, per peer the rounds summed and
    the reduced shares weighted by them; each run's median and the load at its end besides."""
    if len(runs) == 1:
        return runs[0]
    seconds = [s for r in runs for s in r["_seconds"]]
    peers = []
    for i, p in enumerate(runs[0]["peers"]):
        mine = [r["peers"][i] for r in runs]
        n = sum(q["rounds"] for q in mine)
        reduced = sum((q["reduced_in"] or 0) * q["rounds"] for q in mine)
        punches = sum(q["hole_punches"] for q in mine)
        peers.append(
            {
                "peer": p["peer"],
                "rounds": n,
                "reduced_in": round(reduced / n, 2) if n else None,
                "hole_punches": punches,
            }
        )
    return {
        "median_round_s": round(statistics.median(seconds), 3) if seconds else None,
        "rounds_measured": len(seconds),
        "peers": peers,
        "runs": [{"median_round_s": r["median_round_s"], "load": round(r["load"], 1)} for r in runs],
        "_seconds": seconds,
    }


def _shared_steps(nodes: list[_Node], since: float = 0.0) -> dict[str, Any]:
    peers = []
    for i, n in enumerate(nodes):
        metrics = [m for m in n.metrics() if m.get("t", 0) >= since]
        peers.append({"index": i, "metrics": metrics})
    d = divergence(digest_lines(peers))
    return {k: d[k] for k in ("verdict", "ok", "steps_compared")} | {"divergent": len(d["divergences"])}


def _steps(node: _Node) -> int:
    lines = [m for m in node.metrics() if m.get("step") is not None]
    return int(lines[-1]["step"]) if lines else 0


def public_leaves(
    workdir: Path, *, rate_mbit: float, seconds: float, away: float | None, router: str = "drop"
) -> dict[str, Any]:
    """``public-leaves`` (``away`` None) or ``public-returns`` (see the module docstring)."""
    name = "public-leaves" if away is None else "public-returns"
    out: dict[str, Any] = {"scenario": name, "rate_mbit": rate_mbit, "router": router}
    with NatLab(2, rate_mbit=rate_mbit, router=router) as lab:
        nodes = _swarm(lab, workdir, 2)
        public, homes = nodes[0], nodes[1:]
        time.sleep(seconds)
        out["steps_before"] = [_steps(n) for n in nodes]
        public.stop()
        left = time.time()
        time.sleep(away if away is not None else seconds)
        out["steps_while_away"] = [_steps(n) - b for n, b in zip(homes, out["steps_before"][1:], strict=True)]
        if away is not None:
            # the same node again (its identity, its last checkpoint, the peers it trained with)
            back = _Node(lab, lab.public, workdir / "public", f"{PUBLIC}:{PORT}", None, resume=True)
            came = time.time()
            together = None
            while time.time() - came < 120.0:
                steps = [_steps(n) for n in (back, *homes)]
                if min(steps) > 0 and max(steps) - min(steps) <= 1:
                    together = round(time.time() - came, 1)
                    break
                time.sleep(1.0)
            out["one_swarm_again_s"] = together
            time.sleep(30.0)
            nodes = [back, *homes]
        for n in nodes:
            n.stop()
        out["homes_after_leaving"] = _shared_steps(homes, since=left)
        out["all"] = _shared_steps(nodes if away is not None else homes)
        out["ok"] = bool(out["homes_after_leaving"]["ok"]) and bool(out["all"]["ok"])
        if away is not None:
            out["ok"] = out["ok"] and out["one_swarm_again_s"] is not None and out["one_swarm_again_s"] <= 30
    return out


RESULTS = {  # scenario -> its file in simulations/results/
    "rounds": "natlab-rounds.json",
    "public-leaves": "natlab-public-leaves.json",
    "public-returns": "natlab-public-returns.json",
}


def result_rows(results: Path) -> list[dict[str, Any]]:
    """Rows of the README's results table (``simulations.benchmarks.suite``) from the scenarios' JSON
    files."""
    from simulations.benchmarks.suite import not_run, row

    out = []
    for scenario, name in RESULTS.items():
        cmd = f"python -m simulations.nat_scenarios {scenario}"
        path = results / name
        if not path.exists():
            out.append(not_run(f"NAT lab: {scenario}", cmd + " (root)"))
            continue
        d = json.loads(path.read_text())
        if scenario == "rounds":
            ways = d["ways"]
            for way, r in ways.items():
                shares = ", ".join(f"{p['peer']} {p['reduced_in']}" for p in r["peers"])
                target = "within 15% of all public, every peer reducing" if "endpoint" in way else "-"
                met = d["ok"] if "endpoint" in way else None
                metric = f"{way}: median round s (4 peers, {d['rate_mbit']:g} Mbit/s); rounds reduced in"
                window = d["seconds"] - d.get("warmup", 0)
                n = r["rounds_measured"]
                measured = f"{r['median_round_s']} s, {n} results of all peers in {window:g} s ({shares})"
                out.append(row("NAT lab: rounds", metric, measured, None, target, met, cmd))
            continue
        homes = d["homes_after_leaving"]
        metric = (
            f"home peers' steps while the public peer is away: {d['steps_while_away']}; "
            f"{homes['steps_compared']} shared steps compared, {homes['divergent']} divergent"
        )
        target = "one swarm, identical parameters"
        if scenario == "public-returns":
            again, divergent = d["one_swarm_again_s"], d["all"]["divergent"]
            metric += f"; one swarm again after {again} s ({divergent} divergent)"
            target += "; together again within 30 s"
        out.append(row(f"NAT lab: {scenario}", metric, d["all"]["verdict"], None, target, d["ok"], cmd))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m simulations.nat_scenarios", description=__doc__.split("\n")[0]
    )
    parser.add_argument("scenario", choices=["rounds", "public-leaves", "public-returns"])
    parser.add_argument("--rate-mbit", type=float, default=40.0, help="every link, both ways (default 40)")
    parser.add_argument("--seconds", type=float, default=120.0, help="training time per way or phase")
    parser.add_argument("--warmup", type=float, default=40.0, help="rounds before this are not measured")
    parser.add_argument("--away", type=float, default=60.0, help="public-returns: seconds the peer is gone")
    parser.add_argument(
        "--router",
        choices=ROUTERS,
        default="drop",
        help="what the home routers do with a stranger's SYN to themselves: drop it, or answer with a reset",
    )
    parser.add_argument("--homes", type=int, default=3, help="rounds: home peers (default 3)")
    parser.add_argument("--no-symmetric", action="store_true", help="rounds: skip the symmetric-NAT way")
    parser.add_argument(
        "--repeat", type=int, default=1, help="rounds: run the ways this many times, interleaved, pooled"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the JSON report here")
    parser.add_argument("--workdir", metavar="DIR", help="node logs and data (default: a new temp folder)")
    args = parser.parse_args(argv)
    workdir = workdir_for(args.workdir)
    if workdir is None:
        return 2
    if args.scenario == "rounds":
        report = rounds(
            workdir,
            rate_mbit=args.rate_mbit,
            seconds=args.seconds,
            warmup=args.warmup,
            router=args.router,
            homes=args.homes,
            symmetric=not args.no_symmetric,
            repeat=args.repeat,
        )
    else:
        away = args.away if args.scenario == "public-returns" else None
        report = public_leaves(
            workdir, rate_mbit=args.rate_mbit, seconds=args.seconds, away=away, router=args.router
        )
    report["workdir"] = str(workdir)
    print_report(report, args.json)
    _table(report)
    return 0 if report["ok"] else 1


def _table(report: dict[str, Any]) -> None:
    if report["scenario"] == "rounds":
        print(f"{'way':28} {'median round s':>15} {'rounds':>7}  reduced in (share of rounds) / punches")
        for way, r in report["ways"].items():
            peers = ", ".join(f"{p['peer']} {p['reduced_in']}/{p['hole_punches']}" for p in r["peers"])
            print(f"{way:28} {r['median_round_s']!s:>15} {r['rounds_measured']:>7}  {peers}", file=sys.stderr)
        print(f"punched / public round time: {report['punched_vs_public']}", file=sys.stderr)
        return
    for k, v in report.items():
        print(f"{k:22} {v}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
