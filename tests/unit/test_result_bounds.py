"""Bounds on a round's result (``averaging.bounds``), the verdicts they lead to (``Auditor.convict``,
decaying strikes) and the round machine's faults: pure, seeded-random properties.

- Honest rounds never trip the bound: groups of 2-8 members with contributions of several sizes (sync
  gradients of small and large batches, DiLoCo pseudo-gradients of slow and fast hosts, top-k with error
  feedback, a joiner's first top-k round), every compression, every aggregation rule: 400 seeds.
- A reducer serving a result beyond the bound (scaled, shifted, random, sign-flipped and scaled) always
  trips it, and the chunk that trips it does not land: 400 seeds.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from p2ptrain.averaging import sparse
from p2ptrain.averaging.auditor import STRIKE_HALF_LIFE, STRIKES, Auditor
from p2ptrain.averaging.bounds import BOUND, Limit, ResultCheck, ResultHistory, Scale, limit
from p2ptrain.averaging.compression import DENSE, Compression, decode, encode, encoded_chunk, roundtrip
from p2ptrain.averaging.gathering import Malformed, OutOfBounds, _store
from p2ptrain.averaging.partition import chunks, offsets, partition_sizes
from p2ptrain.averaging.protocol import Decision, Manifest, MemberMsg, TensorSpec
from p2ptrain.averaging.reducer import PartitionReducer, SliceOutOfBounds
from p2ptrain.averaging.robust import aggregate
from p2ptrain.averaging.round_machine import Deadlines, RoundMachine
from p2ptrain.averaging.spill import SpillFile
from p2ptrain.net import Host, MemoryNetwork
from tests.harness.identities import identity

SEEDS = 400
SPARSE = [m for m in Compression if m.sparse]


# ---- honest groups -------------------------------------------------------------------------------


def _honest_contributions(rng: random.Random, g: torch.Generator, n: int, d: int) -> tuple[str, list, list]:
    """n members' contributions to one vector of d values, and their weights (samples)."""
    kind = rng.choice(["sync", "diloco", "topk"])
    direction = torch.randn(d, generator=g)
    signal = rng.choice([0.0, 0.1, 1.0, 10.0])  # from noise-dominated to aligned
    scale = 10.0 ** rng.uniform(-6, 2)  # the model's own units
    xs, ws = [], []
    for _ in range(n):
        if kind == "sync":  # a mean gradient over B samples: the noise shrinks as 1/sqrt(B)
            batch = rng.choice([1, 2, 8, 32, 128, 1000])
            x = signal * direction + torch.randn(d, generator=g) / math.sqrt(batch)
            w = float(batch)
        else:  # DiLoCo: k inner steps, aligned drift plus noise (hosts up to 16x apart)
            k = rng.choice([1, 2, 4, 8, 16])
            x = k * signal * direction + math.sqrt(k) * torch.randn(d, generator=g)
            w = float(k)
        xs.append(x * scale)
        ws.append(w)
    if kind == "topk":  # with error feedback: some members carry residuals of past rounds, a joiner none
        mode = rng.choice(SPARSE)
        sent = []
        for x in xs:
            residual = torch.zeros(d)
            for _ in range(rng.choice([0, 1, 3])):  # earlier rounds this member took part in
                past = x * rng.uniform(0.5, 1.5) + residual
                residual = past - roundtrip(past, mode)
            now = x + residual
            sent.append(roundtrip(now, mode))
        return mode.value, sent, ws
    return kind, xs, ws


def _round_result(rng: random.Random, xs: list, ws: list, kind: str) -> torch.Tensor:
    """What an honest reducer serves: the rule's result, encoded as a group's sum and decoded."""
    n = len(xs)
    if kind.startswith("topk"):
        mode, rule = Compression(kind), "mean"
    else:
        mode, rule = rng.choice(DENSE), rng.choice(["mean", "trimmed_mean", "centered_clip"])
    if rule == "mean":
        result = sum(w * x for w, x in zip(ws, xs, strict=True)) / sum(ws)
    else:
        result = aggregate(rule, torch.stack(xs))
    result = result.contiguous()
    out = torch.empty_like(result)
    for a, b in chunks(result.numel(), mode):
        out[a:b] = decode(encode(result[a:b].contiguous(), mode, n), mode, b - a, n)
    return out


def _check(result: torch.Tensor, bound: Limit | None, mode: Compression = Compression.NONE) -> str:
    check = ResultCheck(bound)
    for a, b in chunks(result.numel(), mode):
        why = check.add(result[a:b])
        if why:
            return why
    return ""


