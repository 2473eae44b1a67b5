"""Networking: addresses, the handshake, encrypted channels, RPC, hosts and transports."""

from .address import PeerAddress
from .connection import ClientStream, Connection, ConnectionConfig
from .host import Host, HostConfig
from .memory import LinkProfile, MemoryNetwork
from .rpc import CallContext, Method, Reply, RpcRegistry
from .streams import RpcStream
from .transport import TcpTransport, Transport

__all__ = [
    "CallContext",
    "ClientStream",
    "Connection",
    "ConnectionConfig",
    "Host",
    "HostConfig",
    "LinkProfile",
    "MemoryNetwork",
    "Method",
    "PeerAddress",
    "Reply",
    "RpcRegistry",
    "RpcStream",
    "TcpTransport",
    "Transport",
]
