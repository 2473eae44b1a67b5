"""What the trust check costs a reducer at real sizes: the Gram pass over the kept slices of one partition
(``trust.useful``), with and without the member's last result as one more row (the check that a slice
carries work beyond it), against the rest of the reduction.

    python -m simulations.benchmarks.trust_check [--params 124e6] [--members 4] [--threads 1]

One process, no network: a partition of ``params / members`` float32 elements, ``members`` contributors
whose slices arrive as uncompressed chunks (as the all-reduce hands them over), spilled to a file where
the reducer spills them (partitions of 16 MiB or more), then reduced. Prints JSON and a table; writes
``simulations/results/trust-check.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from p2ptrain.averaging.compression import Compression
from p2ptrain.averaging.reducer import PartitionReducer

RESULTS = Path(__file__).resolve().parents[1] / "results" / "trust-check.json"


def one(size: int, members: int, prior: bool, spill: bool | None) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    common = torch.randn(size, generator=gen)
    before = torch.randn(size, generator=gen) if prior else None
    red = PartitionReducer(
        size,
        Compression.NONE,
        members=members,
        prior=None if before is None else before.bfloat16(),
        spill=spill,
    )
    began = time.perf_counter()
    for i in range(members):
        mine = common + torch.randn(size, generator=gen)
        view = memoryview(mine.numpy()).cast("B")
        offset = 0
        for index in range(len(red.spans)):
            n = red.chunk_bytes(index)
            red.add_chunk(i, index, view[offset : offset + n], 1.0)
            offset += n
        red.complete(i, 1.0)
        del mine, view
    received = time.perf_counter() - began
    gram_began = time.perf_counter()
    red._gram(list(range(members)))  # the pass ``finalize`` makes for the verdicts (once more there)
    gram = time.perf_counter() - gram_began
    began = time.perf_counter()
    red.finalize(list(range(members)), [1.0] * members)
    final = time.perf_counter() - began
    assert all(v.useful for v in red.verdicts.values()), red.verdicts
    return {"receive_s": received, "gram_s": gram, "finalize_s": final}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=124e6)
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--spill", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a node's default: 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    size = int(args.params) // args.members
    rows = []
    for prior in (False, True):
        r = one(size, args.members, prior, args.spill)
        rows.append(
            {"params": int(args.params), "members": args.members, "partition": size, "prior": prior, **r}
        )
    out = {"benchmark": "trust-check", "rows": rows, "torch_threads": torch.get_num_threads()}
    print(json.dumps(out, indent=2))
    head = ("partition", "prior", "receive s", "gram s", "finalize s", "gram/finalize")
    print("\n{:>12} {:>6} {:>10} {:>8} {:>11} {:>14}".format(*head))
    for r in rows:
        share = r["gram_s"] / r["finalize_s"] if r["finalize_s"] else float("nan")
        print(
            f"{r['partition']:>12,} {r['prior']!s:>6} {r['receive_s']:>10.2f} {r['gram_s']:>8.2f}"
            f" {r['finalize_s']:>11.2f} {share:>14.2f}"
        )
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
