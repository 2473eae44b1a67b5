"""Byte-stream transports behind one small interface: real TCP, and (in ``memory``) a simulated network.

A transport dials ``(host, port)`` and returns a trio stream, and serves a port by calling a handler with
each accepted stream and the remote's host. Everything above it (handshake, channel, RPC) is the same
for both, which is what lets in-process tests exercise the real protocol code.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

log = logging.getLogger(__name__)

StreamHandler = Callable[[trio.abc.Stream, str, int], Awaitable[None]]
"""Called with (stream, remote host, remote port) for each accepted connection."""


class Transport(Protocol):
    async def connect(self, host: str, port: int) -> trio.abc.Stream: ...

    async def serve(
        self,
        host: str,
        port: int,
        handler: StreamHandler,
        *,
        task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen and run ``handler`` per connection; report the bound (host, port) list when ready."""
        ...


class TcpTransport:
    """Plain TCP (IPv4, IPv6, DNS names).

    Socket buffer sizes are left to the kernel: setting SO_RCVBUF turns off Linux's receive-buffer
    auto-tuning and caps it at net.core.rmem_max, which would throttle long fat WAN paths.
    ``source_address`` makes outgoing connections leave from that local address (a multi-homed host,
    or a network emulator that tells peers apart by address).
    """

    def __init__(self, source_address: str | None = None) -> None:
        self.source_address = source_address

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        return await trio.open_tcp_stream(host, port, local_address=self.source_address)

    async def serve(
        self,
        host: str,
        port: int,
        handler: StreamHandler,
        *,
        task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host or None)
        bound = []
        for lst in listeners:
            sockname = lst.socket.getsockname()
            bound.append((sockname[0], sockname[1]))

        async def on_stream(stream: trio.SocketStream) -> None:
            try:
                peer = stream.socket.getpeername()
            except OSError:
                await stream.aclose()
                return
            await handler(stream, peer[0], peer[1])

        task_status.started(bound)
        await trio.serve_listeners(on_stream, listeners)
