"""A round's signed scales cost each member one signature check per contributor, whatever the group's size,
and a contributor that signs a different table for each reducer frames no honest reducer (``bounds``).

Before, a contributor signed one scale per partition and each reducer served all of them with its result:
a member checked k^2 signatures a round (65,536 in a group of 256, about 4 s of one core) and received
k^2 signed scales of ~130 bytes. Now a contributor signs one table of all its partitions' scales, every
member holds the tables that came with the slices it reduced, and a result's server sends only the tags
of the tables it used, with those the fetcher lacks in full.

The invariant, over random group sizes, partition sizes, client-only members (they reduce nothing, so
hold no table until they ask for them) and compressed or plain rounds: every member commits the same
bits; the tables sent to members are only those they lack (n per client-only member, which asks one
member once, not every fetch's server; an early result's stream names what its fetcher holds once the
decision is in, not as it began: the first version of this sent 120 tables in a round of 6); and the
signature checks of scale evidence in the whole round are at most ``2 n^2`` (``n (n-1)`` reducers'
checks of the tables with the slices, plus the client-only members' ``n`` each); the code before made
about ``n^2 (n-1)`` (441 in a round of 8), so this fails on it at every size drawn.

The adversary: a contributor far larger than its mates (its values 30x theirs, within every cap) signs,
for each reducer, a table whose entry for that reducer's partition is true and whose other entries are
a millionth of the truth. A member that bounded a partition by the table it holds itself would refuse
the honest reducer's result (the contributor dominates it) and blame that reducer; bounded by the table
the reducer used, which its server sends because the tags differ, every member commits the round with
the contributor in it.

The rounds run on the virtual clock: on the real one, a machine busy with other work let a phase's
deadline pass, and a round came out without one of its members.
"""

from __future__ import annotations

import random

import pytest
import torch
import trio

from p2ptrain.averaging import allreduce, gathering
from p2ptrain.averaging.allreduce import RoundResult
from p2ptrain.averaging.bounds import TABLE_DOMAIN, Scale, open_table, seal_table
from p2ptrain.averaging.protocol import TABLES, TAG_BYTES, FetchReq, PartReq
from p2ptrain.averaging.round_tensors import RoundTensors
from p2ptrain.errors import P2PError
from p2ptrain.identity import SignedEnvelope
from tests.harness.averaging import (
    Group,
    Outcome,
    check_invariant,
    contributors_of,
    open_group,
    run_round,
    sign_manifest,
)
from tests.harness.identities import identity

pytestmark = pytest.mark.timeout(300)

SEEDS = 6


def count_scale_checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every opening of a signed scale (of either form: the per-partition one before, the table now)."""
    opened = [0]
    real = SignedEnvelope.open

    def counting(self: SignedEnvelope, domain: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        if domain.startswith("p2ptrain/averaging-scale"):
            opened[0] += 1
        return real(self, domain, *args, **kwargs)

    monkeypatch.setattr(SignedEnvelope, "open", counting)
    return opened


async def round_over(
    group: Group, originals: list[list[torch.Tensor]], weights: list[float], compression: str = "none"
) -> tuple[list[list[torch.Tensor]], list[Outcome]]:
    """One round of ``group`` over copies of ``originals``: the copies (averaged in place) and what each
    member's round returned."""
    inputs = [[t.clone() for t in ts] for ts in originals]
    signed = sign_manifest(group.peers, inputs[0], compression=compression)
    with trio.fail_after(120):
        outcomes = await run_round(group, signed, inputs, weights)
    return inputs, outcomes


@pytest.mark.parametrize("seed", range(SEEDS))
async def test_a_member_checks_each_contributors_signed_scales_once_a_round(
    seed: int, monkeypatch: pytest.MonkeyPatch, autojump_clock: object
) -> None:
    rng = random.Random(seed)
    n = rng.randint(5, 10)
    client_only = tuple(rng.sample(range(1, n), rng.randint(0, 2)))
    size = rng.randint(2_000, 40_000)
    opened = count_scale_checks(monkeypatch)
    served = [0]  # signed tables a fetch's server sent the fetcher
    take = RoundTensors.take_tables

    def counting(self: RoundTensors, tables, tags, decision) -> None:  # type: ignore[no-untyped-def]
        served[0] += len(tables)
        take(self, tables, tags, decision)

    monkeypatch.setattr(RoundTensors, "take_tables", counting)
    async with open_group(n, client_only=client_only, seed=seed) as group:
        g = torch.Generator().manual_seed(seed)
        originals = [[torch.randn(size, generator=g)] for _ in range(n)]
        weights = [rng.uniform(0.5, 2.0) for _ in range(n)]
        inputs, outcomes = await round_over(group, originals, weights, rng.choice(["none", "fp16"]))
    assert check_invariant(originals, inputs, weights, outcomes, atol=1e-3) == "commit"
    assert all(isinstance(o, RoundResult) and len(o.contributors) == n for o in outcomes)
    assert 0 < opened[0] <= 2 * n * n, f"{opened[0]} signature checks of scales in a round of {n}"
    # tables travel to the members that lack them: the client-only ones (n each), not with every fetch
    assert served[0] <= n * (len(client_only) + 1), f"{served[0]} tables sent in a round of {n}"


