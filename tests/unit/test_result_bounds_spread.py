"""The result bound against honest spreads of work and values (``averaging.bounds``), seeded.

The invariant: an honest member never refuses an honest result, and an honest reducer never refuses an
honest slice, whatever the honest contributors' spread of work per round (their weights), and with
values per unit of weight up to ``SPREAD`` apart; a result beyond what an honest round with the signed
weights can produce is refused before any of it lands.

- Honest rounds of the kinds that broke the fixed 32x bound on a member's own values (a restarted
  DiLoCo member beside hosts 20-100x ahead, a host 100x slower than its mates, a 100x gradient spike on
  one peer, sparse embedding rows, a pipeline stage's mean gradients over few samples with a 70x
  spike): no member refuses a partition, no reducer refuses a slice; the old bound (reproduced here)
  refuses some of every kind.
- Lying reducers: a result beyond the limit the decided weights give, of any shape, is refused and
  nothing of it lands; weights a hostile leader inflates are capped before they widen the limit.
- A reducer whose own values are small this round (a few inner steps) bounds slices by its last
  accepted result too.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from p2ptrain.averaging.agreement import WEIGHT_SLACK
from p2ptrain.averaging.bounds import Limit, ResultCheck, Scale, limit, reach
from p2ptrain.averaging.compression import Compression, encoded_chunk
from p2ptrain.averaging.gathering import Gatherer, OutOfBounds, _store
from p2ptrain.averaging.partition import chunks, offsets, partition_sizes
from p2ptrain.averaging.protocol import Decision, Manifest, MemberMsg, TensorSpec
from p2ptrain.averaging.reducer import PartitionReducer, SliceOutOfBounds
from p2ptrain.averaging.robust import aggregate
from p2ptrain.averaging.round_machine import Deadlines, RoundMachine
from p2ptrain.averaging.round_tensors import RoundTensors
from tests.harness.identities import identity

SEEDS = 40  # per kind
KINDS = ("restarted-diloco", "slow-host", "sync-spike", "sparse-embedding", "pipeline-few-samples")


def old_limit(own: Scale, whole: Scale) -> Limit | None:
    """The bound this replaced: 32x the member's own values alone, whatever the weights."""
    if whole.zero:
        return None
    d = own.count
    return Limit(
        32.0 * max(own.norm, whole.rms * math.sqrt(d)) + 1e-6 * math.sqrt(d), 32.0 * whole.absmax + 1e-6
    )


def honest_round(kind: str, rng: random.Random, g: torch.Generator) -> tuple[list[torch.Tensor], list[float]]:
    """The members' contributions (whole vectors) and weights (samples) of one honest round."""
    n = rng.randint(2, 6)
    d = rng.choice([600, 3000])
    scale = 10.0 ** rng.uniform(-5, 1)
    direction = torch.randn(d, generator=g)
    xs: list[torch.Tensor] = []
    ws: list[float] = []
    if kind in ("restarted-diloco", "slow-host"):
        # DiLoCo pseudo-gradients: k inner steps of aligned drift (Adam: about linear in k) plus noise
        batch = rng.choice([4, 16, 64])
        steps = [rng.randint(20, 100) for _ in range(n)]
        if kind == "restarted-diloco":  # one member restarted: it took a step or two since
            steps[rng.randrange(n)] = rng.choice([1, 2])
        else:  # one host 100x slower than the others
            steps = [100] * n
            steps[rng.randrange(n)] = 1
        for k in steps:
            drift = rng.choice([1.0, math.sqrt(k) / k])  # aligned steps, or drifting apart (sqrt growth)
            xs.append((k * drift * direction + math.sqrt(k) * 0.1 * torch.randn(d, generator=g)) * scale)
            ws.append(float(k * batch))
    elif kind == "sync-spike":  # mean gradients of equal batches; one peer's batch spikes 100x
        for _ in range(n):
            xs.append((0.1 * direction + torch.randn(d, generator=g) / math.sqrt(32)) * scale)
            ws.append(32.0)
        xs[rng.randrange(n)] *= 100.0
    elif kind == "sparse-embedding":  # a token embedding's rows (touched by few members) and dense rest
        rows, dim = 128, d // 256
        for _ in range(n):
            x = torch.randn(d, generator=g) * 0.1  # (the rest of the model: most of a gradient's norm)
            emb = torch.zeros(rows, dim)
            for r in rng.sample(range(rows), rng.randint(1, 6)):  # the rare tokens its batch held
                emb[r] = torch.randn(dim, generator=g) * rng.choice([1.0, 30.0])
            x[: rows * dim] = emb.reshape(-1)
            xs.append(x * scale)
            ws.append(float(rng.choice([8, 16, 32])))
    else:  # a pipeline stage: mean gradients over 8-64 samples, a 70x coordinate spike on one peer
        for _ in range(n):
            b = rng.choice([8, 8, 16, 64])
            xs.append((0.05 * direction + torch.randn(d, generator=g) / math.sqrt(b)) * scale)
            ws.append(float(b))
        spiky, largest = xs[rng.randrange(n)], float(max(x.abs().max() for x in xs))
        for j in rng.sample(range(d), 3):
            spiky[j] = 70.0 * largest
    return xs, ws


