"""p2ptrain: decentralized peer-to-peer training over the WAN.

The front door: what a user who trains a model with a swarm calls. Everything else is internal and may
change, except the layers' own public modules, which stay importable by their names:

- train with the tools you use: :func:`join_swarm`, :class:`SwarmOptimizer`, :class:`SwarmTrainer`
  (``transformers``), :class:`SwarmCallback` (Lightning), :class:`SwarmShards`;
- the collaborative optimizer itself: :class:`CollaborativeOptimizer` (trio code),
  :class:`SyncCollaborativeOptimizer` (a plain loop, on a :class:`BackgroundNode`);
- run files and tasks: :func:`load_config`, :class:`RunConfig`, :class:`Task`, :func:`load_task`;
- a node from Python: :class:`Node`, :class:`NodeConfig`, :class:`BackgroundNode`;
- the errors, all under :class:`P2PError`, each saying whose fault it is (:mod:`p2ptrain.errors`).

The layers underneath have their own front doors: :mod:`p2ptrain.net` (hosts, connections, the RPC
toolkit: ``RpcRegistry``, ``Method``, ``Reply``, ``CallContext``, ``RpcStream``, ``PeerAddress``),
:mod:`p2ptrain.identity`, :mod:`p2ptrain.wire` (``Message``, ``bounded``), :mod:`p2ptrain.dht`,
:mod:`p2ptrain.averaging` (``Averager``, ``AveragerConfig``, ``RoundResult``).

``import p2ptrain`` stays cheap (no torch, no network stack): the names above but the errors are
imported on first use (``__getattr__``); the ``TYPE_CHECKING`` block names the same ones for type
checkers and documentation tools.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
from .version import __version__

if TYPE_CHECKING:  # (the same names and modules as _LAZY: tests/unit/test_front_door.py checks it)
    from .config import RunConfig, load_config
    from .integrations import SwarmOptimizer, SwarmShards, join_swarm
    from .integrations.huggingface import SwarmTrainer
    from .integrations.lightning import SwarmCallback
    from .node import BackgroundNode, Node, NodeConfig
    from .tasks import Task, load_task
    from .training import CollaborativeOptimizer, SyncCollaborativeOptimizer

# Each lazily imported name and the module it comes from. The integrations with other libraries import
# those libraries (``pip install 'p2ptrain[integrations]'``) when first used.
_LAZY = {
    "RunConfig": "config",
    "load_config": "config",
    "SwarmOptimizer": "integrations",
    "SwarmShards": "integrations",
    "join_swarm": "integrations",
    "SwarmTrainer": "integrations.huggingface",
    "SwarmCallback": "integrations.lightning",
    "BackgroundNode": "node",
    "Node": "node",
    "NodeConfig": "node",
    "Task": "tasks",
    "load_task": "tasks",
    "CollaborativeOptimizer": "training",
    "SyncCollaborativeOptimizer": "training",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'p2ptrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "BackgroundNode",
    "CallRefused",
    "CollaborativeOptimizer",
    "ConfigError",
    "ConnectionClosed",
    "DeadlineExceeded",
    "GroupFormationFailed",
    "GroupTooSmall",
    "HandshakeRefused",
    "IdentityError",
    "InvalidSignature",
    "LocalProtocolError",
    "Node",
    "NodeConfig",
    "P2PError",
    "PeerUnavailable",
    "RemoteCallError",
    "RemoteProtocolError",
    "RoundAborted",
    "RoundTimedOut",
    "RunConfig",
    "SchemaMismatch",
    "SwarmCallback",
    "SwarmOptimizer",
    "SwarmShards",
    "SwarmTrainer",
    "SyncCollaborativeOptimizer",
    "Task",
    "__version__",
    "join_swarm",
    "load_config",
    "load_task",
]
