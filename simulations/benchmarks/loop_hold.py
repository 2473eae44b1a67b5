"""How long one round holds a member's event loop: the longest task step, in wall seconds.

Two members in one process average a vector of N float32 values over the in-memory network (no link
limits), copied or in place, with the code as it is (passes over the vector or a partition in worker
threads from ``offload.LOOP_ELEMENTS`` values on) and with every pass on the loop (``--inline``: how it
was). Each round is timed, and a trio instrument records the longest task step: the time every other
task of the node (heartbeats, DHT answers, the round's own streams) waited at most. Prints JSON and a
table::

    python -m simulations.bench_loop_hold --values 25000000,100000000
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import trio

from p2ptrain.averaging import offload
from p2ptrain.averaging.allreduce import RoundResult
from p2ptrain.averaging.averager import Averager, schema_of
from p2ptrain.averaging.partition import partition_sizes
from p2ptrain.averaging.protocol import Manifest, MemberMsg, SignedManifest
from p2ptrain.identity import Identity
from p2ptrain.net import Host, LinkProfile, MemoryNetwork

RESULTS = Path(__file__).resolve().parents[1] / "results"
RUN_ID = "loop-hold"


class Steps(trio.abc.Instrument):
    """The longest task step (wall seconds) and the task that took it."""

    def __init__(self) -> None:
        self.began: float | None = None  # (None: the step running as this was added, not timed)
        self.longest = 0.0
        self.task = ""

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.began = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.began is None:
            return
        took = time.perf_counter() - self.began
        if took > self.longest:
            self.longest, self.task = took, task.name


def manifest(hosts: list[Host], tensors: list[torch.Tensor]) -> SignedManifest:
    total = sum(t.numel() for t in tensors)
    sizes = partition_sizes(total, [1.0] * len(hosts), [True] * len(hosts), 1)
    m = Manifest(
        round_id=random.randbytes(16),
        group_key="bench",
        members=tuple(
            MemberMsg(h.identity.peer_id.digest, str(h.advertised_addresses()[0]), 1.0) for h in hosts
        ),
        sizes=tuple(sizes),
        schema=schema_of(tensors),
        compression="none",
        timeout=600.0,
    )
    return SignedManifest.sign(hosts[0].identity, m)


async def one(values: int, members: int, in_place: bool) -> dict[str, Any]:
    net = MemoryNetwork(seed=1, default=LinkProfile())
    async with trio.open_nursery() as nursery:
        hosts, averagers = [], []
        for i in range(members):
            seed = hashlib.blake2b(f"m{i}".encode(), digest_size=32).digest()
            host = Host(Identity.from_seed(seed), RUN_ID, transport=net.transport(f"m{i}"))
            averager = Averager(host, None, clock=trio.current_time)
            await nursery.start(host.run, [(f"m{i}", 2000)])
            await nursery.start(averager.run)
            hosts.append(host)
            averagers.append(averager)
        g = torch.Generator().manual_seed(0)
        inputs = [[torch.randn(values, generator=g)] for _ in range(members)]
        signed = manifest(hosts, inputs[0])
        steps = Steps()
        trio.lowlevel.add_instrument(steps)
        began = time.perf_counter()
        want = inputs[0][0].clone()
        for t in inputs[1:]:
            want += t[0]
        want /= members
        outcomes: list[object] = [None] * members

        async def member(i: int) -> None:
            outcomes[i] = await averagers[i].run_round(signed, inputs[i], weight=1.0, in_place=in_place)

        try:
            async with trio.open_nursery() as rounds:
                for i in range(members):
                    rounds.start_soon(member, i)
        finally:
            trio.lowlevel.remove_instrument(steps)
        took = time.perf_counter() - began
        if not all(isinstance(o, RoundResult) for o in outcomes):
            raise RuntimeError(f"the round did not commit: {outcomes}")
        if not all(torch.allclose(t[0], want, atol=1e-5) for t in inputs):
            raise RuntimeError("the round's result is not the mean")
        nursery.cancel_scope.cancel()
    return {
        "values": values,
        "members": members,
        "in_place": in_place,
        "round_s": round(took, 3),
        "longest_step_s": round(steps.longest, 4),
        "longest_step_task": steps.task,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--values", default="25000000", help="comma-separated vector sizes")
    ap.add_argument("--members", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="rounds per case (the median is reported)")
    ap.add_argument("--json", default=str(RESULTS / "loop_hold.json"))
    args = ap.parse_args()
    rows = []
    for values in [int(v) for v in args.values.split(",")]:
        for in_place in (False, True):
            for inline in (True, False):
                offload.LOOP_ELEMENTS = 1 << 62 if inline else 1 << 22
                runs = [trio.run(one, values, args.members, in_place) for _ in range(args.repeats)]
                row = dict(runs[0])
                row["round_s"] = round(statistics.median(r["round_s"] for r in runs), 3)
                row["longest_step_s"] = round(statistics.median(r["longest_step_s"] for r in runs), 4)
                row["passes"] = "on the loop (before)" if inline else "in threads"
                rows.append(row)
                print(json.dumps(row), flush=True)
    report = {"benchmark": "loop_hold", "threads": torch.get_num_threads(), "rows": rows}
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{'values':>12}  {'in place':>8}  {'passes':<22}  {'round s':>8}  {'longest loop step s':>19}")
    for r in rows:
        print(
            f"{r['values']:>12}  {r['in_place']!s:>8}  {r['passes']:<22}  {r['round_s']:>8}  "
            f"{r['longest_step_s']:>19}"
        )


if __name__ == "__main__":
    main()