def _result(xs: list[torch.Tensor], ws: list[float], rule: str) -> torch.Tensor:
    if rule == "mean":
        return sum(w * x for w, x in zip(ws, xs, strict=True)) / sum(ws)
    return aggregate(rule, torch.stack(xs))


def _refused(result: torch.Tensor, bound: Limit | None) -> str:
    check = ResultCheck(bound)
    for a, b in chunks(result.numel(), Compression.NONE):
        why = check.add(result[a:b].contiguous())
        if why:
            return why
    return ""


def _slice_refused(
    own: torch.Tensor, whole: Scale, w_own: float, slice_: torch.Tensor, w: float, *, old: bool
) -> bool:
    """Would a reducer with ``own`` values there (weight ``w_own``) refuse this slice of weight ``w``?"""
    bound = old_limit(Scale.of(own), whole) if old else limit(Scale.of(own), whole)
    red = PartitionReducer(own.numel(), Compression.NONE, bound=bound, weight=1.0 if old else w_own)
    try:
        for index, (a, b) in enumerate(red.spans):
            red.add_chunk(1, index, memoryview(bytearray(encoded_chunk(slice_[a:b], Compression.NONE))), w)
    except SliceOutOfBounds:
        return True
    return False


@pytest.mark.parametrize("kind", KINDS)
def test_honest_rounds_of_wide_spreads_are_never_refused_and_the_old_bound_refused_them(kind: str) -> None:
    old_refusals = 0
    for seed in range(SEEDS):
        rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
        xs, ws = honest_round(kind, rng, g)
        n, d = len(xs), xs[0].numel()
        rule = rng.choice(["mean", "mean", "trimmed_mean", "centered_clip"])
        result = _result(xs, ws, rule).contiguous()
        at = offsets(partition_sizes(d, [rng.uniform(0.2, 1.0) for _ in range(n)], [True] * n, 1))
        old_refused = False
        for i, x in enumerate(xs):
            own = [Scale.of(x[at[p] : at[p + 1]]) for p in range(n)]
            whole = Scale.total(own)
            factor = reach(ws[i], ws, robust=rule != "mean")
            for p in range(n):
                part = result[at[p] : at[p + 1]]
                why = _refused(part, limit(own[p], whole, factor=factor))
                assert not why, (
                    f"{kind} seed {seed}: member {i} (weight {ws[i]:g} of {ws}) refused {p}: {why}"
                )
                old_refused = old_refused or bool(_refused(part, old_limit(own[p], whole)))
                # as the reducer of p: every other member's slice of p, with its weight
                for j, y in enumerate(xs):
                    if j != i:
                        mine, theirs = x[at[p] : at[p + 1]], y[at[p] : at[p + 1]]
                        assert not _slice_refused(mine, whole, ws[i], theirs, ws[j], old=False), (
                            f"{kind} seed {seed}: reducer {i} (weight {ws[i]:g}) refused {j}'s slice"
                        )
                        if not old_refused and p == i:
                            old_refused = _slice_refused(mine, whole, ws[i], theirs, ws[j], old=True)
        old_refusals += old_refused
    assert old_refusals > 0, f"{kind}: the old bound refused none of these rounds (the test shows nothing)"


# ---- lying reducers ------------------------------------------------------------------------------

SHAPES = ("scaled", "sign-flipped", "one-value", "uniform", "random")


