"""The ``pipeline`` benchmark with real processes over emulated WAN links.

Eight ``p2ptrain node`` processes (the way ``p2ptrain simulate`` starts them: node 0 first, the others
join through it, ``--wait-peers`` so that they take the stages together) train a GPT of 4 stages, 2
peers per stage, for ``--steps`` steps. Every node's access link goes through the userspace WAN switch
(``simulations.labs.wan``: token buckets per peer and direction, one-way latency per access link; no
root, no netem), set so that a path between two peers has ``--rate-mbit`` each way and ``--latency-ms``
one-way (half of it on each end's link).

When every node has stopped, the model is put together from one stage checkpoint per stage (each node
writes its stage's state when it stops) and its validation loss compared with the reference of the
in-process benchmark (:mod:`simulations.benchmarks.pipeline`): the unsplit, tied GPT from the same seed,
trained data-parallel on *the same batches* (each node's data comes from a seed derived from its
peer id and the run's seed, which the benchmark recomputes from the nodes' status files), one AdamW step
per step. Target: within 3% at equal tokens. The comparison holds only if no micro-batch was given up
and every node took every step (both reported).

Also reported: seconds per step (real time: compute on this machine's shared cores plus the links and the
protocol), swarm samples per second, bytes per micro-batch through a caller's link, and whether each
stage's peers ended on the same weights and the embedding's two copies on the same values.

Usage::

    python -m simulations.bench_pipeline_procs [--steps 12] [--peers 8] [--stages 4] [--layers 8]
        [--embd 64] [--rate-mbit 100] [--latency-ms 50] [--json PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from p2ptrain.identity import PeerID
from p2ptrain.pipeline.settings import PipelineSection
from p2ptrain.pipeline.stages import build_stage
from p2ptrain.pipeline.transfer import apply_snapshot, load_checkpoint
from p2ptrain.simulate import SimNode, _metrics, _stop, _wait_address
from p2ptrain.tasks.gpt import GPTConfig
from p2ptrain.tasks.text import gpt_task
from simulations.benchmarks.pipeline import data_parallel, val_loss
from simulations.benchmarks.statesync import host_port
from simulations.labs.wan import LinkProfile, WanSwitch

RESULTS = Path(__file__).resolve().parents[1] / "results"
SEED = 0
LR = 2e-3
MAX_BYTES = 2_000_000

RUN = """
[run]
id = "bench-pipeline-procs"
seed = {seed}

[task]
name = "tiny-gpt"

[task.options]
n_layer = {layers}
n_head = 4
n_embd = {embd}
block_size = {block}
max_bytes = {max_bytes}

[training]
lr = {lr}
batch_size = {batch}

[averaging]
matchmaking_time = {matchmaking}

[checkpoint]
every_steps = 1000       # the stage's state when the node stops: the model is put together from them

[pipeline]
stages = {stages}
micro_batch = {micro_batch}
compression = "{compression}"
timeout = 30.0
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=8)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=64)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--per-peer", type=int, default=2, help="micro-batches per peer per step")
    ap.add_argument("--compression", default="int8", choices=["none", "fp16", "bf16", "int8"])
    ap.add_argument("--rate-mbit", type=float, default=100.0, help="each way, on every path")
    ap.add_argument("--latency-ms", type=float, default=50.0, help="one-way, on every path")
    ap.add_argument(
        "--matchmaking-time",
        type=float,
        default=5.0,
        help="averaging.matchmaking_time: 8 processes on a loaded machine missed 1 s groups",
    )
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds before the run is given up")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=str(RESULTS / "pipeline_procs.json"))
    return ap.parse_args(argv)


