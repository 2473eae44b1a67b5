"""The result bound built on signed scales (``averaging.bounds``: ``result_limit``, ``slice_limit``,
``cap``, ``seal_table``/``open_table``): seeded-random properties over a real ``PartitionReducer``.

- Honest rounds pass everywhere: every member's check of every result, and every honest reducer's check of
  every slice, over DiLoCo spreads of 1..100x work (aligned and not), sync batches of 1..1000 samples, a
  restarted member (one inner step), a member 70x its mate (the pipeline's stage 0), sparse rows (a
  member's whole slice zero, or most of it), a member that sends only zeros; every dense compression and
  every aggregation rule.
- A hostile reducer with k colluding contributors (0..n-2 of them, any weights up to half the decision's,
  any signed claims: huge, at the cap, tiny) never gets a result applied by an honest member beyond what
  the honest contributions explain plus what the colluders' weight could move through an honest reducer
  (the member's cap on each, over the largest honest scale); forged, replayed or missing scales are
  refused as malformed.
- A garbage reducer (noise 100x its result, or 100x the largest slice) with honest contributors is refused
  by every honest member.
"""

from __future__ import annotations

import math
import random
import struct

import pytest
import torch

from p2ptrain.averaging.bounds import (
    CAP,
    NOTHING,
    TABLE_DOMAIN,
    Limit,
    ResultCheck,
    Scale,
    ScaleTable,
    base,
    cap,
    open_table,
    over_cap,
    result_limit,
    seal_table,
    table_tag,
    typical,
)
from p2ptrain.averaging.compression import DENSE, Compression, encoded_chunk
from p2ptrain.averaging.partition import chunks
from p2ptrain.averaging.reducer import PartitionReducer, SliceOutOfBounds
from p2ptrain.errors import RemoteProtocolError
from p2ptrain.identity import SignedEnvelope
from p2ptrain.wire.codec import pack
from tests.harness.identities import identity

SEEDS = 120
ROUND = b"r" * 16
RULES = ("mean", "trimmed_mean", "centered_clip")


def _honest(rng: random.Random, g: torch.Generator, n: int, d: int, parts: int) -> tuple[str, list, list]:
    """n members' whole vectors (``parts`` partitions of ``d``) and weights, of one honest kind."""
    kind = rng.choice(["diloco", "sync", "restarted", "pipeline", "sparse", "zero"])
    direction = torch.randn(parts * d, generator=g)
    signal = rng.choice([0.0, 0.1, 1.0, 10.0])
    unit = 10.0 ** rng.uniform(-5, 2)
    alpha = rng.choice([0.5, 1.0])  # pseudo-gradients grow as the work (aligned) or its square root
    xs, ws = [], []
    for i in range(n):
        if kind == "sync":
            batch = rng.choice([1, 2, 8, 32, 128, 1000])
            x = signal * direction + torch.randn(parts * d, generator=g) / math.sqrt(batch)
            w = float(batch)
        else:
            k = 10 ** rng.uniform(0, 2)  # 1..100x work
            if kind == "restarted" and i == 0:
                k = 1.0
            x = k**alpha * (signal * direction + torch.randn(parts * d, generator=g))
            w = k
        if kind == "pipeline" and i == 0:
            x = x * 70.0
        if kind == "sparse":  # rows a member did not touch: all of a partition, or most of it
            for p in range(parts):
                if rng.random() < 0.4:
                    mask = torch.rand(d, generator=g) < rng.choice([0.0, 0.05])
                    x[p * d : (p + 1) * d] *= mask
        if kind == "zero" and i == 0:
            x = torch.zeros(parts * d)
        xs.append(x * unit)
        ws.append(w)
    return kind, xs, ws


