"""Pipeline benchmark: a GPT of 4 stages on 8 peers (2 per stage) over emulated WAN links.

The peers are in-process :class:`~p2ptrain.node.Node` s (host, DHT, averager) over the in-memory
network with every link shaped to ``--rate-mbit`` and ``--latency-ms`` (default 100 Mbit/s, 50 ms), on
the real clock. Each joins in turn and takes the stage the directory says limits the swarm
(``directory.choose_stage``), serves it, and sends its own micro-batches (text windows of the built-in
task) through the pipeline every step; each stage's peers average their gradients with the all-reduce.

Reported:

* **validation loss** after ``--steps`` steps against the same model trained data-parallel on the same
  batches (the reference: the tied, unsplit GPT from the same seed, one AdamW step per step on the mean
  gradient of all peers' batches, which is what synchronous data-parallel peers compute; run in one
  process). Target: within 3%.
* **throughput** against an ideal pipeline of the same peers. The run is on trio's virtual clock: the
  emulated links' latency and bandwidth and the protocol's waits take their time, compute takes none
  and is measured apart in real seconds per stage (so the result does not depend on how busy this
  machine is). The ideal pipeline gives each peer hardware of its own and overlaps perfectly: a step
  takes its slowest stage's compute over that stage's peers. The estimate adds the protocol's time per
  step (no overlap of network and compute: a bound), and ``bubble_bound`` is that time's share. Also,
  per stage, the share of steps in which it was the bottleneck (the most compute seconds).
* **activation bytes per token** through a caller's link (activations and gradients relay through the
  caller), measured (what the callers sent and received: int8, or with ``--rank R`` int8 rank-R
  factors, ``pipeline.rank``), and computed exactly from the wire format for float32, int8 and the
  rank-R code.

``--diloco H``: each stage's peers run DiLoCo (``training.mode = "diloco"``, ``pipeline.local_steps``
H): inner AdamW steps alone, an outer average every H steps; the data-parallel reference stays
synchronous, so the gap is DiLoCo per stage against sync at equal tokens (end on a multiple of H: the
weights evaluated are then the outer step's). The tied embedding's copies are tied at the outer steps;
``--untie`` (an ablation) trains them apart, as the pipeline did before, and ``--tied-outer F`` steps each
copy with F times the two ends' summed pseudo-gradients (the pipeline's 1: their sum).
* the largest share of the parameters one peer holds (target: at most ~30%).

Usage::

    python -m simulations.bench_pipeline [--steps 12] [--layers 8] [--embd 64] [--block 32]
        [--rate-mbit 100] [--latency-ms 50] [--seed 0] [--rounding stochastic|nearest] [--quick]
        [--json PATH]

``--quick``: 3 steps of a smaller model (a smoke run). The JSON report goes to PATH (default
``simulations/results/pipeline.json``; ``-``: stdout), a table to stderr.
"""

from __future__ import annotations

import argparse
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
from p2ptrain.config import DilocoSection
from p2ptrain.identity import Identity
from p2ptrain.net import LinkProfile, MemoryNetwork
from p2ptrain.pipeline import peer as peer_module
from p2ptrain.pipeline.codec import Rounding, Wire, seed_rounding
from p2ptrain.pipeline.peer import PipelinePeer, StepReport
from p2ptrain.pipeline.settings import PipelineSection
from p2ptrain.pipeline.stages import Stage, stage_loss
from p2ptrain.tasks.gpt import GPT, GPTConfig
from p2ptrain.tasks.text import gpt_task

