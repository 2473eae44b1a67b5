"""Rounds with a robust aggregation rule: one hostile member sends scaled values; every member still
commits the same bits, and they stay close to the honest members' mean (the plain mean does not).
Values scaled past a reducer's bound (``bounds``: 32x its own) are refused outright, whatever the rule:
the scaling member is left out. On the virtual clock, so that the rounds' deadlines do not depend on how
busy the machine is: on the real one, a full suite beside two simulations (a load of 7 on 2 cores) once
left one member's contribution out of a round."""

from __future__ import annotations

import logging

import pytest
import torch
import trio
import trio.testing

from p2ptrain.averaging import RoundPolicy
from p2ptrain.averaging.allreduce import RoundResult
from p2ptrain.averaging.averager import Averager, schema_of
from p2ptrain.averaging.partition import partition_sizes
from p2ptrain.averaging.protocol import Manifest, MemberMsg, SignedManifest
from p2ptrain.errors import RemoteProtocolError
from p2ptrain.identity import Identity
from p2ptrain.net import Connection, Host, MemoryNetwork
from tests.harness.identities import identity

PORT = 2100
N = 5


SCALE = 20.0  # what the hostile member multiplies its values by: within every reducer's bound (32x)


async def run_round(
    aggregation: str, compression: str = "none", scale: float = SCALE
) -> tuple[list[RoundResult], torch.Tensor]:
    net = MemoryNetwork(seed=11)
    g = torch.Generator().manual_seed(1)
    inputs = [[1.0 + 0.1 * torch.randn(3001, generator=g)] for _ in range(N)]
    honest_mean = torch.stack([x[0] for x in inputs[1:]]).mean(dim=0)
    inputs[0][0] *= scale  # member 0 is hostile: it scales everything it sends
    async with trio.open_nursery() as nursery:
        hosts, averagers = [], []
        for i in range(N):
            ident = identity(f"r{i}")
            host = Host(ident, "robust", transport=net.transport(f"r{i}"))
            averager = Averager(host, None)
            await nursery.start(host.run, [(f"r{i}", PORT)])
            await nursery.start(averager.run)
            hosts.append(host)
            averagers.append(averager)
        sizes = partition_sizes(3001, [1.0] * N, [True] * N)
        manifest = Manifest(
            round_id=bytes(16),
            group_key="robust",
            members=tuple(
                MemberMsg(h.identity.peer_id.digest, str(h.advertised_addresses()[0]), 1.0) for h in hosts
            ),
            sizes=tuple(sizes),
            schema=schema_of(inputs[0]),
            compression=compression,
            timeout=30.0,
            aggregation=aggregation,
        )
        signed = SignedManifest.sign(hosts[1].identity, manifest)
        results: list[RoundResult] = []

        async def one(i: int) -> None:
            results.append(await averagers[i].run_round(signed, inputs[i], weight=1.0 + i))

        with trio.fail_after(60):
            async with trio.open_nursery() as rounds:
                for i in range(N):
                    rounds.start_soon(one, i)
        nursery.cancel_scope.cancel()
    assert len(results) == N
    for x in inputs[1:]:
        assert torch.equal(x[0], inputs[0][0]), "members hold different bits"
    return results, (inputs[0][0] - honest_mean).abs()


@pytest.mark.parametrize("rule", ["trimmed_mean", "centered_clip"])
@pytest.mark.parametrize("compression", ["none", "int8"])
async def test_a_robust_round_shrugs_off_a_scaled_contribution(
    rule: str, compression: str, caplog: pytest.LogCaptureFixture, autojump_clock: object
) -> None:
    with caplog.at_level(logging.WARNING, logger="p2ptrain.averaging.allreduce"):
        results, error = await run_round(rule, compression)
    assert all(len(r.contributors) == N for r in results)
    assert error.max() < 0.25, error.max()  # honest values are 1 +- 0.1 (int8 adds its own error)
    # every reducer names the scaling member in its log, and nobody else
    named = [r.getMessage() for r in caplog.records if "is an outlier" in r.getMessage()]
    hostile = identity("r0").peer_id.short()
    assert len(named) == N and all(hostile in m for m in named), named


