"""The scale simulator against real processes: the same 8-peer swarm, measured both ways.

``python -m simulations.scale`` runs the real node components for N peers in one process on trio's
virtual clock, over the message-level network (see ``simulations/scale``). Whether its figures say
anything about a deployment depends on its agreeing with one where both can run. This benchmark runs

1. **real processes**: ``p2ptrain simulate --peers 8`` (8 ``p2ptrain node`` processes on loopback, the
   real transport with its handshakes, encryption and framing), in sync mode on a tiny GPT whose
   compute is slowed to about a second per batch (``--slowdown``), with the simulator's settings: a
   batch of 8 samples per peer, a target of ``8 x 8 x batches`` samples per step, 3 s of matchmaking;
   once every node has taken a step, the window opens, and each node's wire counters by RPC method
   (``traffic.sent_by_method`` in its status file) and its step are read at the window's start and end;
2. **the simulator**: ``simulations.scale`` at 8 peers with the compute per batch the real peers
   measured (their samples per second), the same target and the same window; with ``--match-rate``
   once more with that compute scaled so that the simulated swarm steps as often as the real one did
   (heartbeats are sent per second and rounds per step, so bytes per step compare only at one step
   rate; the real swarm's rate includes this machine's load, which the virtual clock does not);

and prints the control bytes each peer sent per global step (everything but the methods that carry
the model's values, as the simulator counts them), by method, side by side. Target (issue 51): the
per-peer figures agree within 20%.

Usage::

    python -m simulations.bench_scale_real [--window 120] [--batches 10] [--slowdown 100] [--match-rate]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from simulations.benchmarks.environment import REPO_ROOT, write_report
from simulations.benchmarks.environment import environment as base_environment
from simulations.scale.swarm import BATCH, DATA_METHODS, SwarmSpec
from simulations.scale.swarm import run as run_swarm

MODULE = "simulations.bench_scale_real"
DEFAULT_JSON = "simulations/results/scale-vs-real.json"
PEERS = 8
TARGET = 0.20  # the per-peer control bytes per step agree within this share

RUN_FILE = """\
[run]
id = "scale-vs-real"
seed = 0

[task]
name = "tiny-gpt"

[task.options]
n_layer = 1
n_head = 1
n_embd = 16
block_size = 16
max_bytes = 200000
val_sequences = 16

[training]
mode = "sync"
batch_size = {batch}
target_batch_size = {target}
lr = 0.01
warmup_steps = 0
grad_clip = 0.0
threads = 1

[averaging]
matchmaking_time = 3.0

[checkpoint]
every_steps = 0

[eval]
every_steps = 0
"""


def read_status(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # (not written yet, or being replaced)
    return data


def snapshot(folders: list[Path]) -> dict[int, tuple[Counter[str], int, float]]:
    """Each node's bytes sent by method, its step, and its samples per second, now."""
    out: dict[int, tuple[Counter[str], int, float]] = {}
    for i, folder in enumerate(folders):
        status = read_status(folder / "status.json")
        if status is None:
            continue
        training = status.get("training") or {}
        sent = Counter((status.get("traffic") or {}).get("sent_by_method") or {})
        out[i] = (sent, int(training.get("step") or 0), float(training.get("samples_per_s") or 0.0))
    return out


def control_per_step(
    before: dict[int, tuple[Counter[str], int, float]], after: dict[int, tuple[Counter[str], int, float]]
) -> dict[str, Any]:
    """The window's control bytes per peer per global step (median over peers, and by method)."""
    steps = max(1, max(a[1] for a in after.values()) - max(b[1] for b in before.values()))
    both = [i for i in after if i in before]
    per_peer: list[float] = []
    by_method: Counter[str] = Counter()
    for i in both:
        delta = after[i][0] - before[i][0]
        control = {m: v for m, v in delta.items() if m not in DATA_METHODS}
        by_method.update(control)
        per_peer.append(sum(control.values()) / steps)
    n = max(1, len(both))
    return {
        "global_steps": steps,
        "control_bytes_sent_per_peer_per_step": round(statistics.median(per_peer)) if per_peer else 0,
        "control_by_method_per_peer_per_step": {m: round(v / n / steps) for m, v in by_method.most_common()},
    }


