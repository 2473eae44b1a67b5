"""A site's hash after a state change: the time it takes and the bytes that cross to rank 0.

    python -m simulations.site_hash [--layers 12] [--width 1024] [--ranks 2 4] [--repeat 2] [--layouts]

Every rank (spawned processes, gloo on the CPU) holds its rows of a DiLoCo state shaped like the
built-in GPT's (each parameter and its outer momentum, random values), and the site hashes it into a
snapshot file two ways, each ``--repeat`` times: rank 0 assembling every chunk from the ranks' bytes
(``ShardedState.chunk``, then hashed and written on rank 0: how a site hashed before) and
``ShardedState.hash_into`` (each chunk hashed and written by the rank whose shards hold it; rank 0
assembles only the chunks split between ranks). Both give one root (checked). Prints one JSON line per
(ranks, way) and a table: the state's bytes, the best time, the bytes rank 0 received.

``--layouts`` adds arithmetic on layouts alone (no data, nothing hashed): the share of a DiLoCo state's
chunks split between ranks, which rank 0 still assembles, for Llama-shaped 7B and 70B models on 4 and 8
ranks (the chunk layout of ``state.chunks`` and FSDP2's rows, as the site computes them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from p2ptrain.training.site.state import ShardedState


def _state_shapes(shape: dict[str, int]) -> dict[str, list[int]]:
    """A DiLoCo state's names and full shapes for the GPT of ``shape`` (a meta build: no memory)."""
    from p2ptrain.tasks.gpt import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(**shape))
    out = {}
    for k, (name, p) in enumerate(model.named_parameters()):
        out[f"model.{name}"] = list(p.shape)
        out[f"optim.outer.{k}.momentum_buffer"] = list(p.shape)
    return out


def assembled_on_rank0(state: ShardedState, path: str | None) -> list[bytes] | None:
    """How a site hashed before: every chunk assembled on rank 0, hashed there, written to ``path``."""
    from p2ptrain.training.state import chunks

    fd = os.open(path, os.O_WRONLY) if path else -1

    def chunk(i: int) -> bytearray:
        data = state.chunk(i)
        assert data is not None
        return data

    def written(i: int, data: bytes | bytearray) -> None:
        os.pwrite(fd, data, i * chunks.CHUNK)

    try:
        if state.rank != 0:
            for i in range(state.layout.chunks):
                state.chunk(i)
            return None
        return chunks.hash_each(state.layout.chunks, chunk, written)
    finally:
        if fd >= 0:
            os.close(fd)


LLAMA = {  # hidden, intermediate, layers, vocabulary, key/value width
    "7B": (4096, 11008, 32, 32000, 4096),
    "70B": (8192, 28672, 80, 128256, 1024),
}


def llama_shapes(hidden: int, inter: int, layers: int, vocab: int, kv: int) -> dict[str, list[int]]:
    """A Llama-shaped model's parameters and their outer momentum: names and full shapes."""
    model = {"embed": [vocab, hidden], "lm_head": [vocab, hidden], "norm": [hidden]}
    for k in range(layers):
        block = {"q": [hidden, hidden], "k": [kv, hidden], "v": [kv, hidden], "o": [hidden, hidden]}
        block |= {"gate": [inter, hidden], "up": [inter, hidden], "down": [hidden, inter]}
        block |= {"ln1": [hidden], "ln2": [hidden]}
        model |= {f"layers.{k:02d}.{n}": s for n, s in block.items()}
    return {f"model.{n}": s for n, s in model.items()} | {f"optim.{n}.momentum": s for n, s in model.items()}


def split_share(shapes: dict[str, list[int]], world: int) -> tuple[int, int, float]:
    """(state bytes, chunks, the share of the state's bytes in chunks split between ranks)."""
    from p2ptrain.training.site.layout import rows_of
    from p2ptrain.training.site.state import ShardedState

    meta = {n: torch.empty((len(rows_of(s[0], world, 0)), *s[1:]), device="meta") for n, s in shapes.items()}
    state = ShardedState(meta, shapes, 0, world)  # (rank 0's view: no collective)
    layout = state.layout
    split = sum(layout.chunk_size(i) for i, r in enumerate(state.owners()) if r is None)
    return layout.size, layout.chunks, split / layout.size


