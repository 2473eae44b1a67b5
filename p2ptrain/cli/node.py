"""``p2ptrain node`` and ``p2ptrain average``: a node that only helps others find each other (a bootstrap
node), or one that averages synthetic tensors with its peers round after round. ``p2ptrain node`` with a
run file or a task trains: see :mod:`p2ptrain.cli.train`, whose flags are declared here with the
command's."""

from __future__ import annotations

import argparse
import signal
from typing import TYPE_CHECKING, Any

import trio

from .common import (
    UsageError,
    log,
    node_config,
    node_identity,
    node_settings,
    peer_list_buckets,
    print_join_addresses,
    run_node,
    stop_if_join_refused,
)

if TYPE_CHECKING:  # (the training stack, torch included, is imported by the commands that run it)
    from ..averaging import AveragerConfig
    from ..node import Node


def _bootstrap_node(args: argparse.Namespace, averaging: AveragerConfig | None = None) -> Node:
    """A node started without a run file: its flags over the defaults."""
    from ..node import Node

    settings = node_settings(args)
    identity = node_identity(settings)
    run_id = args.run_id or "default"
    buckets = peer_list_buckets(args.buckets or 1)
    return Node(
        identity,
        node_config(
            settings, run_id=run_id, authority=args.authority, averaging=averaging, peer_list_buckets=buckets
        ),
    )


def cmd_node(args: argparse.Namespace) -> int:
    from ..net.linger import raise_fd_limit

    raise_fd_limit()  # inbound slots and refused connections held open (see ``net.linger``)
    if args.config or args.task:
        from .train import train_node

        if args.buckets is not None:
            raise UsageError(
                "--buckets is a bootstrap node's: a training node's is its run's progress.buckets"
            )

        return train_node(args)
    run_node(_serve_node, _bootstrap_node(args))
    return 0


async def _serve_node(node: Node) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            nursery.start_soon(print_join_addresses, node)
            nursery.start_soon(stop_if_join_refused, node, nursery.cancel_scope)
            async for signum in signals:
                log.info("received %s: shutting down", signal.Signals(signum).name)
                await node.leave()
                nursery.cancel_scope.cancel()
                break
    log.info("node stopped")


def cmd_average(args: argparse.Namespace) -> int:
    from ..averaging import AveragerConfig

    try:
        averaging = AveragerConfig(
            target_size=args.group_size,
            min_size=args.min_size or args.group_size,
            matchmaking_time=args.matchmaking_time,
            bandwidth=args.bandwidth * 1e6,
            compression=args.compression,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.mb < 0 or args.rounds < 0:
        raise UsageError("--mb and --rounds must not be negative")
    node = _bootstrap_node(args, averaging)
    committed = run_node(_average_rounds, node, args)
    return 0 if committed or args.rounds == 0 else 1


async def _average_rounds(node: Node, args: argparse.Namespace) -> int:
    import torch

    from ..averaging.synthetic import run_rounds

    # Chunk-sized tensor ops gain nothing from a thread pool, and pools of processes sharing cores
    # spin against each other.
    torch.set_num_threads(1)

    lines: list[dict[str, object]] = []
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            nursery.start_soon(print_join_addresses, node)  # (checked ones: rounds need not wait)
            with trio.CancelScope() as rounds:
                nursery.start_soon(stop_if_join_refused, node, rounds)

                async def stop_on_signal() -> None:
                    async for signum in signals:
                        log.info(
                            "received %s: stopping (a round in progress is abandoned)",
                            signal.Signals(signum).name,
                        )
                        rounds.cancel()
                        return

                nursery.start_soon(stop_on_signal)
                numel = int(args.mb * 1e6) // 4
                await run_rounds(
                    node,
                    numel=numel,
                    rounds=args.rounds,
                    timeout=args.timeout,
                    compression=args.compression,
                    lines=lines,
                    wait_peers=args.wait_peers,
                )
            if not rounds.cancelled_caught:
                with trio.move_on_after(args.timeout):  # slower members may still be fetching from us
                    await node.averager.wait_idle()
            await node.leave()
            nursery.cancel_scope.cancel()
    log.info("averaging stopped")
    return sum("error" not in line for line in lines)


# ---- parsers -----------------------------------------------------------------------------------------


def _node_flags(s: argparse.ArgumentParser) -> None:
    """The flags of any node; a training node's run file may give them in its ``[node]`` section (a
    flag given wins: see ``config.NodeSection``)."""
    s.add_argument("--listen", action="append", metavar="HOST:PORT", help="default 0.0.0.0:31337; repeatable")
    s.add_argument(
        "--announce",
        metavar="HOST[:PORT]",
        help="host (and port) to put in the join address (behind NAT, in containers, behind a relay)",
    )
    s.add_argument(
        "--source-address", metavar="IP", help="outgoing connections leave from this local address"
    )
    s.add_argument("--join", action="append", metavar="ADDR", help="a peer's address; repeatable")
    s.add_argument(
        "--no-relay",
        action="store_true",
        help="do not relay for peers behind NATs (on by default, with limits on circuits and bytes)",
    )
    s.add_argument("--identity", metavar="KEYFILE", help="key file (default: one kept in the data directory)")
    s.add_argument(
        "--data-dir", metavar="DIR", help="default $XDG_DATA_HOME/p2ptrain or ~/.local/share/p2ptrain"
    )
    s.add_argument(
        "--run-id", help="peers only talk within the same run id (default: the run file's, else default)"
    )
    s.add_argument("--status-file", metavar="PATH", help="JSON status, rewritten atomically every second")
    s.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve the live swarm page (/), Prometheus /metrics and /healthz over HTTP here",
    )
    s.add_argument("--log-format", choices=["text", "json"], default="text", help="json: one object per line")
    s.add_argument(
        "--authority",
        metavar="PUBKEY",
        help="a private run: its authority's public key (`p2ptrain authority init` prints it); peers"
        " without a valid membership certificate are refused",
    )
    s.add_argument("--certificate", metavar="FILE", help="this node's membership certificate (private runs)")