def real_swarm(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    target = PEERS * BATCH * args.batches
    run_file = workdir / "run.toml"
    run_file.write_text(RUN_FILE.format(batch=BATCH, target=target))
    cmd = [sys.executable, "-m", "p2ptrain", "simulate", "--peers", str(PEERS), "--config", str(run_file)]
    cmd += ["--slowdown", ",".join([f"{args.slowdown:g}"] * PEERS), "--workdir", str(workdir), "--no-live"]
    folders = [workdir / f"node{i}" for i in range(PEERS)]
    log = open(workdir / "simulate.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ | {"PYTHONHASHSEED": "0"}
    )
    began = time.monotonic()
    try:
        deadline = began + args.start_timeout
        while True:  # the window opens once every node took a step (starting 8 processes takes a while)
            snap = snapshot(folders)
            if len(snap) == PEERS and min(s[1] for s in snap.values()) >= 1:
                break
            if proc.poll() is not None:
                raise RuntimeError(f"p2ptrain simulate exited with {proc.returncode}: see {workdir}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"not every node took a step within {args.start_timeout:g} s: see {workdir}"
                )
            time.sleep(1.0)
        started = time.monotonic() - began
        time.sleep(args.settle)
        before, t0 = snapshot(folders), time.monotonic()
        time.sleep(args.window)
        after, t1 = snapshot(folders), time.monotonic()
    finally:
        proc.send_signal(signal.SIGINT)  # as a user stops it: the nodes finish their round
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    rates = [a[2] for a in after.values() if a[2] > 0]
    out = control_per_step(before, after)
    out |= {
        "window_s": round(t1 - t0, 1),
        "first_step_after_s": round(started, 1),
        "samples_per_s_per_peer": round(statistics.median(rates), 3) if rates else None,
        "step_rate_per_min": round(out["global_steps"] / (t1 - t0) * 60, 2),
    }
    out["control_bytes_sent_per_peer_per_s"] = round(
        out["control_bytes_sent_per_peer_per_step"] * out["global_steps"] / (t1 - t0)
    )
    return out


def simulated_swarm(args: argparse.Namespace, compute: float, warmup: float) -> dict[str, Any]:
    spec = SwarmSpec(
        peers=PEERS,
        duration=warmup + args.window,
        warmup=warmup,
        batches_per_step=args.batches,
        compute=compute,
        join_spread=args.join_spread,
    )
    result = run_swarm(spec)
    keys = (
        "global_steps",
        "control_bytes_sent_per_peer_per_step",
        "control_by_method_per_peer_per_step",
        "step_rate_per_min",
        "virtual_s",
        "forks",
    )
    out = {k: result[k] for k in keys}
    out["control_bytes_sent_per_peer_per_s"] = round(
        result["control_bytes_sent_per_peer_per_step"] * result["global_steps"] / result["virtual_s"]
    )
    out["compute_s_per_batch"] = round(compute, 3)
    return out


def compare(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, Any]:
    r, s = real["control_bytes_sent_per_peer_per_step"], sim["control_bytes_sent_per_peer_per_step"]
    methods = sorted(
        set(real["control_by_method_per_peer_per_step"]) | set(sim["control_by_method_per_peer_per_step"]),
        key=lambda m: -real["control_by_method_per_peer_per_step"].get(m, 0),
    )
    rows = [
        (
            m,
            real["control_by_method_per_peer_per_step"].get(m, 0),
            sim["control_by_method_per_peer_per_step"].get(m, 0),
        )
        for m in methods
    ]
    ratio = s / r if r else float("nan")
    return {
        "sim_over_real_per_step": round(ratio, 3),
        "sim_over_real_per_s": round(
            sim["control_bytes_sent_per_peer_per_s"] / real["control_bytes_sent_per_peer_per_s"], 3
        )
        if real["control_bytes_sent_per_peer_per_s"]
        else None,
        "within_target": abs(ratio - 1) <= TARGET,
        "by_method": [{"method": m, "real": a, "sim": b} for m, a, b in rows],
    }


def format_table(report: dict[str, Any]) -> str:
    real, sim, cmp = report["real"], report["sim"], report["comparison"]
    lines = [
        f"8 peers, sync, a target of {report['settings']['target_batch_size']} samples per step; "
        f"real: {real['global_steps']} steps in {real['window_s']} s; "
        f"simulated: {sim['global_steps']} steps in {sim['virtual_s']} virtual s",
        f"{'control bytes sent per peer per step':40} {'real':>10} {'simulated':>10}",
        f"{'all control methods (median peer)':40} {real['control_bytes_sent_per_peer_per_step']:>10} "
        f"{sim['control_bytes_sent_per_peer_per_step']:>10}",
    ]
    for row in cmp["by_method"][:14]:
        lines.append(f"  {row['method']:38} {row['real']:>10} {row['sim']:>10}")
    lines.append(
        f"simulated / real: {cmp['sim_over_real_per_step']} per step, "
        f"{cmp['sim_over_real_per_s']} per second "
        f"(target within {TARGET:.0%}: {'met' if cmp['within_target'] else 'not met'})"
    )
    lines.append(f"reproduce: {report['command']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=float, default=120.0, help="seconds measured (default 120)")
    parser.add_argument("--batches", type=int, default=10, help="batches per peer per step (default 10)")
    parser.add_argument("--slowdown", type=float, default=100.0, help="real compute slowdown (default 100)")
    parser.add_argument(
        "--settle", type=float, default=20.0, help="seconds after the first step (default 20)"
    )
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds for every first step")
    parser.add_argument("--join-spread", type=float, default=5.0, help="the simulator's join spread (s)")
    parser.add_argument("--match-rate", action="store_true", help="simulate again at the real step rate")
    parser.add_argument("--workdir", help="the real nodes' folders (default: a temporary folder)")
    parser.add_argument("--json", default=DEFAULT_JSON, metavar="PATH")
    args = parser.parse_args(argv)
    words = [f"python -m {MODULE}", f"--window {args.window:g}", f"--batches {args.batches}"]
    words += [f"--slowdown {args.slowdown:g}"] + (["--match-rate"] if args.match_rate else [])
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="scale-real-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        print("real processes ...", file=sys.stderr, flush=True)
        real = real_swarm(args, workdir)
    print(json.dumps({"real": real}), file=sys.stderr, flush=True)  # (kept should the simulator not finish)
    rate = real["samples_per_s_per_peer"] or 1.0
    compute = BATCH / rate  # the seconds a real peer took per batch, slowdown and machine included
    warmup = args.join_spread + real["first_step_after_s"] + args.settle
    print(f"simulator (compute {compute:.2f} s per batch) ...", file=sys.stderr, flush=True)
    first = sim = simulated_swarm(args, compute, warmup)
    # Heartbeats (progress records, DHT upkeep) are sent per second, rounds per step: bytes per step
    # compare only at the same step rate. The real one includes this machine's load (protocol waits
    # stretched by contention), which the virtual clock does not have: with --match-rate, scale the
    # compute once so the simulated swarm steps as often as the real one did.
    if args.match_rate and real["step_rate_per_min"] and sim["step_rate_per_min"]:
        compute *= sim["step_rate_per_min"] / real["step_rate_per_min"]
        print(f"simulator at the real step rate (compute {compute:.2f} s) ...", file=sys.stderr, flush=True)
        sim = simulated_swarm(args, compute, warmup)
    report: dict[str, Any] = {
        "benchmark": "scale-vs-real",
        "command": " ".join(words),
        "environment": base_environment(("p2ptrain", "torch", "trio")),
        "settings": {"peers": PEERS, "batch": BATCH, "target_batch_size": PEERS * BATCH * args.batches},
        "target": f"the simulator's control bytes per peer per step within {TARGET:.0%} of the real swarm's",
        "real": real,
        "sim": sim,
        "sim_at_measured_compute": first,
        "comparison": compare(real, sim),
        "total_s": round(time.perf_counter() - began, 1),
    }
    json_path = (
        None
        if args.json == "-"
        else str(REPO_ROOT / args.json if not args.json.startswith("/") else args.json)
    )
    write_report(report, json_path, format_table(report))
    return 0 if report["comparison"]["within_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
