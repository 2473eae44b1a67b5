"""How long a site's outer step holds rank 0's event loop: the longest task step, in wall seconds.

    python -m simulations.site_loop_hold [--layers 12] [--width 1024] [--ranks 2] [--steps 3]

A site of N ranks (spawned processes, FSDP2 over gloo on the CPU) trains the built-in GPT alone with
the real node (on the in-memory network) and ``CollaborativeOptimizer``: a batch on every rank, then
``opt.step``, which takes the outer step alone once the batch target is reached (ALONE and LAND:
collectives of every rank). A trio instrument on rank 0 records the longest task step during each
``opt.step`` that stepped: how long every other task of the node (heartbeats, DHT answers, RPCs) waited
at most. Once as the code is (the passes over the model in a worker thread) and once with them on the
loop (``SharedState.off_loop`` inline: how it was). Prints one JSON line per way and a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import trio

BATCH, TOKENS = 2, 64


def run(rank: int, world: int, out: str, shape: dict[str, int], steps: int, inline: bool) -> None:
    """One rank (``launch.spawn``); rank 0 writes its figures to ``out``."""
    from p2ptrain import Node, NodeConfig
    from p2ptrain.averaging import AveragerConfig
    from p2ptrain.config import RunConfig
    from p2ptrain.identity import Identity
    from p2ptrain.net import MemoryNetwork
    from p2ptrain.tasks.gpt import GPTConfig
    from p2ptrain.training import CollaborativeOptimizer
    from p2ptrain.training.optimizer.shared_state import SharedState
    from p2ptrain.training.site.commands import Commands
    from p2ptrain.training.site.node import build_rank
    from simulations.benchmarks.loop_hold import Steps
    from simulations.benchmarks.site_build import site_task

    config = (
        RunConfig()
        .replace("training", mode="diloco", target_batch_size=2 * world * BATCH, warmup_steps=0)
        .replace("training", grad_clip=1.0)  # (the clip's norm is a collective of the site)
        .replace("progress", interval=0.1, ttl=1.0)  # (a lone site steps alone soon)
    )
    cfg = GPTConfig(**shape)
    site = build_rank(config, site_task(cfg, True), Commands(rank), world, "cpu")
    g = torch.Generator().manual_seed(rank)

    def compute() -> None:
        tokens = torch.randint(0, cfg.vocab_size, (BATCH, TOKENS), generator=g)
        logits = site.model(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, -2), tokens.flatten()).backward()

    if rank != 0:
        site.follow(compute)
        return
    if inline:  # (how it was: every pass over the model on the event loop)

        async def on_the_loop(self: SharedState, fn: Any, *args: Any) -> None:
            fn(*args)

        SharedState.off_loop = on_the_loop  # type: ignore[method-assign]
    figures: list[dict[str, float]] = []

    async def main() -> None:
        net = MemoryNetwork(seed=1)
        nc = NodeConfig(
            run_id="site-loop-hold",
            listen=(("site", 4000),),
            averaging=AveragerConfig(target_size=64, min_size=1, matchmaking_time=2.0),
        )
        node = Node(Identity.generate(), nc, transport=net.transport("site"), clock=trio.current_time)
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            opt = CollaborativeOptimizer(node, site.model, site.optimizer, config, parts=site.parts())
            await nursery.start(opt.run)
            while len(figures) < steps:
                await trio.to_thread.run_sync(site.train, compute, opt.inner_steps)
                held = Steps()
                trio.lowlevel.add_instrument(held)
                held.began = time.perf_counter()  # (this task's own step, running now, is timed too)
                epoch, start = opt.epoch, time.perf_counter()
                try:
                    await opt.step(world * BATCH)
                    await trio.lowlevel.checkpoint()  # (the step this task is in ends here: timed)
                finally:
                    trio.lowlevel.remove_instrument(held)
                if opt.epoch > epoch:
                    figures.append({"seconds": time.perf_counter() - start, "longest": held.longest})
            await opt.hashed_digest()  # (the last step's hash holds the site's turn until it is done)
            site.stop()
            nursery.cancel_scope.cancel()

    trio.run(main)
    params = sum(p.numel() for p in site.model.parameters())  # (DTensors: the full model's)
    Path(out).write_text(json.dumps({"params": params, "steps": figures}))


def main(argv: list[str] | None = None) -> int:
    from p2ptrain.training.site import launch
    from simulations.benchmarks.site_build import add_shape_arguments, shape_of

    parser = argparse.ArgumentParser(prog="python -m simulations.site_loop_hold", description=__doc__)
    add_shape_arguments(parser)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    shape = shape_of(args, TOKENS)
    rows = []
    with tempfile.TemporaryDirectory(prefix="p2ptrain-site-loop-") as folder:
        for inline in (False, True):
            out = str(Path(folder) / f"{int(inline)}")
            launch.spawn(run, args.ranks, out, shape, args.steps, inline, timeout=3600)
            got = json.loads(Path(out).read_text())
            steps = got["steps"]
            row = {
                "params_m": round(got["params"] / 1e6, 1),
                "ranks": args.ranks,
                "way": "on the event loop (before)" if inline else "in a worker thread",
                "steps": len(steps),
                "step_s_median": round(statistics.median(s["seconds"] for s in steps), 2),
                "loop_held_s_max": round(max(s["longest"] for s in steps), 3),
                "loop_held_s_median": round(statistics.median(s["longest"] for s in steps), 3),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    held_title = "loop held s (max / median)"
    print(f"{'params':>8} {'ranks':>5}  {'way':<28} {'steps':>5} {'step s':>7} {held_title:>27}")
    for r in rows:
        held = f"{r['loop_held_s_max']} / {r['loop_held_s_median']}"
        way, count = r["way"], r["steps"]
        print(f"{r['params_m']:>7}M {r['ranks']:>5}  {way:<28} {count:>5} {r['step_s_median']:>7} {held:>27}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
