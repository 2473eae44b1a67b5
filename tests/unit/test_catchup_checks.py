"""The pure parts of catching up by replay (``state.replay``): what a peer keeps, what it lists, and
the checks a fetched result passes before anything of it is applied (randomized over seeds)."""

from __future__ import annotations

import random

import pytest
import torch

from p2ptrain.averaging.bounds import BOUND, Scale
from p2ptrain.averaging.spill import Spilled
from p2ptrain.training.state.replay import (
    ResultEntry,
    ResultFetcher,
    ResultStore,
    check_bound,
    compact_dtype,
)

SEEDS = range(10)
A, B, C = b"a" * 32, b"b" * 32, b"c" * 32


def test_a_store_keeps_the_last_results_and_lists_only_those_with_both_digests() -> None:
    digests = {0: A, 1: B, 2: C}
    store = ResultStore(None, 2, lambda e: digests.get(e, b""))
    for epoch in range(3):
        store.keep(epoch, range(0, 1), [torch.full((4,), float(epoch))], [torch.float16])
    assert [e.epoch for e in store.entries(0)] == [1]  # 0 dropped (keep 2); 2's "after" is unknown
    entry = store.entries(0)[0]
    assert (entry.before, entry.after, entry.dtype, entry.size) == (B, C, "float16", 8)
    assert store.entries(2) == []
    digests[3] = A
    assert [e.epoch for e in store.entries(0)] == [1, 2]


def test_a_digest_once_known_stays_with_its_result() -> None:
    """The peer's own digests of old steps are forgotten after a while: the entry keeps them."""
    digests = {0: A, 1: B}
    store = ResultStore(None, 4, lambda e: digests.get(e, b""))
    store.keep(0, range(0, 1), [torch.ones(3)], [])
    assert [e.epoch for e in store.entries(0)] == [0]
    digests.clear()
    assert [(e.before, e.after) for e in store.entries(0)] == [(A, B)]


def test_no_store_keeps_nothing() -> None:
    store = ResultStore(None, 0, lambda e: A)
    store.keep(0, range(0, 1), [torch.ones(3)], [])
    assert store.entries(0) == [] and store.scale() is None


@pytest.mark.parametrize("seed", SEEDS)
def test_results_are_kept_losslessly(seed: int) -> None:
    """fp16 or bf16 only when every value is one of those (a round compressed to it): never a rounding."""
    g = torch.Generator().manual_seed(seed)
    values = [torch.randn(17, generator=g), torch.randn(3, 5, generator=g)]
    assert compact_dtype(values, [torch.float16]) == torch.float32
    halves = [v.to(torch.float16).float() for v in values]
    assert compact_dtype(halves, [torch.float16]) == torch.float16
    bf = [v.to(torch.bfloat16).float() for v in values]
    assert compact_dtype(bf, [torch.bfloat16]) == torch.bfloat16
    store = ResultStore(None, 1, lambda e: A if e == 0 else B)
    store.keep(0, range(0, 2), halves, [torch.float16])
    kept = store.get(0)
    assert kept is not None
    back = torch.frombuffer(bytearray(kept.data), dtype=kept.dtype).float()
    assert torch.equal(back, torch.cat([h.reshape(-1) for h in halves]))


@pytest.mark.parametrize("seed", SEEDS)
def test_the_bound_passes_honest_sizes_and_refuses_the_rest(seed: int) -> None:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    last = torch.randn(1000, generator=g)
    bound = Scale.of(last)
    honest = torch.randn(rng.randint(100, 2000), generator=g) * rng.uniform(0.1, 4.0)
    assert check_bound(honest, bound) == ""
    assert check_bound(honest, None) == ""  # nothing to bound by: only finiteness
    huge = honest * (BOUND * 10)
    assert "over 32x" in check_bound(huge, bound)
    spoilt = honest.clone()
    spoilt[rng.randrange(len(spoilt))] = rng.choice([float("nan"), float("inf")])
    assert "not finite" in check_bound(spoilt, bound) and "not finite" in check_bound(spoilt, None)


@pytest.mark.parametrize("seed", SEEDS)
def test_an_entry_is_fetched_only_if_it_fits_the_chain_and_this_model(seed: int) -> None:
    """Right digests, slots, dtype and size pass; any one of them wrong is refused, naming what."""
    rng = random.Random(seed)
    epoch, count = rng.randint(0, 100), rng.randint(1, 10_000)
    slots = range(rng.randint(0, 3), rng.randint(4, 8))
    good = ResultEntry(epoch, slots.start, slots.stop, "float32", 4 * count, A, B)
    check = ResultFetcher._entry_problem
    assert check(good, A, B, slots, count, torch.float32) == ""
    half = ResultEntry(epoch, slots.start, slots.stop, "float16", 2 * count, A, B)
    assert check(half, A, B, slots, count, torch.float32) == ""
    bad = {
        "leads to a state": ResultEntry(epoch, slots.start, slots.stop, "float32", 4 * count, A, C),
        "starts from another": ResultEntry(epoch, slots.start, slots.stop, "float32", 4 * count, C, B),
        "other parameters": ResultEntry(epoch, slots.start + 1, slots.stop, "float32", 4 * count, A, B),
        "is in 'int64'": ResultEntry(epoch, slots.start, slots.stop, "int64", 8 * count, A, B),
        "is in 'float64'": ResultEntry(epoch, slots.start, slots.stop, "float64", 8 * count, A, B),
        "bytes, not": ResultEntry(
            epoch, slots.start, slots.stop, "float32", 4 * count + rng.choice([-4, 4]), A, B
        ),
    }
    for why, entry in bad.items():
        assert why in check(entry, A, B, slots, count, torch.float32), why


def test_a_large_result_waits_in_a_spill_file_and_goes_with_its_eviction() -> None:
    store = ResultStore(None, 1, lambda e: A if e == 0 else B)
    big = torch.arange(3 << 20, dtype=torch.float32)  # 12 MiB: over SPILL_BYTES
    store.keep(0, range(0, 1), [big], [])
    kept = store.get(0)
    assert kept is not None and isinstance(kept.data, Spilled) and kept.size == big.numel() * 4
    assert torch.equal(torch.frombuffer(bytearray(kept.read()), dtype=torch.float32), big)
    assert store.scale() == Scale.of(big)
    store.keep(1, range(0, 1), [torch.ones(2)], [])
    assert kept.data.file.closed  # evicted: its file is gone


@pytest.mark.parametrize("seed", SEEDS)
def test_a_range_of_a_spilled_result_reads_that_range_only(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder serves a result piece by piece (``train.result_data`` with a byte range): each request
    reads its range from the spill file, not the whole result (at 256 pieces of a 2 GB result, the whole
    read per piece was 512 GB of copies)."""
    rng = random.Random(seed)
    store = ResultStore(None, 1, lambda e: A if e == 0 else B)
    big = torch.randn(3 << 20)  # 12 MiB: over SPILL_BYTES
    store.keep(0, range(0, 1), [big], [])
    kept = store.get(0)
    assert kept is not None and isinstance(kept.data, Spilled)
    reads: list[int] = []
    real = type(kept.data.file).read
    monkeypatch.setattr(type(kept.data.file), "read", lambda f, at, n: reads.append(n) or real(f, at, n))
    start = rng.randrange(kept.size)
    stop = rng.randrange(start, kept.size + 1)
    got = kept.read(start, stop)
    assert bytes(got) == big.numpy().tobytes()[start:stop]
    assert reads == [stop - start]
