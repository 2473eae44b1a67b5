"""Byte-stream transports behind one small interface: real TCP, and (in ``memory``) a simulated network.

A transport dials ``(host, port)`` and returns a trio stream, and serves a port by calling a handler with
each accepted stream and the remote's host. Everything above it (handshake, channel, RPC) is the same
for both, which is what lets in-process tests exercise the real protocol code.
"""

from __future__ import annotations

import contextlib
import logging
import socket
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


_SOCKET_BUFFER = 4 * 1024 * 1024


def _tune(sock: trio.socket.SocketType) -> None:
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER)


class TcpTransport:
    """Plain TCP (IPv4, IPv6, DNS names) with larger socket buffers for WAN links."""

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        stream = await trio.open_tcp_stream(host, port)
        _tune(stream.socket)
        return stream

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
            _tune(stream.socket)
            try:
                peer = stream.socket.getpeername()
            except OSError:
                await stream.aclose()
                return
            await handler(stream, peer[0], peer[1])

        task_status.started(bound)
        await trio.serve_listeners(on_stream, listeners)
