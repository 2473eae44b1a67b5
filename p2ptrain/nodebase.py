"""The parts of a node that need no training stack: its built-in methods (ping, info, status), its data
folder and the checks of its settings. The command line's light commands (``ping``, ``peers``,
``status``, ``id``, ``keygen``) import only these and the network, so they start without torch."""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .dht.peers import Member
from .errors import ConfigError
from .net.address import PeerAddress
from .net.handshake import MAX_RUN_ID
from .net.rpc import Method
from .wire.schema import Message, bounded

# ---- built-in methods --------------------------------------------------------------------------


@dataclass(frozen=True)
class PingRequest(Message):
    payload: bytes = bounded(b"", max_len=1024)


@dataclass(frozen=True)
class PingResponse(Message):
    payload: bytes = bounded(b"", max_len=1024)


@dataclass(frozen=True)
class InfoRequest(Message):
    pass


@dataclass(frozen=True)
class NodeInfo(Message):
    peer_id: str = bounded(max_len=64)
    run_id: str = bounded(max_len=MAX_RUN_ID)
    version: str = bounded(max_len=32)
    protocol: int = bounded(ge=0, le=2**31)
    addresses: tuple[str, ...] = bounded((), max_len=16)
    connected_peers: int = bounded(0, ge=0, le=2**31)
    uptime: float = bounded(0.0, ge=0.0)


@dataclass(frozen=True)
class StatusRequest(Message):
    pass


@dataclass(frozen=True)
class StatusResponse(Message):
    format: str = bounded("json", max_len=16)  # the body: the node's status as JSON


PING = Method("p2p.ping", PingRequest, PingResponse)
INFO = Method("p2p.info", InfoRequest, NodeInfo)
STATUS = Method("p2p.status", StatusRequest, StatusResponse)
MAX_STATUS_BYTES = 512 * 1024

# ---- configuration -----------------------------------------------------------------------------


def default_data_dir() -> Path:
    """``$XDG_DATA_HOME/p2ptrain``, else ``~/.local/share/p2ptrain``."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "p2ptrain"


def lock_data_dir(path: Path) -> Callable[[], None]:
    """Hold ``path`` (an existing folder) and return the function that lets it go, or raise ConfigError
    if another node holds it, in this process or another: two nodes in one data directory share one
    identity (so each refuses to dial the other) and write into one checkpoints folder. The lock
    (``flock`` on ``path/lock``, which is per open file, so a second claim from this process fails too)
    goes when the release is called or the process ends, however it ends; the file keeps the holder's
    pid for the message."""
    path = path.resolve()
    fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        mine = holder == str(os.getpid())
        raise ConfigError(
            f"data directory {path} is in use by another node "
            f"{'in this process' if mine else 'on this machine'}"
            f"{f' (pid {holder})' if holder.isdigit() and not mine else ''}: give each node its own"
            f" {'data_dir' if mine else '--data-dir'}{'' if mine else ' (and its own --listen port)'}"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

    def release() -> None:
        nonlocal fd
        if fd >= 0:
            os.close(fd)  # (closing the only descriptor of the open file drops its flock)
            fd = -1

    return release


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` (port 0 picks a free one)."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"bad listen address {text!r}: expected HOST:PORT, e.g. 0.0.0.0:31337")
    return host, int(port)


def parse_join_address(text: str) -> PeerAddress:
    """A join address, which must name its peer: a node trusts its join peers' view of the swarm, so
    whoever answers at a bare HOST:PORT (another swarm, this very node) would be trusted. ValueError: not
    an address; ConfigError: no peer id in it."""
    addr = PeerAddress.parse(text)
    if addr.peer_id is None:
        raise ConfigError(
            f"{text}: give the full address the peer printed (/ip4/HOST/tcp/PORT/p2p/PEER_ID);"
            " without its peer id, whoever answers there would be trusted"
        )
    return addr


def parse_announce(text: str) -> tuple[str, int | None]:
    """``HOST``, ``HOST:PORT`` or ``[V6]:PORT``: the host (and port) to put in the join address."""
    host, sep, port = text.rpartition(":")
    if sep and port.isdigit() and "]" not in port and (host.endswith("]") or ":" not in host):
        if not 0 < int(port) < 65536:
            raise ConfigError(f"{text!r}: port out of range")
        return host.strip("[]"), int(port)
    return text.strip("[]"), None


def validate_run_id(run_id: str) -> str:
    if not 0 < len(run_id) <= MAX_RUN_ID or not run_id.isprintable():
        raise ConfigError(f"run id must be 1-{MAX_RUN_ID} printable characters")
    return run_id


def public_status(status: dict[str, Any]) -> bytes:
    """What a node tells anyone who asks (``p2ptrain status``): its status without the network addresses
    of the peers it talks to, and at most ``MAX_STATUS_BYTES`` of it."""
    shown = dict(status)
    shown["connections"] = [
        {k: v for k, v in c.items() if k != "remote"} for c in status.get("connections", [])
    ]
    shown.pop("pid", None)
    data = json.dumps(shown).encode()
    if len(data) > MAX_STATUS_BYTES:  # a crowded node: the first connections and members only
        shown["connections"] = shown["connections"][:16]
        shown["members"] = shown.get("members", [])[:64]
        data = json.dumps(shown).encode()
    if len(data) > MAX_STATUS_BYTES:
        keep = ("peer_id", "run_id", "state", "version", "traffic", "training")
        data = json.dumps({k: shown[k] for k in keep if k in shown}).encode()
    return data


def member_json(m: Member) -> dict[str, Any]:
    """A member of the run as plain JSON (status file, ``p2ptrain peers --json``)."""
    return {
        "peer_id": str(m.peer_id),
        "addresses": list(m.record.addresses),
        "reachable": m.record.reachable,
        "throughput": m.record.throughput,
        "version": m.record.version,
        "last_seen": m.record.published,
        "expires": m.expiry,
    }
