"""int8 activations over many seeds: is the pipeline's gap to data-parallel a bias or chaos?

The ``pipeline`` benchmark's swarm, replayed in one process: the same GPT split into the same stages,
the same peers' micro-batches (``--peers`` x ``--per-peer`` of ``--micro-batch`` samples a step), every
stage boundary's activation (forward) and its gradient (backward) passed through the pipeline's own
wire code (``codec.Wire``: encode, then decode, as the stage servers and the caller do), each stage's
gradient the mean over every sample it counted, the tied embedding's two copies given the sum of their
gradients, one AdamW step per stage a step. Only the network is left out (and the order in which two
peers of a stage sum their micro-batches: float rounding). The reference is the benchmark's: the
unsplit tied GPT from the same seed trained data-parallel on the same batches.

Run per seed (the model's initial weights and every peer's data) and per scheme:

- ``none``: float32 on the wire (the floor: float rounding alone);
- ``int8``: one scale per token, rounded to nearest (the pipeline's default before stochastic rounding);
- ``int8-stochastic``: the same grid, rounded at random so that the mean decoded value is the value,
  activations and gradients;
- ``int8-stochastic-gradients``: activations rounded to nearest, their gradients at random;
- ``int8-reversed``: ``int8`` with each step's micro-batches summed in reverse order (the same algorithm:
  only float rounding differs, as between two swarms' runs).

Reported per scheme: each seed's validation-loss gap to data-parallel after ``--steps`` steps, their
mean and standard deviation. A bias shows as a mean away from ``none``'s; chaos as a spread.

Usage::

    python -m simulations.bench_pipeline_rounding [--steps 40] [--seeds 0,1,2,3,4]
        [--schemes none,int8,int8-stochastic] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from p2ptrain.averaging.compression import Compression
from p2ptrain.pipeline import codec
from p2ptrain.pipeline.codec import Rounding, Wire
from p2ptrain.pipeline.settings import PipelineSection
from p2ptrain.pipeline.stages import Stage, split_gpt, stage_loss, tied_index
from p2ptrain.tasks.gpt import GPT, GPTConfig
from p2ptrain.tasks.text import gpt_task

from .pipeline import data_parallel, val_loss

RESULTS = Path(__file__).resolve().parents[1] / "results"
NEAREST = Wire(Compression.INT8, rounding=Rounding.NEAREST)
STOCHASTIC = Wire(Compression.INT8, rounding=Rounding.STOCHASTIC)
# (the wire of the activations, the wire of their gradients)
SCHEMES = {
    "none": (Wire(Compression.NONE), Wire(Compression.NONE)),
    "int8": (NEAREST, NEAREST),
    "int8-stochastic": (STOCHASTIC, STOCHASTIC),
    "int8-stochastic-gradients": (NEAREST, STOCHASTIC),
    "int8-reversed": (NEAREST, NEAREST),  # the micro-batches of a step summed in reverse order
}


class _OnWire(torch.autograd.Function):
    """Identity whose forward value and backward gradient cross the wire (encoded, then decoded)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, wires: tuple[Wire, Wire]) -> torch.Tensor:  # type: ignore[override]
        ctx.wire = wires[1]
        return wires[0].decode(wires[0].encode(x), tuple(x.shape), 1e30, "activation")

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        wire: Wire = ctx.wire
        return wire.decode(wire.encode(g), tuple(g.shape), 1e30, "gradient"), None


def data_seeds(seed: int, peers: int) -> list[int]:
    """Every peer's data seed; seed 0 is the ``pipeline`` benchmark's (1000 + peer)."""
    return [1000 + 100 * seed + i for i in range(peers)]


