"""``p2ptrain ping | peers | status ADDR``: ask a peer or the swarm at one address, as a client that
joins nothing (a fresh identity, a client-only DHT peer)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import trio
from rich.console import Console
from rich.table import Table

from ..dht.peers import Member, list_members
from ..dht.service import DHT, DHTConfig
from ..errors import PeerUnavailable, RemoteProtocolError
from ..identity import Identity
from ..net.address import PeerAddress
from ..net.host import Host
from ..nodebase import PING, STATUS, PingRequest, StatusRequest, member_json, validate_run_id
from .common import parse_address, peer_list_buckets, run_trio


def cmd_ping(args: argparse.Namespace) -> int:
    addr = parse_address(args.address)
    validate_run_id(args.run_id)
    return run_trio(_ping, addr, args.run_id, args.count, args.timeout)


async def _ping(addr: PeerAddress, run_id: str, count: int, timeout: float) -> int:
    host = Host(Identity.generate(), run_id)
    async with trio.open_nursery() as nursery:
        await nursery.start(host.run, [])
        start = trio.current_time()
        conn = await host.connect(addr, timeout=timeout)
        setup = trio.current_time() - start
        print(
            f"connected to {conn.peer} at {addr.host}:{addr.port} (connect + handshake {setup * 1e3:.2f} ms)"
        )
        rtts = []
        for i in range(count):
            t0 = trio.current_time()
            await conn.call(PING, PingRequest(b"p" * 32), timeout=timeout)
            rtts.append(trio.current_time() - t0)
            print(f"ping {i + 1}: rtt {rtts[-1] * 1e3:.3f} ms")
        avg = sum(rtts) / len(rtts)
        print(f"{count} pings: min/avg/max {min(rtts) * 1e3:.3f}/{avg * 1e3:.3f}/{max(rtts) * 1e3:.3f} ms")
        nursery.cancel_scope.cancel()
    return 0


def cmd_peers(args: argparse.Namespace) -> int:
    addr = parse_address(args.address)
    validate_run_id(args.run_id)
    members = run_trio(_members_via, addr, args.run_id, args.timeout, peer_list_buckets(args.buckets))
    if args.json:
        print(json.dumps([member_json(m) for m in members], indent=2))
        return 0
    table = Table(title=f"run {args.run_id!r}: {len(members)} peer(s)")
    for col in ("peer id", "address", "reachable", "throughput", "last seen"):
        table.add_column(col)
    now = time.time()
    for m in members:
        table.add_row(
            str(m.peer_id),
            m.record.addresses[0] if m.record.addresses else "-",
            "yes" if m.record.reachable else "client-only",
            f"{m.record.throughput:.1f}/s",
            f"{max(0.0, now - m.record.published):.0f} s ago",
        )
    Console(width=max(Console().width, 160)).print(table)
    return 0


async def _members_via(addr: PeerAddress, run_id: str, timeout: float, buckets: int = 1) -> list[Member]:
    """Ask the swarm at ``addr`` for the run's members, as a client-only DHT peer (every bucket's of a
    list spread over ``buckets`` keys)."""
    host = Host(Identity.generate(), run_id)
    dht = DHT(host, config=DHTConfig(client_only=True, rpc_timeout=timeout))
    async with trio.open_nursery() as nursery:
        await nursery.start(host.run, [])
        with trio.fail_after((3 + buckets) * timeout):  # (each bucket of the list a read)
            await host.connect(addr, timeout=timeout)  # a refusal says why (another run id, another peer)
            if not await dht.bootstrap([addr], attempts=1):
                raise PeerUnavailable(f"no answer from {addr}")
            members = await list_members(dht, run_id, buckets=buckets)
        nursery.cancel_scope.cancel()
    return members


def cmd_status(args: argparse.Namespace) -> int:
    addr = parse_address(args.address)
    validate_run_id(args.run_id)
    status = run_trio(_status_of, addr, args.run_id, args.timeout)
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    from ..training.loop.console import node_table

    console = Console(width=max(Console().width, 120))
    peer = str(status.get("peer_id", "?"))
    traffic = status.get("traffic", {})
    connected, members = len(status.get("connected_peers", [])), len(status.get("members", []))
    sent, received = traffic.get("bytes_sent", 0) / 1e6, traffic.get("bytes_received", 0) / 1e6
    console.print(
        f"node {peer} in run {status.get('run_id')!r}: {status.get('state')}, {connected} connected, "
        f"{members} members known, {sent:.1f} MB sent, {received:.1f} MB received"
    )
    if status.get("training"):
        console.print(node_table(peer[:12], status["training"]))
    else:
        console.print("(this node does not train)")
    return 0


async def _status_of(addr: PeerAddress, run_id: str, timeout: float) -> dict[str, Any]:
    host = Host(Identity.generate(), run_id)
    async with trio.open_nursery() as nursery:
        await nursery.start(host.run, [])
        conn = await host.connect(addr, timeout=timeout)
        reply = await conn.call_with_body(STATUS, StatusRequest(), timeout=timeout)
        nursery.cancel_scope.cancel()
    try:
        status = json.loads(bytes(reply.body))
    except ValueError:
        raise RemoteProtocolError(f"{addr.peer_id} answered with a status that is not JSON") from None
    if not isinstance(status, dict):
        raise RemoteProtocolError(f"{addr.peer_id} answered with a status that is not a JSON object")
    return status


_RUN_ID_HELP = (
    "the run the node is in (default: default); a training node's is its run file's [run] id, e.g. tiny-gpt"
)


def add_parsers(sub: Any) -> None:
    """The ``ping``, ``peers`` and ``status`` commands' parsers, under ``sub`` (the command's subparsers)."""
    s = sub.add_parser("ping", help="connect to a peer, complete the handshake, measure round trips")
    s.add_argument("address", help="/ip4/HOST/tcp/PORT/p2p/PEERID (or HOST:PORT, unverified)")
    s.add_argument("--run-id", default="default", help=_RUN_ID_HELP)
    s.add_argument("--count", type=int, default=3, help="round trips to measure (default 3)")
    s.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each answer (default 5)")
    s.set_defaults(func=cmd_ping)

    s = sub.add_parser("peers", help="ask the swarm at ADDR who is in the run")
    s.add_argument("address", help="any member's address")
    s.add_argument("--run-id", default="default", help=_RUN_ID_HELP)
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.add_argument(
        "--buckets",
        type=int,
        default=1,
        help="keys the run's peer list spreads over: the run's progress.buckets (default 1)",
    )
    s.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each answer (default 5)")
    s.set_defaults(func=cmd_peers)

    s = sub.add_parser("status", help="ask a node how it is doing (step, loss, rounds, traffic)")
    s.add_argument("address", help="the node's address")
    s.add_argument("--run-id", default="default", help=_RUN_ID_HELP)
    s.add_argument("--json", action="store_true", help="print its whole status as JSON")
    s.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer (default 5)")
    s.set_defaults(func=cmd_status)
