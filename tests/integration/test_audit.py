"""Audited rounds: a reducer that returns a wrong result, or a contributor that disowns what it sent, is
identified by the partition's auditor and banned; honest audited rounds ban nobody and average exactly.

The hostile members here are honest processes with one method replaced: the reducer signs an
attestation of a garbled result (a consistent liar: its attestation matches what it serves), and the
contributor answers the auditor with other bytes than those it committed to.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
import torch
import trio

from p2ptrain.averaging import RoundPolicy
from p2ptrain.averaging.allreduce import AllReduceRound, RoundResult
from p2ptrain.averaging.audit import Proof, check_proof, open_attestation
from p2ptrain.averaging.auditor import Accusation, Auditor
from p2ptrain.averaging.averager import Averager, schema_of
from p2ptrain.averaging.partition import partition_sizes
from p2ptrain.averaging.protocol import ACCUSE, FetchReq, Manifest, MemberMsg, SignedManifest
from p2ptrain.errors import RemoteCallError
from p2ptrain.identity import Identity
from p2ptrain.net import Host, MemoryNetwork
from tests.harness.identities import identity

PORT = 2200
N = 4
SIZE = 4001


async def audited_round(
    *,
    liar_reducer: int | None = None,
    liar_contributor: int | None = None,
    compression: str = "none",
    expected_verdicts: int = N,
    after: Callable[[list[Averager], list[Host], MemoryNetwork], Awaitable[None]] | None = None,
) -> tuple[list[RoundResult], list[Averager], list[Host], list[torch.Tensor]]:
    net = MemoryNetwork(seed=21)
    g = torch.Generator().manual_seed(5)
    values = [torch.randn(SIZE, generator=g) for _ in range(N)]
    originals = [v.clone() for v in values]
    hosts, averagers = [], []
    results: list[RoundResult] = []
    async with trio.open_nursery() as nursery:
        for i in range(N):
            ident = identity(f"a{i}")
            host = Host(ident, "audit", transport=net.transport(f"a{i}"))
            averager = Averager(host, None)
            await nursery.start(host.run, [(f"a{i}", PORT)])
            await nursery.start(averager.run)
            hosts.append(host)
            averagers.append(averager)
        manifest = Manifest(
            round_id=bytes(16),
            group_key="audit",
            members=tuple(
                MemberMsg(h.identity.peer_id.digest, str(h.advertised_addresses()[0]), 1.0) for h in hosts
            ),
            sizes=tuple(partition_sizes(SIZE, [1.0] * N, [True] * N)),
            schema=schema_of([values[0]]),
            compression=compression,
            timeout=30.0,
            audit=True,
        )
        signed = SignedManifest.sign(hosts[0].identity, manifest)

        async def one(i: int) -> None:
            results.append(await averagers[i].run_round(signed, [values[i]], weight=1.0 + i))

        with trio.fail_after(60):
            if liar_reducer is not None:
                garble_reductions_of(averagers[liar_reducer])
            if liar_contributor is not None:
                disown_slices_of(averagers[liar_contributor])
            async with trio.open_nursery() as rounds:
                for i in range(N):
                    rounds.start_soon(one, i)
            # the audits run in the averagers' nurseries right after each commit: wait for their verdicts
            while sum(len(a.auditor.verdicts) for a in averagers) < expected_verdicts:  # noqa: ASYNC110 (virtual clock)
                await trio.sleep(0.05)
            if after is not None:  # while every host still serves
                await after(averagers, hosts, net)
        nursery.cancel_scope.cancel()
    return results, averagers, hosts, originals


def garble_reductions_of(averager: Averager) -> None:
    """This member flips the sign of every partition it reduces, and attests the garbled bytes it serves:
    a consistent liar (what it signs matches what it sends) within every member's bound (its size is the
    true result's: only a recomputation can tell)."""

    async def fault(rnd: AllReduceRound, point: str) -> None:
        if point == "after_reduce":
            for red in rnd.reducers.values():
                if red.result is not None:  # uncompressed: the served bytes are views of the result
                    red.result.neg_()

    averager.fault = fault


