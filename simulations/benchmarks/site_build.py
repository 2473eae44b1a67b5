"""A site's start: each rank's peak memory while it builds its shards of the built-in GPT.

    python -m simulations.site_build [--layers 12] [--width 1024] [--ranks 2 4]

Every rank (spawned processes, gloo on the CPU) builds the model through ``site.node.sharded_model``
twice, in fresh processes: with the task's ``initial_values`` (the meta device, one parameter at a time)
and without them (the model whole once, then sharded: how a task without them is built). Prints one
JSON line per (ranks, way) and a table: the model's fp32 bytes, each rank's shards, and how much its peak
resident memory (VmHWM) grew while it built them.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _no_batches(seed: int, size: int) -> Any:
    return iter(())


def _loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return model(batch).mean()


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """``--layers``, ``--width`` and ``--heads``: the built-in GPT the site benchmarks build."""
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)


def shape_of(args: argparse.Namespace, block_size: int) -> dict[str, int]:
    """The ``GPTConfig`` fields of :func:`add_shape_arguments`' options."""
    return {"n_layer": args.layers, "n_head": args.heads, "n_embd": args.width, "block_size": block_size}


def site_task(cfg: Any, initial_values: bool) -> Any:
    """A task of the built-in GPT of ``cfg`` (no data: only its model is built), with or without the
    GPT's ``initial_values``."""
    from p2ptrain.tasks.gpt import GPT
    from p2ptrain.tasks.task import Task
    from p2ptrain.tasks.text import gpt_initial_values

    return Task(
        name="site-build",
        model=functools.partial(GPT, cfg),
        batches=_no_batches,
        loss=_loss,
        initial_values=gpt_initial_values if initial_values else None,
    )


def build(rank: int, world: int, out: str, initial_values: bool, shape: dict[str, int]) -> None:
    """One rank (``launch.spawn``): builds its shards of the GPT of ``shape`` and writes to ``out.RANK``
    how much its peak memory grew (``grew``) and the bytes of its shards (``held``), as JSON."""
    from torch.distributed.device_mesh import init_device_mesh

    from p2ptrain.tasks.gpt import GPT, GPTConfig
    from p2ptrain.training.site.node import sharded_model
    from p2ptrain.training.site.outer import local_of

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8))  # torch's own first allocations
    before = _peak_rss()
    model = sharded_model(site_task(GPTConfig(**shape), initial_values), 0, mesh, "cpu")
    grew = _peak_rss() - before
    held = sum(local_of(p).numel() * local_of(p).element_size() for p in model.parameters())
    Path(f"{out}.{rank}").write_text(json.dumps({"grew": grew, "held": held}))


def main(argv: list[str] | None = None) -> int:
    from p2ptrain.tasks.gpt import GPTConfig
    from p2ptrain.training.site import launch

    parser = argparse.ArgumentParser(prog="python -m simulations.site_build", description=__doc__)
    add_shape_arguments(parser)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out", default=None, help="a folder for the ranks' numbers")
    args = parser.parse_args(argv)
    folder = args.out or tempfile.mkdtemp(prefix="p2ptrain-site-build-")
    shape = shape_of(args, 128)
    model_bytes = GPTConfig(**shape).num_parameters() * 4
    rows = []
    for world in args.ranks:
        for initial_values in (True, False):
            out = str(Path(folder) / f"{world}-{int(initial_values)}")
            launch.spawn(build, world, out, initial_values, shape, timeout=1200)
            ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
            row = {
                "params_m": round(model_bytes / 4e6, 1),
                "model_mb": round(model_bytes / 1e6),
                "ranks": world,
                "way": "meta, one parameter at a time" if initial_values else "whole, then sharded",
                "shard_mb": max(round(r["held"] / 1e6) for r in ranks),
                "peak_growth_mb": max(round(r["grew"] / 1e6) for r in ranks),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"{'params':>8} {'model MB':>8} {'ranks':>5}  {'way':<30} {'shard MB':>8} {'peak growth MB':>14}")
    for r in rows:
        print(
            f"{r['params_m']:>7}M {r['model_mb']:>8} {r['ranks']:>5}  {r['way']:<30} {r['shard_mb']:>8} "
            f"{r['peak_growth_mb']:>14}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