async def test_the_plain_mean_is_dragged_away_by_the_same_contribution(autojump_clock: object) -> None:
    _, error = await run_round("mean")
    assert error.max() > 1.0  # (20 + 2 + 3 + 4 + 5) / 15 where the honest mean is 1


@pytest.mark.parametrize("rule", ["mean", "trimmed_mean"])
async def test_a_contribution_past_the_bound_is_refused_whatever_the_rule(
    rule: str, autojump_clock: object
) -> None:
    """1000x the honest values (at the same weight) is past every reducer's cap, 128x its own (``bounds``:
    an honest member may send 70x its mate, so 100x is not refused): its slices are refused, the member is
    left out, and even the plain mean is the honest one. (Before, the plain mean was dragged away.)"""
    results, error = await run_round(rule, scale=1000.0)
    hostile = identity("r0").peer_id
    assert all(hostile not in r.contributors and len(r.contributors) == N - 1 for r in results)
    assert error.max() < 0.25, error.max()


def test_a_manifest_with_an_unknown_rule_is_refused() -> None:
    manifest = Manifest(
        round_id=bytes(16),
        group_key="x",
        members=(MemberMsg(bytes(32), "a", 1.0),),
        sizes=(1,),
        schema=schema_of([torch.zeros(1)]),
        aggregation="median_of_means",
    )
    with pytest.raises(RemoteProtocolError, match="aggregation"):
        manifest.check()


@pytest.mark.parametrize("claimed", [8.0, 1000.0], ids=["within-slack", "far-above"])
async def test_the_coordinator_counts_a_liar_at_its_plausible_weight(
    claimed: float, autojump_clock: object
) -> None:
    """Member 4 claims more weight than the 5 the coordinator (member 0) allows it. Within twice that,
    every member holds the mean with weight 5 for it, computed the same way (the reducers replay their
    slices); far above (1000), the coordinator's partition refuses its slice and it is left out."""
    net = MemoryNetwork(seed=12)
    values = [torch.full((2000,), float(i)) for i in range(N)]
    weights = [1.0, 2.0, 3.0, 4.0, claimed]
    async with trio.open_nursery() as nursery:
        hosts, averagers = [], []
        liar = identity("w4").peer_id
        caps = RoundPolicy(weight_cap=lambda peer: 5.0 if peer == liar else None)  # the coordinator's
        for i in range(N):
            ident = identity(f"w{i}")
            host = Host(ident, "caps", transport=net.transport(f"w{i}"))
            averager = Averager(host, None, policy=caps if i == 0 else None)
            await nursery.start(host.run, [(f"w{i}", PORT)])
            await nursery.start(averager.run)
            hosts.append(host)
            averagers.append(averager)
        manifest = Manifest(
            round_id=bytes(16),
            group_key="caps",
            members=tuple(
                MemberMsg(h.identity.peer_id.digest, str(h.advertised_addresses()[0]), 1.0) for h in hosts
            ),
            sizes=tuple(partition_sizes(2000, [1.0] * N, [True] * N)),
            schema=schema_of([values[0]]),
            timeout=30.0,
        )
        signed = SignedManifest.sign(hosts[0].identity, manifest)
        results: list[RoundResult] = []

        async def one(i: int) -> None:
            results.append(await averagers[i].run_round(signed, [values[i]], weight=weights[i]))

        with trio.fail_after(60):
            async with trio.open_nursery() as rounds:
                for i in range(N):
                    rounds.start_soon(one, i)
        nursery.cancel_scope.cancel()
    if claimed > 2 * 5.0:
        expected = (0 * 1 + 1 * 2 + 2 * 3 + 3 * 4) / (1 + 2 + 3 + 4)
        assert all(r.total_weight == 10.0 and liar not in r.contributors for r in results)
    else:
        expected = (0 * 1 + 1 * 2 + 2 * 3 + 3 * 4 + 4 * 5) / (1 + 2 + 3 + 4 + 5)
        assert all(r.total_weight == 15.0 for r in results)
    for v in values:
        torch.testing.assert_close(v, torch.full((2000,), expected), rtol=1e-6, atol=1e-6)
        assert torch.equal(v, values[0])


