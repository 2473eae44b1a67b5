"""What the trust check costs a reducer at real sizes: the Gram pass over the kept slices of one partition
(``trust.useful``), with and without the member's last result as one more row (the check that a slice
carries work beyond it), against the rest of the reduction.

    python -m simulations.benchmarks.trust_check [--params 124e6] [--members 4] [--threads 1] [--residuals 30]

One process, no network: a partition of ``params / members`` float32 elements, ``members`` contributors
whose slices arrive as uncompressed chunks (as the all-reduce hands them over), spilled to a file where
the reducer spills them (partitions of 16 MiB or more), then reduced. ``--residuals STEPS``: also train
the built-in tiny GPT as 4 peers of 64 samples and judge their gradients and an echo of the last
average, plainly and beyond it, at some steps. Prints JSON and a table; writes
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


def residuals(steps: int, peers: int, batch: int) -> list[dict[str, object]]:
    """Train the built-in tiny GPT in sync mode as ``peers`` peers of ``batch`` samples would (their
    gradients averaged each step); at some steps, judge each peer's gradient in partition 0 and 2 of 4
    as a reducer does, plainly and beyond the last averaged result, beside an echo of that result
    with noise of 30% of its norm."""
    from p2ptrain.averaging.trust import gram, threshold, useful
    from p2ptrain.tasks.text import gpt_task

    torch.manual_seed(0)
    task = gpt_task(max_bytes=1_000_000)
    model = task.model()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    streams = [task.batches(100 + i, batch) for i in range(peers)]

    def grad(stream: object) -> torch.Tensor:
        for q in params:
            q.grad = None
        task.loss(model, next(stream)).backward()  # type: ignore[call-overload]
        return torch.cat([q.grad.reshape(-1) for q in params if q.grad is not None]).clone()

    def cosines(verdicts: list[object]) -> list[float]:
        out = []
        for v in verdicts:
            reason = str(getattr(v, "reason", ""))
            number = reason.split("cosine ")[-1].split(" ")[0] if "cosine " in reason else "nan"
            out.append(float(number))
        return out

    rows: list[dict[str, object]] = []
    previous = None
    gen = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        g = torch.stack([grad(s) for s in streams])
        if previous is not None and (step <= 3 or step % 5 == 0):
            d = g.shape[1] // 4
            for part in (0, 2):
                x = g[:, part * d : (part + 1) * d]
                p = previous[part * d : (part + 1) * d]
                echo = p + 0.3 * p.norm() / d**0.5 * torch.randn(d, generator=gen)
                slices = [*x, echo]
                plain = useful(gram(slices), [1.0] * len(slices), d)
                beyond = useful(gram([*slices, p]), [1.0] * len(slices), d, prior=True)
                rows.append(
                    {
                        "step": step,
                        "partition": part,
                        "elements": d,
                        "bar": threshold(d),
                        "honest_plain": cosines(plain[:-1]),
                        "honest_beyond": [v.useful for v in beyond[:-1]],
                        "echo_plain": cosines(plain[-1:])[0],
                        "echo_plain_useful": plain[-1].useful,
                        "echo_beyond_useful": beyond[-1].useful,
                        "echo_beyond_reason": beyond[-1].reason,
                    }
                )
        previous = g.mean(0)
        offset = 0
        for q in params:
            n = q.numel()
            q.grad = previous[offset : offset + n].view_as(q).clone()
            offset += n
        opt.step()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=124e6)
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--spill", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a node's default: 1)")
    parser.add_argument(
        "--residuals",
        type=int,
        default=0,
        metavar="STEPS",
        help="also judge a tiny GPT's gradients and echoes",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    size = int(args.params) // args.members
    rows = []
    for prior in (False, True):
        r = one(size, args.members, prior, args.spill)
        rows.append(
            {"params": int(args.params), "members": args.members, "partition": size, "prior": prior, **r}
        )
    out: dict[str, object] = {
        "benchmark": "trust-check",
        "rows": rows,
        "torch_threads": torch.get_num_threads(),
    }
    if args.residuals:
        judged = residuals(args.residuals, peers=4, batch=64)
        out["residuals"] = judged
        for r in judged:
            print(
                f"step {r['step']:>3} partition {r['partition']} bar {r['bar']:.4f}: honest plain"
                f" {min(r['honest_plain']):.3f}-{max(r['honest_plain']):.3f} beyond"  # type: ignore[type-var]
                f" {'all useful' if all(r['honest_beyond']) else 'NOT all useful'};"  # type: ignore[arg-type]
                f" echo plain {r['echo_plain']:.3f} ({'passes' if r['echo_plain_useful'] else 'fails'}),"
                f" beyond {'passes' if r['echo_beyond_useful'] else 'fails'}"
            )
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
