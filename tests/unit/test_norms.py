"""Norms over a round's vectors are float64-accurate at any length (``averaging.norms``).

A float32 reduction of tens of millions of values comes out low (0.5% at 64M standard normal values, 9%
at 500M). A member signs its slice's scale over its whole partition in one call, its reducer measures
the slice chunk by chunk as it arrives: on the old code, at ~1B parameters (two partitions of 500M),
every honest slice was over its own signed norm beyond the compression's margin, and every round of two
honest peers aborted (seen on a GPU host: 0 outer steps in 520 s).

- the scale of a vector, a tensor or an array, whole or in any cut, is within float64 rounding of the
  exact one, for lengths drawn up to 2^26 and values of every kind;
- an honest slice of a partition of tens of millions of values passes its reducer (a real
  ``PartitionReducer``, the slice checked chunk by chunk against its sender's signed scale), and the
  result passes every member, in every dense compression.
"""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
import torch

from p2ptrain.averaging.bounds import ResultCheck, Scale, base, cap, over_cap, result_limit, typical
from p2ptrain.averaging.compression import DENSE, encoded_chunk
from p2ptrain.averaging.norms import BLOCK, row_norms, sum_of_squares
from p2ptrain.averaging.partition import chunks
from p2ptrain.averaging.reducer import PartitionReducer, SliceOutOfBounds


def _values(
    rng: random.Random, g: torch.Generator, n: int, kind: str = "", unit: float = 0.0
) -> torch.Tensor:
    kind = kind or rng.choice(["normal", "uniform", "heavy", "sparse", "constant"])
    unit = unit or 10.0 ** rng.uniform(-6, 3)
    if kind == "normal":
        x = torch.randn(n, generator=g)
    elif kind == "uniform":
        x = torch.rand(n, generator=g)
    elif kind == "heavy":  # a few values far above the rest
        x = torch.randn(n, generator=g) ** 3
    elif kind == "sparse":
        x = torch.randn(n, generator=g) * (torch.rand(n, generator=g) < 0.01)
    else:
        x = torch.full((n,), 0.37)
    return x * unit


def _exact(x: torch.Tensor) -> float:
    return math.fsum(float(x[i : i + BLOCK].double().square().sum()) for i in range(0, x.numel(), BLOCK))


@pytest.mark.parametrize("seed", range(6))
def test_a_scale_is_float64_accurate_whatever_the_length_or_the_cut(seed: int) -> None:
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    n = rng.choice([1, 7, BLOCK - 1, BLOCK + 3]) if seed < 2 else int(2 ** rng.uniform(24.5, 26))
    x = _values(rng, g, n)
    exact = _exact(x)
    for got in (Scale.of(x).sumsq, Scale.of(x.numpy()).sumsq, sum_of_squares(x)):
        assert abs(got - exact) <= 1e-9 * exact, f"n={n}: {got} against {exact}"
    cuts = sorted({0, n, *(rng.randrange(n + 1) for _ in range(5))})
    whole = Scale.total(Scale.of(x[a:b]) for a, b in itertools.pairwise(cuts))
    assert abs(whole.sumsq - exact) <= 1e-9 * exact
    assert Scale.of(x).absmax == float(x.abs().max())


def test_row_norms_are_float64_accurate() -> None:
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(3, (1 << 25) + 5, generator=g)
    rows[1] *= 1e-3
    got = row_norms(rows)
    for k in range(3):
        want = math.sqrt(_exact(rows[k]))
        assert abs(float(got[k]) - want) <= 2e-7 * want


@pytest.mark.parametrize("mode", DENSE, ids=lambda m: m.value)
def test_honest_slices_of_partitions_of_tens_of_millions_pass_their_reducer_and_every_member(mode) -> None:
    seed = DENSE.index(mode)
    rng, g = random.Random(100 + seed), torch.Generator().manual_seed(100 + seed)
    d = int(2 ** rng.uniform(25, 25.6))  # (32M-50M values: 0.2-0.5% low in one float32 reduction)
    kind, unit = rng.choice(["normal", "uniform"]), 10.0 ** rng.uniform(-6, 3)  # (honest pseudo-gradients)
    xs = [_values(rng, g, d, kind, unit * (1.0 + rng.random())) for _ in range(2)]
    ws = [1.0 + rng.random() * 3, 1.0]
    claims = [Scale.of(x) for x in xs]  # (as a member signs its slice: the whole partition at once)
    red = PartitionReducer(d, mode, members=2)
    b = base(claims[0], claims[0])
    usual = typical(claims, ws)
    red.add_local(0, xs[0].clone(), ws[0])
    red.bound_sender(1, claims[1], b"", ws[1])
    try:
        for index, (a, c) in enumerate(chunks(d, mode)):
            red.add_chunk(1, index, memoryview(bytearray(encoded_chunk(xs[1][a:c], mode))), ws[1])
    except SliceOutOfBounds as e:
        pytest.fail(f"{mode.value}, {d} values: an honest reducer refused an honest slice: {e}")
    assert over_cap(claims[1], cap(b, ws[1], ws[0], usual)) == ""
    red.complete(1, ws[1])
    result = red.finalize([0, 1], ws)
    for m in range(2):
        own = claims[m]
        caps = [cap(base(own, own), w, ws[m], usual) for w in ws]
        check = ResultCheck(None)
        for a, c in chunks(d, mode):  # (a member checks the result chunk by chunk as it lands)
            assert check.add(result[a:c]) == ""
        why = check.within(result_limit(claims, ws, caps, "mean", mode, []))
        assert why == "", f"{mode.value}, {d} values: member {m} refused an honest result: {why}"


def test_a_sum_of_squares_says_when_values_are_not_finite() -> None:
    x = torch.ones(BLOCK * 2 + 1)
    x[BLOCK + 5] = math.inf
    assert sum_of_squares(x) == math.inf
    x[3] = math.nan
    assert math.isnan(sum_of_squares(x))
    assert Scale.of(x).sumsq == math.inf  # (a scale counts what is not finite as unbounded)
    assert sum_of_squares(np.zeros(0, dtype=np.float32)) == 0.0
