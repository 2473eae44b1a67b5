"""Byte-stream transports behind one small interface: real TCP, and (in ``memory``) a simulated network.

A transport dials ``(host, port)`` and returns a trio stream, and serves a port by calling a handler with
each accepted stream and the remote's host. Everything above it (handshake, channel, RPC) is the same
for both, which is what lets in-process tests exercise the real protocol code.

Hole punching (``punch``) needs one more thing of a transport: a dial that leaves from the port the
host listens on (``connect(..., local_port=)``), so that a NAT maps it as it maps that port. Two such
dials towards each other meet in a TCP *simultaneous open*: both return the two ends of one connection.
A transport may also dial so that its first SYN has a low TTL (``TcpTransport.connect_primed``); one
without it (the in-memory network) dials as ``connect`` does.
TCP listeners get SO_REUSEPORT set after the bind: a dial may then share the listening port, while
another program's plain listener on that port is still refused.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

log = logging.getLogger(__name__)

TCP_ESTABLISHED, TCP_SYN_SENT = 1, 2  # (Linux's TCP states, as TCP_INFO gives them)
SOFT_ERROR_PAUSE = 0.01  # seconds between looks at a dial that reported a soft error
MAX_QUEUED_ERRORS = 64  # queued ICMP errors read off a primed dial's socket, at most


def _tcp_state(sock: socket.socket) -> int | None:
    """A TCP socket's state (Linux), or None where the system does not say."""
    if not hasattr(socket, "TCP_INFO"):
        return None
    try:
        return int(struct.unpack("B", sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1))[0])
    except OSError:
        return None


def drain_error_queue(sock: socket.socket) -> int:
    """Discard the ICMP errors queued on ``sock``'s error queue (Linux queues there the "time exceeded"
    that a primed dial's dead SYN draws, without IP_RECVERR); how many. While one is queued, poll and
    epoll report the socket in error for good, and every wait for it to become readable returns at once
    with nothing to read: a reader would spin, taking a core (a punched connection's whole life)."""
    flag = getattr(socket, "MSG_ERRQUEUE", 0)
    drained = 0
    while flag and drained < MAX_QUEUED_ERRORS:
        try:
            sock.recvmsg(1, 1024, flag | getattr(socket, "MSG_DONTWAIT", 0))
        except OSError:  # (BlockingIOError: the queue is empty)
            break
        drained += 1
    return drained


StreamHandler = Callable[[trio.abc.Stream, str, int], Awaitable[None]]
"""Called with (stream, remote host, remote port) for each accepted connection."""


class Transport(Protocol):
    async def connect(self, host: str, port: int, *, local_port: int | None = None) -> trio.abc.Stream: ...

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

    async def connect(self, host: str, port: int, *, local_port: int | None = None) -> trio.abc.Stream:
        if local_port is None:
            return await trio.open_tcp_stream(host, port, local_address=self.source_address)
        sock = await self._bound_socket(host, local_port)
        try:
            await sock.connect((host, port))
        except BaseException:
            sock.close()
            raise
        return trio.SocketStream(sock)

    async def _bound_socket(self, host: str, local_port: int) -> trio.socket.SocketType:
        """A socket bound to ``local_port`` beside this host's listener (``host`` an IP literal: punching
        dials addresses peers reported, never names to resolve)."""
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            raise OSError(f"not an IP address: {host!r}") from None
        family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
        sock = trio.socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            local = self.source_address or ("::" if family == socket.AF_INET6 else "0.0.0.0")
            await sock.bind((local, local_port))
        except BaseException:
            sock.close()
            raise
        return sock

    async def connect_primed(self, host: str, port: int, *, local_port: int, ttl: int) -> trio.abc.Stream:
        """A dial from ``local_port`` (as ``connect``) whose first SYN lives ``ttl`` hops: behind a NAT it
        opens this host's mapping towards the peer but dies before the peer's router, which may answer
        a SYN it was not expecting with a reset (closing that mapping again). The SYN's retransmissions
        (the first after a second) go the whole way, by when the peer's own dial opened its side: see
        ``punch``. The socket lives on through the dead SYN's ICMP error (a soft error while the SYN is
        retransmitted: TCP_INFO tells); where the kernel gives up on it instead, OSError (EHOSTUNREACH),
        and that dial served to open the mapping. The ICMP error the dead SYN left queued on the socket is
        read off before the stream is handed out (``drain_error_queue``)."""
        try:
            family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
        except ValueError:
            raise OSError(f"not an IP address: {host!r}") from None
        level, name = (
            (socket.IPPROTO_IPV6, socket.IPV6_UNICAST_HOPS)
            if family == socket.AF_INET6
            else (socket.IPPROTO_IP, socket.IP_TTL)
        )
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((self.source_address or ("::" if family == socket.AF_INET6 else "0.0.0.0"), local_port))
            sock.setsockopt(level, name, ttl)
            err = sock.connect_ex((host, port))
            sock.setsockopt(level, name, -1)  # (the system's default from here on)
            if err not in (0, errno.EINPROGRESS):
                raise OSError(err, f"connecting to {host}:{port}: {os.strerror(err)}")
            while err != 0:
                await trio.lowlevel.wait_writable(sock)
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)  # (reading it clears it)
                state = _tcp_state(sock)
                if state == TCP_ESTABLISHED or (state is None and err == 0):
                    break
                if state != TCP_SYN_SENT:
                    failed = err or errno.ECONNREFUSED
                    raise OSError(failed, f"connecting to {host}:{port}: {os.strerror(failed)}")
                err = errno.EINPROGRESS  # still trying (a wake-up for the dead SYN's soft error)
                await trio.sleep(SOFT_ERROR_PAUSE)
            drain_error_queue(sock)
            return trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        except BaseException:
            sock.close()
            raise

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
            with contextlib.suppress(OSError, AttributeError):  # (no SO_REUSEPORT: no punching from here)
                lst.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
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
