"""``python -m simulations.scale``: the real node at N peers in one process, in virtual time.

::

    python -m simulations.scale --peers 16,64,256 [--duration 210] [--warmup 90] [--nat-share 0.3]
        [--join-rate R] [--leave-rate R] [--kill-rate R] [--loss P] [--seed S]
    python -m simulations.scale --dht 1000,10000 [--keys 200] [--kill 0.1] [--wave 32]
    python -m simulations.scale --plot-only      # redraw the plots from the JSON reports

Each run's figures go into ``simulations/results/scale-swarm.json`` (training peers) or
``scale-dht.json`` (DHT only), merged with the runs of other sizes already there (a run of the same
size and settings replaces its old entry), with the fits of the per-peer control bytes against N; the
table goes to stderr; each figure is plotted against N on a log axis (``scale-swarm.png``,
``scale-dht.png``) where matplotlib can be imported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

from simulations.benchmarks.environment import REPO_ROOT, environment, write_report
from simulations.scale.model import Churn

RESULTS = REPO_ROOT / "simulations" / "results"
SWARM_JSON = RESULTS / "scale-swarm.json"
DHT_JSON = RESULTS / "scale-dht.json"

SWARM_FIGURES = (
    ("control_bytes_sent_per_peer_per_step", "control bytes sent / peer / step"),
    ("control_bytes_received_per_peer_per_step", "control bytes received / peer / step"),
    ("max_node_control_over_median", "max node's control bytes / median"),
    ("dht_lookup_hops_median", "DHT lookup hops (median)"),
    ("target_to_commit_s_median", "target reached -> committed (s)"),
    ("share_in_committed_round_mean", "share of live peers in a committed round"),
    ("step_rate_per_min", "global steps / minute"),
    ("step_period_s_median", "step period, commit to commit (s, median)"),
    ("sim.wall_s", "simulation wall time (s)"),
    ("sim.peak_rss_mb", "simulation peak RSS (MB)"),
)
DHT_FIGURES = (
    ("hot_key.sent_per_node_per_s_median", "one progress key: B/s sent per node (median)"),
    ("hot_key.max_over_median", "one progress key: max node / median"),
    ("lookup_hops_median", "lookup hops (median)"),
    ("lookup_hops_p99", "lookup hops (p99)"),
    ("get_success", "get success after 10% killed"),
    ("sim.build_wall_s", "build wall time (s)"),
    ("sim.peak_rss_mb", "peak RSS (MB)"),
)


def figure(run: dict[str, Any], key: str) -> Any:
    value: Any = run
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def fits(xs: list[float], ys: list[float]) -> dict[str, Any]:
    """Least squares of y = a + b log2(N) and of log y = log c + p log N (the growth's exponent)."""
    pts = [(x, y) for x, y in zip(xs, ys, strict=True) if x > 0 and y and y > 0]
    if len(pts) < 2:
        return {"points": len(pts)}

    def line(us: list[float], vs: list[float]) -> tuple[float, float]:
        mu, mv = sum(us) / len(us), sum(vs) / len(vs)
        var = sum((u - mu) ** 2 for u in us)
        slope = sum((u - mu) * (v - mv) for u, v in zip(us, vs, strict=True)) / var if var else 0.0
        return mv - slope * mu, slope

    a, b = line([math.log2(x) for x, _ in pts], [y for _, y in pts])
    lc, p = line([math.log(x) for x, _ in pts], [math.log(y) for _, y in pts])
    return {
        "points": len(pts),
        "log_fit": f"{a:.0f} + {b:.0f} * log2(N)",
        "power_fit": f"{math.exp(lc):.0f} * N^{p:.2f}",
        "exponent": round(p, 3),
    }


def region_layout(peers: int, region_size: int) -> tuple[int, int]:
    """The run's (``progress.buckets``, ``progress.regions``) for ``peers`` training peers in regions of
    about ``region_size`` peers: one key and one region up to ``region_size`` peers, else ``peers /
    region_size`` regions of two buckets each (every bucket about half a region), both powers of 2, at
    most ``MAX_BUCKETS`` keys. A series of runs at several N with one ``region_size`` is one setting
    (each region's size, its groups and its reads the same at every N), so its figures are fitted and
    drawn against N as one line."""
    from p2ptrain.config import MAX_BUCKETS

    if region_size < 2 or region_size & (region_size - 1):
        raise ValueError(f"--region-size must be a power of 2 from 2 (got {region_size})")
    regions = 1 << max(0, (peers // region_size).bit_length() - 1) if peers >= region_size else 1
    if regions == 1:
        return 1, 1
    buckets = min(MAX_BUCKETS, 2 * regions)
    return buckets, min(regions, buckets // 2)


def merge(path: Path, runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    old: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        old = json.loads(path.read_text())
    kept = [
        r
        for r in old.get("runs", [])
        if (r.get(key), r.get("settings")) not in {(n.get(key), n.get("settings")) for n in runs}
    ]
    merged = sorted(kept + runs, key=lambda r: (str(r.get("settings")), r.get(key, 0)))
    return {"benchmark": path.stem, "environment": environment(("torch", "trio")), "runs": merged}


def swarm_table(report: dict[str, Any]) -> str:
    rows = [
        "peers  steps/min  ctl-sent/peer/step  ctl-recv  max/median  hops(med,p99)  "
        "target->commit(s)  in-round(mean,min)  forks  wall(s)  RSS(MB)"
    ]
    for r in report["runs"]:
        rows.append(
            f"{r['peers']:5}  {r['step_rate_per_min']:9}  {r['control_bytes_sent_per_peer_per_step']:18}  "
            f"{r['control_bytes_received_per_peer_per_step']:8}  {r['max_node_control_over_median']!s:10}  "
            f"{r['dht_lookup_hops_median']!s:>5},{r['dht_lookup_hops_p99']!s:<6}  "
            f"{r['target_to_commit_s_median']!s:17}  "
            f"{r['share_in_committed_round_mean']!s:>8},{r['share_in_committed_round_min']!s:<9}  "
            f"{r['forks']:5}  {r['sim']['wall_s']:7}  {r['sim']['peak_rss_mb']:7}"
        )
    for r in report["runs"]:
        top = list(r["control_by_method_per_peer_per_step"].items())[:5]
        rows.append(f"  N={r['peers']}: " + ", ".join(f"{m} {v}" for m, v in top))
    if "fit" in report:
        rows.append(f"control bytes / peer / step against N: {report['fit']}")
    for settings, f in report.get("fits", {}).items():
        if settings != "default":
            rows.append(f"  {settings}, N={f['peers']}: per step {f['per_step']}")
    if "fit_per_s" in report:
        per_s = ", ".join(f"N={r['peers']}: {round(per_second(r))}" for r in report["runs"])
        rows.append(f"control bytes / peer / virtual second: {per_s}; against N: {report['fit_per_s']}")
    return "\n".join(rows)


def dht_table(report: dict[str, Any]) -> str:
    rows = ["nodes  store-ok  get-ok(10% killed)  hops(med,p99)  queries  build-wall(s)  wall(s)  RSS(MB)"]
    for r in report["runs"]:
        if "growing_hot_key" in r:  # (a growing swarm's run: its own line below)
            continue
        rows.append(
            f"{r['nodes']:5}  {r['store_success']:8}  {r['get_success']:18}  "
            f"{r['lookup_hops_median']!s:>5},{r['lookup_hops_p99']!s:<6}  {r['lookup_queries_median']!s:7}  "
            f"{r['sim']['build_wall_s']:13}  {r['sim']['wall_s']:7}  {r['sim']['peak_rss_mb']:7}"
        )
    for r in report["runs"]:
        if r.get("hot_key"):
            h = r["hot_key"]
            rows.append(
                f"  N={r['nodes']} ({r.get('settings')}) one progress key: "
                f"{h['records_per_read_median']} records a read, "
                f"{h['sent_per_node_per_s_median']} B/s sent per node (median), "
                f"max {h['sent_per_node_per_s_max']} "
                f"({h['max_over_median']}x): {h['by_method_per_node_per_s']}"
            )
        if r.get("growing_hot_key"):
            g = r["growing_hot_key"]
            rows.append(
                f"  N={r['nodes']} ({r.get('settings')}) joining over {r['joins_over_virtual_s']} s, one key"
                f" written and read from each join: {g['reads']} reads after the joins settled, live"
                f" records held p01 {g['live_records_per_read_share_p01']}, p10"
                f" {g['live_records_per_read_share_p10']}, median {g['live_records_per_read_share_median']};"
                f" {g['reads_missing_live_records']:.1%} of the reads missed some"
            )
    return "\n".join(rows)


def plot(report: dict[str, Any], figures: tuple[tuple[str, str], ...], key: str, path: Path) -> bool:
    """Each figure against N on a log axis; False where matplotlib cannot be imported."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = sorted(report["runs"], key=lambda r: r[key])
    # a line per setting run at three sizes or more (those fitted: a setting tried at one or two sizes is
    # a table row, not a line), labelled by what sets it apart from the defaults
    sizes: dict[str, set[int]] = {}
    for r in runs:
        sizes.setdefault(str(r.get("settings")), set()).add(r[key])
    if any(len(n) >= 3 for n in sizes.values()):
        runs = [r for r in runs if len(sizes[str(r.get("settings"))]) >= 3]
    lines = sorted({str(r.get("settings")) for r in runs})
    cols = 3
    rows = math.ceil(len(figures) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, (name, label) in zip(axes.flat, figures, strict=False):
        for i, settings in enumerate(lines):  # (one colour a line, in every panel)
            pts = [
                (r[key], figure(r, name))
                for r in runs
                if str(r.get("settings")) == settings and isinstance(figure(r, name), int | float)
            ]
            if pts:
                ax.plot(
                    [x for x, _ in pts],
                    [y for _, y in pts],
                    marker="o",
                    color=f"C{i}",
                    label=short_settings(settings),
                )
        ax.set_xscale("log", base=2)
        ax.set_xlabel(key)
        ax.set_title(label, fontsize=9)
        ax.grid(True, alpha=0.3)
    spare = list(axes.flat)[len(figures) :]
    for ax in spare:
        ax.axis("off")
    if len(lines) > 1:  # (the legend in a spare panel, else below them all)
        handles = [plt.Line2D([], [], marker="o", color=f"C{i}") for i in range(len(lines))]
        labels = [short_settings(s) for s in lines]
        (spare[0] if spare else fig).legend(handles, labels, loc="center", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def short_settings(settings: str) -> str:
    """A run's settings less those at their defaults (a line's label)."""
    plain = {"nat=0.0", "churn=0.0/0.0/0.0", "loss=0.0", "bps=10", "group=64"}
    return ",".join(p for p in settings.split(",") if p not in plain) or "default"


def per_second(run: dict[str, Any]) -> float:
    """A run's median control bytes sent per peer per virtual second: the per-step figure times the steps
    in the window over its length (per step, a swarm whose step rate fell shows every byte it sent
    while waiting; per second, what the protocol costs a peer whatever the step rate)."""
    return float(run["control_bytes_sent_per_peer_per_step"]) * run["global_steps"] / run["virtual_s"]


def finish_swarm(report: dict[str, Any]) -> dict[str, Any]:
    for r in report["runs"]:
        r["control_bytes_sent_per_peer_per_s"] = round(per_second(r))
    base = [r for r in report["runs"] if r.get("settings") == "default"]
    if base:
        report["fit"] = fits(
            [float(r["peers"]) for r in base],
            [float(r["control_bytes_sent_per_peer_per_step"]) for r in base],
        )
        report["fit_per_s"] = fits([float(r["peers"]) for r in base], [per_second(r) for r in base])
    # every setting run at three sizes or more (a ``--region-size`` series among them), fitted on its own
    series: dict[str, list[dict[str, Any]]] = {}
    for r in report["runs"]:
        series.setdefault(str(r.get("settings")), []).append(r)
    report["fits"] = {
        settings: {
            "per_step": fits(
                [float(r["peers"]) for r in runs],
                [float(r["control_bytes_sent_per_peer_per_step"]) for r in runs],
            ),
            "per_s": fits([float(r["peers"]) for r in runs], [per_second(r) for r in runs]),
            "peers": sorted(r["peers"] for r in runs),
        }
        for settings, runs in series.items()
        if len({r["peers"] for r in runs}) >= 3
    }
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m simulations.scale", description=__doc__.split("\n")[0])
    ap.add_argument("--peers", default="", help="training peers per run, comma-separated (16,64,256)")
    ap.add_argument("--dht", default="", help="DHT-only runs: nodes, comma-separated (1000,10000)")
    ap.add_argument("--duration", type=float, default=210.0, help="virtual seconds per training run")
    ap.add_argument("--warmup", type=float, default=90.0, help="virtual seconds before measuring")
    ap.add_argument(
        "--settle",
        type=float,
        default=0.0,
        help="virtual seconds the run goes on after --duration, measuring no bytes, so that a step whose"
        " first round landed in the window has its other regions' rounds counted (0: none)",
    )
    ap.add_argument("--batches-per-step", type=int, default=10)
    ap.add_argument("--nat-share", type=float, default=0.0)
    ap.add_argument("--join-rate", type=float, default=0.0, help="joins per peer per hour")
    ap.add_argument("--leave-rate", type=float, default=0.0, help="clean leaves per peer per hour")
    ap.add_argument("--kill-rate", type=float, default=0.0, help="crashes per peer per hour")
    ap.add_argument("--loss", type=float, default=0.0, help="chance a message is retransmitted")
    ap.add_argument("--max-group", type=int, default=64, help="the run's averaging.max_group_size")
    ap.add_argument(
        "--max-inbound", type=int, default=0, help="each host's inbound connection cap (0: the default, 512)"
    )
    ap.add_argument(
        "--width", type=int, default=0, help="the model's hidden units (0: 8 per member of a full group)"
    )
    ap.add_argument("--keys", type=int, default=200)
    ap.add_argument("--kill", type=float, default=0.1, help="share of DHT nodes killed before the reads")
    ap.add_argument(
        "--hot-key",
        type=float,
        default=0.0,
        help="DHT runs: virtual seconds of the one-key progress workload afterwards",
    )
    ap.add_argument(
        "--wave",
        type=int,
        default=32,
        help="DHT runs: nodes that join at once (the build lasts nodes / wave rounds of virtual time, "
        "and the upkeep of every node joined runs meanwhile)",
    )
    ap.add_argument(
        "--grow",
        type=float,
        default=0.0,
        help="DHT runs: waves join this many virtual seconds apart, each node running the one-key workload"
        " from its join on, for --hot-key seconds after the last join (no keys, no kills)",
    )
    ap.add_argument(
        "--partners",
        type=int,
        default=0,
        help="DHT runs: the one-key workload as the progress board runs it, each node with this many"
        " partners it offers its records to; the replicas read once a record's life (0: every read)",
    )
    ap.add_argument("--pulls", action="store_true", help="DHT runs: each read first pulls from a partner")
    ap.add_argument(
        "--hot-warmup",
        type=float,
        default=0.0,
        help="DHT runs: virtual seconds of the one-key workload before its bytes are counted (each node's"
        " first read of a key is a lookup of the whole value)",
    )
    ap.add_argument(
        "--buckets",
        type=int,
        default=1,
        help="the run's progress.buckets (swarm runs); DHT runs: the one-key workload's records spread"
        " over this many keys (a power of 2), all read",
    )
    ap.add_argument(
        "--regions",
        type=int,
        default=1,
        help="the run's progress.regions (swarm runs): regions a step's swarm splits into, each forming"
        " its own group and averaging states (a power of 2 below --buckets)",
    )
    ap.add_argument(
        "--region-size",
        type=int,
        default=0,
        help="split each run into regions of this many peers (buckets and regions chosen per N:"
        " one series of runs at several sizes; replaces --buckets and --regions)",
    )
    ap.add_argument("--tag", default="", help="appended to the run's settings (before/after a change)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot-only", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.verbose:  # the virtual time and the peer on each line; the transport's chatter left out
        from simulations.scale.swarm import LogContext

        handler = logging.StreamHandler()
        handler.addFilter(LogContext())
        handler.setFormatter(logging.Formatter("%(vt)9.3f %(peer)s %(name)s %(message)s"))
        logging.basicConfig(level=logging.INFO, handlers=[handler])
        for quiet in ("p2ptrain.net", "p2ptrain.node", "p2ptrain.dht"):
            logging.getLogger(quiet).setLevel(logging.WARNING)
        # each look's asks and each leader's admissions too: who was in which group, and who came late
        logging.getLogger("p2ptrain.averaging.averager").setLevel(logging.DEBUG)
        # and each look's view of its step as it began (peers, samples, rate: when and why it looked)
        logging.getLogger("p2ptrain.training.collaborative").setLevel(logging.DEBUG)
    else:
        logging.basicConfig(level=logging.CRITICAL)
    if args.plot_only:
        for path, figs, key in ((SWARM_JSON, SWARM_FIGURES, "peers"), (DHT_JSON, DHT_FIGURES, "nodes")):
            with contextlib.suppress(OSError):
                plot(json.loads(path.read_text()), figs, key, path.with_suffix(".png"))
        return 0
    command = "python -m simulations.scale " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.peers:
        from simulations.scale.swarm import SwarmSpec, run

        churn = Churn(args.join_rate, args.leave_rate, args.kill_rate)
        default = (
            not any((args.nat_share, args.join_rate, args.leave_rate, args.kill_rate, args.loss))
            and args.batches_per_step == 10
            and args.max_group == 64
            and not args.width
            and args.buckets == 1
            and args.regions == 1
            and not args.max_inbound
            and not args.region_size
            and not args.settle
        )
        settings = (
            "default"
            if default
            else (
                f"nat={args.nat_share},churn={args.join_rate}/{args.leave_rate}/{args.kill_rate},"
                f"loss={args.loss},bps={args.batches_per_step},group={args.max_group}"
                + (f",width={args.width}" if args.width else "")
                + (f",buckets={args.buckets}" if args.buckets > 1 else "")
                + (f",regions={args.regions}" if args.regions > 1 else "")
                + (f",region-size={args.region_size}" if args.region_size else "")
                + (f",settle={args.settle:g}" if args.settle else "")
                + (f",inbound={args.max_inbound}" if args.max_inbound else "")
            )
        ) + (f",{args.tag}" if args.tag else "")
        if args.region_size and (args.buckets > 1 or args.regions > 1):
            ap.error(
                "--region-size chooses the buckets and regions itself: leave --buckets and --regions out"
            )
        runs = []
        for n in (int(x) for x in args.peers.split(",")):
            buckets, regions = (
                region_layout(n, args.region_size) if args.region_size else (args.buckets, args.regions)
            )
            spec = SwarmSpec(
                peers=n,
                duration=args.duration,
                warmup=args.warmup,
                settle=args.settle,
                batches_per_step=args.batches_per_step,
                nat_share=args.nat_share,
                churn=churn,
                loss=args.loss,
                seed=args.seed,
                max_group=args.max_group,
                width=args.width,
                max_inbound=args.max_inbound,
                buckets=buckets,
                regions=regions,
            )
            t0 = time.perf_counter()
            result = run(spec)
            result.update(settings=settings, command=command, finished=time.strftime("%Y-%m-%d %H:%M"))
            print(f"N={n}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            print(json.dumps(result))
            runs.append(result)
            report = finish_swarm(merge(SWARM_JSON, runs, "peers"))
            if plot(report, SWARM_FIGURES, "peers", SWARM_JSON.with_suffix(".png")):
                report["plot"] = str(SWARM_JSON.with_suffix(".png").relative_to(REPO_ROOT))
            write_report(report, str(SWARM_JSON), swarm_table(report))
    if args.dht:
        from simulations.scale.dht import DhtSpec, run_dht

        runs = []
        for n in (int(x) for x in args.dht.split(",")):
            spec = DhtSpec(
                nodes=n,
                keys=args.keys,
                kill=args.kill,
                wave=args.wave,
                seed=args.seed,
                hot_key=args.hot_key,
                grow=args.grow,
                partners=args.partners,
                pulls=args.pulls,
                buckets=args.buckets,
                hot_warmup=args.hot_warmup,
            )
            result = run_dht(spec)
            parts = [f"hot_key={args.hot_key:g}"] if args.hot_key else []
            parts += [f"wave={args.wave}"] if args.wave != DhtSpec.wave else []
            parts += [f"grow={args.grow:g}"] if args.grow else []
            parts += [f"partners={args.partners}"] if args.partners else []
            parts += ["pulls"] if args.pulls else []
            parts += [f"buckets={args.buckets}"] if args.buckets > 1 else []
            parts += [f"hot_warmup={args.hot_warmup:g}"] if args.hot_warmup else []
            result.update(
                settings=(",".join(parts) or "default") + (f",{args.tag}" if args.tag else ""),
                command=command,
                finished=time.strftime("%Y-%m-%d %H:%M"),
            )
            print(json.dumps(result))
            runs.append(result)
            report = merge(DHT_JSON, runs, "nodes")
            if plot(report, DHT_FIGURES, "nodes", DHT_JSON.with_suffix(".png")):
                report["plot"] = str(DHT_JSON.with_suffix(".png").relative_to(REPO_ROOT))
            write_report(report, str(DHT_JSON), dht_table(report))
    if not (args.peers or args.dht):
        ap.error("say --peers, --dht or --plot-only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
