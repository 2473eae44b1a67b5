"""Results bounded before they are applied, on the in-memory network: hostile reducers serve garbage
(1000 everywhere), well-formed but wrong top-k sums (100 in every kept slot) or malformed bytes (NaN),
and no honest member applies anything of it; each hostile reducer is banned by every honest member by
the end of its first bad round, and no honest member is banned.

The hostile members are honest processes whose reducer serves other bytes than the ones it computed:
its early chunks (pipelined rounds) and its result, encoded as the round says (and attested, in an
audited round: a consistent liar). What they send as contributors is honest.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
import torch
import trio

from p2ptrain.averaging import sparse
from p2ptrain.averaging.allreduce import AllReduceRound, RoundResult
from p2ptrain.averaging.averager import schema_of
from p2ptrain.averaging.compression import Compression, decode, encode, roundtrip
from p2ptrain.averaging.partition import offsets, partition_sizes
from p2ptrain.averaging.protocol import Manifest, MemberMsg, SignedManifest
from p2ptrain.averaging.reducer import PartitionReducer
from p2ptrain.errors import RoundAborted
from tests.harness.averaging import Group, Outcome, Peer, open_group

pytestmark = pytest.mark.timeout(600)

NAN = b"\x00\x00\xc0\x7f"  # a float32 NaN, little-endian
OWN_BOUND = 32.0  # the bound each member holds a result to: BOUND x its own values (bounds.BOUND)

Garble = Callable[[torch.Tensor], torch.Tensor]


def fill(value: float) -> Garble:
    """Every value becomes ``value`` (attack 1: a garbage reducer)."""
    return lambda x: torch.full_like(x, value)


def kept_slots(value: float) -> Garble:
    """Every non-zero becomes ``value`` (attack 2: well-formed but wrong top-k sums)."""
    return lambda x: torch.where(x != 0, torch.full_like(x, value), x)


def serve(red: PartitionReducer, index: int, chunk: bytes | memoryview, garble: Garble | None) -> bytes:
    """Chunk ``index`` of a reducer's result as the liar serves it: ``garble``d values, encoded as the
    round says; None: malformed bytes (attack 3: its first value, or block scale, is NaN)."""
    if garble is None:
        return NAN + bytes(chunk)[4:]
    a, b = red.spans[index]
    values = decode(chunk, red.mode, b - a, red.members).contiguous()
    return bytes(encode(garble(values).contiguous(), red.mode, red.members))


class Forged(list):  # type: ignore[type-arg]
    """A reducer's early chunks: served garbled (the server reads them by index), while the liar's own
    copy decodes the honest ones (it iterates them)."""

    def __init__(self, red: PartitionReducer, garble: Garble | None) -> None:
        super().__init__()
        self.red, self.garble = red, garble

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        return serve(self.red, index, super().__getitem__(index), self.garble)


def lie_as_reducer(peer: Peer, garble: Garble | None, rounds: Callable[[int], bool] = lambda r: True) -> None:
    """``peer``'s reducer serves garbled results in the rounds ``rounds(r)`` picks (r counts from 0)."""
    count = [0]

    async def fault(rnd: AllReduceRound, point: str) -> None:
        if point == "before_send":
            count[0] += 1
        if not rounds(count[0] - 1):
            return
        for red in rnd.reducers.values():
            if point == "before_send" and red.early is not None and not red.early:
                red.early = Forged(red, garble)
            if point == "after_reduce" and red.encoded is not None and not isinstance(red.encoded, Forged):
                red.encoded = [serve(red, i, c, garble) for i, c in enumerate(red.encoded)]

    peer.averager.fault = fault


def manifest(
    peers: list[Peer], size: int, *, mode: Compression, aggregation: str, audit: bool, round_id: int = 0
) -> SignedManifest:
    align = sparse.BLOCK if mode.sparse else 1
    sizes = partition_sizes(size, [1.0] * len(peers), [p.listen for p in peers], align)
    m = Manifest(
        round_id=random.Random(size * 1000 + round_id).randbytes(16),
        group_key="bounded",
        members=tuple(MemberMsg(p.host.identity.peer_id.digest, p.addr, 1.0) for p in peers),
        sizes=tuple(sizes),
        schema=schema_of([torch.zeros(size)]),
        compression=mode.value,
        timeout=30.0,
        aggregation=aggregation,
        audit=audit,
    )
    return SignedManifest.sign(peers[0].host.identity, m)


