"""The ``p2ptrain`` command: keygen, id, node, average, ping, peers, status, authority, simulate.

(``node`` with a training config runs ``train_cli``; ``ping``, ``peers`` and ``status`` are
``query_cli``'s, ``authority`` is ``authority_cli``'s.)

Every failure a user can cause (bad flag, unreadable key, unreachable peer, refused handshake) ends
with one line on stderr that says what went wrong, and a non-zero exit status.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from . import __version__
from .errors import ConfigError, IdentityError, P2PError
from .identity import Identity, load_identity, load_or_create_identity, save_identity
from .net.address import PeerAddress
from .nodebase import (
    default_data_dir,
    lock_data_dir,
    parse_listen,
    validate_run_id,
)

if TYPE_CHECKING:  # (the training stack, torch included, is imported by the commands that run it)
    from .averaging import AveragerConfig
    from .node import Node, NodeConfig

log = logging.getLogger("p2ptrain")
T = TypeVar("T")


class UsageError(Exception):
    """A command-line problem reported as one line, exit status 2."""


class JsonFormatter(logging.Formatter):
    """One JSON object per line: for log collectors (``--log-format json``)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _setup_logging(level: str, fmt: str = "text") -> None:
    if fmt == "json":
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter())
        logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler])
        return
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def run_trio(fn: Callable[..., Awaitable[T]], *args: object) -> T:
    """``trio.run`` that re-raises a lone error instead of an exception group, for a one-line message."""
    try:
        return trio.run(fn, *args)
    except BaseExceptionGroup as group:
        leaves = _leaves(group)
        if len(leaves) == 1:
            raise leaves[0] from None
        raise


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def _parse_address(text: str) -> PeerAddress:
    try:
        return PeerAddress.parse(text)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _parse_join(text: str) -> PeerAddress:
    """A join address must name its peer: the node trusts its join peers' view of the swarm, so
    whoever answers at a bare HOST:PORT (another swarm, this very node) would be trusted."""
    addr = _parse_address(text)
    if addr.peer_id is None:
        raise UsageError(
            f"--join {text}: give the full address the peer printed (/ip4/HOST/tcp/PORT/p2p/PEER_ID);"
            " without its peer id, whoever answers there would be trusted"
        )
    return addr


# ---- keygen / id ---------------------------------------------------------------------------------


def cmd_keygen(args: argparse.Namespace) -> int:
    identity = Identity.generate()
    save_identity(identity, args.out, overwrite=args.force)
    print(identity.peer_id)
    return 0


def cmd_id(args: argparse.Namespace) -> int:
    print(load_identity(args.keyfile).peer_id)
    return 0


# ---- node ------------------------------------------------------------------------------------------


def _node_identity(args: argparse.Namespace) -> Identity:
    if args.identity:
        return load_identity(args.identity)
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
    _claim_data_dir(data_dir)
    identity, created = load_or_create_identity(data_dir / "identity.key")
    if created:
        log.info("created a new identity %s in %s", identity.peer_id, data_dir)
    return identity


_CLAIMED: set[Path] = set()  # data directories this command holds, for the life of the process


def _claim_data_dir(data_dir: Path) -> None:
    """Create the node's data directory and hold it (see ``node.lock_data_dir``) until the process ends
    (the identity and the node's configuration both ask for it: the first claims it)."""
    if data_dir.resolve() in _CLAIMED:
        return
    try:
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        lock_data_dir(data_dir)
        _CLAIMED.add(data_dir.resolve())
    except OSError as e:  # a file in the way, no such parent, no permission
        raise UsageError(f"--data-dir {data_dir}: cannot use it as a folder: {e.strerror or e}") from None
    except ConfigError as e:
        raise UsageError(str(e)) from None