RESULTS = Path(__file__).resolve().parents[1] / "results"
SEED = 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=8)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--per-peer", type=int, default=2, help="micro-batches per peer per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--rate-mbit", type=float, default=100.0)
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument(
        "--matchmaking", type=float, default=1.0, help="seconds a leader gathers its group (default 1)"
    )
    ap.add_argument(
        "--compression",
        default="int8",
        choices=["none", "fp16", "bf16", "int8"],
        help="pipeline.compression: activations and their gradients on the wire",
    )
    ap.add_argument("--rank", type=int, default=0, help="pipeline.rank: low-rank activations (0: int8 alone)")
    ap.add_argument(
        "--rounding",
        default=PipelineSection().rounding.value,
        choices=[r.value for r in Rounding],
        help="pipeline.rounding: how int8 rounds activations and their gradients",
    )
    ap.add_argument(
        "--seed", type=int, default=0, help="the model's initial weights and the peers' data (0: the default)"
    )
    ap.add_argument(
        "--diloco", type=int, default=0, help="DiLoCo per stage with this many local steps (0: sync)"
    )
    ap.add_argument(
        "--untie",
        action="store_true",
        help="ablation: the embedding's two copies trained apart (no tied round), as before they were tied",
    )
    ap.add_argument(
        "--tied-outer",
        type=float,
        default=None,
        help="ablation under --diloco: the share of the two ends' summed pseudo-gradients each copy steps"
        " with (default: the pipeline's, 1: their sum)",
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--json", default=str(RESULTS / "pipeline.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.layers, args.embd, args.block = 3, 4, 32, 16
    return args


def val_loss(stages: list[Stage] | GPT, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    total = 0.0
    with torch.no_grad():
        for x, y in batches:
            if isinstance(stages, GPT):
                logits = stages(x)
            else:
                logits = x
                for stage in stages:
                    logits = stage(logits)
            total += float(stage_loss(logits, y))
    return total / len(batches)


def data_parallel(
    model_cfg: GPTConfig, steps: list[list[tuple[torch.Tensor, torch.Tensor]]], lr: float, seed: int = SEED
) -> GPT:
    """The reference: the unsplit, tied GPT trained on the mean gradient of every peer's batches."""
    torch.manual_seed(seed)
    model = GPT(model_cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for batch in steps:
        x = torch.cat([b[0] for b in batch])
        y = torch.cat([b[1] for b in batch])
        stage_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


async def run_pipeline(args: argparse.Namespace, model_cfg: GPTConfig, task: Any) -> dict[str, Any]:
    bounds = tuple(round(i * args.layers / args.stages) for i in range(args.stages))
    pipeline = PipelineSection(
        stages=bounds,
        micro_batch=args.micro_batch,
        compression=Compression(args.compression),
        timeout=30.0,
        rank=args.rank,
        local_steps=max(1, args.diloco),
        rounding=Rounding(args.rounding),
    )
    seed_rounding(args.seed)
    link = LinkProfile(latency=args.latency_ms / 1000, bandwidth=args.rate_mbit * 1e6 / 8)
    net = MemoryNetwork(seed=1, default=link)
    avg = AveragerConfig(target_size=8, min_size=1, matchmaking_time=args.matchmaking)
    peers: list[PipelinePeer] = []
    # (seed 0: the data every earlier run of this benchmark used)
    iters = [task.batches(1000 + 100 * args.seed + i, args.micro_batch) for i in range(args.peers)]
    batches_per_step: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    reports: list[list[StepReport]] = []
    walls: list[float] = []
    computes: list[list[float]] = []
    async with trio.open_nursery() as nursery:
        nodes: list[Node] = []
        for i in range(args.peers):
            config = NodeConfig(
                run_id="bench-pipeline",
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
                model_cfg,
                seed=args.seed,
                lr=args.lr,
                rng=random.Random(i),
                diloco=DilocoSection() if args.diloco else None,
                local_steps=max(1, args.diloco),
            )
            await nursery.start(peer.run)  # joins: takes the stage that limits the swarm
            peers.append(peer)
        for _ in range(20):  # until every peer's directory lists every peer (a few reads at most)
            for p in peers:
                await p.refresh()
            if all(len(p.directory) == args.peers for p in peers):
                break
        print(f"stages: {[p.stage.index for p in peers]}", file=sys.stderr)
        for step in range(args.steps):
            mine = [[next(iters[i]) for _ in range(args.per_peer)] for i in range(args.peers)]
            batches_per_step.append([b for m in mine for b in m])
            before = [p.server.stats.compute_seconds for p in peers if p.server is not None]
            began = trio.current_time()
            out: list[StepReport | None] = [None] * args.peers

            async def one(i: int, mine: list = mine, out: list = out) -> None:
                out[i] = await peers[i].step(mine[i])

            async with trio.open_nursery() as inner:
                for i in range(args.peers):
                    inner.start_soon(one, i)
            walls.append(trio.current_time() - began)
            after = [p.server.stats.compute_seconds for p in peers if p.server is not None]
            per_stage = [0.0] * args.stages
            for p, a, b in zip(peers, after, before, strict=True):
                per_stage[p.stage.index] += a - b
            computes.append(per_stage)
            reports.append([r for r in out if r is not None])
            losses = [x for r in reports[-1] for x in r.losses]
            print(
                f"step {step + 1}: {walls[-1]:.2f} s, loss {sum(losses) / max(1, len(losses)):.3f}",
                file=sys.stderr,
            )
        stages = [next(p for p in peers if p.stage.index == s).stage for s in range(args.stages)]
        identical = all(
            len({p.weights_digest() for p in peers if p.stage.index == s}) == 1 for s in range(args.stages)
        )
        params = [s.num_parameters() for s in stages]
        # stage 0's embedding and the last stage's head: one tensor held twice (``stagewise.tie_ends``)
        ends = [p.stage.wte if p.stage.is_first else p.stage.lm_head for p in peers]
        copies = [e.weight for e in ends if e is not None]
        tied = all(torch.equal(c, copies[0]) for c in copies)
        nursery.cancel_scope.cancel()
    return {
        "stages": stages,
        "batches": batches_per_step,
        "reports": reports,
        "walls": walls,
        "computes": computes,
        "identical": identical,
        "tied": tied,
        "params": params,
        "bounds": bounds,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.untie:  # (an ablation: no stage holds a tied copy, so no tied round runs)
        peer_module.tied_index = lambda stage: None
    if args.tied_outer is not None:
        peer_module.TIED_OUTER = args.tied_outer
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(relativeCreated)d %(name)s %(message)s",
    )
    torch.set_num_threads(1)
    task = gpt_task(
        n_layer=args.layers, n_head=args.heads, n_embd=args.embd, block_size=args.block, max_bytes=2_000_000
    )
    model_cfg = GPTConfig(block_size=args.block, n_layer=args.layers, n_head=args.heads, n_embd=args.embd)
    started = time.perf_counter()
    # The virtual clock: the emulated links' latency and bandwidth take their time, compute takes none
    # (it is measured apart, in real seconds), so the result does not depend on how busy this machine is.
    run = trio.run(run_pipeline, args, model_cfg, task, clock=trio.testing.MockClock(autojump_threshold=0))
    val = task.validation(16)[:4]
    pipe_loss = val_loss(run["stages"], val)
    ref = data_parallel(model_cfg, run["batches"], args.lr, args.seed)
    dp_loss = val_loss(ref, val)
    samples = sum(len(b) * args.micro_batch for b in run["batches"])
    tokens = samples * args.block
    protocol = sum(run["walls"])  # virtual seconds: the links and the protocol's waits, compute free
    compute = sum(sum(c) for c in run["computes"])  # real seconds of model compute, all stages
    per_stage = [sum(c[s] for c in run["computes"]) for s in range(args.stages)]
    peers_per_stage = args.peers // args.stages
    # each peer on hardware of its own, a perfect pipeline: a step takes its slowest stage's compute
    ideal = sum(max(c[s] / peers_per_stage for s in range(args.stages)) for c in run["computes"])
    bottleneck = [0] * args.stages
    for c in run["computes"]:
        bottleneck[max(range(args.stages), key=lambda s: c[s])] += 1
    sent = sum(r.bytes_sent + r.bytes_received for step in run["reports"] for r in step)
    given_up = sum(r.given_up for step in run["reports"] for r in step)
    shape = (args.micro_batch, args.block, args.embd)
    # Through the caller's link per micro-batch: each boundary's activation comes from one stage and
    # goes to the next, and its gradient likewise back (4 crossings of the caller's link); the token
    # ids go to stage 0 and the targets to the last stage (int32).
    wires = {"none": Wire(Compression.NONE), "int8": Wire(Compression.INT8)}
    if args.rank:
        wires[f"int8+r{args.rank}"] = Wire(Compression.INT8, args.rank)
    per_mb = {
        name: 4 * (args.stages - 1) * wire.size(shape) + 2 * 4 * args.micro_batch * args.block
        for name, wire in wires.items()
    }
    # (tokens go to stage 0 and, as targets, to the last; each boundary carries the activation forward
    # and its gradient back)
    total_params = sum(run["params"])
    report = {
        "benchmark": "pipeline",
        "command": "python -m simulations.bench_pipeline "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "peers": args.peers,
        "stages": args.stages,
        "stage_layers": list(run["bounds"]),
        "model": {
            "n_layer": args.layers,
            "n_embd": args.embd,
            "block_size": args.block,
            "params": total_params,
        },
        "largest_stage_share": round(max(run["params"]) / total_params, 3),
        "link": {"rate_mbit": args.rate_mbit, "latency_ms": args.latency_ms},
        "steps": args.steps,
        "samples": samples,
        "tokens": tokens,
        "val_loss_pipeline": round(pipe_loss, 4),
        "val_loss_data_parallel": round(dp_loss, 4),
        "val_loss_gap_pct": round(100 * (pipe_loss - dp_loss) / dp_loss, 2),
        "stage_weights_identical": run["identical"],
        "embedding_and_head_tied": run["tied"],
        "micro_batches_given_up": given_up,
        "protocol_s_per_step": round(protocol / args.steps, 3),
        "compute_s_per_step_by_stage": [round(c / args.steps, 3) for c in per_stage],
        "compute_s_per_step": round(compute / args.steps, 3),
        "ideal_samples_s": round(samples / ideal, 2),
        "estimated_samples_s": round(samples / (ideal + protocol), 2),
        "bubble_bound": round(protocol / (ideal + protocol), 3),
        "bottleneck_share": [round(b / args.steps, 2) for b in bottleneck],
        "rank": args.rank,
        "rounding": args.rounding,
        "seed": args.seed,
        "diloco_local_steps": args.diloco,
        "untied": args.untie,
        "tied_outer": peer_module.TIED_OUTER,
        "activation_bytes_per_token_measured": round(sent / tokens, 1),
        "activation_bytes_per_token": {
            m: round(b / (args.micro_batch * args.block), 1) for m, b in per_mb.items()
        },
        "wall_s": round(time.perf_counter() - started, 1),
    }
    text = json.dumps(report, indent=2)
    if args.json == "-":
        print(text)
    else:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
        print(text)
    abpt = report["activation_bytes_per_token"]
    rows = [
        (
            "validation loss: pipeline / data-parallel",
            f"{pipe_loss:.4f} / {dp_loss:.4f} ({report['val_loss_gap_pct']:+.2f}%)",
        ),
        (
            "throughput: estimated / ideal (samples/s)",
            f"{report['estimated_samples_s']} / {report['ideal_samples_s']}"
            f" (bubble <= {report['bubble_bound']:.0%})",
        ),
        (
            "protocol s/step (emulated links), compute s/step",
            f"{report['protocol_s_per_step']}, {report['compute_s_per_step']}",
        ),
        ("bottleneck share per stage", str(report["bottleneck_share"])),
        (
            "activation bytes/token: " + " / ".join(abpt) + " (measured)",
            " / ".join(str(v) for v in abpt.values()) + f" ({report['activation_bytes_per_token_measured']})",
        ),
        ("largest stage's share of the parameters", f"{report['largest_stage_share']:.0%}"),
        ("stage peers hold identical weights", str(run["identical"])),
        ("stage 0's embedding == the last stage's head", str(run["tied"])),
    ]
    for k, v in rows:
        print(f"{k:55s} {v}", file=sys.stderr)


if __name__ == "__main__":
    main()
