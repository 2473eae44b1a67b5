"""A member whose quorum its group cannot meet is signed out of the round, and costs it nothing.

A leader signs each member's quorum into the manifest, and a member whose quorum the members taking
part cannot meet declines the group on receipt (``matchmaking.Gathering.entries``, ``holds_me``). It
was signed in all the same, as a reducer of its share: every other member's slice of that partition
went to a peer that had left, the coordinator named a replacement, and every member sent its slice
again. At 128 simulated peers with 48 inbound slots a node, 196 of the 337 slices that never reached
their reducer went to such a member. The invariant: a member the leader signs out holds no partition,
no member sends it a slice or waits for one, and the round commits with every member taking part,
with no partition to replace.
"""

from __future__ import annotations

import random

import pytest
import torch
import trio

from p2ptrain.averaging import AveragerConfig, RoundResult
from p2ptrain.averaging.matchmaking import Quorum
from p2ptrain.averaging.protocol import SignedManifest
from p2ptrain.errors import GroupFormationFailed, RoundAborted
from p2ptrain.identity import Identity
from tests.harness.nodes import swarm


@pytest.mark.parametrize("seed", range(6))
async def test_a_member_signed_out_holds_no_partition_and_the_round_commits_without_it(autojump_clock, seed):
    """Randomized: the group's size, and which joiners name a peer that never joins in their quorum
    (bound to decline)."""
    rng = random.Random(seed)
    n = rng.randint(4, 6)
    key = f"out-{seed}"
    cfg = AveragerConfig(target_size=n, min_size=2, matchmaking_time=3.0)
    async with swarm(n, cfg) as nodes:
        ids = [node.peer_id for node in nodes]
        bound = set(rng.sample(range(n), rng.randint(1, n - 3)))
        honest = frozenset(ids[i] for i in range(n) if i not in bound)
        phantom = Identity.from_seed(bytes([200 + seed]) * 32).peer_id  # (nobody knows it; it never joins)
        got: dict[int, SignedManifest | Exception] = {}
        inputs = [[torch.full((4096,), float(i))] for i in range(n)]

        async def form(i: int) -> None:
            if i in bound:
                quorum = Quorum(frozenset({ids[i], phantom}), 2, leads=False)  # (a newcomer's)
            else:
                quorum = Quorum(honest, len(honest), frozenset(ids))
            try:
                got[i] = await nodes[i].averager.form_group(
                    inputs[i], timeout=20.0, group_key=key, quorum=quorum
                )
            except GroupFormationFailed as e:
                got[i] = e

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(form, i)
        taking = sorted(i for i, g in got.items() if isinstance(g, SignedManifest))
        assert taking == sorted(set(range(n)) - bound), got
        signed = got[taking[0]]
        assert isinstance(signed, SignedManifest)
        m = signed.manifest
        assert all(isinstance(got[i], SignedManifest) and got[i].digest == signed.digest for i in taking)
        peers = m.peers()
        assert sorted(peers[i] for i in m.out) == sorted(ids[i] for i in bound)  # each bound one: out
        assert all(m.sizes[i] == 0 for i in m.out)
        assert all("signed this peer out" in str(got[i]) for i in bound), got
        results: dict[int, RoundResult | Exception] = {}

        async def run(i: int) -> None:
            try:
                results[i] = await nodes[i].averager.run_round(signed, inputs[i])
            except RoundAborted as e:
                results[i] = e

        began = trio.current_time()
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for i in taking:
                    nursery.start_soon(run, i)
        took = trio.current_time() - began
    mean = sum(float(i) for i in taking) / len(taking)
    for i in taking:
        r = results[i]
        assert isinstance(r, RoundResult), r
        assert sorted(r.contributors) == sorted(ids[j] for j in taking), r.excluded
        assert all(r.shares[ids[j]] == 0 for j in bound)  # no slice went to a member that left
        assert all("signed out" in why for why in r.excluded.values()), r.excluded  # (nothing replaced)
        assert torch.equal(r.tensors[0], torch.full((4096,), mean))
    assert took < 2.0, took  # no member waited for anyone's slices