def disown_slices_of(averager: Averager) -> None:
    """This member answers auditors with other bytes than it committed to."""
    kept = averager.auditor._kept

    class Lying(dict):  # type: ignore[type-arg]
        def __setitem__(self, key, ev):  # type: ignore[no-untyped-def]
            ev.sent = {p: bytes(b ^ 1 for b in data[:8]) + data[8:] for p, data in ev.sent.items()}
            super().__setitem__(key, ev)

    averager.auditor._kept = Lying(kept)  # type: ignore[assignment]


@pytest.mark.parametrize("compression", ["none", "int8"])
async def test_an_honest_audited_round_is_exact_and_bans_nobody(
    autojump_clock: object, compression: str
) -> None:
    results, averagers, _, originals = await audited_round(compression=compression)
    assert len(results) == N
    expected = sum(o * (1.0 + i) for i, o in enumerate(originals)) / sum(1.0 + i for i in range(N))
    tolerance = 1e-5 if compression == "none" else 0.05
    for r in results:
        torch.testing.assert_close(r.tensors[0], expected, rtol=tolerance, atol=tolerance)
        assert torch.equal(r.tensors[0], results[0].tensors[0])
    verdicts = [v for a in averagers for _, _, v in a.auditor.verdicts]
    assert len(verdicts) == N  # every partition audited exactly once, by one member
    assert all(v.ok and v.offender is None for v in verdicts), verdicts
    assert not any(a.auditor.banned for a in averagers)


async def test_a_reducer_serving_a_wrong_result_is_identified_and_banned(autojump_clock: object) -> None:
    liar = 2
    _results, averagers, hosts, _ = await audited_round(liar_reducer=liar)
    liar_id = hosts[liar].identity.peer_id
    accusers = [i for i, a in enumerate(averagers) if liar_id in a.auditor.banned]
    assert accusers and liar not in accusers
    reason = averagers[accusers[0]].auditor.banned[liar_id]
    assert "reducer of partition 2" in reason and "does not match" in reason
    # nobody else was blamed
    assert all(set(a.auditor.banned) <= {liar_id} for a in averagers)


async def test_a_contributor_disowning_its_slice_is_identified_and_banned(autojump_clock: object) -> None:
    liar = 1
    _, averagers, hosts, _ = await audited_round(liar_contributor=liar)
    liar_id = hosts[liar].identity.peer_id
    banned_by = [i for i, a in enumerate(averagers) if liar_id in a.auditor.banned]
    assert banned_by, [a.auditor.verdicts for a in averagers]
    assert "contributor" in averagers[banned_by[0]].auditor.banned[liar_id]
    assert all(set(a.auditor.banned) <= {liar_id} for a in averagers)


async def test_the_other_members_are_told_at_once_and_recheck_the_proof(autojump_clock: object) -> None:
    """The member that convicts a reducer tells the round's other members (the peers the reducer meets
    next) at once: each fetches the proof and re-checks it, with no ban records to read. A peer that was
    not in the round cannot make a member examine anything."""
    liar = 2

    async def told(averagers: list[Averager], hosts: list[Host], net: MemoryNetwork) -> None:
        liar_id = hosts[liar].identity.peer_id
        honest = [a for i, a in enumerate(averagers) if i != liar]
        with trio.fail_after(30):
            while not all(liar_id in a.auditor.banned for a in honest):  # noqa: ASYNC110 (virtual clock)
                await trio.sleep(0.05)
        reasons = [a.auditor.banned[liar_id] for a in honest]
        assert sum(r.startswith("proven by") for r in reasons) == len(honest) - 1, reasons  # re-checked
        digest = next(iter(averagers[0].auditor._kept))
        async with trio.open_nursery() as nursery:
            stranger = await outsider(net, nursery)
            conn = await stranger.host.connect(str(hosts[0].advertised_addresses()[0]))
            with pytest.raises(RemoteCallError, match="not a member of this round"):
                await conn.call(ACCUSE, FetchReq(digest, 0))
            nursery.cancel_scope.cancel()

    await audited_round(liar_reducer=liar, after=told)


