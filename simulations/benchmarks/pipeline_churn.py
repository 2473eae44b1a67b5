"""Pipeline churn benchmark: real ``p2ptrain node`` processes train a 4-stage GPT pipeline while a stage
peer is SIGKILLed every ``--every`` seconds and restarted at once.

Eight nodes (two per stage at the start) are started the way ``p2ptrain simulate`` starts them (node 0
first, the others join through its address; each its own folder, so a restarted node keeps its
identity). After ``--warmup`` seconds of training, every ``--every`` seconds one node other than node 0
(chosen in turn) is killed with SIGKILL, in the middle of whatever it was doing, and started again: it
joins the running swarm as a newcomer (the stage that limits the swarm) and downloads that stage's
state from its peers. After ``--duration`` seconds every node is stopped (SIGTERM).

Reported, from the nodes' metrics lines: the steps the swarm took and its loss per step (the mean over
the nodes' smoothed training losses), before the first kill and after; the micro-batches given up
(the callers could not pass them through a stage: the cost of the kills) in all and per kill; the
retries (a micro-batch re-sent to another peer of a stage); the restarted nodes' state downloads; and
whether each stage's peers ended on the same weights.

Usage::

    python -m simulations.bench_pipeline_churn [--duration 210] [--every 30] [--warmup 45]
        [--peers 8] [--layers 8] [--embd 64] [--json PATH]

The JSON report goes to PATH (default ``simulations/results/pipeline_churn.json``), a table to stderr.
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from p2ptrain.simulate import SimNode, SimulationOptions, _metrics, _start, _stop, _wait_address

RESULTS = Path(__file__).resolve().parents[1] / "results"

RUN = """
[run]
id = "bench-pipeline-churn"
seed = 0

[task]
name = "tiny-gpt"

[task.options]
n_layer = {layers}
n_head = 4
n_embd = {embd}
block_size = 32
max_bytes = 1000000

[training]
lr = 0.002
batch_size = 8

[averaging]
matchmaking_time = 1.0

[checkpoint]
every_steps = 2          # each peer's stage state on its disk: what a restart restores an empty stage from

[pipeline]
stages = {stages}
micro_batch = 4
compression = "int8"
timeout = {timeout}
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=8)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=5.0, help="pipeline.timeout")
    ap.add_argument("--duration", type=float, default=210.0, help="seconds of training, from the first step")
    ap.add_argument("--warmup", type=float, default=45.0, help="seconds of training before the first kill")
    ap.add_argument("--every", type=float, default=30.0, help="seconds between kills")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=str(RESULTS / "pipeline_churn.json"))
    return ap.parse_args(argv)


def _step_of(node: SimNode) -> int:
    return int((node.read_status().get("training") or {}).get("step", 0) or 0)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    folder = Path(args.workdir or tempfile.mkdtemp(prefix="pipeline-churn-"))
    folder.mkdir(parents=True, exist_ok=True)
    bounds = [round(i * args.layers / args.stages) for i in range(args.stages)]
    config = folder / "run.toml"
    config.write_text(RUN.format(layers=args.layers, embd=args.embd, stages=bounds, timeout=args.timeout))
    opts = SimulationOptions(peers=args.peers, config=str(config), max_steps=0, duration=1e9, live=False)
    nodes: list[SimNode] = []
    kills: list[dict[str, Any]] = []
    began = time.time()
    try:
        nodes.append(_start(opts, 0, folder, None))
        join = _wait_address(nodes[0])
        nodes += [_start(opts, i, folder, join) for i in range(1, args.peers)]
        print(f"{args.peers} nodes started; waiting for the first step", file=sys.stderr)
        while not all(_step_of(n) >= 1 for n in nodes):
            if any(n.proc.poll() is not None for n in nodes):
                raise SystemExit("a node exited before the first step: see its node.log in " + str(folder))
            time.sleep(1.0)
        trained = time.time()
        print(f"training from {trained - began:.0f} s after the start", file=sys.stderr)
        next_kill = trained + args.warmup
        victim = 1
        while time.time() - trained < args.duration:
            if time.time() >= next_kill:
                node = nodes[victim]
                step = max(_step_of(n) for n in nodes)
                node.proc.send_signal(signal.SIGKILL)
                node.proc.wait()
                node.log_file.close()
                nodes[victim] = _start(opts, victim, folder, join)
                kills.append(
                    {
                        "node": victim,
                        "time": round(time.time() - trained, 1),
                        "swarm_step": step,
                        "at": time.time(),
                    }
                )
                print(f"killed and restarted node {victim} at swarm step {step}", file=sys.stderr)
                victim = victim % (args.peers - 1) + 1
                next_kill += args.every
            time.sleep(0.5)
    finally:
        problems = _stop(nodes)
    report = analyse(nodes, kills, args, problems, time.time() - began)
    text = json.dumps(report, indent=2)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(text + "\n")
    print(text)
    for k in (
        "steps",
        "loss_first",
        "loss_before_first_kill",
        "loss_last",
        "kills",
        "given_up",
        "given_up_per_kill",
    ):
        print(f"{k:30s} {report[k]}", file=sys.stderr)


