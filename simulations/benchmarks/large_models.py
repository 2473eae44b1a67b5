"""What a swarm of a large model needs per peer: the README's "Large models" table, from measurements.

Arithmetic on three measured inputs (defaults: this machine, the commands in the README):

- ``--rss-sync`` / ``--rss-diloco``: a CPU peer's peak host RAM as a multiple of its fp32 parameter
  bytes (``python -m simulations.bench_scale``); a DiLoCo CPU peer of a large model also keeps its
  global parameters and outer momentum (2x) in a mapped file, which the page cache holds while memory
  is free and the kernel writes out when it is short (``diloco.outer_state``), reported apart;
- ``--allreduce-efficiency``: the all-reduce's fraction of the link bound on shaped links
  (``python -m simulations bench --only allreduce``, netns scenario);
- ``--sync-efficiency``: a state download's fraction of the link (``python -m simulations.bench_statesync``).

Per model size, mode and compression it prints: the state a joiner downloads, the GPU memory of a GPU
peer (parameters, gradients and AdamW moments, plus what the mode keeps on the device: the gradient
accumulator and the one a round takes in sync mode; the global parameters, outer momentum, pseudo-gradient
and the overlap snapshot in DiLoCo), the host RAM of a CPU peer (the measured multiple), the bytes each
peer sends (and receives) per round in a butterfly all-reduce of ``--peers`` peers, the round time at
100 Mbit/s and 1 Gbit/s, and a joiner's state download at both rates. JSON first, then a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

SIZES = {"124M": 124e6, "350M": 355e6, "1B": 1.0e9, "7B": 7.0e9}
MODES = [  # (mode, compression, bytes per value on the wire)
    ("sync", "none", 4.0),
    ("sync", "fp16", 2.0),
    ("diloco", "fp16", 2.0),
    ("diloco", "int8", 1.03),  # blockwise int8: one fp32 scale per block of 128 values
]
GPU_MULTIPLE = {"sync": 6.0, "diloco": 8.0}  # 4x (params, grads, AdamW) + the mode's device buffers
STATE_MULTIPLE = {"sync": 3.0, "diloco": 2.0}  # params + AdamW moments; global params + outer momentum
GB = 1e9


def table_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    n = args.peers
    for size, params in SIZES.items():
        fp32 = 4 * params
        for mode, compression, per_value in MODES:
            wire = 2 * (n - 1) / n * params * per_value  # each way, per round
            state = STATE_MULTIPLE[mode] * fp32
            row: dict[str, Any] = {
                "size": size,
                "parameters": params,
                "mode": mode,
                "compression": compression,
                "gpu_memory_gb": round(GPU_MULTIPLE[mode] * fp32 / GB, 1),
                "cpu_host_ram_gb": round(
                    (args.rss_sync if mode == "sync" else args.rss_diloco) * fp32 / GB, 1
                ),
                "cpu_page_cache_gb": round((2 * fp32 if mode == "diloco" else 0) / GB, 1),
                "round_bytes_each_way_gb": round(wire / GB, 2),
                "state_gb": round(state / GB, 2),
            }
            for mbit in (100, 1000):
                rate = mbit * 1e6 / 8
                row[f"round_s_{mbit}mbit"] = round(wire / (rate * args.allreduce_efficiency), 1)
                row[f"state_sync_s_{mbit}mbit"] = round(state / (rate * args.sync_efficiency), 1)
            rows.append(row)
    return rows


def fmt_time(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.0f} s"


def print_table(rows: list[dict[str, Any]]) -> None:
    head = [
        "size",
        "mode",
        "compression",
        "GPU mem",
        "CPU host RAM (+ page cache)",
        "per round (each way)",
        "round 100M/1G",
        "state",
        "join 100M/1G",
    ]
    out = []
    for r in rows:
        out.append(
            [
                r["size"],
                r["mode"],
                r["compression"],
                f"{r['gpu_memory_gb']:g} GB",
                f"{r['cpu_host_ram_gb']:g} GB"
                + (f" (+ {r['cpu_page_cache_gb']:g} GB)" if r["cpu_page_cache_gb"] else ""),
                f"{r['round_bytes_each_way_gb']:g} GB",
                f"{fmt_time(r['round_s_100mbit'])} / {fmt_time(r['round_s_1000mbit'])}",
                f"{r['state_gb']:g} GB",
                f"{fmt_time(r['state_sync_s_100mbit'])} / {fmt_time(r['state_sync_s_1000mbit'])}",
            ]
        )
    widths = [max(len(str(x)) for x in col) for col in zip(head, *out, strict=True)]
    for line in [head, ["-" * w for w in widths], *out]:
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulations.large_models", description=__doc__)
    parser.add_argument("--peers", type=int, default=8, help="peers in a round (default 8)")
    parser.add_argument("--rss-sync", type=float, default=5.5, help="measured RSS multiple, sync mode")
    parser.add_argument("--rss-diloco", type=float, default=5.8, help="measured RSS multiple, DiLoCo")
    parser.add_argument("--allreduce-efficiency", type=float, default=0.81, help="fraction of the link bound")
    parser.add_argument("--sync-efficiency", type=float, default=0.93, help="state download, of the link")
    args = parser.parse_args(argv)
    if args.peers < 2:
        parser.error("--peers must be at least 2")
    rows = table_rows(args)
    print(json.dumps({"benchmark": "large-models", "inputs": vars(args), "rows": rows}))
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