async def one_round(
    group: Group, signed: SignedManifest, inputs: list[torch.Tensor], *, in_place: bool = False
) -> list[Outcome]:
    outcomes: list[Outcome] = [None] * len(group.peers)

    async def run(i: int, peer: Peer) -> None:
        try:
            outcomes[i] = await peer.averager.run_round(
                signed, [inputs[i]], weight=1.0 + i, in_place=in_place
            )
        except RoundAborted as e:
            outcomes[i] = e

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            for i, peer in enumerate(group.peers):
                nursery.start_soon(run, i, peer)
    return outcomes


def check_nothing_applied(
    signed: SignedManifest,
    sent: list[torch.Tensor],
    originals: list[torch.Tensor],
    inputs: list[torch.Tensor],
    outcomes: list[Outcome],
    honest: list[int],
    liars: list[int],
    *,
    in_place: bool = False,
) -> None:
    """No honest member applied a result beyond its own bound (``sent``: what it sent, as the round's
    compression left it), nor anything of a liar's partition (``originals``: its tensors before)."""
    at = offsets(list(signed.manifest.sizes))
    for i in honest:
        got, own = inputs[i], sent[i]
        if isinstance(outcomes[i], RoundResult):
            for p in range(len(at) - 1):  # every partition within BOUND x its own values
                mine, res = own[at[p] : at[p + 1]], got[at[p] : at[p + 1]]
                if res.numel():
                    limit = OWN_BOUND * max(float(mine.abs().max()), float(own.abs().max())) + 1e-6
                    assert float(res.abs().max()) <= limit, (i, p)
        else:
            assert isinstance(outcomes[i], RoundAborted), outcomes[i]
            if not in_place:  # an abort leaves the caller's tensors as they were
                assert torch.equal(got, originals[i])


def check_banned(group: Group, honest: list[int], liars: list[int]) -> None:
    ids = [p.host.identity.peer_id for p in group.peers]
    for i in honest:
        banned = group.peers[i].averager.auditor.banned
        for j in liars:
            assert ids[j] in banned, f"member {i} did not ban liar {j}: {banned}"
        assert not {ids[k] for k in honest} & set(banned), f"member {i} banned an honest member: {banned}"