@pytest.mark.parametrize("seed", range(SEEDS))
def test_honest_rounds_never_trip_the_bound(seed: int) -> None:
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    n = rng.randint(2, 8)
    d = rng.choice([3, 40, 700, 5000, 2 * sparse.BLOCK + 123])
    kind, xs, ws = _honest_contributions(rng, g, n, d)
    result = _round_result(rng, xs, ws, kind)
    # the group's partitions (every member checks every partition against its own values there)
    align = sparse.BLOCK if kind.startswith("topk") else 1
    sizes = partition_sizes(d, [rng.uniform(0.2, 1.0) for _ in range(n)], [True] * n, align)
    at = offsets(sizes)
    for i, x in enumerate(xs):
        own = [Scale.of(x[at[p] : at[p + 1]]) for p in range(n)]
        whole = Scale.total(own)
        for p in range(n):
            why = _check(result[at[p] : at[p + 1]], limit(own[p], whole))
            assert not why, f"member {i} ({kind}, {n} members, {d} values) refused partition {p}: {why}"


# ---- hostile reducers ----------------------------------------------------------------------------

ATTACKS = ["scaled", "shifted", "random", "sign-flipped", "one-value"]


def _attack(rng: random.Random, g: torch.Generator, honest: torch.Tensor, bound: Limit) -> torch.Tensor:
    """A result beyond ``bound``: one of the attacks, made large enough to break it (norm or magnitude)."""
    kind = rng.choice(ATTACKS)
    d = honest.numel()
    if kind == "scaled":
        bad = honest.clone()
    elif kind == "shifted":
        bad = honest + 1.0
    elif kind == "random":
        bad = torch.randn(d, generator=g)
    elif kind == "sign-flipped":
        bad = -honest
    else:  # everything in one coordinate (the norm's budget spent where it hurts most)
        bad = torch.zeros(d)
        bad[rng.randrange(d)] = 1.0
    if float(bad.abs().max()) == 0:
        bad = torch.ones(d)
    over = rng.choice([1.01, 2.0, 100.0, 1e6])
    factor = over * min(bound.norm / float(bad.norm()), bound.absmax / float(bad.abs().max()))
    if rng.random() < 0.5:  # over the norm (not necessarily the magnitude)
        factor = max(factor, over * bound.norm / float(bad.norm()))
    else:
        factor = max(factor, over * bound.absmax / float(bad.abs().max()))
    return (bad * factor).contiguous()


@pytest.mark.parametrize("seed", range(SEEDS))
def test_a_result_beyond_the_bound_always_trips_it_and_nothing_of_it_lands(seed: int) -> None:
    rng, g = random.Random(1000 + seed), torch.Generator().manual_seed(1000 + seed)
    d = rng.choice([1, 17, 900, 4096 + 5])
    own = torch.randn(d, generator=g) * 10.0 ** rng.uniform(-4, 2)
    if rng.random() < 0.2:
        own[: rng.randrange(d + 1)] = 0.0  # (partly) zero: its values elsewhere bound it
    whole = Scale.of(own) + Scale.of(torch.randn(50, generator=g))
    bound = limit(Scale.of(own), whole)
    assert bound is not None
    bad = _attack(rng, g, own, bound)
    assert float(bad.norm()) > bound.norm or float(bad.abs().max()) > bound.absmax
    assert _check(bad, bound)
    # as the gather stores it: chunk by chunk, raw float32 off the wire; the chunk that breaks the
    # bound (and all after it) never lands
    target = torch.full((d,), 7.0)
    check = ResultCheck(bound)
    landed = 0
    with pytest.raises(OutOfBounds):
        for a, b in chunks(d, Compression.NONE):
            _store(
                target[a:b],
                memoryview(bytes(encoded_chunk(bad[a:b], Compression.NONE))),
                Compression.NONE,
                3,
                check,
            )
            landed = b
    assert torch.equal(target[landed:], torch.full((d - landed,), 7.0))
    assert check.seen.norm <= bound.norm and check.seen.absmax <= bound.absmax