@pytest.mark.parametrize("seed", range(SEEDS))
async def test_a_contributor_that_signs_a_table_for_each_reducer_frames_no_honest_reducer(
    seed: int, monkeypatch: pytest.MonkeyPatch, autojump_clock: object
) -> None:
    rng = random.Random(100 + seed)
    n = rng.randint(4, 8)
    liar = rng.randrange(n)
    key = identity(f"p{liar}")
    real_part_req = PartReq

    def equivocating(digest: bytes, p: int, weight: float, commit: bytes, scale: bytes) -> PartReq:
        if SignedEnvelope.from_bytes(scale).signer == key.peer_id:  # the liar's slice to reducer p
            true = open_table(scale, key.peer_id, digest, [1] * n)  # (the counts are not signed)
            forged = [s if q == p else Scale(s.sumsq * 1e-12, s.absmax * 1e-6, 1) for q, s in enumerate(true)]
            scale = seal_table(key, digest, forged)
        return real_part_req(digest, p, weight, commit, scale)

    monkeypatch.setattr(allreduce, "PartReq", equivocating)
    size = rng.randint(4_000, 30_000)
    async with open_group(n, seed=seed) as group:
        g = torch.Generator().manual_seed(seed)
        originals = [[torch.randn(size, generator=g) * (30.0 if i == liar else 1.0)] for i in range(n)]
        weights = [1.0] * n
        inputs, outcomes = await round_over(group, originals, weights)
        assert check_invariant(originals, inputs, weights, outcomes, atol=1e-3) == "commit"
        first = outcomes[0]
        assert isinstance(first, RoundResult)
        assert sorted(contributors_of(group, first)) == list(range(n)), "a member was left out"
        expected = torch.stack([o[0] for o in originals]).mean(0)
        assert torch.allclose(inputs[0][0], expected, atol=1e-3)
        for peer in group.peers:  # no member blamed anyone
            assert not peer.averager.auditor.banned, f"{peer.name} banned {peer.averager.auditor.banned}"
    assert TABLE_DOMAIN.startswith("p2ptrain/averaging-scale")  # (what the counter above counts)


@pytest.mark.parametrize("seed", range(3))
async def test_a_member_that_asks_for_the_tables_again_and_again_is_sent_them_once(
    seed: int, monkeypatch: pytest.MonkeyPatch, autojump_clock: object
) -> None:
    """A client-only member (it reduces nothing, so it lacks every table) that asks one member for the
    round's tables again and again (five times before each of its fetches), saying each time that it
    holds none: it is sent at most the round's n tables in all, and the round commits for everyone. On
    the code before, each ask was answered in full (60 to 210 tables in these draws)."""
    rng = random.Random(200 + seed)
    n = rng.randint(4, 8)
    greedy = rng.randrange(1, n)
    received = [0]
    asks = 5

    async def greedy_tables(self: gathering.Gatherer, decision) -> None:  # type: ignore[no-untyped-def]
        if self.m.me != greedy:
            return await real_tables_for(self, decision)
        server = next(i for i, a in enumerate(self.addrs) if a and i != self.m.me)
        for _ in range(asks):
            try:  # (a failed ask is its own loss, as in the real one: the server's round may be over)
                conn = await self.host.connect(self.addrs[server])
                req = FetchReq(self.m.digest, 0, bytes(TAG_BYTES * self.m.n))  # ("it holds none")
                async with conn.open_stream(TABLES, req, timeout=30.0) as stream:
                    tables = await self._tables(stream)
                    ack = await stream.response()
            except P2PError:
                continue
            received[0] += len(tables)
            if ack.ok:
                self.t.take_tables(tables, ack.scales, decision)
        return None

    real_tables_for = gathering.Gatherer.tables_for
    monkeypatch.setattr(gathering.Gatherer, "tables_for", greedy_tables)
    async with open_group(n, client_only=(greedy,), seed=seed) as group:
        g = torch.Generator().manual_seed(seed)
        size = rng.randint(2_000, 20_000)
        originals = [[torch.randn(size, generator=g)] for _ in range(n)]
        weights = [1.0] * n
        inputs, outcomes = await round_over(group, originals, weights)
    assert check_invariant(originals, inputs, weights, outcomes, atol=1e-3) == "commit"
    assert 0 < received[0] <= n, f"{received[0]} tables sent to one member that asked {asks} times"
