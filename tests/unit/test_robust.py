"""Robust aggregation rules (pure): outliers move the result a bounded amount, honest agreement is kept."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.averaging.compression import Compression
from p2ptrain.averaging.reducer import PartitionReducer
from p2ptrain.averaging.robust import (
    aggregate,
    by_origin,
    centered_clip,
    outliers,
    parse_aggregation,
    trimmed_count,
    trimmed_mean,
)


def honest(k: int, n: int = 1000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 1.0 + 0.1 * torch.randn(k, n, generator=g)


@pytest.mark.parametrize(("k", "t"), [(1, 0), (2, 0), (3, 1), (4, 1), (5, 1), (8, 2), (10, 2), (16, 4)])
def test_trimmed_count(k: int, t: int) -> None:
    assert trimmed_count(k) == t


@pytest.mark.parametrize("rule", ["trimmed_mean", "centered_clip"])
@pytest.mark.parametrize(
    "attack",
    [
        lambda x: x * 100.0,  # scaled
        lambda x: -50.0 * x,  # flipped and scaled
        lambda x: torch.full_like(x, 1e6),  # a constant far away
        lambda x: torch.randn(x.shape, generator=torch.Generator().manual_seed(9)) * 1e3,  # random
    ],
    ids=["x100", "flip", "constant", "random"],
)
@pytest.mark.parametrize(("k", "bad"), [(4, 1), (8, 2)], ids=["1-of-4", "2-of-8"])
def test_a_minority_of_attackers_moves_the_result_little(rule: str, attack: object, k: int, bad: int) -> None:
    rows = honest(k)
    good_mean = rows[bad:].mean(dim=0)
    for i in range(bad):
        rows[i] = attack(rows[i])  # type: ignore[operator]
    got = aggregate(rule, rows)
    plain = rows.mean(dim=0)
    assert (got - good_mean).abs().max() < 0.2  # honest values are 1 +- 0.1: stays among them
    assert (plain - good_mean).abs().max() > 10  # while the plain mean is dragged away


@pytest.mark.parametrize("rule", ["trimmed_mean", "centered_clip"])
@pytest.mark.parametrize(("k", "bad"), [(4, 1), (8, 2)], ids=["1-of-4", "2-of-8"])
def test_the_attackers_and_only_they_are_named_as_outliers(rule: str, k: int, bad: int) -> None:
    rows = honest(k) - 1.0  # centred on zero, as gradients are
    rows[:bad] *= 100.0
    found = outliers(rows, aggregate(rule, rows))
    assert [row for row, _ in found] == list(range(bad))
    assert all(ratio > 20 for _, ratio in found)
    assert outliers(honest(k) - 1.0, aggregate(rule, honest(k) - 1.0)) == []  # honest spread: nobody
    assert outliers(rows[:2], rows[:2].mean(dim=0)) == []  # two rows: no majority to measure against


@pytest.mark.parametrize("rule", ["trimmed_mean", "centered_clip"])
def test_identical_slices_give_that_slice(rule: str) -> None:
    row = torch.linspace(-3, 3, 101)
    torch.testing.assert_close(aggregate(rule, row.repeat(5, 1)), row, rtol=1e-6, atol=1e-7)


def test_with_two_or_fewer_slices_the_rules_are_the_mean() -> None:
    rows = honest(2)
    assert torch.equal(trimmed_mean(rows), rows.mean(dim=0))
    assert torch.equal(centered_clip(rows), rows.mean(dim=0))


def test_the_rules_are_deterministic() -> None:
    rows = honest(7, seed=3)
    rows[0] *= 100
    assert torch.equal(centered_clip(rows), centered_clip(rows.clone()))
    assert torch.equal(trimmed_mean(rows), trimmed_mean(rows.clone()))


def test_parse_aggregation() -> None:
    assert parse_aggregation("Trimmed-Mean") == "trimmed_mean"
    assert parse_aggregation("mean") == "mean"
    with pytest.raises(ValueError, match="known: mean, trimmed_mean, centered_clip"):
        parse_aggregation("median-of-means")
    with pytest.raises(ValueError):
        aggregate("mean", honest(3))  # the reducer streams the mean; it is no robust rule


def test_rows_of_one_origin_count_once() -> None:
    rows = torch.tensor([[1.0], [5.0], [2.0], [7.0], [9.0]])
    collapsed, groups = by_origin(rows, [0, 1, 0, 3, 1])
    assert groups == [[0, 2], [1, 4], [3]]
    assert collapsed.squeeze(1).tolist() == [1.5, 7.0, 7.0]
    same, alone = by_origin(rows, [0, 1, 2, 3, 4])
    assert same is rows and alone == [[k] for k in range(5)]


@pytest.mark.parametrize("rule", ["trimmed_mean", "centered_clip"])
def test_many_keys_of_one_subnet_are_one_row_for_the_reducer(rule: str) -> None:
    """Three honest members and five fresh keys of one subnet sending x100: counted by id, the keys are
    a majority that carries the result away; counted by origin, they are one row out of four, bounded
    like any outlier, and all five are named."""
    good = honest(3, 500)
    rows = torch.cat([good, 100.0 * honest(5, 500, seed=1)])
    origins = [0, 1, 2, 3, 3, 3, 3, 3]

    def reduce(origins: tuple[int, ...]) -> tuple[torch.Tensor, list[int]]:
        red = PartitionReducer(500, Compression.NONE, aggregation=rule, origins=origins, canonical=True)
        for k in range(8):
            red.add_local(k, rows[k].clone(), 1.0)
        out = red.finalize(list(range(8)), [1.0] * 8).clone()
        return out, sorted(k for k, _ in red.outliers)

    by_id, _ = reduce(())
    assert (by_id - good.mean(dim=0)).abs().max() > 10.0
    counted, named = reduce(tuple(origins))
    assert (counted - good.mean(dim=0)).abs().max() < 0.5
    assert named == [3, 4, 5, 6, 7]