def _reduce(
    p: int, d: int, xs: list, ws: list, rule: str, mode: Compression, origins: list, reducer: int
) -> tuple[torch.Tensor, list[Scale]]:
    """What honest member ``reducer`` serves for partition ``p``, every slice checked against its
    signed scale and its cap; and the scales everyone signed."""
    n = len(xs)
    claims = [Scale.of(x[p * d : (p + 1) * d]) for x in xs]
    red = PartitionReducer(d, mode, aggregation=rule, members=n, origins=origins)
    b = base(claims[reducer], Scale.of(xs[reducer]))
    usual = typical(claims, ws)
    for i, x in enumerate(xs):
        own = x[p * d : (p + 1) * d].contiguous()
        if i == reducer:
            red.add_local(i, own, ws[i])
            continue
        red.bound_sender(i, claims[i], b"", ws[i])
        for index, (a, c) in enumerate(chunks(d, mode)):
            red.add_chunk(i, index, memoryview(bytearray(encoded_chunk(own[a:c], mode))), ws[i])
        why = over_cap(claims[i], cap(b, ws[i], ws[reducer], usual))
        if why:
            raise SliceOutOfBounds(why)
        red.complete(i, ws[i])
    return red.finalize(list(range(n)), ws).clone(), claims


def _within(result: torch.Tensor, bound: Limit | None) -> str:
    check = ResultCheck(None)
    assert check.add(result) == ""
    return check.within(bound)


def _member_limit(
    m: int, p: int, d: int, xs: list, ws: list, claims: list, rule: str, mode, origins
) -> Limit:
    b = base(Scale.of(xs[m][p * d : (p + 1) * d]), Scale.of(xs[m]))
    usual = typical(claims, ws)
    caps = [cap(b, w, ws[m], usual) for w in ws]
    return result_limit(claims, ws, caps, rule, mode, origins)


@pytest.mark.parametrize("seed", range(SEEDS))
def test_honest_rounds_pass_every_member_and_every_reducer(seed: int) -> None:
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    n, parts, d = rng.randint(2, 8), rng.randint(1, 3), rng.choice([16, 100, 700])
    kind, xs, ws = _honest(rng, g, n, d, parts)
    rule, mode = rng.choice(RULES), rng.choice(DENSE)
    origins = [rng.randrange(n) for _ in range(n)] if rng.random() < 0.3 else []
    for p in range(parts):
        reducer = rng.randrange(n)
        try:
            result, claims = _reduce(p, d, xs, ws, rule, mode, origins, reducer)
        except SliceOutOfBounds as e:
            pytest.fail(f"{kind}: an honest reducer refused an honest slice: {e}")
        for m in range(n):
            why = _within(result, _member_limit(m, p, d, xs, ws, claims, rule, mode, origins))
            assert why == "", f"{kind}, {rule}, {mode.value}: member {m} refused an honest result: {why}"


def _explained(m: int, p: int, d: int, xs: list, ws: list, honest: set, rule: str, mode, origins) -> Limit:
    """What the honest contributions explain, plus the colluders' weight at this member's cap on each
    (with the largest honest signed scale as the typical one: colluders hold at most half the weight)."""
    b = base(Scale.of(xs[m][p * d : (p + 1) * d]), Scale.of(xs[m]))
    mine = [Scale.of(xs[i][p * d : (p + 1) * d]) for i in sorted(honest)]
    usual = Limit(max(c.norm for c in mine), max(c.absmax for c in mine))
    caps = [cap(b, w, ws[m], usual) for w in ws]
    claims = []
    for i, c in enumerate(caps):
        if i in honest:
            claims.append(Scale.of(xs[i][p * d : (p + 1) * d]))
        elif c is None:  # every honest slice zero and no history: nothing to cap by (see bounds)
            return Limit(math.inf, math.inf)
        else:
            claims.append(Scale(c.norm**2, c.absmax, d))
    return result_limit(claims, ws, caps, rule, mode, origins)


