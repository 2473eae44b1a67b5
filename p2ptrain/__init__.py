"""p2ptrain: decentralized peer-to-peer training over the WAN.

The public API is what this module re-exports; everything else is internal and may change.
"""

__version__ = "0.1.0"

from typing import TYPE_CHECKING, Any

from .dht import DHT, DHTConfig, owned_subkey
from .errors import (
    CallRefused,
    ConfigError,
    ConnectionClosed,
    DeadlineExceeded,
    GroupFormationFailed,
    GroupTooSmall,
    HandshakeRefused,
    IdentityError,
    InvalidSignature,
    LocalProtocolError,
    P2PError,
    PeerUnavailable,
    RemoteCallError,
    RemoteProtocolError,
    RoundAborted,
    RoundTimedOut,
    SchemaMismatch,
)
from .identity import Identity, PeerID, SignedEnvelope, load_identity, save_identity
from .net import (
    CallContext,
    Connection,
    Host,
    HostConfig,
    MemoryNetwork,
    Method,
    PeerAddress,
    Reply,
    RpcRegistry,
    RpcStream,
)
from .wire import Message, bounded

if TYPE_CHECKING:
    from .averaging import Averager, AveragerConfig, Compression, RoundResult
    from .config import RunConfig, load_config
    from .node import BackgroundNode, Node, NodeConfig
    from .tasks import Task, load_task
    from .training.collaborative import CollaborativeOptimizer, SyncCollaborativeOptimizer

# The training stack (torch) is imported on first use, so that the light commands (``p2ptrain id``,
# ``ping``, ``peers``, ``status``) start in a fraction of a second.
_LAZY = {
    "Averager": "averaging",
    "AveragerConfig": "averaging",
    "Compression": "averaging",
    "RoundResult": "averaging",
    "RunConfig": "config",
    "load_config": "config",
    "BackgroundNode": "node",
    "Node": "node",
    "NodeConfig": "node",
    "Task": "tasks",
    "load_task": "tasks",
    "CollaborativeOptimizer": "training.collaborative",
    "SyncCollaborativeOptimizer": "training.collaborative",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'p2ptrain' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "DHT",
    "Averager",
    "AveragerConfig",
    "BackgroundNode",
    "CallContext",
    "CallRefused",
    "CollaborativeOptimizer",
    "Compression",
    "ConfigError",
    "Connection",
    "ConnectionClosed",
    "DHTConfig",
    "DeadlineExceeded",
    "GroupFormationFailed",
    "GroupTooSmall",
    "HandshakeRefused",
    "Host",
    "HostConfig",
    "Identity",
    "IdentityError",
    "InvalidSignature",
    "LocalProtocolError",
    "MemoryNetwork",
    "Message",
    "Method",
    "Node",
    "NodeConfig",
    "P2PError",
    "PeerAddress",
    "PeerID",
    "PeerUnavailable",
    "RemoteCallError",
    "RemoteProtocolError",
    "Reply",
    "RoundAborted",
    "RoundResult",
    "RoundTimedOut",
    "RpcRegistry",
    "RpcStream",
    "RunConfig",
    "SchemaMismatch",
    "SignedEnvelope",
    "SyncCollaborativeOptimizer",
    "Task",
    "__version__",
    "bounded",
    "load_config",
    "load_identity",
    "load_task",
    "owned_subkey",
    "save_identity",
]