def inputs_for(n: int, size: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [0.01 * torch.randn(size, generator=g) for _ in range(n)]  # pseudo-gradients: small values


# ---- the attacks -------------------------------------------------------------------------


async def test_a_garbage_reducer_in_an_audited_trimmed_mean_round_lands_nothing_and_is_banned_at_once(
    autojump_clock: object,
) -> None:
    """Attack 1: the reducer of partition 2 serves 1000 everywhere in an audited trimmed-mean round
    (attested: a consistent liar). Before, every member applied it at once (the audit ran afterwards, in
    the background, and banned it there, after the damage); now no member applies it, and every honest
    member bans it by the end of the round."""
    n, size, liar = 4, 4001, 2
    async with open_group(n) as group:
        inputs = inputs_for(n, size, 1)
        sent = [x.clone() for x in inputs]
        originals = sent
        lie_as_reducer(group.peers[liar], fill(1000.0))
        signed = manifest(group.peers, size, mode=Compression.NONE, aggregation="trimmed_mean", audit=True)
        outcomes = await one_round(group, signed, inputs)
        honest = [i for i in range(n) if i != liar]
        check_nothing_applied(signed, sent, originals, inputs, outcomes, honest, [liar])
        assert all(float(inputs[i].abs().max()) < 1.0 for i in honest)
        check_banned(group, honest, [liar])


async def test_wrong_topk_sums_land_nothing_and_their_reducer_is_banned_at_once(
    autojump_clock: object,
) -> None:
    """Attack 2: a top-k reducer serves well-formed sums with 100 in every kept slot. Before, they were
    checked for form only and applied (the largest value of every member became 100), and nobody was
    banned: top-k rounds are not audited."""
    n, liar = 4, 1
    size = 3 * sparse.BLOCK * n + 77
    mode = Compression.TOPK1_Q2
    async with open_group(n) as group:
        inputs = inputs_for(n, size, 2)
        sent = [roundtrip(x, mode) for x in inputs]  # what a top-k round sends of them
        originals = [x.clone() for x in inputs]
        lie_as_reducer(group.peers[liar], kept_slots(100.0))
        signed = manifest(group.peers, size, mode=mode, aggregation="mean", audit=False)
        outcomes = await one_round(group, signed, inputs)
        honest = [i for i in range(n) if i != liar]
        check_nothing_applied(signed, sent, originals, inputs, outcomes, honest, [liar])
        assert all(float(inputs[i].abs().max()) < 1.0 for i in honest)
        check_banned(group, honest, [liar])


async def test_a_topk_reducer_that_serves_malformed_sums_now_and_then_is_banned_in_its_first_bad_round(
    autojump_clock: object,
) -> None:
    """Attack 3: a top-k reducer serves malformed sums in two rounds of three and behaves in the third,
    so that a strike count wiped by every good round never reaches 3. Before, it was never banned; now
    malformed bytes are proof enough: banned by every honest member in its first bad round."""
    n, liar = 4, 3
    size = 2 * sparse.BLOCK * n
    mode = Compression.TOPK3_Q4
    async with open_group(n) as group:
        lie_as_reducer(group.peers[liar], None, rounds=lambda r: r % 3 != 0)  # behaves in round 0
        ids = [p.host.identity.peer_id for p in group.peers]
        honest = [i for i in range(n) if i != liar]
        for r in range(2):
            inputs = inputs_for(n, size, 10 + r)
            sent = [roundtrip(x, mode) for x in inputs]
            originals = [x.clone() for x in inputs]
            signed = manifest(group.peers, size, mode=mode, aggregation="mean", audit=False, round_id=r)
            outcomes = await one_round(group, signed, inputs)
            check_nothing_applied(signed, sent, originals, inputs, outcomes, honest, [liar])
            if r == 0:  # it behaved: committed, nobody banned
                assert all(isinstance(outcomes[i], RoundResult) for i in honest)
                assert not any(ids[liar] in group.peers[i].averager.auditor.banned for i in honest)
        check_banned(group, honest, [liar])


# ---- seeded hostile groups that mix the attacks --------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
async def test_seeded_hostile_reducers_never_land_anything_and_are_banned_in_their_first_bad_round(
    autojump_clock: object, seed: int
) -> None:
    """Groups of 3-6 with one or two hostile reducers, each with its own attack (garbage, a wrong sign
    and size, wrong kept slots, malformed bytes), in every kind of round by turns: top-k (pipelined),
    dense pipelined means, dense audited or robust ones, in place or not."""
    rng = random.Random(seed)
    n = rng.randint(3, 6)
    liars = sorted(rng.sample(range(1, n), rng.randint(1, min(2, n - 1))))  # the coordinator is honest
    honest = [i for i in range(n) if i not in liars]
    kind = seed % 4
    if kind == 0:  # top-k
        mode = rng.choice([m for m in Compression if m.sparse])
        aggregation, audit, in_place = "mean", False, False
        size = sparse.BLOCK * n * rng.randint(1, 3) + rng.randrange(sparse.BLOCK)
        attacks: list[Garble | None] = [fill(1000.0), kept_slots(100.0), None]
    else:
        mode = rng.choice([Compression.NONE, Compression.INT8, Compression.FP16])
        if kind == 1:  # pipelined: the liar's early chunks are what members fetch
            aggregation, audit = "mean", False
        else:
            aggregation, audit = rng.choice(["mean", "trimmed_mean", "centered_clip"]), kind == 2
        in_place = rng.random() < 0.5
        size = rng.randint(50 * n, 3000)
        attacks = [fill(1000.0), fill(-55.0), kept_slots(100.0), None]
    async with open_group(n, seed=seed) as group:
        for j in liars:
            lie_as_reducer(group.peers[j], rng.choice(attacks))
        inputs = inputs_for(n, size, 100 + seed)
        sent = [roundtrip(x, mode) if mode.sparse else x.clone() for x in inputs]
        originals = [x.clone() for x in inputs]
        signed = manifest(group.peers, size, mode=mode, aggregation=aggregation, audit=audit)
        outcomes = await one_round(group, signed, inputs, in_place=in_place)
        what = f"{n} members, liars {liars}, {mode.value} {aggregation} audit={audit} in_place={in_place}"
        assert all(not isinstance(outcomes[i], RoundResult) for i in honest), what
        check_nothing_applied(signed, sent, originals, inputs, outcomes, honest, liars, in_place=in_place)
        if in_place:  # the liars' partitions of the caller's tensor still hold its own values
            at = offsets(list(signed.manifest.sizes))
            for i in honest:
                for j in liars:
                    assert torch.equal(inputs[i][at[j] : at[j + 1]], sent[i][at[j] : at[j + 1]]), (what, i, j)
        check_banned(group, honest, liars)
        assert math.isfinite(float(torch.stack([inputs[i] for i in honest]).abs().max()))


async def test_a_contributor_sending_huge_values_cannot_get_an_honest_reducer_banned(
    autojump_clock: object,
) -> None:
    """A reducer holds each contributor's slice to the same bound as results: a member sending 1000x its
    values in a plain-mean round is left out, so the honest reducers' means stay within every member's
    bound, every honest member commits the honest mean, and nobody is banned (else one hostile
    contributor would make every member refuse, and ban, every honest reducer)."""
    n, size, hostile = 4, 3001, 2
    async with open_group(n, client_only=(hostile,)) as group:  # (a reducer would serve its own values)
        inputs = inputs_for(n, size, 7)
        originals = [x.clone() for x in inputs]
        inputs[hostile].mul_(1000.0)
        signed = manifest(group.peers, size, mode=Compression.NONE, aggregation="mean", audit=False)
        outcomes = await one_round(group, signed, inputs)
        honest = [i for i in range(n) if i != hostile]
        ids = [p.host.identity.peer_id for p in group.peers]
        for i in honest:
            result = outcomes[i]
            assert isinstance(result, RoundResult), result
            assert ids[hostile] not in result.contributors
            weights = {k: 1.0 + k for k in honest}
            want = sum(originals[k] * w for k, w in weights.items()) / sum(weights.values())
            torch.testing.assert_close(inputs[i], want, rtol=1e-5, atol=1e-7)
            assert not group.peers[i].averager.auditor.banned


async def test_a_contributor_sending_nan_is_banned_by_every_reducer_it_sent_to(
    autojump_clock: object,
) -> None:
    """Malformed slices are the sender's own bytes: proof enough (R2). Before, the reducers only refused
    them, and the sender was back in the next round."""
    from p2ptrain.testing.adversary import install

    n, size, hostile = 4, 2000, 3
    async with open_group(n) as group:
        install("nan", group.peers[hostile].averager)
        inputs = inputs_for(n, size, 9)
        signed = manifest(group.peers, size, mode=Compression.NONE, aggregation="trimmed_mean", audit=False)
        outcomes = await one_round(group, signed, inputs)
        ids = [p.host.identity.peer_id for p in group.peers]
        for i in range(n - 1):
            result = outcomes[i]
            assert isinstance(result, RoundResult) and ids[hostile] not in result.contributors
            banned = group.peers[i].averager.auditor.banned
            assert set(banned) == {ids[hostile]} and "NaN" in banned[ids[hostile]], banned


@pytest.mark.parametrize("seed", range(16))
async def test_no_member_applies_a_non_finite_result_not_even_one_of_its_own_partition(
    autojump_clock: object, seed: int
) -> None:
    """A member never applies a non-finite result, whoever built it: one hostile member (the coordinator
    or another, by seed) spoils the values it sends with NaN (``nan``: in place that is also where it
    reduces its own partition) or fills its own result with NaN (``flaky-reducer``), in plain-mean and
    trimmed-mean rounds, in place or not. Every member ends the round with finite tensors committed, or
    an abort (16 seeds; 14 of them failed before). Before, the attacker
    committed the NaN of its own partition (reduced in place over the values it spoilt, or filled after
    reducing) and its next round raised on its NaN model (seen once leaders were chosen by lottery)."""
    from p2ptrain.testing.adversary import install

    rng = random.Random(seed)
    n, size = 4, rng.choice([1000, 2000, 3001])
    kind = rng.choice(["nan", "flaky-reducer"])
    aggregation = rng.choice(["mean", "trimmed_mean"])
    in_place, hostile = rng.random() < 0.5, rng.choice([0, rng.randrange(1, n)])
    async with open_group(n) as group:
        install(kind, group.peers[hostile].averager)
        inputs = inputs_for(n, size, seed)
        signed = manifest(group.peers, size, mode=Compression.NONE, aggregation=aggregation, audit=False)
        outcomes = await one_round(group, signed, inputs, in_place=in_place)
        for i, outcome in enumerate(outcomes):
            assert isinstance(outcome, RoundResult | RoundAborted), (i, outcome)
            if isinstance(outcome, RoundResult):
                assert all(torch.isfinite(t).all() for t in outcome.tensors), (i, kind, in_place)
                assert torch.isfinite(inputs[i]).all(), (i, kind, in_place)
