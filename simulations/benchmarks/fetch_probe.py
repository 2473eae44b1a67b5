"""State-download throughput alone: one donor process serves a synthetic state, one joiner fetches it.

No training runs (unless ``--busy``: a thread in each process keeps one core busy with torch work, as a
training loop would), so this isolates what the download protocol gets out of a link: the state-sync
benchmark (``bench_statesync``) measures the same inside a real swarm, where donors and joiner also
compute on this machine's two cores.

    python -m simulations.fetch_probe [--mb 400] [--rate-mbit 100] [--busy] [--donors 1] [--ping]

Prints JSON: bytes, seconds, Mbit/s and the fraction of the link rate. ``--ping``: the joiner pings its
first donor every 0.25 s while it downloads, over the connection that carries the state, and the JSON
adds the pings' round trips (a control message behind the download's bulk: see ``channel.DrainRate``).
Needs root (namespaces).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import threading
import time

import torch
import trio

from p2ptrain import Node, NodeConfig
from p2ptrain.config import RunConfig
from p2ptrain.identity import Identity
from p2ptrain.net.address import PeerAddress
from p2ptrain.net.connection import Connection
from p2ptrain.training.optimizer import CollaborativeOptimizer
from p2ptrain.training.optimizer.progress import PeerProgress, ProgressRecord
from p2ptrain.training.state.download import Fetcher

PORT = 4100


def _identity(name: str) -> Identity:
    return Identity.from_seed(hashlib.blake2b(name.encode(), digest_size=32).digest())


def _model(mb: int) -> torch.nn.Module:
    torch.manual_seed(0)
    width = 1024
    layers = max(1, mb * (1 << 20) // (4 * width * width))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])


def _busy(stop: threading.Event) -> None:
    a = torch.randn(512, 512)
    while not stop.is_set():
        a = torch.tanh(a @ a.T / 512)


def _optimizer(node: Node, mb: int) -> CollaborativeOptimizer:
    model = _model(mb)
    config = RunConfig().replace("training", mode="sync")
    return CollaborativeOptimizer(node, model, torch.optim.SGD(model.parameters(), lr=0.1), config)


async def donor(args: argparse.Namespace) -> None:
    node = Node(_identity(f"donor{args.index}"), NodeConfig(run_id="probe", listen=((args.host, PORT),)))
    opt = _optimizer(node, args.mb)
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        await nursery.start(opt.run)
        print(json.dumps({"addr": str(node.addresses[0]), "digest": opt.digest.hex()}), flush=True)
        await trio.sleep_forever()


async def joiner(args: argparse.Namespace) -> None:
    node = Node(_identity("joiner"), NodeConfig(run_id="probe", listen=((args.host, PORT),)))
    opt = _optimizer(node, args.mb)
    donors = [json.loads(d) for d in args.donor]
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        records = []
        for d in donors:
            record = ProgressRecord(epoch=0, samples=0, rate=0.0, time=0.0, addr=d["addr"])
            records.append(PeerProgress(PeerAddress.parse(d["addr"]).peer_id, record))
        f = Fetcher(node.host, max_size=opt.max_state_bytes(), chunk_timeout=30.0, max_donors=4)
        rtts: list[float] = []
        if args.ping:
            conn = await node.host.connect(PeerAddress.parse(donors[0]["addr"]))
            nursery.start_soon(_ping_every, conn, PING_EVERY, rtts)
        began = time.monotonic()
        got = await f.fetch(records, want_epoch=0, expected=lambda e: bytes.fromhex(donors[0]["digest"]))
        took = time.monotonic() - began
        size = sum(t.numel() * t.element_size() for t in got.tensors.values())
        out: dict[str, object] = {
            "bytes": size,
            "seconds": round(took, 2),
            "mbit": round(size * 8 / took / 1e6, 1),
        }
        if args.ping:
            ordered = sorted(rtts)
            out |= {
                "pings": len(rtts),
                "ping_median_s": round(statistics.median(ordered), 3) if ordered else None,
                "ping_p90_s": round(ordered[int(0.9 * (len(ordered) - 1))], 3) if ordered else None,
                "ping_max_s": round(ordered[-1], 3) if ordered else None,
                "ping_series_s": [round(r, 3) for r in rtts],
            }
        print(json.dumps(out))
        nursery.cancel_scope.cancel()


PING_EVERY = 0.25


async def _ping_every(conn: Connection, seconds: float, into: list[float]) -> None:
    """Ping over ``conn`` every ``seconds`` (after each answer), each round trip into ``into``."""
    while True:
        into.append(await conn.ping(timeout=60.0))
        await trio.sleep(seconds)


def lab_main(args: argparse.Namespace) -> int:
    from simulations.labs.netns import NetnsLab, read_line

    with NetnsLab(args.donors + 1, args.rate_mbit, prefix="p2pprobe") as lab:
        procs, lines = [], []
        for i in range(args.donors):
            argv = [sys.executable, "-m", "simulations.fetch_probe", "--role", "donor", "--index", str(i)]
            argv += ["--host", lab.address(i), "--mb", str(args.mb)] + (["--busy"] if args.busy else [])
            procs.append(lab.popen(i, argv, stdout=-1, text=True))
            lines.append(read_line(procs[-1], 120))
        argv = [sys.executable, "-m", "simulations.fetch_probe", "--role", "joiner", "--host"]
        argv += [lab.address(args.donors), "--mb", str(args.mb)] + (["--busy"] if args.busy else [])
        argv += ["--ping"] if args.ping else []
        for line in lines:
            argv += ["--donor", line]
        out = lab.run(args.donors, argv, timeout=1800, capture_output=True, text=True)
        if out.returncode or not out.stdout.strip():
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        result = json.loads(out.stdout.strip().splitlines()[-1])
        result |= {"donors": args.donors, "rate_mbit": args.rate_mbit, "busy": args.busy}
        result["fraction_of_link"] = round(result["mbit"] / args.rate_mbit, 3)
        print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulations.fetch_probe", description=__doc__)
    parser.add_argument("--role", choices=["lab", "donor", "joiner"], default="lab")
    parser.add_argument("--mb", type=int, default=400, help="state size in MB (default 400)")
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--donors", type=int, default=1)
    parser.add_argument("--busy", action="store_true", help="keep a core busy in every process")
    parser.add_argument("--ping", action="store_true", help="ping the first donor while downloading")
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--donor", action="append", default=[])
    args = parser.parse_args(argv)
    if args.role == "lab":
        return lab_main(args)
    torch.set_num_threads(1)
    stop = threading.Event()
    if args.busy:
        threading.Thread(target=_busy, args=(stop,), daemon=True).start()
    try:
        trio.run(donor if args.role == "donor" else joiner, args)
    finally:
        stop.set()
    return 0


if __name__ == "__main__":
    sys.exit(main())
