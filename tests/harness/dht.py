"""DHT swarms without the rest of a Node: each node a Host and a DHT over one in-memory network, with a
deterministic identity and DHT seed and ``clock=trio.current_time``, so record expiry runs on the virtual
clock (``async with open_swarm(DHTConfig(...)) as swarm``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

from p2ptrain.dht import DHT, DHTConfig
from p2ptrain.dht.records import key_id, make_entry, owned_subkey
from p2ptrain.errors import P2PError
from p2ptrain.identity import Identity
from p2ptrain.net import Host, HostConfig, MemoryNetwork, PeerAddress
from tests.harness.identities import identity

RUN_ID = "dht-swarm"
PORT = 1000


@dataclass
class DhtNode:
    """A Host and its DHT running under their own cancel scope, so a test can stop one node."""

    name: str
    host: Host
    dht: DHT
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    stopped: trio.Event = field(default_factory=trio.Event)

    @property
    def address(self) -> PeerAddress:
        return self.dht.advertised_address()


class Swarm:
    """Starts DHT nodes on one MemoryNetwork inside a test's nursery."""

    def __init__(self, nursery: trio.Nursery, net: MemoryNetwork, config: DHTConfig) -> None:
        self.nursery = nursery
        self.net = net
        self.config = config
        self.nodes: list[DhtNode] = []

    async def start(
        self,
        name: str,
        bootstrap: list[PeerAddress],
        *,
        config: DHTConfig | None = None,
        listen: bool = True,
        host_config: HostConfig | None = None,
    ) -> DhtNode:
        host = Host(identity(name), RUN_ID, transport=self.net.transport(name), config=host_config)
        dht = DHT(host, config=config or self.config, clock=trio.current_time, seed=len(self.nodes))
        node = DhtNode(name, host, dht)

        async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            try:
                with node.scope:
                    async with trio.open_nursery() as inner:
                        await inner.start(host.run, [(name, PORT)] if listen else [])
                        await inner.start(dht.run, bootstrap)
                        await dht.bootstrapped.wait()
                        task_status.started()
            finally:
                node.stopped.set()

        await self.nursery.start(run)
        self.nodes.append(node)
        return node

    async def kill(self, node: DhtNode) -> None:
        """Crash ``node``: every connection reset and its listener gone, then its tasks cancelled."""
        self.net.kill(node.name)
        node.scope.cancel()
        await node.stopped.wait()


@asynccontextmanager
async def open_swarm(config: DHTConfig) -> AsyncIterator[Swarm]:
    async with trio.open_nursery() as nursery:
        yield Swarm(nursery, MemoryNetwork(seed=7), config)
        nursery.cancel_scope.cancel()


async def store_as(dht: DHT, who: Identity, keys: Iterable[bytes], value: bytes, expiry: float) -> None:
    """``who``'s signed entry (under its owned subkey) stored under each of ``keys`` through ``dht``,
    as an id that is not the node's would write it; a refused store is left refused."""
    for key in keys:
        entry = make_entry(key, value, expiry, subkey=owned_subkey(who.peer_id), signer=who)
        try:
            await dht.writer.store_entries(key_id(key), [entry])
        except P2PError:
            pass
