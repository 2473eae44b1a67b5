"""How long a DiLoCo step is held by keeping its result for peers behind.

    python -m simulations.step_keep [--layers 12] [--width 1024] [--compression int8] [--steps 3]

One peer of the built-in GPT (DiLoCo, the run's ``--compression``) takes ``--steps`` global steps alone
(``CollaborativeOptimizer.solo_step``: the pseudo-gradient, the keeping of the step's result, the outer
step), twice: with the result kept on the step's path (``keep_result`` awaited, as before) and kept in
the background (``buffered``: the step goes on while a worker thread packs and spills it). For each way:
the seconds each ``solo_step`` took (median), and the seconds until every result was kept. Prints one
JSON line per way and a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch
import trio

BATCH, TOKENS = 2, 64


def main(argv: list[str] | None = None) -> int:
    from p2ptrain import Node, NodeConfig
    from p2ptrain.config import RunConfig
    from p2ptrain.identity import Identity
    from p2ptrain.tasks.gpt import GPT, GPTConfig
    from p2ptrain.training import CollaborativeOptimizer
    from p2ptrain.training.optimizer.shared_state import SharedState
    from p2ptrain.training.site.node import inner_optimizer
    from simulations.benchmarks.site_build import add_shape_arguments, shape_of

    parser = argparse.ArgumentParser(prog="python -m simulations.step_keep", description=__doc__)
    add_shape_arguments(parser)
    parser.add_argument("--compression", default="int8")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    cfg = GPTConfig(**shape_of(args, TOKENS))
    config = (
        RunConfig()
        .replace("training", mode="diloco", target_batch_size=1 << 20, warmup_steps=0)
        .replace("averaging", compression=args.compression)
    )
    rows: list[dict[str, Any]] = []
    keep_result = SharedState.keep_result

    for way in ("on the path", "background"):

        async def inline(self: Any, epoch: int, values: Any, *, buffered: bool = False) -> None:
            await keep_result(self, epoch, values)

        SharedState.keep_result = inline if way == "on the path" else keep_result  # type: ignore[method-assign]
        torch.manual_seed(0)
        model = GPT(cfg)
        params = sum(p.numel() for p in model.parameters())
        g = torch.Generator().manual_seed(7)

        async def run(model: torch.nn.Module, g: torch.Generator) -> tuple[list[float], float]:
            node = Node(Identity.generate(), NodeConfig(run_id="step-keep", listen=(("127.0.0.1", 0),)))
            async with trio.open_nursery() as nursery:
                await nursery.start(node.run)
                opt = CollaborativeOptimizer(node, model, inner_optimizer(model, config), config)
                await nursery.start(opt.run)
                steps = []
                began = time.perf_counter()
                for _ in range(args.steps):
                    tokens = torch.randint(0, cfg.vocab_size, (BATCH, TOKENS), generator=g)
                    torch.nn.functional.cross_entropy(
                        model(tokens).flatten(0, -2), tokens.flatten()
                    ).backward()
                    await opt.step(BATCH)
                    start = time.perf_counter()
                    await opt.solo_step()
                    steps.append(time.perf_counter() - start)
                await opt.shared.kept()
                kept_all = time.perf_counter() - began
                assert all(opt.shared.results.get(e) is not None for e in range(args.steps))
                nursery.cancel_scope.cancel()
            return steps, kept_all

        steps, kept_all = trio.run(run, model, g)
        rows.append(
            {
                "params_m": round(params / 1e6, 1),
                "compression": args.compression,
                "way": way,
                "step_s_median": round(statistics.median(steps), 2),
                "steps_s": [round(s, 2) for s in steps],
                "until_all_kept_s": round(kept_all, 2),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    SharedState.keep_result = keep_result  # type: ignore[method-assign]
    head = ("params", "form", "keeping", "step s (med)", "all kept s")
    print("{:>8} {:<6} {:<12} {:>14} {:>12}".format(*head))
    for r in rows:
        print(
            f"{r['params_m']:>7}M {r['compression']:<6} {r['way']:<12} {r['step_s_median']:>14}"
            f" {r['until_all_kept_s']:>12}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