def _training_flags(s: argparse.ArgumentParser) -> None:
    # (the flags that the run file's [node] section may give have no argparse default: left out, they
    # are None, and the section's value or its default applies)
    g = s.add_argument_group("training")
    g.add_argument("--config", metavar="TOML", help="the run file (e.g. configs/tiny-gpt.toml)")
    g.add_argument("--task", metavar="MODULE:CALLABLE", help="train this task instead of the run file's")
    g.add_argument("--device", help="cpu, cuda, cuda:N (default cpu)")
    g.add_argument(
        "--local-workers",
        type=int,
        metavar="N",
        help="N more data-parallel workers on this host (its other GPUs; CPU processes on a CPU)",
    )
    g.add_argument(
        "--devices", metavar="LIST", help="one device per local worker, this one first: cuda:0,cuda:1"
    )
    g.add_argument("--local-timeout", type=float, help="seconds a local collective may take")
    g.add_argument(
        "--shard",
        type=int,
        metavar="N",
        help="a sharded site of N ranks on this host (FSDP2; DiLoCo runs): one peer, the model in N shards",
    )
    g.add_argument("--mode", choices=["sync", "diloco"], help="override the run file's training.mode")
    g.add_argument("--resume", action="store_true", help="start from this node's newest checkpoint")
    g.add_argument("--max-steps", type=int, metavar="N", help="stop after N global steps")
    g.add_argument(
        "--duration", type=float, default=0.0, metavar="S", help="stop after S seconds of training"
    )
    g.add_argument("--threads", type=int, metavar="N", help="torch threads for compute")
    g.add_argument("--slowdown", type=float, default=1.0, help="compute N times slower (simulations)")
    g.add_argument("--metrics-file", metavar="PATH", help="append one JSON line of metrics per global step")
    g.add_argument("--wait-peers", type=int, metavar="N", help="start training once N peers are in the run")
    g.add_argument(
        "--bandwidth", type=float, metavar="MB/S", help="this host's MB/s, sets its share (0: measure it)"
    )
    g.add_argument(
        "--tracker", choices=["tensorboard", "mlflow"], help="also log the metrics there (if it is installed)"
    )
    g.add_argument("--adversary", help=argparse.SUPPRESS)  # simulations only: see p2ptrain.testing.adversary
    g.add_argument(
        "--no-live",
        action="store_true",
        help="plain log lines instead of the live view (default off a terminal)",
    )


def add_parsers(sub: Any) -> None:
    """The ``node`` and ``average`` commands' parsers, under ``sub`` (the command's subparsers)."""
    s = sub.add_parser(
        "node",
        help="run a node: train with the swarm (--config/--task), or only help others find each other",
        description="With --config or --task the node trains the run's model with its swarm; without, it"
        " is a bootstrap node: it keeps the DHT and the peer list but trains nothing.",
    )
    _node_flags(s)
    s.add_argument(
        "--buckets",
        type=int,
        metavar="B",
        help="a bootstrap node of a run whose peer list is spread: the run's progress.buckets (default 1;"
        " a training node takes its run file's)",
    )
    _training_flags(s)
    s.set_defaults(func=cmd_node)

    s = sub.add_parser(
        "average",
        help="run a node that averages synthetic tensors with its peers, round after round",
        description="A check of connectivity and speed: each round prints one JSON line (time, group,"
        " contributors, who was left out and why, error against the exact mean).",
    )
    _node_flags(s)
    s.add_argument("--mb", type=float, default=10.0, help="megabytes of float32 to average (default 10)")
    s.add_argument("--rounds", type=int, default=3, help="rounds to run; 0: until stopped (default 3)")
    s.add_argument("--group-size", type=int, default=2, help="target group size (default 2)")
    s.add_argument("--min-size", type=int, help="smallest group worth a round (default: the target)")
    s.add_argument("--timeout", type=float, default=60.0, help="seconds one round may take (default 60)")
    s.add_argument("--matchmaking-time", type=float, default=5.0, help="seconds a leader gathers (default 5)")
    s.add_argument(
        "--bandwidth", type=float, default=0.0, help="this host's MB/s, sets its share (default 0: measure)"
    )
    s.add_argument(
        "--compression", default="none", help="none, fp16, bf16, int8 or a top-k mode such as topk1-q2"
    )
    s.add_argument("--wait-peers", type=int, default=1, help="start once this many members are known")
    s.set_defaults(func=cmd_average, buckets=None)  # (its peer list: one key)
