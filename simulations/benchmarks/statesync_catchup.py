"""Catch-up benchmark: a home peer on a slow link in a sync swarm whose steps take less time than its
state download (issue 49's sync-mode chase).

Peers train a small MLP in sync mode (AdamW; the model's size sets the state's: ``--params``) on the
in-memory network (``p2ptrain.net.memory``) on trio's virtual clock: ``--fast`` peers on unlimited
links, then, once they took a few steps, a home peer whose links to each of them carry ``--rate-mbit``
each way. Each peer computes one batch per ``--compute`` virtual seconds; the target batch makes a step
take about ``--step-s`` seconds of the swarm's compute, less than the home peer's state download (the
report says both). By default the in-memory network shapes each pair of peers apart, so the home peer
downloads from one donor at a time (``statesync.max_donors = 1``) as its own link would allow; its
rounds send to several peers at once, which is kinder to it than one shared uplink. ``--access`` gives
the home peer one access link instead, shared by all its connections each way, as a home router's is
(``MemoryNetwork.set_access``): a download, a replay and its rounds then queue on one line, as in the
namespace lab (``simulations.benchmarks.statesync_home``).

It runs twice: with ``statesync.replay_steps`` at its default (a peer a few steps behind replays the
missed steps' results, ``p2ptrain.training.state.replay``) and at 0 (the code before: every catch-up is
a state download). Reported for each: the swarm's steps while the home peer was there (from its first
step), the steps it averaged in with its own samples, their fraction (target: at least 80%), its state
downloads and replayed steps, and whether every peer held the same parameters at every step.

Usage::

    python -m simulations.benchmarks.statesync_catchup [--rate-mbit 10] [--params 1000000] [--fast 3]
        [--seconds 120] [--compute 1.0] [--step-s 4.0] [--access] [--no-baseline] [--json PATH]

The JSON report goes to PATH (default ``simulations/results/statesync_catchup.json``; ``-``: stdout), a
table to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import trio
import trio.testing

from p2ptrain import Node, NodeConfig
from p2ptrain.averaging import AveragerConfig
from p2ptrain.config import RunConfig
from p2ptrain.identity import Identity
from p2ptrain.net import MemoryNetwork
from p2ptrain.net.memory import LinkProfile
from p2ptrain.training import CollaborativeOptimizer
from simulations.benchmarks.environment import REPO_ROOT, write_report
from simulations.benchmarks.environment import environment as base_environment

MODULE = "simulations.benchmarks.statesync_catchup"
DEFAULT_JSON = "simulations/results/statesync_catchup.json"
TARGET = 0.8  # of the steps the home peer is present for, averaged with its own samples
BATCH = 8
PORT = 4000


def make_model(params: int) -> torch.nn.Module:
    """An MLP of about ``params`` parameters (4 -> w -> w -> 1), the same weights on every peer."""
    width = max(8, int((params / 1.0) ** 0.5))
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, width), torch.nn.Linear(width, 1)
    )


@dataclass
class Peer:
    index: int
    opt: CollaborativeOptimizer
    model: torch.nn.Module
    steps: list[tuple[int, str, int, bytes]] = field(default_factory=list)  # epoch, outcome, mine, digest


def run_config(target: int, replay_steps: int) -> RunConfig:
    return (
        RunConfig()
        .replace("training", mode="sync", target_batch_size=target, warmup_steps=0, lr=1e-3, grad_clip=0.0)
        .replace("averaging", timeout=30.0, matchmaking_time=2.0)
        .replace("progress", interval=0.5, ttl=3.0)
        .replace("statesync", replay_steps=replay_steps)
    )


async def swarm(args: argparse.Namespace, replay_steps: int) -> dict[str, Any]:
    net = MemoryNetwork(seed=7)
    peers: list[Peer] = []
    target = max(BATCH, round(args.step_s / args.compute * BATCH * (args.fast + 1)))
    cfg = run_config(target, replay_steps)

    async def start(nursery: trio.Nursery, config: RunConfig) -> Peer:
        i = len(peers)
        name = f"p{i}"
        node = Node(
            Identity.generate(),
            NodeConfig(
                run_id="catchup",
                listen=((name, PORT),),
                join=(peers[0].opt.node.addresses[0],) if peers else (),
                averaging=AveragerConfig(target_size=64, min_size=1, matchmaking_time=2.0),
            ),
            transport=net.transport(name),
            clock=trio.current_time,
        )
        model = make_model(args.params)
        opt = CollaborativeOptimizer(
            node, model, torch.optim.AdamW(model.parameters(), lr=1e-3), config, clock=trio.current_time
        )
        peer = Peer(i, opt, model)
        peers.append(peer)

        async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            async with trio.open_nursery() as inner:
                await inner.start(node.run)
                await inner.start(opt.run)
                task_status.started()
                g = torch.Generator().manual_seed(100 + i)
                x = torch.randn(BATCH, 4, generator=g)
                y = x.sum(1, keepdim=True)
                while True:
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    await trio.sleep(args.compute)
                    if await opt.step(BATCH):
                        last = opt.stats.last
                        peer.steps.append((opt.epoch, last["outcome"], int(last.get("mine", 0)), opt.digest))

        await nursery.start(run)
        return peer

    async with trio.open_nursery() as nursery:
        fast = [await start(nursery, cfg) for _ in range(args.fast)]
        rate = args.rate_mbit * 1e6 / 8
        if args.access:  # one access link, shared by all its connections (as behind a home router)
            net.set_access(f"p{args.fast}", up=rate, down=rate)
        else:
            for p in fast:
                net.set_link(f"p{p.index}", f"p{args.fast}", LinkProfile(bandwidth=rate))
        with trio.fail_after(600):
            while fast[0].opt.epoch < 3:  # noqa: ASYNC110  (the peers' loops move it)
                await trio.sleep(0.1)
        home = await start(nursery, cfg.replace("statesync", max_donors=1))
        with trio.fail_after(600):
            while not home.steps:  # noqa: ASYNC110
                await trio.sleep(0.1)
        first = fast[0].opt.epoch
        await trio.sleep(args.seconds)
        swarm_steps = fast[0].opt.epoch - first
        swarm_end = fast[0].opt.epoch
        nursery.cancel_scope.cancel()
    after = home.steps[1:]  # its first step is the join's download
    averaged = sum(1 for _, outcome, mine, _ in after if outcome == "averaged" and mine > 0)
    # the chase's end: the home's first averaged step; from then on, its share of the swarm's steps
    joined = [e for e, outcome, mine, _ in after if outcome == "averaged" and mine > 0]
    chase_end = joined[0] if joined else None
    digests: dict[int, set[bytes]] = {}
    holders: dict[int, dict[bytes, list[str]]] = {}  # step -> digest -> the peers (and outcomes) holding it
    for p in peers:
        for epoch, outcome, _, digest in p.steps:
            if digest:  # (b"": a large state still being hashed when the step returned)
                digests.setdefault(epoch, set()).add(digest)
                holders.setdefault(epoch, {}).setdefault(digest, []).append(f"p{p.index}:{outcome}")
    params = sum(p.numel() for p in home.model.parameters())
    state = 3 * 4 * params  # AdamW: the parameters and two moments, fp32
    rate = args.rate_mbit * 1e6 / 8
    shared = home.opt.shared
    return {
        "replay_steps": replay_steps,
        "parameters": params,
        "state_bytes": state,
        "state_download_s": round(state / rate, 2),
        "target_batch_size": target,
        "swarm_steps_present": swarm_steps,
        "averaged": averaged,
        "fraction": round(averaged / swarm_steps, 3) if swarm_steps else None,
        "home_steps": {o: sum(1 for _, x, _, _ in after if x == o) for o in {x for _, x, _, _ in after}},
        "home_outcomes": [f"{epoch}:{outcome}" for epoch, outcome, _, _ in home.steps],
        # swarm steps from the home's first step (its join) to its first averaged one, and after that
        "chase_steps": chase_end - first if chase_end is not None else None,
        "steps_after_chase": swarm_end - chase_end + 1 if chase_end is not None else 0,
        "averaged_after_chase": len(joined),
        "downloads": shared.downloads,
        "replayed_steps": shared.replayed,
        "replayed_bytes": shared.replayed_bytes,
        "step_s": round(args.seconds / swarm_steps, 2) if swarm_steps else None,
        "identical": all(len(d) == 1 for d in digests.values()),
        # where not: each such step's states, by who held them after which outcome
        "diverged": {e: sorted(holders[e].values()) for e in sorted(digests) if len(digests[e]) > 1},
        "met": bool(swarm_steps) and averaged >= TARGET * swarm_steps,
    }


def format_table(report: dict[str, Any]) -> str:
    head = ["replay_steps", "swarm steps", "averaged", "fraction", "downloads", "replayed", "step s"]
    head += ["download s", "identical", "met"]
    rows = [head]
    for r in report["results"]:
        rows.append(
            [
                str(r["replay_steps"]),
                str(r["swarm_steps_present"]),
                str(r["averaged"]),
                f"{100 * r['fraction']:.0f}%" if r["fraction"] is not None else "-",
                str(r["downloads"]),
                str(r["replayed_steps"]),
                str(r["step_s"]),
                str(r["state_download_s"]),
                str(r["identical"]),
                str(r["met"]),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    text = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    text.insert(1, "  ".join("-" * w for w in widths))
    text.append(f"reproduce: {report['command']}")
    return "\n".join(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate-mbit", type=float, default=10.0, help="the home peer's links (default 10)")
    parser.add_argument("--params", type=int, default=1_000_000, help="model parameters (default 1M)")
    parser.add_argument("--fast", type=int, default=3, help="peers on fast links (default 3)")
    parser.add_argument("--seconds", type=float, default=120.0, help="virtual seconds measured (default 120)")
    parser.add_argument("--compute", type=float, default=1.0, help="virtual seconds per batch (default 1)")
    parser.add_argument("--step-s", type=float, default=4.0, help="compute seconds per step (default 4)")
    parser.add_argument(
        "--access", action="store_true", help="the home's rate is one access link all its connections share"
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the run with replay_steps 0")
    parser.add_argument("--json", default=DEFAULT_JSON, metavar="PATH")
    args = parser.parse_args(argv)
    words = [f"python -m {MODULE}", f"--rate-mbit {args.rate_mbit:g}", f"--params {args.params}"]
    words += [f"--fast {args.fast}", f"--seconds {args.seconds:g}", f"--compute {args.compute:g}"]
    words += [f"--step-s {args.step_s:g}"]
    words += ["--access"] if args.access else []
    words += ["--no-baseline"] if args.no_baseline else []
    report: dict[str, Any] = {
        "benchmark": "state-sync-catchup",
        "command": " ".join(words),
        "environment": base_environment(("p2ptrain", "torch", "trio")),
        "emulation": "in-memory network, virtual clock; "
        + (
            "the home peer's one access link, shared"
            if args.access
            else "the home peer's links shaped per pair"
        ),
        "target": f"the home peer averages in >= {100 * TARGET:g}% of the steps it is present for",
        "results": [],
    }
    began = time.perf_counter()
    default = RunConfig().statesync.replay_steps
    for replay in (default,) if args.no_baseline else (default, 0):
        print(f"replay_steps = {replay} ...", file=sys.stderr, flush=True)
        result = trio.run(swarm, args, replay, clock=trio.testing.MockClock(autojump_threshold=0))
        report["results"].append(result)
    report["total_s"] = round(time.perf_counter() - began, 1)
    json_path = (
        None
        if args.json == "-"
        else str(REPO_ROOT / args.json if not args.json.startswith("/") else args.json)
    )
    write_report(report, json_path, format_table(report))
    return 0 if report["results"][0]["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