MARKS = {  # a restarted node's log line -> the phase of its restart it ends
    "process_up_s": "waiting for",
    "directory_read_s": "joining a running swarm",
    "state_downloaded_s": "downloaded stage",
    "serving_s": "training stage",
    "first_step_s": "trainer: step ",
}


def _clock_s(stamp: str) -> float | None:
    try:
        h, m, sec = (int(x) for x in stamp.split(":"))
    except ValueError:
        return None
    return float(h * 3600 + m * 60 + sec)


def restart_timeline(node: SimNode, killed_at: float) -> dict[str, float | None]:
    """Seconds from the kill to each phase of the node's restart, from its log's time stamps (whole
    seconds, local time): the process up (imports, data, the node's start), the directory read, its
    stage's state downloaded, serving, its first step."""
    lt = time.localtime(killed_at)
    base = lt.tm_hour * 3600 + lt.tm_min * 60 + lt.tm_sec + (killed_at % 1)
    out: dict[str, float | None] = dict.fromkeys(MARKS)
    try:
        lines = (node.folder / "node.log").read_text(errors="replace").splitlines()
    except OSError:
        return out
    for line in lines:
        t = _clock_s(line[:8])
        if t is None:
            continue
        for key, mark in MARKS.items():
            if out[key] is None and mark in line:
                out[key] = round((t - base) % 86400, 1)
    return out


def survivor_steps(nodes: list[SimNode], kills: list[dict[str, Any]]) -> list[float]:
    """The seconds node 0 (never killed) took per step, in order (from its metrics lines' times)."""
    times = [float(m["time"]) for m in _metrics(nodes[0]) if "event" not in m and "time" in m]
    return [round(b - a, 1) for a, b in itertools.pairwise(times)]


def analyse(
    nodes: list[SimNode],
    kills: list[dict[str, Any]],
    args: argparse.Namespace,
    problems: list[str],
    wall: float,
) -> dict[str, Any]:
    lines = [[m for m in _metrics(n) if "event" not in m] for n in nodes]
    by_step: dict[int, list[float]] = {}
    for node_lines in lines:
        for m in node_lines:
            if m.get("loss") is not None:
                by_step.setdefault(int(m["step"]), []).append(float(m["loss"]))
    curve = {s: round(sum(v) / len(v), 4) for s, v in sorted(by_step.items())}
    first_kill_step = kills[0]["swarm_step"] if kills else None
    before = [v for s, v in curve.items() if first_kill_step is None or s <= first_kill_step]

    def last(node_lines: list[dict[str, Any]], key: str) -> int:
        # a restarted node counts from zero again: sum over its runs (a drop in the counter starts one)
        total, prev = 0, 0
        for m in node_lines:
            value = int((m.get("pipeline") or {}).get(key, 0) or 0)
            if value < prev:
                total += prev
            prev = value
        return total + prev

    given_up = sum(last(x, "given_up") for x in lines)
    final = [n.read_status() for n in nodes]
    last_step = max(((f.get("training") or {}).get("step", 0) for f in final), default=0)
    digests: dict[Any, set[str]] = {}
    for f in final:
        tr = f.get("training") or {}
        if tr.get("step") == last_step and tr.get("digest"):
            digests.setdefault(tr.get("stage"), set()).add(str(tr["digest"]))
    return {
        "benchmark": "pipeline-churn",
        "command": "python -m simulations.bench_pipeline_churn " + " ".join(sys.argv[1:]),
        "peers": args.peers,
        "stages": args.stages,
        "model": {"n_layer": args.layers, "n_embd": args.embd, "block_size": 32},
        "every_s": args.every,
        "duration_s": args.duration,
        "kills": len(kills),
        "kill_log": [{k: v for k, v in kill.items() if k != "at"} for kill in kills],
        "steps": last_step,
        "loss_first": next(iter(curve.values()), None),
        "loss_before_first_kill": before[-1] if before else None,
        "loss_last": list(curve.values())[-1] if curve else None,
        "loss_curve": curve,
        "restarts": [
            {"node": k["node"], **restart_timeline(nodes[k["node"]], k["at"])} for k in kills if "at" in k
        ],
        "node0_step_s": survivor_steps(nodes, kills),
        "given_up": given_up,
        "given_up_per_kill": round(given_up / len(kills), 2) if kills else None,
        "retries": sum(last(x, "retries") for x in lines),
        "downloads": sum(last(x, "downloads") for x in lines),
        "resyncs": sum(last(x, "resyncs") for x in lines),
        "moves": sum(last(x, "moves") for x in lines),
        "stage_weights_identical_at_end": {str(k): len(v) == 1 for k, v in digests.items()},
        "nodes_on_last_step": sum(1 for f in final if (f.get("training") or {}).get("step") == last_step),
        "problems": problems,
        "wall_s": round(wall, 1),
    }


if __name__ == "__main__":
    main()
