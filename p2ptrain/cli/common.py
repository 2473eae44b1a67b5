"""What the command groups share: the one-line usage error, running trio, reading a node's flags, and
starting a node (identity, data folder, settings) and watching it (join addresses, a refused join).

Every command module imports this one and nothing of each other's.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from ..errors import ConfigError
from ..identity import Identity, load_identity, load_or_create_identity
from ..net.address import PeerAddress
from ..nodebase import (
    default_data_dir,
    lock_data_dir,
    parse_announce,
    parse_join_address,
    parse_listen,
    validate_run_id,
)

if TYPE_CHECKING:  # (the training stack, torch included, is imported by the commands that run it)
    from ..averaging import AveragerConfig
    from ..config import NodeSection
    from ..node import Node, NodeConfig

log = logging.getLogger("p2ptrain")
T = TypeVar("T")


class UsageError(Exception):
    """A command-line problem reported as one line, exit status 2."""


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


def parse_address(text: str) -> PeerAddress:
    try:
        return PeerAddress.parse(text)
    except ValueError as e:
        raise UsageError(str(e)) from None


# ---- a node's flags ---------------------------------------------------------------------------------


def announce_flag(text: str | None) -> tuple[str | None, int | None]:
    """``HOST`` or ``HOST:PORT`` (``[V6]:PORT``) of --announce."""
    if not text:
        return None, None
    try:
        return parse_announce(text)
    except ConfigError as e:
        raise UsageError(f"--announce {e}") from None


def _join_flag(text: str) -> PeerAddress:
    try:
        return parse_join_address(text)
    except ValueError as e:
        raise UsageError(str(e)) from None
    except ConfigError as e:
        raise UsageError(f"--join {e}") from None


def _metrics_port_flag(port: int | None) -> int | None:
    if port is not None and not 0 <= port < 65536:
        raise UsageError(f"--metrics-port {port}: out of range")
    return port


def _path(text: str | None) -> Path | None:
    return Path(text) if text else None


def node_flags(args: argparse.Namespace, *, training: bool = False) -> dict[str, Any]:
    """The ``[node]`` keys as the command line gives them, parsed, as
    :func:`~p2ptrain.config.with_flags` takes them: None for each flag left out, and for the training
    flags (device, workers, ...) unless ``training`` (``p2ptrain node`` with a run file or a task)."""
    flags = {
        "listen": tuple(parse_listen(x) for x in args.listen) if args.listen else None,
        "announce": announce_flag(args.announce) if args.announce else None,
        "source_address": args.source_address,
        "join": tuple(_join_flag(x) for x in args.join) if args.join else None,
        "relay": False if args.no_relay else None,
        "identity": _path(args.identity),
        "data_dir": _path(args.data_dir),
        "status_file": _path(args.status_file),
        "metrics_port": _metrics_port_flag(args.metrics_port),
        "certificate": _path(args.certificate),
    }
    if not training:
        return flags
    if args.local_workers is not None and args.local_workers < 0:
        raise UsageError("--local-workers must not be negative")
    if args.wait_peers is not None and args.wait_peers < 1:
        raise UsageError("--wait-peers must be at least 1")
    devices = None
    if args.devices is not None:
        devices = tuple(d.strip() for d in args.devices.split(",") if d.strip())
        if not devices:
            raise UsageError("--devices: give a comma-separated list, e.g. cuda:0,cuda:1")
    return flags | {
        "device": args.device,
        "devices": devices,
        "local_workers": args.local_workers,
        "shard": getattr(args, "shard", None),
        "local_timeout": args.local_timeout,
        "wait_peers": args.wait_peers,
        "metrics_file": _path(args.metrics_file),
        "tracker": args.tracker,
    }


def node_settings(
    args: argparse.Namespace, section: NodeSection | None = None, *, training: bool = False
) -> NodeSection:
    """The node's settings: the flags given over ``section`` (the run file's ``[node]``; without a run
    file, the defaults), by the one rule of :class:`~p2ptrain.config.NodeSection`."""
    from ..config import NodeSection, with_flags  # (the run file's settings name the averaging stack)

    return with_flags(section or NodeSection(), **node_flags(args, training=training))


# ---- starting a node ----------------------------------------------------------------------------------


def data_folder(settings: NodeSection) -> Path | None:
    """The node's data folder, claimed (see :func:`claim_data_dir`): ``data_dir``, else the default one,
    unless the node was given a key file and no folder (then it keeps nothing)."""
    folder = settings.data_dir
    if folder is None and settings.identity is None:
        folder = default_data_dir()
    if folder is not None:
        claim_data_dir(folder)
    return folder


def node_identity(settings: NodeSection) -> Identity:
    if settings.identity is not None:
        return load_identity(settings.identity)
    folder = data_folder(settings)
    assert folder is not None  # (no key file: the default folder at least)
    identity, created = load_or_create_identity(folder / "identity.key")
    if created:
        log.info("created a new identity %s in %s", identity.peer_id, folder)
    return identity


_CLAIMED: set[Path] = set()  # data directories this command holds, for the life of the process


def claim_data_dir(data_dir: Path) -> None:
    """Create the node's data directory and hold it (see ``nodebase.lock_data_dir``) until the process
    ends (the identity and the node's configuration both ask for it: the first claims it)."""
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


def peer_list_buckets(buckets: int) -> int:
    """``--buckets``: the keys a run's peer list spreads over, its ``progress.buckets`` (a power of 2)."""
    if buckets < 1 or buckets & (buckets - 1):
        raise UsageError(f"--buckets must be a power of 2 (the run's progress.buckets), not {buckets}")
    return buckets


def node_config(
    settings: NodeSection,
    *,
    run_id: str,
    authority: str | None,
    averaging: AveragerConfig | None = None,
    peer_list_buckets: int = 1,
) -> NodeConfig:
    """The node's configuration from its settings, the run it is in and the run's authority (a private
    run's public key, or none); ``peer_list_buckets``: the run's ``progress.buckets``."""
    from ..averaging import AveragerConfig
    from ..node import NodeConfig

    folder = data_folder(settings)
    host, port = settings.announce or (None, None)
    return NodeConfig(
        run_id=validate_run_id(run_id),
        listen=settings.listen,
        announce_host=host,
        announce_port=port,
        source_address=settings.source_address or None,
        join=settings.join,
        status_file=settings.status_file,
        peer_cache=folder / "peers.json" if folder is not None else None,
        metrics=("0.0.0.0", settings.metrics_port) if settings.metrics_port is not None else None,
        averaging=averaging or AveragerConfig(),
        relay=settings.relay,
        peer_list_buckets=peer_list_buckets,
        **_membership(authority, settings.certificate),
    )


def _membership(authority: str | None, certificate: Path | None) -> dict[str, Any]:
    """NodeConfig's ``authority`` and ``certificate`` (from --authority or the run file's, and
    --certificate or the ``[node]`` section's)."""
    from ..authority import load_certificate, parse_authority_key

    if certificate and not authority:
        raise UsageError("--certificate needs --authority (the public key of the run's authority)")
    return {
        "authority": parse_authority_key(authority) if authority else None,
        "certificate": load_certificate(certificate) if certificate else None,
    }


def run_node(fn: Callable[..., Awaitable[T]], node: Node, *args: object) -> T:
    """Run ``fn(node, *args)`` under trio; a port in use or a join refused for good is one line."""
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
    peer at that address): it would otherwise run alone; ``run_node`` then says why and exits 2."""
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