@pytest.mark.parametrize("seed", range(60))
def test_a_result_beyond_what_the_signed_weights_allow_is_refused_and_nothing_of_it_lands(seed: int) -> None:
    rng, g = random.Random(7000 + seed), torch.Generator().manual_seed(7000 + seed)
    kind = rng.choice(KINDS)
    xs, ws = honest_round(kind, rng, g)
    n, d = len(xs), xs[0].numel()
    rule = rng.choice(["mean", "trimmed_mean"])
    honest = _result(xs, ws, rule).contiguous()
    at = offsets(partition_sizes(d, [1.0] * n, [True] * n, 1))
    p = rng.randrange(n)
    part = honest[at[p] : at[p + 1]]
    shape = rng.choice(SHAPES)
    if shape == "scaled":
        bad = part.clone()
    elif shape == "sign-flipped":
        bad = -part
    elif shape == "one-value":
        bad = torch.zeros_like(part)
        bad[rng.randrange(bad.numel())] = 1.0
    elif shape == "uniform":
        bad = torch.full_like(part, -1.0)
    else:
        bad = torch.randn(part.numel(), generator=g)
    if float(bad.norm()) == 0:
        bad = torch.ones_like(part)
    over = rng.choice([1.01, 3.0, 1e3, 1e9])
    for i, x in enumerate(xs):  # every member refuses it (the liar scales it past the largest limit)
        whole = Scale.of(x)
        bound = limit(Scale.of(x[at[p] : at[p + 1]]), whole, factor=reach(ws[i], ws, robust=rule != "mean"))
        assert bound is not None
        lie = (bad * (over * bound.norm / float(bad.norm()))).contiguous()
        target = torch.full_like(part, 7.0)
        check = ResultCheck(bound)
        landed = 0
        with pytest.raises(OutOfBounds):
            for a, b in chunks(part.numel(), Compression.NONE):
                raw = memoryview(bytes(encoded_chunk(lie[a:b], Compression.NONE)))
                _store(target[a:b], raw, Compression.NONE, n, check)
                landed = b
        assert torch.equal(target[landed:], torch.full((part.numel() - landed,), 7.0)), (kind, shape, i)
    # the latitude (docstring): a sign-flipped honest result is within every member's limit
    for i, x in enumerate(xs):
        bound = limit(
            Scale.of(x[at[p] : at[p + 1]]), Scale.of(x), factor=reach(ws[i], ws, robust=rule != "mean")
        )
        assert not _refused((-part).contiguous(), bound)


def _round_parts(weights: tuple[float, ...], caps: dict[int, float], me: int, history: Scale | None = None):  # type: ignore[no-untyped-def]
    ids = [identity(f"s{i}") for i in range(len(weights))]
    n = len(weights)
    manifest = Manifest(
        round_id=bytes(16),
        group_key="k",
        members=tuple(MemberMsg(i.peer_id.digest, f"addr{k}", 1.0) for k, i in enumerate(ids)),
        sizes=(10,) * n,
        schema=(TensorSpec((10 * n,), "float32"),),
    )
    m = RoundMachine(manifest, b"d" * 16, me, weights[me], Deadlines.of(0.0, 30.0), caps)
    flat = torch.ones(10 * n) * 0.01
    t = RoundTensors(ids[me], manifest, b"d" * 16, me, weights[me], flat, [flat], history=history)
    return m, t


def test_weights_a_hostile_leader_inflates_are_capped_before_they_widen_the_limit() -> None:
    weights = (10.0, 10.0, 1e9)  # member 2's weight as a hostile leader decided it
    m, t = _round_parts(weights, {1: 10.0, 2: 10.0}, me=0)
    me = SimpleNamespace(m=m, t=t)
    assert Gatherer.reach(me) == (1.0, False)  # before the decision: no weight sent here yet
    m.settle(Decision(round=b"d" * 16, contributors=(0, 1, 2), weights=weights), b"")
    factor, final = Gatherer.reach(me)
    assert final and factor == pytest.approx(reach(10.0, [10.0, 10.0, WEIGHT_SLACK * 10.0]))
    assert factor <= WEIGHT_SLACK


def test_a_reducer_that_did_little_work_this_round_bounds_slices_by_its_last_result_too() -> None:
    last = Scale.of(torch.ones(40))  # its last accepted result: norm 6.3, where it now sends 0.01s
    _, t = _round_parts((1.0, 1.0, 1.0, 1.0), {}, me=0, history=last)
    slice_ = torch.full((10,), 5.0)  # an honest slice 500x its values this round, far below its last result
    bound = t.slice_limit(1)
    assert bound is not None and not _refused(slice_, bound)
    assert _refused(slice_, t.limit(1))  # (by its own values alone it would refuse it)
    assert _refused(slice_ * 1e3, bound)  # a slice far beyond both is still refused