def _announce(text: str | None) -> tuple[str | None, int | None]:
    """``HOST`` or ``HOST:PORT`` (``[V6]:PORT``) of --announce."""
    if not text:
        return None, None
    host, sep, port = text.rpartition(":")
    if sep and port.isdigit() and "]" not in port and (host.endswith("]") or ":" not in host):
        if not 0 < int(port) < 65536:
            raise UsageError(f"--announce {text!r}: port out of range")
        return host.strip("[]"), int(port)
    return text.strip("[]"), None


def _metrics_address(port: int | None) -> tuple[str, int] | None:
    if port is None:
        return None
    if not 0 <= port < 65536:
        raise UsageError(f"--metrics-port {port}: out of range")
    return ("0.0.0.0", port)


def _node_config(args: argparse.Namespace, averaging: AveragerConfig | None = None) -> NodeConfig:
    from .averaging import AveragerConfig
    from .node import NodeConfig

    announce_host, announce_port = _announce(args.announce)
    data_dir = Path(args.data_dir) if args.data_dir else None if args.identity else default_data_dir()
    if data_dir is not None:
        _claim_data_dir(data_dir)
    return NodeConfig(
        run_id=validate_run_id(args.run_id or "default"),
        listen=tuple(parse_listen(x) for x in (args.listen or ["0.0.0.0:31337"])),
        announce_host=announce_host,
        announce_port=announce_port,
        source_address=args.source_address,
        join=tuple(_parse_join(x) for x in args.join or []),
        status_file=Path(args.status_file) if args.status_file else None,
        peer_cache=data_dir / "peers.json" if data_dir is not None else None,
        metrics=_metrics_address(args.metrics_port),
        averaging=averaging or AveragerConfig(),
        relay=not args.no_relay,
        **_membership_options(args),
    )


def _run_node(fn: Callable[..., Awaitable[T]], node: Node, *args: object) -> T:
    try:
        result = run_trio(fn, node, *args)
    except OSError as e:
        listen = ", ".join(f"{h}:{p}" for h, p in node.config.listen)
        raise UsageError(f"cannot listen on {listen}: {e.strerror or e}") from None
    if node.join_refused.is_set():
        raise UsageError(f"cannot join the swarm: {node.join_refusal}")
    return result


