"""A site joins a running swarm and catches up by downloading its state into its ranks' shards.

Site A (``--ranks-a`` ranks, ``p2ptrain node --shard``) and an unsharded peer B train the built-in GPT
(DiLoCo, int8 rounds) on this host's loopback; once A has taken ``--join-at`` outer steps, site C of
``--ranks-c`` ranks (a different N) joins. C finds itself behind, downloads the swarm's state (the real
download protocol, each chunk verified on arrival at its rank 0 and placed into its ranks' shards),
and trains on (to two steps before A and B stop). Reported: C's download (bytes, seconds, MB/s, from
C's log), the time from C's start to its state landing and to its first round with others (from its
metrics), and whether C's global parameters equal A's at every step both checkpointed
(``sharded_swarm.identical``). The link is the loopback (no rate limit): the download rate here is
what the site's rank 0 and this machine's CPUs allow, not a link's.

Usage::

    python -m simulations.bench_sharded_join [--ranks-a 2] [--ranks-c 3] [--steps 12] [--join-at 2]
        [--layers 2] [--width 128] [--json PATH] [--timeout 1200]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from simulations.benchmarks.environment import environment, write_report
from simulations.benchmarks.sharded_swarm import address, identical, metrics, run_file, start, watch

DEFAULT_JSON = "simulations/results/sharded-join.json"
DOWNLOADED = re.compile(r"downloaded step (\d+)'s state \(([\d.]+) MB.*?in ([\d.]+) s \(([\d.]+) MB/s\)")


def steps_of(folder: Path) -> list[dict[str, Any]]:
    try:
        return [m for m in metrics(folder) if m.get("step")]
    except OSError:
        return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m simulations.bench_sharded_join", description=__doc__)
    ap.add_argument("--ranks-a", type=int, default=2)
    ap.add_argument("--ranks-c", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--join-at", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="samples per batch on each rank")
    ap.add_argument("--target", type=int, default=256, help="samples per outer step")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--json", default=DEFAULT_JSON)
    ap.add_argument("--timeout", type=float, default=1200.0)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sharded-join-") as tmp:
        folder = Path(tmp)
        run = run_file(folder, args, "int8", args.batch, "")
        a, b, c = folder / "a", folder / "b", folder / "c"
        began = time.time()
        procs = {"a": start(a, run, args.steps, args.ranks_a, None, [])}
        join = address(a, args.timeout)
        procs["b"] = start(b, run, args.steps, 1, join, [])
        while max((m["step"] for m in steps_of(a)), default=0) < args.join_at:
            if time.time() - began > args.timeout or any(p.poll() is not None for p in procs.values()):
                for p in procs.values():
                    p.kill()
                raise RuntimeError("the swarm did not reach the join step")
            time.sleep(0.5)
        c_started = time.time()
        # (C stops two steps before A and B: it never waits for peers that stopped)
        procs["c"] = start(c, run, args.steps - 2, args.ranks_c, join, [])
        watch(procs, args.timeout)
        log = (c / "node.log").read_text(errors="replace")
        got = DOWNLOADED.search(log)
        lines = steps_of(c)
        synced = [m for m in lines if m["rounds"]["last"].get("outcome") == "synced"]
        rounds = [m for m in lines if m["rounds"]["last"].get("outcome") == "averaged"]
        report: dict[str, Any] = {
            "environment": environment(("torch",)),
            "command": "python -m simulations.bench_sharded_join "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "ranks": {"a": args.ranks_a, "b": 1, "c": args.ranks_c},
            "model": {"layers": args.layers, "width": args.width, "block": args.block},
            "download": {
                "step": int(got.group(1)),
                "mb": float(got.group(2)),
                "seconds": float(got.group(3)),
                "mb_per_s": float(got.group(4)),
            }
            if got
            else None,
            "c_synced_after_s": round(synced[0]["time"] - c_started, 1) if synced else None,
            "c_first_round_after_s": round(rounds[0]["time"] - c_started, 1) if rounds else None,
            "c_rounds": [
                (m["step"], m["rounds"]["last"].get("outcome"), m["rounds"]["last"].get("contributors"))
                for m in lines
            ],
            "identical_steps_a_c": identical(a, c, args.steps, folder),
            "wall_s": round(time.time() - began, 1),
        }
    d = report["download"] or {}
    same = report["identical_steps_a_c"]
    table = (
        f"site of {args.ranks_c} started when A was on step {args.join_at}: downloaded {d.get('mb')} MB"
        f" in {d.get('seconds')} s ({d.get('mb_per_s')} MB/s);"
        f" synced after {report['c_synced_after_s']} s,"
        f" first round after {report['c_first_round_after_s']} s; identical to site A: {same}"
    )
    write_report(report, args.json, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