@pytest.mark.parametrize("seed", range(SEEDS))
def test_a_hostile_reducer_and_its_colluders_move_no_honest_member_beyond_what_honest_work_explains(
    seed: int,
) -> None:
    rng, g = random.Random(1000 + seed), torch.Generator().manual_seed(1000 + seed)
    n, d = rng.randint(2, 8), rng.choice([16, 100, 700])
    _, xs, ws = _honest(rng, g, n, d, 1)
    rule, mode = rng.choice(RULES), rng.choice(DENSE)
    origins = [rng.randrange(n) for _ in range(n)] if rng.random() < 0.3 else []
    hostile_reducer = rng.randrange(n)
    colluders = set(rng.sample([i for i in range(n) if i != hostile_reducer], rng.randint(0, n - 2)))
    hostile = colluders | {hostile_reducer}
    honest = set(range(n)) - hostile
    honest_result, _ = _reduce(0, d, [x[:d] for x in xs], ws, rule, mode, origins, next(iter(honest)))
    for h in hostile:  # any weight the decision lets them have, up to half of it; any values
        ws[h] = ws[h] * 10 ** rng.uniform(-1, 2)
    excess = sum(ws[h] for h in hostile) / sum(ws[i] for i in honest)
    for h in hostile:
        ws[h] /= max(1.0, excess)
    claims = [Scale.of(x[:d]) for x in xs]
    for h in hostile:
        claims[h] = rng.choice(
            [
                Scale(1e60, 1e30, d),
                Scale(claims[h].sumsq * 1e6, claims[h].absmax * 1e3, d),
                Scale(0.0, 0.0, d),
            ]
        )
    served = [
        honest_result * 100,
        torch.randn(d, generator=g) * float(honest_result.norm()) * rng.choice([2.0, 30.0, 1e4]),
        -honest_result * rng.uniform(1, 50),
        honest_result + torch.randn(d, generator=g) * 10 ** rng.uniform(-3, 3),
    ]
    for m in honest:
        limit = _member_limit(m, 0, d, xs, ws, claims, rule, mode, origins)
        explained = _explained(m, 0, d, xs, ws, honest, rule, mode, origins)
        for result in served:
            if (
                _within(result, limit) == ""
            ):  # applied: then the honest work and the colluders' weight explain it
                s = Scale.of(result)
                assert s.norm <= explained.norm and s.absmax <= explained.absmax, (rule, s, explained)


@pytest.mark.parametrize("seed", range(60))
def test_a_garbage_reducer_among_honest_contributors_is_refused_by_every_honest_member(seed: int) -> None:
    rng, g = random.Random(5000 + seed), torch.Generator().manual_seed(5000 + seed)
    n, d = rng.randint(2, 8), rng.choice([100, 700])
    _, xs, ws = _honest(rng, g, n, d, 1)
    rule, mode = rng.choice(RULES), rng.choice(DENSE)
    reducer = rng.randrange(n)
    result, claims = _reduce(0, d, xs, ws, rule, mode, [], reducer)
    garbage = torch.randn(d, generator=g)  # (100x the result, or the largest slice where that is more:
    # a robust rule's result over sparse rows may be far smaller than what honest slices explain)
    garbage *= 100 * max(float(result.norm()), max(c.norm for c in claims)) / float(garbage.norm())
    for m in range(n):
        if m != reducer:
            assert _within(garbage, _member_limit(m, 0, d, xs, ws, claims, rule, mode, [])) != ""