@pytest.mark.parametrize("mode", [Compression.INT8, Compression.FP16, Compression.TOPK1_Q2])
def test_compressed_results_are_checked_before_they_land_and_malformed_bytes_are_told_apart(
    mode: Compression,
) -> None:
    d = 2 * sparse.BLOCK
    g = torch.Generator().manual_seed(3)
    own = roundtrip(torch.randn(d, generator=g), mode) if mode.sparse else torch.randn(d, generator=g)
    bound = limit(Scale.of(own), Scale.of(own))
    wrong = torch.where(own != 0, torch.full_like(own, 100.0 * float(own.abs().max())), own)  # well formed
    target = torch.zeros(d)
    with pytest.raises(OutOfBounds):
        _store(target, memoryview(bytes(encode(wrong, mode, 4))), mode, 4, ResultCheck(bound))
    assert not target.any()
    broken = bytearray(encode(own, mode, 4))
    broken[:4] = b"\xff\xff\xff\xff"  # the first scale (or value): NaN
    with pytest.raises(Malformed):
        _store(target, memoryview(bytes(broken)), mode, 4, ResultCheck(bound))
    assert not target.any()


def test_the_bound_in_numbers() -> None:
    own = Scale.of(torch.tensor([3.0, -4.0]))  # norm 5, largest 4
    b = limit(own, own)
    assert b is not None
    assert b.norm == pytest.approx(BOUND * 5 + 1e-6 * math.sqrt(2)) and b.absmax == pytest.approx(BOUND * 4)
    # own values all zero in this partition: the member's typical element elsewhere bounds it
    zero = Scale.of(torch.zeros(100))
    elsewhere = Scale.of(torch.full((400,), 0.5))
    b = limit(zero, zero + elsewhere)
    assert b is not None and b.norm == pytest.approx(BOUND * math.sqrt(100 / 500) * math.sqrt(100), rel=1e-3)
    # nothing sent but zeros: the last accepted result bounds it; nothing at all: no bound
    assert limit(zero, zero) is None
    assert limit(zero, zero, history=elsewhere) is not None
    assert _check(torch.full((100,), 1e9), None) == ""


def test_a_member_whose_own_values_are_not_finite_accepts_nothing() -> None:
    """Its limit is NaN, and no comparison with NaN passes: not a result, not zeros, not a slice. Before,
    NaN own values made the bound infinite, and anything passed it (a reducer's slices included)."""
    finite = Scale.of(torch.ones(10))
    for bad in (torch.full((10,), math.nan), torch.tensor([1.0] * 9 + [math.inf])):
        spoilt = Scale.of(bad)
        for b in (limit(spoilt, spoilt), limit(finite, finite + spoilt)):
            assert b is not None
            assert _check(torch.zeros(10), b) and _check(torch.ones(10), b) and _check(bad, b)
    red = PartitionReducer(10, Compression.NONE, bound=limit(Scale.of(torch.full((10,), math.nan)), finite))
    with pytest.raises(SliceOutOfBounds):
        red.add_chunk(1, 0, memoryview(bytearray(torch.ones(10).numpy().tobytes())), 1.0)


def test_a_reducer_refuses_its_own_non_finite_slice_and_never_finalizes_values_spoilt_in_place() -> None:
    """Its own slice is held to the rules of every other: a non-finite one is left out. Values summed in
    place that change under it (its caller spoils its own buffer mid-round) are not its result: it sums
    the kept, checked slices again. Before, both went into the mean."""
    red = PartitionReducer(10, Compression.NONE)
    red.add_local(0, torch.full((10,), math.nan), 1.0)
    assert 0 not in red.delivered and not red.touched
    own, other = torch.arange(10.0), torch.ones(10)
    buffer = own.clone()
    backup = SpillFile()
    try:
        kept = backup.put(memoryview(own.numpy().tobytes()))
        red = PartitionReducer(10, Compression.NONE, buffer=buffer)
        red.add_local(0, buffer, 1.0, kept=kept)  # (reduced in place, as its own partition is)
        red.add_chunk(1, 0, memoryview(bytearray(other.numpy().tobytes())), 1.0)
        red.complete(1, 1.0)
        buffer.fill_(math.nan)  # its caller spoils the buffer the sum lives in
        torch.testing.assert_close(red.finalize([0, 1], [1.0, 1.0]), (own + other) / 2)
    finally:
        backup.close()


def test_history_records_only_results_its_own_values_bounded() -> None:
    history = ResultHistory()
    result, own = Scale.of(torch.ones(10)), Scale.of(torch.full((10,), 0.5))
    history.record("layout", result, Scale.of(torch.zeros(10)))  # bounded by history: not history
    assert history.get("layout") is None
    history.record("layout", result, own)
    assert history.get("layout") == result
    history.record("other", result, Scale.of(torch.ones(7)))  # another layout's count: not kept
    assert history.get("other") is None