async def test_a_peer_may_keep_only_a_few_calls_waiting_for_unknown_rounds(autojump_clock: object) -> None:
    """Calls for a round the callee has not started wait for it a while, holding the sender's data: one
    peer gets eight such calls at most; the rest are refused at once, and the waiting ones give up."""
    from p2ptrain.averaging.averager import MAX_WAITING_PER_PEER, ROUND_WAIT
    from p2ptrain.averaging.protocol import PART, PartReq
    from p2ptrain.errors import RemoteCallError

    net = MemoryNetwork(seed=13)
    async with trio.open_nursery() as nursery:
        server = Host(Identity.generate(), "wait", transport=net.transport("s"))
        await nursery.start(server.run, [("s", PORT)])
        await nursery.start(Averager(server, None).run)
        client = Host(Identity.generate(), "wait", transport=net.transport("c"))
        await nursery.start(client.run, [])
        conn = await client.connect(server.advertised_addresses()[0])
        outcomes: list[tuple[float, str]] = []

        async def call(i: int) -> None:
            start = trio.current_time()
            try:
                async with conn.open_stream(PART, PartReq(bytes([i]) * 16, 0, 1.0), timeout=60) as stream:
                    await stream.send(b"\0" * 4096)
                    await stream.response()
                outcomes.append((trio.current_time() - start, "answered"))
            except RemoteCallError as e:
                outcomes.append((trio.current_time() - start, e.message))

        with trio.fail_after(30):
            async with trio.open_nursery() as calls:
                for i in range(MAX_WAITING_PER_PEER + 3):
                    calls.start_soon(call, i)
        nursery.cancel_scope.cancel()
    refused_at_once = [o for o in outcomes if "too many" in o[1] and o[0] < 1.0]
    waited = [o for o in outcomes if "unknown round" in o[1] and "too many" not in o[1]]
    assert len(refused_at_once) == 3
    assert len(waited) == MAX_WAITING_PER_PEER and all(t >= ROUND_WAIT for t, _ in waited)


async def test_ids_from_one_subnet_share_its_few_waiting_calls(autojump_clock: object) -> None:
    """Ids are free: six ids from one /24 keep at most MAX_WAITING_PER_SUBNET calls waiting for unknown
    rounds (32 ids x 8 calls used to fill all 256), and a peer from another subnet still gets its turn."""
    from p2ptrain.averaging.averager import MAX_WAITING_PER_PEER, MAX_WAITING_PER_SUBNET
    from p2ptrain.averaging.protocol import PART, PartReq
    from p2ptrain.errors import RemoteCallError

    net = MemoryNetwork(seed=14)
    outcomes: dict[str, list[str]] = {"flood": [], "honest": []}
    async with trio.open_nursery() as nursery:
        server = Host(Identity.generate(), "wait", transport=net.transport("198.18.0.1"))
        await nursery.start(server.run, [("198.18.0.1", PORT)])
        await nursery.start(Averager(server, None).run)

        async def client(name: str) -> Connection:
            host = Host(Identity.generate(), "wait", transport=net.transport(name))
            await nursery.start(host.run, [])
            return await host.connect(server.advertised_addresses()[0])

        async def call(conn: Connection, i: int, who: str) -> None:
            try:
                async with conn.open_stream(
                    PART, PartReq(bytes([i % 256]) * 16, 0, 1.0), timeout=60
                ) as stream:
                    await stream.send(b"\0" * 1024)
                    await stream.response()
                outcomes[who].append("answered")
            except RemoteCallError as e:
                outcomes[who].append("refused" if "too many" in e.message else "waited")

        flood = [await client(f"198.18.7.{k}") for k in range(1, 7)]
        honest = await client("198.18.9.1")
        with trio.fail_after(60):
            async with trio.open_nursery() as calls:
                for k, conn in enumerate(flood):
                    for i in range(MAX_WAITING_PER_PEER):
                        calls.start_soon(call, conn, 16 * k + i, "flood")
                await trio.testing.wait_all_tasks_blocked()
                calls.start_soon(call, honest, 200, "honest")
        nursery.cancel_scope.cancel()
    assert outcomes["flood"].count("waited") == MAX_WAITING_PER_SUBNET
    assert outcomes["flood"].count("refused") == 6 * MAX_WAITING_PER_PEER - MAX_WAITING_PER_SUBNET
    assert outcomes["honest"] == ["waited"]  # it got a place (its round simply never started here)