def run(rank: int, world: int, out: str, shape: dict[str, int], repeat: int) -> None:
    """One rank (``launch.spawn``): both ways, ``repeat`` times; rank 0 writes the figures to ``out``."""
    import torch.distributed as dist

    from p2ptrain.training.site.layout import rows_of
    from p2ptrain.training.site.state import ShardedState

    shapes = _state_shapes(shape)
    g = torch.Generator().manual_seed(rank)
    shards = {}
    for name, full in shapes.items():
        rows = rows_of(full[0], world, rank)
        shards[name] = torch.randn((len(rows), *full[1:]), generator=g)
    state = ShardedState(shards, shapes, rank, world)
    figures: dict[str, dict[str, float]] = {}
    roots = set()
    for way in ("every chunk assembled on rank 0", "each chunk where its bytes are"):
        best = float("inf")
        for _ in range(repeat):
            path = tempfile.mkstemp(prefix="p2ptrain-site-hash-")[1] if rank == 0 else None
            dist.barrier()
            state.received = 0
            start = time.perf_counter()
            try:
                hashes = assembled_on_rank0(state, path) if way.startswith("every") else state.hash_into(path)
            finally:
                dist.barrier()
                if path is not None:
                    os.unlink(path)
            best = min(best, time.perf_counter() - start)
            if hashes is not None:
                roots.add(b"".join(hashes))
        figures[way] = {"seconds": best, "received": state.received}
    if rank == 0:
        if len(roots) != 1:
            raise AssertionError("the two ways gave different hashes")
        size = state.layout.size
        Path(out).write_text(json.dumps({"state_bytes": size, "ways": figures}))


def main(argv: list[str] | None = None) -> int:
    from p2ptrain.tasks.gpt import GPTConfig
    from p2ptrain.training.site import launch
    from simulations.benchmarks.site_build import add_shape_arguments, shape_of

    parser = argparse.ArgumentParser(prog="python -m simulations.site_hash", description=__doc__)
    add_shape_arguments(parser)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--layouts", action="store_true", help="the split share of 7B and 70B layouts")
    parser.add_argument("--skip-run", action="store_true", help="no hashing (with --layouts)")
    args = parser.parse_args(argv)
    if args.layouts:
        for model, dims in LLAMA.items():
            for world in (4, 8):
                size, count, share = split_share(llama_shapes(*dims), world)
                row = {"model": model, "state_gb": round(size / 1e9, 1), "chunks": count, "ranks": world}
                row |= {
                    "split_share": round(share, 4),
                    "rank0_received_at_most_gb": round(size * share / 1e9, 1),
                }
                row["rank0_received_before_gb"] = round(size * (world - 1) / world / 1e9, 1)
                print(json.dumps(row), flush=True)
        if args.skip_run:
            return 0
    shape = shape_of(args, 128)
    params = GPTConfig(**shape).num_parameters()
    rows = []
    with tempfile.TemporaryDirectory(prefix="p2ptrain-site-hash-") as folder:
        for world in args.ranks:
            out = str(Path(folder) / str(world))
            launch.spawn(run, world, out, shape, args.repeat, timeout=3600)
            got = json.loads(Path(out).read_text())
            for way, f in got["ways"].items():
                row = {
                    "params_m": round(params / 1e6, 1),
                    "state_mb": round(got["state_bytes"] / 1e6),
                    "ranks": world,
                    "way": way,
                    "seconds": round(f["seconds"], 2),
                    "rank0_received_mb": round(f["received"] / 1e6, 1),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"{'params':>8} {'state MB':>8} {'ranks':>5}  {'way':<32} {'seconds':>7} {'to rank 0 MB':>12}")
    for r in rows:
        print(
            f"{r['params_m']:>7}M {r['state_mb']:>8} {r['ranks']:>5}  {r['way']:<32} {r['seconds']:>7} "
            f"{r['rank0_received_mb']:>12}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