async def stop_if_join_refused(node: Node, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` once every join address refused the node for good (another run id, another
    peer at that address): it would otherwise run alone; ``_run_node`` then says why and exits 2."""
    await node.join_refused.wait()
    scope.cancel()


async def print_join_addresses(node: Node) -> None:
    """Print the addresses others can join through, one per line on stdout, once a peer has dialed
    this node back there; a node nobody can dial prints none (the log says why and what to do)."""
    addresses = await node.dialable_addresses()
    for addr in addresses:
        print(addr, flush=True)
    if addresses:
        unchecked = {
            True: "",
            False: " (through a relay: no peer could dial this node directly)",
            None: " (not checked yet: the first peers it meets dial it back)",
        }[node.dht.reachable]
        log.info(
            "node %s is up in run %r; others join with --join and the address above%s",
            node.peer_id.short(),
            node.config.run_id,
            unchecked,
        )
    else:
        log.warning(
            "node %s is up in run %r, with no address others can join through",
            node.peer_id.short(),
            node.config.run_id,
        )


def cmd_node(args: argparse.Namespace) -> int:
    from .net.linger import raise_fd_limit

    raise_fd_limit()  # inbound slots and refused connections held open (see ``net.linger``)
    if args.config or args.task:
        from .train_cli import train_node

        return train_node(args)
    from .node import Node

    _run_node(_serve_node, Node(_node_identity(args), _node_config(args)))
    return 0


def cmd_average(args: argparse.Namespace) -> int:
    from .averaging import AveragerConfig
    from .node import Node

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
    node = Node(_node_identity(args), _node_config(args, averaging))
    committed = _run_node(_average_rounds, node, args)
    return 0 if committed or args.rounds == 0 else 1


async def _average_rounds(node: Node, args: argparse.Namespace) -> int:
    import torch

    from .averaging.synthetic import run_rounds

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


# ---- authority -------------------------------------------------------------------------------------


def _membership_options(args: argparse.Namespace) -> dict[str, Any]:
    """NodeConfig's ``authority`` and ``certificate`` from --authority and --certificate."""
    from .authority import load_certificate, parse_authority_key

    authority, cert_file = getattr(args, "authority", None), getattr(args, "certificate", None)
    if cert_file and not authority:
        raise UsageError("--certificate needs --authority (the public key of the run's authority)")
    return {
        "authority": parse_authority_key(authority) if authority else None,
        "certificate": load_certificate(cert_file) if cert_file else None,
    }


# ---- simulate --------------------------------------------------------------------------------------


def cmd_simulate(args: argparse.Namespace) -> int:
    from .simulate import SimulationOptions, run_simulation

    try:
        slowdown = tuple(float(x) for x in args.slowdown.split(",")) if args.slowdown else ()
    except ValueError:
        raise UsageError(
            f"--slowdown {args.slowdown!r}: expected numbers separated by commas, e.g. 1,1,2,4"
        ) from None
    opts = SimulationOptions(
        peers=args.peers,
        config=args.config,
        mode=args.mode,
        max_steps=args.max_steps,
        duration=args.duration,
        slowdown=slowdown,
        threads=args.threads,
        workdir=args.workdir,
        report=args.report,
        run_id=args.run_id,
        live=sys.stdout.isatty() and not args.no_live,
    )
    return run_simulation(opts)


# ---- parser ----------------------------------------------------------------------------------------


def _node_flags(s: argparse.ArgumentParser) -> None:
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
    g = s.add_argument_group("training")
    g.add_argument("--config", metavar="TOML", help="the run file (e.g. configs/tiny-gpt.toml)")
    g.add_argument("--task", metavar="MODULE:CALLABLE", help="train this task instead of the run file's")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (default cpu)")
    g.add_argument(
        "--local-workers",
        type=int,
        default=0,
        metavar="N",
        help="N more data-parallel workers on this host (its other GPUs; CPU processes on a CPU)",
    )
    g.add_argument(
        "--devices", metavar="LIST", help="one device per local worker, this one first: cuda:0,cuda:1"
    )
    g.add_argument("--local-timeout", type=float, default=30.0, help="seconds a local collective may take")
    g.add_argument("--mode", choices=["sync", "diloco"], help="override the run file's training.mode")
    g.add_argument("--resume", action="store_true", help="start from this node's newest checkpoint")
    g.add_argument("--max-steps", type=int, metavar="N", help="stop after N global steps")
    g.add_argument(
        "--duration", type=float, default=0.0, metavar="S", help="stop after S seconds of training"
    )
    g.add_argument("--threads", type=int, metavar="N", help="torch threads for compute")
    g.add_argument("--slowdown", type=float, default=1.0, help="compute N times slower (simulations)")
    g.add_argument("--metrics-file", metavar="PATH", help="append one JSON line of metrics per global step")
    g.add_argument(
        "--wait-peers", type=int, default=1, metavar="N", help="start training once N peers are in the run"
    )
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


_RUN_ID_HELP = (
    "the run the node is in (default: default); a training node's is its run file's [run] id, e.g. tiny-gpt"
)
_LOG_LEVELS = ["debug", "info", "warning", "error"]


def build_parser() -> argparse.ArgumentParser:
    from .query_cli import cmd_peers, cmd_ping, cmd_status

    p = argparse.ArgumentParser(prog="p2ptrain", description="Decentralized peer-to-peer training.")
    p.add_argument("--version", action="version", version=f"p2ptrain {__version__}")
    p.add_argument("--log-level", choices=_LOG_LEVELS, help="default: info for node, else warning")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("keygen", help="create an Ed25519 identity (key file mode 0600)")
    s.add_argument("--out", required=True, help="key file to create")
    s.add_argument("--force", action="store_true", help="overwrite an existing key file")
    s.set_defaults(func=cmd_keygen)

    s = sub.add_parser("id", help="print the peer id of a key file")
    s.add_argument("keyfile")
    s.set_defaults(func=cmd_id)

    s = sub.add_parser(
        "node",
        help="run a node: train with the swarm (--config/--task), or only help others find each other",
        description="With --config or --task the node trains the run's model with its swarm; without, it"
        " is a bootstrap node: it keeps the DHT and the peer list but trains nothing.",
    )
    _node_flags(s)
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
    s.set_defaults(func=cmd_average)

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
    s.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each answer (default 5)")
    s.set_defaults(func=cmd_peers)

    s = sub.add_parser("status", help="ask a node how it is doing (step, loss, rounds, traffic)")
    s.add_argument("address", help="the node's address")
    s.add_argument("--run-id", default="default", help=_RUN_ID_HELP)
    s.add_argument("--json", action="store_true", help="print its whole status as JSON")
    s.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer (default 5)")
    s.set_defaults(func=cmd_status)

    from .authority_cli import authority_parser

    authority_parser(sub)

    s = sub.add_parser(
        "simulate",
        help="train with a local swarm of real node processes, live, and write a report",
        description="Starts --peers `p2ptrain node` processes on this machine that train the run's model"
        " together (node 0 first, the others join it by its address), shows them live, and writes a report"
        " folder: per-peer JSON metrics, loss.png, summary.json.",
    )
    s.add_argument("--peers", type=int, default=4, help="number of nodes (default 4)")
    s.add_argument("--config", metavar="TOML", help="run file (default: the built-in tiny-gpt run)")
    s.add_argument("--mode", choices=["sync", "diloco"], help="override the run file's training.mode")
    s.add_argument(
        "--max-steps", type=int, default=40, help="global steps to train (default 40; 0: no limit)"
    )
    s.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (default: none)")
    s.add_argument("--slowdown", metavar="F,F,...", help="per-node compute slowdown, e.g. 1,1,2,4")
    s.add_argument("--threads", type=int, default=1, help="torch threads per node (default 1)")
    s.add_argument("--workdir", metavar="DIR", help="node folders (data, logs, status, metrics) go here")
    s.add_argument("--report", metavar="DIR", help="report folder (default WORKDIR/report)")
    s.add_argument("--run-id", help="default: the run file's")
    s.add_argument("--no-live", action="store_true", help="print the table every 10 s instead of live")
    s.set_defaults(func=cmd_simulate)
    for command in sub.choices.values():  # also after the command: p2ptrain node --log-level debug
        command.add_argument(
            "--log-level",
            choices=_LOG_LEVELS,
            default=argparse.SUPPRESS,
            help="default: info for node, else warning",
        )
    return p


def _fewer_malloc_arenas(arenas: int = 2) -> None:
    """glibc gives every thread that allocates its own heap (up to 8 per core); the compute, hashing
    and snapshot threads each grew one to the size of a model's tensors, and freed memory stayed
    spread over them: a 124M-parameter node peaked at 10.9x its fp32 parameter bytes, 8.2-8.9x with
    two arenas. Same as MALLOC_ARENA_MAX=2, which, if set, wins. No effect on other C libraries."""
    if sys.platform != "linux" or "MALLOC_ARENA_MAX" in os.environ:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-8, arenas)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass  # not glibc


def main(argv: Sequence[str] | None = None) -> int:
    _fewer_malloc_arenas()
    parser = build_parser()
    args = parser.parse_args(argv)
    verbose = args.command in ("node", "average", "simulate")
    _setup_logging(args.log_level or ("info" if verbose else "warning"), getattr(args, "log_format", "text"))
    try:
        return int(args.func(args))
    except UsageError as e:
        print(f"p2ptrain {args.command}: {e}", file=sys.stderr)
        return 2
    except (ConfigError, IdentityError) as e:
        print(f"p2ptrain {args.command}: {e}", file=sys.stderr)
        return 2
    except P2PError as e:
        print(f"p2ptrain {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"p2ptrain {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