def start(
    i: int, folder: Path, config: Path, args: argparse.Namespace, switch: Any, join: str | None
) -> SimNode:
    sub = folder / f"node{i}"
    sub.mkdir(parents=True, exist_ok=True)
    host = switch.source_address(i)
    cmd = [sys.executable, "-m", "p2ptrain", "--log-level", "info", "node", "--listen", f"{host}:0"]
    cmd += ["--announce", switch.announce(i), "--source-address", host, "--data-dir", str(sub)]
    cmd += ["--status-file", str(sub / "status.json"), "--wait-peers", str(args.peers)]
    cmd += ["--metrics-file", str(sub / "metrics.jsonl"), "--threads", "1", "--no-live"]
    cmd += ["--config", str(config), "--max-steps", str(args.steps)]
    cmd += ["--join", join] if join else []
    out = open(sub / "stdout.log", "wb")  # noqa: SIM115 (closed in _stop)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=out, stderr=open(sub / "node.log", "wb"), env=env)  # noqa: SIM115
    return SimNode(i, sub, proc, out)


def listening(node: SimNode, host: str, deadline: float) -> tuple[str, int]:
    """Where node really listens (its status file), for the switch to forward to."""
    while time.monotonic() < deadline:
        if node.proc.poll() is not None:
            raise SystemExit(f"node {node.index} exited: see {node.folder / 'node.log'}")
        for addr in node.read_status().get("listening") or []:
            got = host_port(str(addr))
            if got is not None and got[0] == host:
                return got
        time.sleep(0.2)
    raise SystemExit(f"node {node.index} did not listen in time")


