"""A site that is behind: replaying the missed steps' results against downloading the whole state.

    python -m simulations.site_replay [--layers 12] [--width 1024] [--ranks 2] [--behind 1]

A site of N ranks (spawned processes, FSDP2 over gloo on the CPU) and an unsharded peer A of the same
built-in GPT (a process of its own) start from the same weights, each with the real node (TCP on the
loopback: no link limit, the times are the CPU's) and ``CollaborativeOptimizer``. A trains a batch and
steps alone ``--behind`` times; the site catches up by replaying A's kept results (each fetched into a mapped
buffer, landed shard by shard, hashed and checked against A's digest), or, where those results hold as
many bytes as the state or more, by downloading it (the "took" column). A steps as many times again, and
the site catches up by downloading A's state into its shards (replay switched off: how every site
caught up before). For each way: the bytes fetched, the wall seconds from the start of the catch-up to
its landing (fetch, land, hash), and how much rank 0's anonymous memory (heap, not the page cache of
mapped files) grew at most meanwhile, against the model's fp32 bytes. Both ways must end on A's digest.
Prints one JSON line per way and a table; the bytes over a link are those bytes over its rate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import trio

BATCH, TOKENS = 2, 64


def _anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class AnonPeak:
    """The most anonymous memory this process held while it ran (sampled every 5 ms)."""

    def __init__(self) -> None:
        self.base = self.peak = _anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _anon())

    def __enter__(self) -> AnonPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _anon())

    @property
    def grew(self) -> int:
        return self.peak - self.base


def config_of(behind: int) -> Any:
    from p2ptrain.config import RunConfig

    return (
        RunConfig()
        .replace("training", mode="diloco", target_batch_size=1 << 20, warmup_steps=0)
        .replace("statesync", replay_steps=max(4, behind))
    )


def loss(model: torch.nn.Module, cfg: Any, g: torch.Generator) -> None:
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, TOKENS), generator=g)
    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits.flatten(0, -2), tokens.flatten()).backward()


def peer_a(conn: Any, shape: dict[str, int], behind: int) -> None:
    """A (a process of its own): steps alone when told, and says its digests and record."""
    from p2ptrain import Node, NodeConfig
    from p2ptrain.identity import Identity
    from p2ptrain.tasks.gpt import GPT, GPTConfig
    from p2ptrain.training import CollaborativeOptimizer
    from p2ptrain.training.optimizer.progress import PeerProgress
    from p2ptrain.training.site.node import inner_optimizer

    config, cfg = config_of(behind), GPTConfig(**shape)
    torch.manual_seed(config.run.seed)  # (every peer's initial weights, as the site's ranks drew them)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(7)

    async def main() -> None:
        node = Node(Identity.generate(), NodeConfig(run_id="site-replay", listen=(("127.0.0.1", 0),)))
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            opt = CollaborativeOptimizer(node, model, inner_optimizer(model, config), config)
            await nursery.start(opt.run)
            digests = {0: await opt.hashed_digest()}
            while (steps := await trio.to_thread.run_sync(conn.recv)) is not None:
                for _ in range(steps):
                    await trio.to_thread.run_sync(loss, model, cfg, g)
                    await opt.step(BATCH)
                    await opt.solo_step()
                    digests[opt.epoch] = await opt.hashed_digest()
                await opt.shared.kept()  # (a large step's result is kept in the background)
                record = dataclasses.replace(opt.record(), addr=str(node.addresses[0]))
                conn.send((opt.epoch, dict(digests), PeerProgress(node.peer_id, record)))
            nursery.cancel_scope.cancel()

    trio.run(main)


def run(rank: int, world: int, out: str, shape: dict[str, int], behind: int) -> None:
    """One rank (``launch.spawn``); rank 0 starts A and writes its figures to ``out``."""
    import multiprocessing

    from p2ptrain import Node, NodeConfig
    from p2ptrain.identity import Identity
    from p2ptrain.tasks.gpt import GPTConfig
    from p2ptrain.training import CollaborativeOptimizer
    from p2ptrain.training.optimizer.progress import SwarmView
    from p2ptrain.training.site.commands import Commands
    from p2ptrain.training.site.node import build_rank
    from simulations.benchmarks.site_build import site_task

    config, cfg = config_of(behind), GPTConfig(**shape)
    site = build_rank(config, site_task(cfg, True), Commands(rank), world, "cpu")
    g = torch.Generator().manual_seed(rank)
    if rank != 0:
        site.follow(lambda: loss(site.model, cfg, g))
        return
    params = sum(p.numel() for p in site.model.parameters())  # (DTensors: the full model's)
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    a = ctx.Process(target=peer_a, args=(theirs, shape, behind), daemon=True)
    a.start()
    rows: list[dict[str, Any]] = []

    async def ask_a(steps: int) -> Any:
        ours.send(steps)
        return await trio.to_thread.run_sync(ours.recv)

    async def main() -> None:
        node = Node(Identity.generate(), NodeConfig(run_id="site-replay", listen=(("127.0.0.1", 0),)))
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            opt = CollaborativeOptimizer(node, site.model, site.optimizer, config, parts=site.parts())
            await nursery.start(opt.run)
            _, trusted, _ = await ask_a(0)
            if await opt.hashed_digest() != trusted[0]:
                raise RuntimeError("the site and A do not start from the same state")
            shared = opt.shared
            for way in ("replay", "download"):
                epoch_a, trusted, donor = await ask_a(behind)  # A steps alone
                shared.replay_steps = config.statesync.replay_steps if way == "replay" else 0
                view = SwarmView(
                    epoch=opt.epoch,
                    newest=epoch_a,
                    peers=1,
                    quorum=1,
                    others=1,
                    samples=0.0,
                    rate=0.0,
                    target=1,
                    majority=b"",
                    overtaken=True,
                    donors=(donor,),
                    reason=f"behind: A is on step {epoch_a}",
                )
                replayed = shared.replayed_bytes
                start = time.perf_counter()
                with AnonPeak() as anon:
                    shared.start_download(view, trusted.get, lambda e, d=donor: (d,))
                    flight = shared.download
                    assert flight is not None and flight.replaying == (way == "replay")
                    await flight.done.wait()
                    fetched = time.perf_counter() - start
                    downloaded = shared.download_progress[0]
                    if not await opt._land_download():
                        raise RuntimeError(f"the {way} did not land")
                    digest = await opt.hashed_digest()
                seconds = time.perf_counter() - start
                # (a replay whose results hold as many bytes as the state downloads it instead)
                took = "replay" if shared.replayed_bytes > replayed else "download"
                moved = shared.replayed_bytes - replayed if took == "replay" else downloaded
                if digest != trusted[epoch_a] or opt.epoch != epoch_a:
                    raise RuntimeError(f"after the {way}, the site is not on A's state")
                rows.append(
                    {
                        "way": way,
                        "took": took,
                        "bytes_mb": round(moved / 1e6, 1),
                        "fetch_s": round(fetched, 2),
                        "seconds": round(seconds, 2),
                        "anon_grew_mb": round(anon.grew / 1e6, 1),
                    }
                )
            ours.send(None)
            site.stop()
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        a.join(timeout=60)
        if a.is_alive():
            a.kill()
    Path(out).write_text(json.dumps({"params": params, "rows": rows}))


def main(argv: list[str] | None = None) -> int:
    from p2ptrain.training.site import launch
    from simulations.benchmarks.site_build import add_shape_arguments, shape_of

    parser = argparse.ArgumentParser(prog="python -m simulations.site_replay", description=__doc__)
    add_shape_arguments(parser)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--behind", type=int, default=1, help="steps the site is behind (each way)")
    args = parser.parse_args(argv)
    shape = shape_of(args, TOKENS)
    with tempfile.TemporaryDirectory(prefix="p2ptrain-site-replay-") as folder:
        out = str(Path(folder) / "figures")
        launch.spawn(run, args.ranks, out, shape, args.behind, timeout=3600)
        got = json.loads(Path(out).read_text())
    fp32_mb = got["params"] * 4 / 1e6
    rows = []
    for r in got["rows"]:
        row = {
            "params_m": round(got["params"] / 1e6, 1),
            "ranks": args.ranks,
            "behind": args.behind,
            **r,
            "anon_over_fp32": round(r["anon_grew_mb"] / fp32_mb, 3),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    head = ("params", "ranks", "behind", "way", "took", "MB", "fetch s", "s", "heap MB")
    print("{:>8} {:>5} {:>6}  {:<9} {:<9} {:>8} {:>8} {:>7} {:>8}".format(*head))
    for r in rows:
        print(
            f"{r['params_m']:>7}M {r['ranks']:>5} {r['behind']:>6}  {r['way']:<9} {r['took']:<9}"
            f" {r['bytes_mb']:>8}"
            f" {r['fetch_s']:>8} {r['seconds']:>7} {r['anon_grew_mb']:>8}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