async def outsider(
    net: MemoryNetwork, nursery: trio.Nursery, name: str = "outsider", policy: RoundPolicy | None = None
) -> Auditor:
    """A peer that took no part in the round: it reads a published accusation and examines it."""
    host = Host(Identity.generate(), "audit", transport=net.transport(name))
    await nursery.start(host.run, [(name, PORT)])
    return Auditor(host, policy=None if policy is None else lambda: policy)


async def test_a_proof_convicts_the_lying_reducer_for_anyone_who_examines_it(autojump_clock: object) -> None:
    liar = 2
    outcomes: list[str] = []

    async def examine(averagers: list[Averager], hosts: list[Host], net: MemoryNetwork) -> None:
        liar_id = hosts[liar].identity.peer_id
        accuser = next(i for i, a in enumerate(averagers) if liar_id in a.auditor.accusations)
        accusation = averagers[accuser].auditor.accusations[liar_id]
        proof = averagers[accuser].auditor.proofs[(accusation.round, accusation.partition)]
        assert check_proof(proof, liar_id, accusation.round).offender == proof.holder
        accuser_id = hosts[accuser].identity.peer_id
        async with trio.open_nursery() as nursery:
            judge = await outsider(net, nursery)
            addr = str(hosts[accuser].advertised_addresses()[0])
            outcomes.append(await judge.examine(accuser_id, addr, accusation))
            assert set(judge.banned) == {liar_id} and "proven by" in judge.banned[liar_id]
            assert await judge.examine(accuser_id, addr, accusation) == "already settled"  # fetched once
            # a proof larger than the examiner's bound is not fetched, and bans nobody
            wary = await outsider(net, nursery, "wary", RoundPolicy(max_proof_bytes=1000))
            got = await wary.examine(accuser_id, addr, accusation)
            assert "over 1000" in got and not wary.banned
            nursery.cancel_scope.cancel()

    await audited_round(liar_reducer=liar, after=examine)
    assert outcomes == ["convicted"]


async def test_a_false_accusation_bans_the_accuser_not_the_accused(autojump_clock: object) -> None:
    """Member 1 accuses the honest reducer of partition 0, serving the real manifest and attestation with
    made-up slices: the examiner's recomputation clears the reducer and bans member 1. An accusation whose
    proof nobody serves bans nobody (an honest accuser may simply have left)."""
    outcomes: list[str] = []

    async def accuse(averagers: list[Averager], hosts: list[Host], net: MemoryNetwork) -> None:
        accuser = averagers[1].auditor
        evidence = next(iter(accuser._kept.values()))
        att = open_attestation(evidence.attestations[0], evidence.peers[0], evidence.digest, 0, N)
        made_up = tuple(bytes(4 * evidence.sizes[0]) for _ in att.contributors)
        accuser.proofs[(evidence.digest, 0)] = Proof(
            evidence.manifest, 0, 0, evidence.attestations[0], made_up
        )
        ids = [h.identity.peer_id for h in hosts]
        async with trio.open_nursery() as nursery:
            judge = await outsider(net, nursery)
            false = Accusation(ids[0], "reducer of partition 0: made up", evidence.digest, 0)
            addr = str(hosts[1].advertised_addresses()[0])
            outcomes.append(await judge.examine(ids[1], addr, false))
            assert set(judge.banned) == {ids[1]} and "false accusation" in judge.banned[ids[1]]
            unproven = Accusation(ids[3], "no proof", evidence.digest, 3)
            outcomes.append(await judge.examine(ids[2], str(hosts[2].advertised_addresses()[0]), unproven))
            assert set(judge.banned) == {ids[1]}
            nursery.cancel_scope.cancel()

    await audited_round(after=accuse)
    assert outcomes[0] == "false accusation" and "keeps no proof" in outcomes[1], outcomes