def data_seed(peer_id: str, seed: int) -> int:
    """The node's data seed (``pipeline.trainer``'s ``_data_seed``)."""
    h = hashlib.blake2b(PeerID.from_string(peer_id).digest + str(seed).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") & (2**62 - 1)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    folder = Path(args.workdir or tempfile.mkdtemp(prefix="pipeline-procs-"))
    folder.mkdir(parents=True, exist_ok=True)
    bounds = [round(i * args.layers / args.stages) for i in range(args.stages)]
    config = folder / "run.toml"
    config.write_text(
        RUN.format(
            seed=SEED,
            layers=args.layers,
            embd=args.embd,
            block=args.block,
            max_bytes=MAX_BYTES,
            lr=LR,
            batch=args.per_peer * args.micro_batch,
            stages=bounds,
            micro_batch=args.micro_batch,
            compression=args.compression,
            matchmaking=args.matchmaking_time,
        )
    )
    half = args.latency_ms / 2
    profiles = [LinkProfile(args.rate_mbit, args.rate_mbit, half) for _ in range(args.peers)]
    began = time.time()
    nodes: list[SimNode] = []
    problems: list[str] = []
    with WanSwitch(profiles).in_thread() as switch:
        try:
            deadline = time.monotonic() + 600
            nodes.append(start(0, folder, config, args, switch, None))
            switch.set_upstream(0, listening(nodes[0], switch.source_address(0), deadline))
            join = _wait_address(nodes[0])  # (its announced address, through the switch)
            # the others at once (one by one, a loaded machine took longer than the start's wait)
            nodes += [start(i, folder, config, args, switch, join) for i in range(1, args.peers)]
            for i in range(1, args.peers):
                switch.set_upstream(i, listening(nodes[i], switch.source_address(i), deadline))
            print(f"{args.peers} nodes started in {time.time() - began:.0f} s", file=sys.stderr)
            deadline = time.monotonic() + args.timeout
            while any(n.proc.poll() is None for n in nodes) and time.monotonic() < deadline:
                time.sleep(1.0)
            link_stats = switch.stats()
        finally:
            problems = _stop(nodes)
    report = analyse(nodes, args, bounds, problems, link_stats, time.time() - began)
    text = json.dumps(report, indent=2)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(text + "\n")
    print(text)
    for k in (
        "val_loss_pipeline",
        "val_loss_data_parallel",
        "val_loss_gap_pct",
        "s_per_step",
        "samples_s",
        "bytes_per_micro_batch",
        "micro_batches_given_up",
        "stage_weights_identical",
        "embedding_and_head_tied",
    ):
        print(f"{k:30s} {report[k]}", file=sys.stderr)


def analyse(
    nodes: list[SimNode],
    args: argparse.Namespace,
    bounds: list[int],
    problems: list[str],
    link_stats: dict[str, Any],
    wall: float,
) -> dict[str, Any]:
    task = gpt_task(
        n_layer=args.layers, n_head=4, n_embd=args.embd, block_size=args.block, max_bytes=MAX_BYTES
    )
    model = GPTConfig(block_size=args.block, n_layer=args.layers, n_head=4, n_embd=args.embd)
    pipeline = PipelineSection(stages=tuple(bounds), micro_batch=args.micro_batch)
    statuses = [n.read_status() for n in nodes]
    lines = [[m for m in _metrics(n) if "event" not in m] for n in nodes]
    steps_taken = [max((int(m.get("step", 0)) for m in x), default=0) for x in lines]
    given_up = sum(int((x[-1].get("pipeline") or {}).get("given_up", 0) or 0) for x in lines if x)
    # one checkpoint per stage, the model put together from them
    stages: dict[int, Any] = {}
    copies: list[torch.Tensor] = []
    digests: dict[int, set[bytes]] = {}
    for n in nodes:
        got = load_checkpoint(n.folder / "pipeline" / "stage.ckpt")
        if got is None:
            problems.append(f"node {n.index} left no stage checkpoint")
            continue
        index, snap = got
        stage = build_stage(model, pipeline, index, SEED)
        params = [p for p in stage.parameters() if p.requires_grad]
        apply_snapshot(snap, params, torch.optim.AdamW(params, lr=LR))
        digests.setdefault(index, set()).add(b"".join(p.detach().numpy().tobytes() for p in params))
        tied = stage.wte if stage.is_first else stage.lm_head
        if tied is not None:
            copies.append(tied.weight.detach())
        stages.setdefault(index, stage)
    val = task.validation(16)[:4]
    pipe_loss = val_loss([stages[s] for s in range(args.stages)], val) if len(stages) == args.stages else None
    # the same batches, data-parallel: each node's iterator from its data seed, its micro-batches per step
    iters = [task.batches(data_seed(str(s["peer_id"]), SEED), args.micro_batch) for s in statuses]
    steps = min(steps_taken) if steps_taken else 0
    batches = [[next(it) for it in iters for _ in range(args.per_peer)] for _ in range(steps)]
    ref = data_parallel(model, batches, LR)
    dp_loss = val_loss(ref, val)
    times = [float(m["time"]) for m in lines[0] if "time" in m]
    per_step = (times[-1] - times[0]) / max(1, len(times) - 1) if len(times) > 1 else None
    bpm = [int((x[-1].get("pipeline") or {}).get("bytes_per_micro_batch", 0) or 0) for x in lines if x]
    samples = steps * args.peers * args.per_peer * args.micro_batch
    return {
        "benchmark": "pipeline-procs",
        "command": "python -m simulations.bench_pipeline_procs " + " ".join(sys.argv[1:]),
        "peers": args.peers,
        "stages": args.stages,
        "stage_layers": bounds,
        "model": {"n_layer": args.layers, "n_embd": args.embd, "block_size": args.block},
        "link": {
            "emulation": "userspace WAN switch (simulations.labs.wan)",
            "rate_mbit": args.rate_mbit,
            "latency_ms": args.latency_ms,
        },
        "compression": args.compression,
        "steps": steps,
        "steps_per_node": steps_taken,
        "samples": samples,
        "tokens": samples * args.block,
        "val_loss_pipeline": round(pipe_loss, 4) if pipe_loss is not None else None,
        "val_loss_data_parallel": round(dp_loss, 4),
        "val_loss_gap_pct": round(100 * (pipe_loss - dp_loss) / dp_loss, 2)
        if pipe_loss is not None
        else None,
        "micro_batches_given_up": given_up,
        "stage_weights_identical": {str(k): len(v) == 1 for k, v in sorted(digests.items())},
        "embedding_and_head_tied": all(torch.equal(c, copies[0]) for c in copies) if copies else None,
        "s_per_step": round(per_step, 2) if per_step else None,
        "samples_s": round(args.peers * args.per_peer * args.micro_batch / per_step, 2) if per_step else None,
        "bytes_per_micro_batch": round(sum(bpm) / len(bpm)) if bpm else None,
        "link_bytes_received": [int(p.get("received", 0)) for p in link_stats.get("peers", [])],
        "problems": problems,
        "wall_s": round(wall, 1),
    }


if __name__ == "__main__":
    main()
