"""The node: a host, its built-in methods, join maintenance and the status file, under one nursery.

Theory of operation: ``Node.run`` starts the host (listeners and connections), one task per join
address that keeps a connection to it open (reconnecting with capped exponential backoff and jitter),
and a task that rewrites the JSON status file atomically every ``status_interval`` seconds. Cancelling
``run`` closes every connection gracefully (peers hear ``shutting down``) and writes a final status
with ``state: "stopped"``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from . import __version__
from .errors import ConfigError, HandshakeRefused, P2PError
from .identity import Identity
from .net.address import PeerAddress, outward_ip
from .net.connection import Connection
from .net.handshake import MAX_RUN_ID, PROTOCOL_VERSION
from .net.host import Host, HostConfig
from .net.rpc import CallContext, Method, RpcRegistry
from .net.transport import Transport
from .wire.schema import Message, bounded

log = logging.getLogger(__name__)


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


PING = Method("p2p.ping", PingRequest, PingResponse)
INFO = Method("p2p.info", InfoRequest, NodeInfo)


# ---- configuration -----------------------------------------------------------------------------


def default_data_dir() -> Path:
    """``$XDG_DATA_HOME/p2ptrain``, else ``~/.local/share/p2ptrain``."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "p2ptrain"


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` (port 0 picks a free one)."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"bad listen address {text!r}: expected HOST:PORT, e.g. 0.0.0.0:31337")
    return host, int(port)


def validate_run_id(run_id: str) -> str:
    if not 0 < len(run_id) <= MAX_RUN_ID or not run_id.isprintable():
        raise ConfigError(f"run id must be 1-{MAX_RUN_ID} printable characters")
    return run_id


@dataclass(frozen=True)
class NodeConfig:
    """What a node needs to start. ``listen`` is [(host, port)], ``join`` peer addresses."""

    run_id: str = "default"
    listen: tuple[tuple[str, int], ...] = (("0.0.0.0", 31337),)
    announce_host: str | None = None
    join: tuple[PeerAddress, ...] = ()
    status_file: Path | None = None
    status_interval: float = 1.0
    host: HostConfig = field(default_factory=HostConfig)
    reconnect_max_delay: float = 30.0


class Node:
    """A running member of a swarm. Use :meth:`run` under a nursery (``await nursery.start(node.run)``)."""

    def __init__(self, identity: Identity, config: NodeConfig, *, transport: Transport | None = None):
        self.identity = identity
        self.config = config
        validate_run_id(config.run_id)
        self.registry = RpcRegistry()
        self.registry.add_unary(PING, self._on_ping)
        self.registry.add_unary(INFO, self._on_info)
        self.host = Host(
            identity, config.run_id, transport=transport, registry=self.registry, config=config.host
        )
        self.host.on_connection(self._on_connection)
        self.state = "starting"
        self._started = time.time()
        self._joined: set[str] = set()

    @property
    def peer_id(self) -> Any:
        return self.identity.peer_id

    @property
    def addresses(self) -> list[PeerAddress]:
        """Addresses others can dial: wildcard listeners replaced by a concrete host."""
        out = []
        for a in self.host.listen_addresses:
            host = self.config.announce_host or _concrete_host(a.host)
            out.append(PeerAddress.for_host(host, a.port, self.peer_id))
        return out

    async def run(self, *, task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.host.run, list(self.config.listen))
                for addr in self.config.join:
                    nursery.start_soon(self._keep_joined, addr)
                if self.config.status_file:
                    nursery.start_soon(self._status_loop)
                self.state = "running"
                task_status.started(self)
        finally:
            self.state = "stopped"
            if self.config.status_file:
                self.write_status()

    # ---- joining ----

    async def _keep_joined(self, addr: PeerAddress) -> None:
        """Keep a connection to a join address open, reconnecting with backoff."""
        delay = 1.0
        while True:
            try:
                conn = await self.host.connect(addr)
            except HandshakeRefused as e:
                log.error("join %s refused: %s", addr, e)
            except P2PError as e:
                log.warning("cannot join %s yet: %s (retrying in %.0f s)", addr, e, delay)
            else:
                delay = 1.0
                conn.keep_open = True
                if str(addr) not in self._joined:
                    self._joined.add(str(addr))
                    log.info("joined the swarm through %s", addr)
                await conn.wait_closed()
                log.info("lost the connection to join peer %s; reconnecting", conn.peer.short())
            await trio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(delay * 2, self.config.reconnect_max_delay)

    def _on_connection(self, conn: Connection, opened: bool) -> None:
        if opened:
            log.info(
                "peer %s connected (%s)", conn.peer.short(), "we dialed" if conn.outbound else "it dialed"
            )

    # ---- built-in handlers ----

    async def _on_ping(self, ctx: CallContext, req: PingRequest) -> PingResponse:
        return PingResponse(req.payload)

    async def _on_info(self, ctx: CallContext, req: InfoRequest) -> NodeInfo:
        return NodeInfo(
            peer_id=str(self.peer_id),
            run_id=self.config.run_id,
            version=__version__,
            protocol=PROTOCOL_VERSION,
            addresses=tuple(str(a) for a in self.addresses[:16]),
            connected_peers=len(self.host.connected_peers()),
            uptime=time.time() - self._started,
        )

    # ---- status ----

    def status(self) -> dict[str, Any]:
        now = trio.current_time()
        conns = [
            {
                "peer_id": str(c.peer),
                "direction": "outbound" if c.outbound else "inbound",
                "remote": f"{c.remote_host}:{c.remote_port}",
                "connected_for_s": round(now - c.opened_at, 3),
                "bytes_sent": c.bytes_sent,
                "bytes_received": c.bytes_received,
            }
            for c in self.host.connections()
        ]
        return {
            "peer_id": str(self.peer_id),
            "run_id": self.config.run_id,
            "state": self.state,
            "pid": os.getpid(),
            "version": __version__,
            "addresses": [str(a) for a in self.addresses],
            "connected_peers": sorted({c["peer_id"] for c in conns}),
            "connections": conns,
            "started_at": self._started,
            "updated_at": time.time(),
        }

    def write_status(self) -> None:
        """Write the status file atomically (temp file in the same folder, then rename)."""
        path = self.config.status_file
        assert path is not None
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(self.status(), indent=2) + "\n")
            os.replace(tmp, path)
        except OSError as e:
            log.warning("cannot write status file %s: %s", path, e)

    async def _status_loop(self) -> None:
        while True:
            self.write_status()
            await trio.sleep(self.config.status_interval)


def _concrete_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return outward_ip(socket.AF_INET) or "127.0.0.1"
    if host == "::":
        return outward_ip(socket.AF_INET6) or "::1"
    return host
