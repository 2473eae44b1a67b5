"""Whole Nodes joined in a chain over one in-memory network, on the virtual clock: node i is named
``n{i}``, listens at ``(n{i}, PORT)`` unless it is client-only, and joins through node 0
(``async with swarm(n, AveragerConfig(...)) as nodes``, every DHT bootstrapped); :func:`look_at` has some of
them look for one group at given moments, :func:`assert_one_group_of_all` checks what they found.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import torch
import trio

from p2ptrain import Node, NodeConfig
from p2ptrain.averaging import AveragerConfig
from p2ptrain.averaging.protocol import SignedManifest
from p2ptrain.dht import DHTConfig
from p2ptrain.errors import GroupFormationFailed
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


async def look_at(
    nodes: list[Node], starts: dict[int, float], how: dict[int, dict[str, Any]], *, key: str, limit: float
) -> tuple[list[SignedManifest | None], list[float]]:
    """Each node ``i`` of ``starts`` begins a look for a group under ``key`` at ``starts[i]`` (``how[i]``:
    what else its ``form_group`` takes: its window's opening, its quorum...), all within ``limit``
    seconds. Returns what each found (None: no group formed) and when each look ended."""
    found: list[SignedManifest | None] = [None] * len(nodes)
    ended = [float("inf")] * len(nodes)

    async def one(i: int) -> None:
        await trio.sleep_until(starts[i])
        try:
            found[i] = await nodes[i].averager.form_group([torch.zeros(8)], group_key=key, **how.get(i, {}))
        except GroupFormationFailed:
            pass
        finally:
            ended[i] = trio.current_time()

    with trio.fail_after(limit):
        async with trio.open_nursery() as group:
            for i in starts:
                group.start_soon(one, i)
    return found, ended


def assert_one_group_of_all(found: list[SignedManifest | None]) -> None:
    """Every peer found a group, the same one, of all of them."""
    assert all(m is not None for m in found), found
    assert len({m.digest for m in found if m is not None}) == 1
    assert all(m is not None and len(m.manifest.members) == len(found) for m in found)