def train_pipeline(
    cfg: GPTConfig,
    pipeline: PipelineSection,
    wire: tuple[Wire, Wire],
    steps: list[list[tuple[torch.Tensor, torch.Tensor]]],
    seed: int,
    lr: float,
    reverse: bool = False,
) -> list[Stage]:
    torch.manual_seed(seed)
    stages = split_gpt(GPT(cfg), pipeline)
    opts = [torch.optim.AdamW(s.parameters(), lr=lr, weight_decay=0.0) for s in stages]
    first, last = stages[0], stages[-1]
    i0, i1 = tied_index(first), tied_index(last)
    assert i0 is not None and i1 is not None
    for batch in steps:
        samples = 0
        for x, y in reversed(batch) if reverse else batch:  # micro-batch by micro-batch, as servers do
            h: torch.Tensor = x
            for k, stage in enumerate(stages):
                h = stage(h)
                if k < len(stages) - 1:
                    h = _OnWire.apply(h, wire)
            # each server keeps the gradient of its micro-batch's mean loss times its samples
            (stage_loss(h, y) * x.shape[0]).backward()
            samples += x.shape[0]
        for s in stages:
            for p in s.parameters():
                if p.grad is not None:
                    p.grad.div_(samples)
        # the tied embedding: both copies apply the sum of their gradients (``stagewise.tie_ends``)
        a, b = list(first.parameters())[i0], list(last.parameters())[i1]
        assert a.grad is not None and b.grad is not None
        total = a.grad + b.grad
        a.grad, b.grad = total, total.clone()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return stages


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--peers", type=int, default=8)
    ap.add_argument("--per-peer", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=64)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--json", default=str(RESULTS / "pipeline_rounding.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    began = time.perf_counter()
    task = gpt_task(
        n_layer=args.layers, n_head=4, n_embd=args.embd, block_size=args.block, max_bytes=2_000_000
    )
    cfg = GPTConfig(block_size=args.block, n_layer=args.layers, n_head=4, n_embd=args.embd)
    pipeline = PipelineSection(stages=tuple(round(i * args.layers / args.stages) for i in range(args.stages)))
    val = task.validation(16)[:4]
    seeds = [int(v) for v in args.seeds.split(",")]
    schemes = [s for s in args.schemes.split(",") if s]
    gaps: dict[str, list[float]] = {s: [] for s in schemes}
    rows = []
    for seed in seeds:
        iters = [task.batches(d, args.micro_batch) for d in data_seeds(seed, args.peers)]
        steps = [
            [next(iters[i]) for i in range(args.peers) for _ in range(args.per_peer)]
            for _ in range(args.steps)
        ]
        ref = val_loss(data_parallel(cfg, steps, args.lr, seed), val)
        for name in schemes:
            codec.seed_rounding(seed)
            stages = train_pipeline(
                cfg, pipeline, SCHEMES[name], steps, seed, args.lr, name.endswith("reversed")
            )
            loss = val_loss(stages, val)
            gap = 100 * (loss - ref) / ref
            gaps[name].append(gap)
            rows.append(
                {
                    "seed": seed,
                    "scheme": name,
                    "val_loss": round(loss, 4),
                    "data_parallel": round(ref, 4),
                    "gap_pct": round(gap, 2),
                }
            )
            print(f"seed {seed} {name:16s} {loss:.4f} / {ref:.4f} ({gap:+.2f}%)", file=sys.stderr)
    summary = {
        name: {
            "gaps_pct": [round(g, 2) for g in gs],
            "mean_pct": round(statistics.fmean(gs), 2),
            "stdev_pct": round(statistics.stdev(gs), 2) if len(gs) > 1 else 0.0,
        }
        for name, gs in gaps.items()
    }
    report = {
        "benchmark": "pipeline-rounding",
        "command": "python -m simulations.bench_pipeline_rounding "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": {
            "n_layer": args.layers,
            "n_embd": args.embd,
            "block_size": args.block,
            "stages": args.stages,
        },
        "steps": args.steps,
        "samples_per_step": args.peers * args.per_peer * args.micro_batch,
        "seeds": seeds,
        "summary": summary,
        "runs": rows,
        "wall_s": round(time.perf_counter() - began, 1),
    }
    text = json.dumps(report, indent=2)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(text + "\n")
    print(text)
    for name, s in summary.items():
        print(
            f"{name:16s} mean {s['mean_pct']:+.2f}% sd {s['stdev_pct']:.2f}  {s['gaps_pct']}", file=sys.stderr
        )


if __name__ == "__main__":
    main()