def test_signed_scales_are_bound_to_their_signer_round_and_partitions() -> None:
    alice, bob = identity("alice"), identity("bob")
    scales = [Scale(4.0, 2.0, 10), Scale(0.0, 0.0, 7), Scale(1e-30, 1e-15, 3)]
    sealed = seal_table(alice, ROUND, scales)
    assert open_table(sealed, alice.peer_id, ROUND, (10, 7, 3)) == tuple(scales)
    assert len(table_tag(sealed)) == 16 and table_tag(sealed) != table_tag(
        seal_table(alice, ROUND, scales[::-1])
    )
    for args, why in [
        ((bob.peer_id, ROUND, (10, 7, 3)), "signed by"),
        ((alice.peer_id, b"x" * 16, (10, 7, 3)), "another round"),
        ((alice.peer_id, ROUND, (10, 7)), "3 partitions, the round has 2"),
        ((alice.peer_id, ROUND, (10, 7, 3, 1)), "3 partitions, the round has 4"),
    ]:
        with pytest.raises(RemoteProtocolError, match=why):
            open_table(sealed, *args)
    with pytest.raises(RemoteProtocolError, match="no signed scales"):
        open_table(b"", alice.peer_id, ROUND, (10,))
    assert seal_table(alice, ROUND, [Scale(1.0, 1.0, 10), Scale(math.inf, 1.0, 10)]) == b""
    for bad in [(-1.0, 1.0), (1.0, math.nan), (math.inf, 1.0)]:  # (signed as is, by a liar)
        table = ScaleTable(ROUND, struct.pack("<dd", 4.0, 2.0) + struct.pack("<dd", *bad))
        forged = SignedEnvelope.seal(alice, TABLE_DOMAIN, pack(table.to_obj())).to_bytes()
        with pytest.raises(RemoteProtocolError, match="negative or not finite"):
            open_table(forged, alice.peer_id, ROUND, (10, 7))


def test_a_slice_beyond_its_signed_scale_or_the_reducers_cap_is_refused() -> None:
    d = 64
    own = torch.ones(d)
    red = PartitionReducer(d, Compression.NONE)
    red.add_local(0, own, 1.0)
    liar = torch.full((d,), 3.0)
    red.bound_sender(1, Scale.of(liar * 0.5), b"", 1.0)
    with pytest.raises(SliceOutOfBounds):
        red.add_chunk(1, 0, memoryview(bytearray(encoded_chunk(liar, Compression.NONE))), 1.0)
    assert 1 not in red.touched
    b = base(Scale.of(own), Scale.of(own))
    mates = [Scale.of(own), Scale.of(own * 2)]
    huge = Scale.of(torch.full((d,), 1000.0))  # (signed truly, but far beyond the typical scale)
    assert over_cap(huge, cap(b, 1.0, 1.0, typical([*mates, huge], [1.0, 1.0, 1.0]))) != ""
    # a restarted member (tiny own values) still takes its mates' usual slices
    tiny = base(Scale.of(own * 1e-4), Scale.of(own * 1e-4))
    usual = typical([Scale.of(own * 1e-4), *mates], [1.0, 1.0, 1.0])
    assert over_cap(Scale.of(own * 2), cap(tiny, 1.0, 1.0, usual)) == ""


def test_the_cap_in_numbers() -> None:
    own = Scale(25.0, 4.0, 100)  # norm 5
    b = base(own, own)
    assert b is not None and b is not NOTHING
    assert b.norm == pytest.approx(5.0) and b.absmax == pytest.approx(4.0)
    c = cap(b, 10.0, 1.0)  # a contributor of 10x this member's weight: 10x more
    assert c is not None and c.norm == pytest.approx(CAP * 50) and c.absmax == pytest.approx(CAP * 40)
    c = cap(b, 0.1, 1.0)  # less weight: never below CAP x its own
    assert c is not None and c.norm == pytest.approx(CAP * 5)
    assert cap(None, 1.0, 1.0) is None
    spoilt = Scale(math.inf, math.inf, 100)
    assert base(spoilt, spoilt) is NOTHING
    mean = result_limit(
        [Scale(1.0, 1.0, 100), Scale(100.0, 10.0, 100)], [1.0, 3.0], [None, None], "mean", Compression.NONE
    )
    assert mean.norm == pytest.approx((1 + 3 * 10) / 4, rel=1e-2)  # (plus the rounding slack)
