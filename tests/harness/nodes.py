"""Whole Nodes joined in a chain over one in-memory network, on the virtual clock: node i is named
``n{i}``, listens at ``(n{i}, PORT)`` unless it is client-only, and joins through node 0
(``async with swarm(n, AveragerConfig(...)) as nodes``, every DHT bootstrapped).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from p2ptrain import Node, NodeConfig
from p2ptrain.averaging import AveragerConfig
from p2ptrain.dht import DHTConfig
from p2ptrain.net import MemoryNetwork
from tests.harness.identities import identity

PORT = 3000


@asynccontextmanager
async def swarm(
    n: int,
    avg: AveragerConfig,
    *,
    client_only: tuple[int, ...] = (),
    net: MemoryNetwork | None = None,
    dht: DHTConfig | None = None,
) -> AsyncIterator[list[Node]]:
    net = net or MemoryNetwork(seed=4)
    nodes: list[Node] = []
    async with trio.open_nursery() as nursery:
        for i in range(n):
            config = NodeConfig(
                run_id="mm",
                listen=() if i in client_only else ((f"n{i}", PORT),),
                join=(nodes[0].addresses[0],) if nodes else (),
                averaging=avg,
                dht=dht or DHTConfig(),
            )
            node = Node(identity(f"n{i}"), config, transport=net.transport(f"n{i}"), clock=trio.current_time)
            nodes.append(await nursery.start(node.run))
        for node in nodes:
            await node.dht.bootstrapped.wait()
        yield nodes
        nursery.cancel_scope.cancel()
