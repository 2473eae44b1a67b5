"""The DHT's settings: Kademlia's parameters, its timers, and the bounds on the records it holds.

Theory of operation: one frozen value, built once where a node's settings are parsed (``[dht]`` in a run
file, or a test's own) and handed to every part of the DHT at construction; nothing reads it from
anywhere else. ``client_only`` is the one setting that is also a question: None means "find out", by
asking peers to dial this node back when it joins (see :mod:`p2ptrain.dht.reachability`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .records import RecordLimits


@dataclass(frozen=True)
class DHTConfig:
    """Kademlia parameters and timers (seconds)."""

    k: int = 20
    alpha: int = 3
    replication: int = 20
    rpc_timeout: float = 5.0
    get_quorum: int = 1  # replicas with entries a get waits for; reads of merged peer lists ask for more
    refresh_interval: float = 600.0
    republish_interval: float = 60.0
    replicate_interval: float = 600.0
    maintenance_interval: float = 10.0
    max_per_subnet: int = 2
    client_only: bool | None = None  # None: find out with a dial-back at bootstrap
    limits: RecordLimits = field(default_factory=RecordLimits)
