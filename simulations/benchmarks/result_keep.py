"""What keeping one step's result costs the peer that keeps it: seconds, and the most its anonymous
memory (the heap, not the page cache of files) grew meanwhile.

    python -m simulations.result_keep [--params 151500000] [--form int8]

Every peer keeps its last steps' results to serve peers that are behind (``state.replay.ResultStore``),
in the round's compact form where it has one. The result lies where a site's round leaves it: in a
mapped wire buffer (``site.wire.WireBuffer``), as consecutive views, one per parameter of 1M values.
``--form``: what the values are: ``int8`` (an int8 round's result, on 8 partitions), ``fp16``,
``float32``. Freed buffers go back to the system at once, as on a site's ranks
(``launch.return_freed_memory``). Prints one JSON line and a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    from p2ptrain.averaging.compression import Compression, decode, encode
    from p2ptrain.training.site.launch import return_freed_memory
    from p2ptrain.training.site.wire import WireBuffer
    from p2ptrain.training.state import result_codec
    from p2ptrain.training.state.replay import ResultStore
    from simulations.benchmarks.site_replay import AnonPeak

    parser = argparse.ArgumentParser(prog="python -m simulations.result_keep", description=__doc__)
    parser.add_argument("--params", type=int, default=151_500_000)
    parser.add_argument("--form", choices=("int8", "fp16", "float32"), default="int8")
    args = parser.parse_args(argv)
    n = args.params
    return_freed_memory()
    wire = WireBuffer(n)
    g = torch.Generator().manual_seed(0)
    step = -(-n // 8)
    for a in range(0, n, step):  # (each partition encoded on its own grid, as reducers do)
        b = min(n, a + step)
        x = torch.randn(b - a, generator=g) * 1e-3
        if args.form == "int8":
            x = decode(encode(x, Compression.INT8), Compression.INT8, b - a)
        elif args.form == "fp16":
            x = x.half().float()
        wire.flat[a:b] = x
    wire.release()
    views = [wire.flat[a : a + (1 << 20)] for a in range(0, n, 1 << 20)]
    compact = [torch.float16] if args.form == "fp16" else []
    packs = (result_codec.INT8,) if args.form == "int8" else ()
    store = ResultStore(None, 1, lambda e: b"")
    start = time.perf_counter()
    with AnonPeak() as anon:
        store.keep(0, range(len(views)), views, compact, packs=packs)
    seconds = time.perf_counter() - start
    kept = store.get(0)
    assert kept is not None
    row = {
        "params_m": round(n / 1e6, 1),
        "form": args.form,
        "kept_as": kept.kind,
        "kept_mb": round(kept.size / 1e6, 1),
        "seconds": round(seconds, 2),
        "anon_grew_mb": round(anon.grew / 1e6, 1),
        "anon_over_fp32": round(anon.grew / (4 * n), 3),
    }
    print(json.dumps(row), flush=True)
    print(f"{'params':>8} {'form':>8} {'kept as':>8} {'kept MB':>8} {'s':>7} {'heap MB':>8} {'/ fp32':>7}")
    print(
        f"{row['params_m']:>7}M {row['form']:>8} {row['kept_as']:>8} {row['kept_mb']:>8} {row['seconds']:>7}"
        f" {row['anon_grew_mb']:>8} {row['anon_over_fp32']:>7}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
