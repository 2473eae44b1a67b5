"""p2ptrain's peer in the all-reduce benchmark: a Node that forms a group through the DHT, then averages.

Each round: matchmaking under a key of its own (before the harness's "go": the contract times the
all-reduce alone), then ``Averager.run_round`` on the "go", timed until this peer holds the average.
Everything is what a user gets: encrypted and authenticated channels, the signed manifest and decision,
fault tolerance on. Run by ``simulations.benchmarks.allreduce`` (see its contract); alone::

    python -m simulations.benchmarks.allreduce_p2ptrain --index 0 --peers 1 --mb 8 --rounds 2 \
        --listen 127.0.0.1:0
"""

from __future__ import annotations

import functools
import logging
import math
import os
import resource
import sys
import time
import traceback
from typing import Any

import torch
import trio

from p2ptrain import Node, NodeConfig
from p2ptrain.averaging import AveragerConfig
from p2ptrain.identity import Identity
from p2ptrain.net import PeerAddress
from simulations.benchmarks.allreduce import (
    Commands,
    emit,
    exact_mean,
    numel_for,
    pattern,
    peer_parser,
    split_addr,
)


def sent_bytes(node: Node) -> int:
    return sum(c.bytes_sent for c in node.host.connections())


async def run(args: Any, commands: Commands) -> None:
    host, port = split_addr(args.listen)
    config = NodeConfig(
        run_id="bench-allreduce",
        listen=((host, port),),
        join=(PeerAddress.parse(args.join),) if args.join else (),
        averaging=AveragerConfig(
            target_size=args.peers,
            min_size=args.peers,
            matchmaking_time=min(args.timeout, 30.0),
            compression=args.compression,
            bandwidth=args.bandwidth * 1e6,
        ),
    )
    numel = numel_for(args.mb)
    expected = torch.from_numpy(exact_mean(args.peers, numel))
    mine = torch.from_numpy(pattern(args.index, numel))
    async with trio.open_nursery() as nursery:
        node = await nursery.start(Node(Identity.generate(), config).run)
        emit("listening", addr=str(node.addresses[0]))
        await trio.to_thread.run_sync(commands.wait, "peers", args.timeout)
        with trio.fail_after(args.timeout):
            # node.members is refreshed from the DHT by the node itself: nothing to wait on but its value
            while len(node.members) < args.peers:  # noqa: ASYNC110 (everyone in the DHT first)
                await trio.sleep(0.1)
        for r in range(args.rounds):
            tensor = mine.clone()
            signed = await node.averager.form_group(
                [tensor], timeout=args.timeout, group_key=f"round-{r}", compression=args.compression
            )
            emit("ready", round=r)
            await trio.to_thread.run_sync(functools.partial(commands.wait, "go", args.timeout, round=r))
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            before, began, cpu = sent_bytes(node), time.perf_counter(), time.process_time()
            result = await node.averager.run_round(signed, [tensor])
            seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            emit(
                "round",
                round=r,
                seconds=seconds,
                cpu_seconds=cpu,
                page_faults=faults,  # pages first touched: fresh allocations cost the kernel's time
                wire_bytes=sent_bytes(node) - before,
                phases=result.phases,
                group=result.group_size,
                share=result.reduced / numel,  # of the vector this peer reduced
                announced_mb_s=round(node.averager.bandwidth / 1e6, 3),  # what it will announce next
            )
            check = functools.partial(commands.wait, "check", args.timeout, round=r)
            await trio.to_thread.run_sync(check)  # the others are done: checking costs no one
            err = float((tensor - expected).abs().max())
            emit("checked", round=r, max_err=err if math.isfinite(err) else None)
        with trio.move_on_after(args.timeout):
            await node.averager.wait_idle()  # slower members may still be fetching from us
        emit("done")
        nursery.cancel_scope.cancel()


def main() -> int:
    parser = peer_parser("p2ptrain peer of the all-reduce benchmark")
    parser.add_argument("--bandwidth", type=float, default=0.0, help="MB/s to announce (0: measure it)")
    args = parser.parse_args()
    logging.basicConfig(level=os.environ.get("P2PTRAIN_BENCH_LOG", "WARNING"), stream=sys.stderr)
    torch.set_num_threads(1)  # chunk-sized tensor ops: a thread pool per process only adds contention
    commands = Commands()
    profile = os.environ.get("P2PTRAIN_BENCH_PROFILE")  # a directory: cProfile each peer's run there
    try:
        if profile:
            import cProfile

            cProfile.runctx(
                "trio.run(run, args, commands)", globals(), locals(), f"{profile}/peer{args.index}.prof"
            )
        else:
            trio.run(run, args, commands)
    except Exception as e:  # the harness reads the reason; the log keeps the traceback
        traceback.print_exc()
        emit("error", error=f"{type(e).__name__}: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
