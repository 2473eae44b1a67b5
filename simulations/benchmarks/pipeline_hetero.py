"""Pipeline benchmark with heterogeneous peers: do stages rebalance to the best assignment's throughput?

Eight in-process :class:`~p2ptrain.node.Node` s over the in-memory network (``--latency-ms`` links) on
trio's virtual clock serve a 4-stage GPT pipeline. Compute is emulated so that speeds are exact and the
machine's load does not matter: a stage takes ``--cost`` seconds per sample on a 1x peer (the same for
every stage), ``cost / speed`` on a faster one (``StageServer``'s ``cost``); the peers' speeds are
``--speeds`` (default two 4x, three 2x, three 1x). The run starts from a poor assignment (the fastest
peers together on stage 0, the slowest together on the last), and after every step every peer runs
the move rule a node runs (``directory.plan_move``: one peer at a time moves to the stage that limits
the swarm when that raises it by 20%, and downloads that stage's state from its peers, verified per
chunk). Then the best assignment is computed offline from the speeds the peers *measured* (each
peer's samples per second on its stage, times the stage's cost: exhaustive over every assignment that
leaves no stage empty, maximising the slowest stage's capacity), and a second run trains with it fixed.

Reported: the swarm's throughput (samples per virtual second) over the last ``--measure`` steps of
each run and their ratio (target: at least 80%), the moves made and when, the assignment each run
ended with, and the capacity (samples/s of the slowest stage) of the start, the end and the best
assignment.

Usage::

    python -m simulations.bench_pipeline_hetero [--steps 24] [--measure 6] [--cost 0.2]
        [--speeds 4,4,2,2,2,1,1,1] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
import trio
import trio.testing

from p2ptrain import Node, NodeConfig
from p2ptrain.averaging import AveragerConfig
from p2ptrain.averaging.compression import Compression
from p2ptrain.identity import Identity
from p2ptrain.net import LinkProfile, MemoryNetwork
from p2ptrain.pipeline.catchup import behind, download_state
from p2ptrain.pipeline.directory import plan_move
from p2ptrain.pipeline.peer import PipelinePeer
from p2ptrain.pipeline.settings import PipelineSection
from p2ptrain.pipeline.transfer import state_size
from p2ptrain.tasks.gpt import GPTConfig

RESULTS = Path(__file__).resolve().parents[1] / "results"
SETTLE_STEPS = 3  # as the node's trainer: no move for throughput in a peer's first steps on a stage


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--speeds", default="4,4,2,2,2,1,1,1")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--measure", type=int, default=6, help="steps at the end the throughput is measured over")
    ap.add_argument("--cost", type=float, default=0.2, help="seconds per sample of a stage on a 1x peer")
    ap.add_argument("--per-peer", type=int, default=2, help="micro-batches per peer per step")
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--json", default=str(RESULTS / "pipeline_hetero.json"))
    return ap.parse_args(argv)


MODEL = GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=2, n_embd=32)


def capacity(assignment: list[int], speeds: list[float], cost: float, stages: int) -> float:
    """Samples per second of the slowest stage (every stage costs ``cost`` s per sample at speed 1)."""
    per = [0.0] * stages
    for s, v in zip(assignment, speeds, strict=True):
        per[s] += v / cost
    return min(per)


def best_assignment(speeds: list[float], cost: float, stages: int) -> tuple[list[int], float]:
    best: tuple[list[int], float] = ([], 0.0)
    for combo in itertools.product(range(stages), repeat=len(speeds)):
        if len(set(combo)) < stages:
            continue
        c = capacity(list(combo), speeds, cost, stages)
        if c > best[1]:
            best = (list(combo), c)
    return best


async def run(
    args: argparse.Namespace, speeds: list[float], start: list[int], rebalance: bool
) -> dict[str, Any]:
    pipeline = PipelineSection(
        stages=tuple(range(args.stages)), micro_batch=4, compression=Compression.INT8, timeout=30.0
    )
    net = MemoryNetwork(seed=1, default=LinkProfile(latency=args.latency_ms / 1000))
    avg = AveragerConfig(target_size=8, min_size=1, matchmaking_time=1.0)
    top = max(speeds)
    costs = [args.cost / top] * args.stages  # a 1x peer's slowdown is top / 1
    peers: list[PipelinePeer] = []
    moves: list[dict[str, Any]] = []
    walls: list[float] = []
    settled = [SETTLE_STEPS] * len(speeds)
    gen = torch.Generator().manual_seed(0)
    async with trio.open_nursery() as nursery:
        nodes: list[Node] = []
        for i, speed in enumerate(speeds):
            config = NodeConfig(
                run_id="bench-hetero",
                listen=((f"n{i}", 4000),),
                join=(nodes[0].addresses[0],) if nodes else (),
                averaging=avg,
            )
            node = Node(
                Identity.generate(), config, transport=net.transport(f"n{i}"), clock=trio.current_time
            )
            await nursery.start(node.run)
            await node.dht.bootstrapped.wait()
            nodes.append(node)
            peer = PipelinePeer(
                node,
                pipeline,
                MODEL,
                seed=0,
                stage=start[i],
                rng=random.Random(i),
                slowdown=top / speed,
                costs=costs,
            )
            await nursery.start(peer.run)
            peers.append(peer)
        for _ in range(20):
            for p in peers:
                await p.refresh()
            if all(len(p.directory) == len(peers) for p in peers):
                break
        for step in range(args.steps):
            began = trio.current_time()

            async def one(p: PipelinePeer) -> None:
                data = torch.randint(
                    0, MODEL.vocab_size, (args.per_peer, 4, MODEL.block_size + 1), generator=gen
                )
                await p.step([(d[:, :-1], d[:, 1:]) for d in data])

            async with trio.open_nursery() as inner:
                for p in peers:
                    inner.start_soon(one, p)
            walls.append(trio.current_time() - began)
            for p in peers:
                await p.refresh()
            if rebalance:
                for i, p in enumerate(peers):
                    move = plan_move(p.directory, p.node.peer_id, args.stages, p.link_bytes)
                    if move is not None and (p.empty_stages or p.step_number >= settled[i]):
                        target, why = move
                        size = state_size([q for q in p.prepare(target).parameters() if q.requires_grad])
                        snapshot = await download_state(p, target, size)
                        moves.append(
                            {"step": step + 1, "peer": i, "speed": speeds[i], "to": target, "why": why}
                        )
                        print(
                            f"step {step + 1}: peer {i} ({speeds[i]}x) moves to stage {target}: {why}",
                            file=sys.stderr,
                        )
                        await p.join(target, snapshot)
                        settled[i] = p.step_number + SETTLE_STEPS
                        for q in peers:
                            await q.refresh()
                    elif behind(p):
                        size = state_size(p.server.params)  # type: ignore[union-attr]
                        await p.join(p.stage.index, await download_state(p, p.stage.index, size))
            samples = len(peers) * args.per_peer * 4
            print(
                f"step {step + 1}: {walls[-1]:.2f} s, {samples / walls[-1]:.1f} samples/s,"
                f" stages {[p.stage.index for p in peers]}",
                file=sys.stderr,
            )
        assignment = [p.stage.index for p in peers]
        # each peer's measured speed: its samples/s on its stage times the stage's cost at 1x speed
        measured = [p.throughput() * args.cost for p in peers]
        nursery.cancel_scope.cancel()
    samples = len(speeds) * args.per_peer * 4
    tail = walls[-args.measure :]
    return {
        "throughput": samples * len(tail) / sum(tail),
        "assignment": assignment,
        "measured_speeds": [round(m, 3) for m in measured],
        "moves": moves,
        "step_s": [round(w, 3) for w in walls],
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR)
    torch.set_num_threads(1)
    speeds = [float(s) for s in args.speeds.split(",")]
    order = sorted(range(len(speeds)), key=lambda i: -speeds[i])  # fastest first
    start = [0] * len(speeds)
    for rank, i in enumerate(order):  # the fastest together on stage 0, the slowest on the last
        start[i] = min(args.stages - 1, rank * args.stages // len(speeds))
    began = time.perf_counter()
    clock = trio.testing.MockClock(autojump_threshold=0)
    rebalanced = trio.run(run, args, speeds, start, True, clock=clock)
    best, best_capacity = best_assignment(rebalanced["measured_speeds"], args.cost, args.stages)
    print(f"best assignment from the measured speeds: {best}", file=sys.stderr)
    clock = trio.testing.MockClock(autojump_threshold=0)
    fixed = trio.run(run, args, speeds, best, False, clock=clock)
    ratio = rebalanced["throughput"] / fixed["throughput"]
    report = {
        "benchmark": "pipeline-hetero",
        "command": "python -m simulations.bench_pipeline_hetero "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "speeds": speeds,
        "stages": args.stages,
        "cost_s_per_sample_1x": args.cost,
        "steps": args.steps,
        "measured_over_last_steps": args.measure,
        "start_assignment": start,
        "start_capacity": round(capacity(start, speeds, args.cost, args.stages), 2),
        "end_assignment": rebalanced["assignment"],
        "end_capacity": round(capacity(rebalanced["assignment"], speeds, args.cost, args.stages), 2),
        "best_assignment": best,
        "best_capacity": round(capacity(best, speeds, args.cost, args.stages), 2),
        "best_capacity_from_measured": round(best_capacity, 2),
        "moves": rebalanced["moves"],
        "throughput_rebalanced": round(rebalanced["throughput"], 2),
        "throughput_best_fixed": round(fixed["throughput"], 2),
        "ratio": round(ratio, 3),
        "measured_speeds": rebalanced["measured_speeds"],
        "step_s_rebalanced": rebalanced["step_s"],
        "step_s_best_fixed": fixed["step_s"],
        "wall_s": round(time.perf_counter() - began, 1),
    }
    text = json.dumps(report, indent=2)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(text + "\n")
    print(text)
    print(
        f"throughput rebalanced / best fixed: {report['throughput_rebalanced']} /"
        f" {report['throughput_best_fixed']} samples/s = {ratio:.0%} (target >= 80%); capacity start"
        f" {report['start_capacity']}, end {report['end_capacity']}, best {report['best_capacity']}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
