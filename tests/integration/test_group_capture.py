"""Group capture: one host's fresh keys rush into an honest leader's group in a robust run.

What is proved here, end to end through the DHT's matchmaking on the in-memory network (hosts named by
address, so each has its subnet): six keys of one subnet ask for places first and send values scaled
x100. The leader counts origins: the peers of other subnets that ask later take places from the keys,
and the reducers count the keys' slices as one row, so every honest member commits a result close to
the honest peers' mean. On the code before, the keys filled the group and the leader's group formed
with them alone: its result was theirs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import torch
import trio

from p2ptrain import Node, NodeConfig
from p2ptrain.averaging import AveragerConfig, RoundResult
from p2ptrain.errors import GroupFormationFailed
from p2ptrain.net import MemoryNetwork
from tests.harness.identities import identity

PORT = 3000
HONEST = ["198.18.1.1", "198.18.2.1", "198.18.3.1"]  # the leader first, then two of other subnets
ATTACKER = "198.18.9.1"
KEYS = 6


@asynccontextmanager
async def swarm(avg: AveragerConfig) -> AsyncIterator[tuple[list[Node], list[Node]]]:
    net = MemoryNetwork(seed=9)
    honest: list[Node] = []
    keys: list[Node] = []
    async with trio.open_nursery() as nursery:
        for i, host in enumerate(HONEST):
            config = NodeConfig(
                run_id="capture",
                listen=((host, PORT),),
                join=(honest[0].addresses[0],) if honest else (),
                averaging=avg,
            )
            node = Node(identity(f"h{i}"), config, transport=net.transport(host), clock=trio.current_time)
            honest.append(await nursery.start(node.run))
        for k in range(KEYS):  # all on the attacker's address
            join = (honest[0].addresses[0],)
            config = NodeConfig(run_id="capture", listen=((ATTACKER, PORT + k),), join=join, averaging=avg)
            node = Node(identity(f"s{k}"), config, transport=net.transport(ATTACKER), clock=trio.current_time)
            keys.append(await nursery.start(node.run))
        for node in honest + keys:
            await node.dht.bootstrapped.wait()
        yield honest, keys
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("audit", [False, True], ids=["plain", "audited"])
async def test_fresh_keys_of_one_subnet_cannot_capture_a_robust_group(autojump_clock, audit: bool):
    """Audited, the auditors recompute each partition counting origins as its reducer did: no honest
    peer is accused."""
    avg = AveragerConfig(
        target_size=4, min_size=2, matchmaking_time=3.0, aggregation="trimmed_mean", audit=audit
    )
    g = torch.Generator().manual_seed(3)
    values = [1.0 + 0.1 * torch.randn(4000, generator=g) for _ in HONEST]
    honest_mean = torch.stack(values).mean(dim=0)
    results: dict[int, RoundResult | Exception] = {}
    async with swarm(avg) as (honest, keys):

        async def member(i: int, delay: float) -> None:
            await trio.sleep(delay)
            try:
                results[i] = await honest[i].average([values[i].clone()], timeout=20.0)
            except GroupFormationFailed as e:
                results[i] = e

        async def key(k: int) -> None:
            await trio.sleep(0.2)  # after the leader announced, before any honest peer asks
            try:
                await keys[k].average([100.0 * values[0]], timeout=20.0)
            except GroupFormationFailed:
                pass

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(member, 0, 0.0)
                for k in range(KEYS):
                    nursery.start_soon(key, k)
                nursery.start_soon(member, 1, 1.0)
                nursery.start_soon(member, 2, 1.2)
            await trio.sleep(30)  # (virtual) the audits run after the round
        banned = {p for node in honest for p in node.averager.auditor.banned}
        # Every member audits what it is drawn for, keys too (they run the same code): a partition's
        # auditor is drawn among its other contributors, so it is a key in some rounds.
        verdicts = {(d, p): v for node in honest + keys for (d, p, v) in node.averager.auditor.verdicts}
    assert not banned & {node.peer_id for node in honest}, banned
    led = results[0]
    assert isinstance(led, RoundResult), led
    if audit:  # every partition of the leader's round was audited, and its result matches
        assert led.evidence is not None
        parts = [p for p, size in enumerate(led.evidence.sizes) if size > 0]
        found = {p: verdicts[(led.round, p)].reason for p in parts if (led.round, p) in verdicts}
        assert len(found) == len(parts) and all("matches" in r for r in found.values()), (parts, found)
    joined = {honest[i].peer_id for i in (1, 2)} & set(led.contributors)
    assert joined, f"no honest peer got a place in the leader's group: {led.contributors}"
    error = (led.tensors[0] - honest_mean).abs().max().item()
    assert error < 0.5, f"the leader's result is {error:.1f} away from the honest mean"
    for i in (1, 2):
        r = results[i]
        if isinstance(r, RoundResult) and r.round == led.round:
            assert torch.equal(r.tensors[0], led.tensors[0])