# ---- verdicts ------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def auditor(clock: Clock) -> Auditor:
    host = Host(identity("judge"), "bounds", transport=MemoryNetwork(seed=1).transport("judge"))
    return Auditor(host, clock=clock)


def test_a_proven_fault_bans_at_once() -> None:
    a = auditor(Clock())
    liar = identity("liar").peer_id
    a.convict(liar, "served a result 1000x its bound")
    assert liar in a.banned and "1000x" in a.banned[liar]


def test_strikes_survive_good_rounds_and_ban_a_peer_that_fails_every_third_round() -> None:
    """Attack 3 of the issue: a reducer that fails two rounds of three (30 s each) and behaves in the
    third. Before, a good round wiped its strikes (``Auditor.cleared``) and it was never banned; now a
    good round forgives nothing, and it is banned in its second bad round."""
    clock = Clock()
    a = auditor(clock)
    flaky = identity("flaky").peer_id
    for r in range(30):
        clock.now = 30.0 * r
        if r % 3:
            a.strike(flaky, "its partition never came")
        if flaky in a.banned:
            break
    assert flaky in a.banned and r < 6, r
    assert not hasattr(a, "cleared")


def test_strikes_decay_so_an_honest_flaky_link_is_not_banned() -> None:
    clock = Clock()
    a = auditor(clock)
    peer = identity("flaky-link").peer_id
    for r in range(50):  # one failed round every 10 minutes, for over 8 hours
        clock.now = 600.0 * r
        a.strike(peer, "its partition never came")
    assert peer not in a.banned and a.strike_weight(peer) < STRIKES
    # the steady-state weight is 1 / (1 - 2^(-gap / half-life)): banned once the gap is under 0.58
    gap = 0.55 * STRIKE_HALF_LIFE
    other = identity("withholder").peer_id
    for r in range(50):
        clock.now = 30000.0 + gap * r
        a.strike(other, "its partition never came")
    assert other in a.banned


# ---- the round machine's faults ------------------------------------------------------------------


def _machine(me: int = 0) -> RoundMachine:
    ids = [identity(f"m{i}") for i in range(4)]
    manifest = Manifest(
        round_id=bytes(16),
        group_key="k",
        members=tuple(MemberMsg(i.peer_id.digest, f"addr{k}", 1.0) for k, i in enumerate(ids)),
        sizes=(10, 10, 10, 10),
        schema=(TensorSpec((40,), "float32"),),
    )
    m = RoundMachine(manifest, b"d" * 16, me, 1.0, Deadlines.of(0.0, 30.0))
    m.settle(Decision(round=b"d" * 16, contributors=(0, 1, 2, 3), weights=(1.0,) * 4), b"")
    return m


def test_a_reducer_that_served_a_bad_result_is_convicted_and_the_round_aborts() -> None:
    m = _machine()
    m.held.update({0, 1, 3})
    assert m.fault(2, 2, "its result's norm reached 1e6", proven=True)
    assert m.fault(2, 1, "again", proven=True) == ""  # the first fault of a partition stands
    outcome = m.outcome()
    assert not outcome.committed and "partition 2" in outcome.reason
    assert set(m.convicted()) == {m.peers[2]} and "1e6" in m.convicted()[m.peers[2]]
    assert m.blame() == {}


def test_a_relayed_result_out_of_bounds_strikes_the_holder_not_the_relay() -> None:
    """A relay serves what it accepted within its own bounds: an honest relay of a liar's result must
    not be banned for it. The holder gets an (unproven) strike; malformed bytes convict the relay."""
    m = _machine()
    m.held.update({0, 1, 3})
    m.fault(2, 3, "out of bounds", proven=False)
    assert m.convicted() == {} and set(m.blame()) == {m.peers[2]}
    m2 = _machine()
    m2.held.update({0, 1, 3})
    m2.fault(2, 1, "NaN", proven=True)
    assert set(m2.convicted()) == {m2.peers[1]}
    assert set(m2.blame()) == {m2.peers[2]}  # its own partition never came from the holder either


def test_a_malformed_slice_convicts_its_sender_and_leaves_it_out() -> None:
    m = _machine()
    m.bad_slice(3, 0, "a slice holds NaN or infinite values")
    assert 3 in m.failed_senders[0]
    assert set(m.convicted()) == {m.peers[3]} and "NaN" in m.convicted()[m.peers[3]]
    m.bad_slice(0, 0, "ours")  # never ourselves
    assert set(m.convicted()) == {m.peers[3]}
