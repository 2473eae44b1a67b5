"""The bucketed view's pure parts: the size estimate from a routing table, the buckets, the keys (one
bucket: the progress key as it is), which buckets a reader reads, and the scaled estimate with the
untrusted cap (seeded); the regions of a step (a partition of the buckets, and averaging within them
for a turn of steps reaches the mean of every bucket), a run's regions by peer id, and the optimizer
state a split swarm's rounds average, made ahead of a first step."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from p2ptrain.config import RunConfig
from p2ptrain.dht.spread import bucket_of
from p2ptrain.identity import Identity, PeerID
from p2ptrain.training.optimizer.buckets import (
    BUCKET_TARGET,
    POOL,
    SAMPLED,
    Regions,
    SampledBuckets,
    bucket_bits,
    capped_estimate,
    paired_dims,
    progress_key,
    region_buckets,
    region_of,
    scaled_total,
    size_estimate,
)
from p2ptrain.training.optimizer.local_steps import LocalSteps


def ids(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(32) for _ in range(n)]


@pytest.mark.parametrize("n", [16, 256, 4096])
def test_the_size_estimate_from_the_closest_contacts_is_within_a_factor_of_two(n: int) -> None:
    swarm = ids(n, n)
    for me in swarm[:10]:
        mine = int.from_bytes(me, "big")
        closest = sorted(swarm, key=lambda c: int.from_bytes(c, "big") ^ mine)[:21]
        estimate = size_estimate(me, closest)
        assert n / 2 <= estimate <= 2 * n, (n, estimate)


def test_no_contacts_is_a_swarm_of_one() -> None:
    me = ids(1, 0)[0]
    assert size_estimate(me, []) == 1.0
    assert size_estimate(me, [me]) == 1.0


def test_buckets_hold_one_to_two_targets_and_one_bucket_below_twice_the_target() -> None:
    assert bucket_bits(1) == 0
    assert bucket_bits(2 * BUCKET_TARGET - 1) == 0
    assert bucket_bits(2 * BUCKET_TARGET) == 1
    assert bucket_bits(1024) == 4
    assert bucket_bits(float("inf")) == 0  # (nonsense: one bucket, as a small swarm)
    for n in (128, 1000, 5000, 100_000):
        b = bucket_bits(n)
        assert BUCKET_TARGET <= n / 2**b < 2 * BUCKET_TARGET


def test_one_bucket_is_the_progress_key_of_today() -> None:
    assert progress_key("run", 0, 0) == b"p2ptrain/run/progress"
    assert progress_key("run", 3, 5) == b"p2ptrain/run/progress/3/5"
    with pytest.raises(ValueError, match="out of range"):
        progress_key("run", 3, 8)


def test_peers_spread_evenly_over_buckets() -> None:
    swarm = ids(4096, 7)
    counts = [0] * 16
    for p in swarm:
        counts[bucket_of(p, 4)] += 1
    assert all(200 <= c <= 320 for c in counts), counts
    assert all(bucket_of(p, 0) == 0 for p in swarm[:10])


def test_a_reader_reads_its_bucket_and_distinct_others() -> None:
    rng = random.Random(3)
    for bits in (0, 1, 2, 6, 12):
        for mine in (0, (1 << bits) - 1):
            window = SampledBuckets(rng, period=10.0)
            for now in (0.0, 9.9, 10.0, 1e6, rng.uniform(-1e9, 1e9)):
                read = window.read(mine, bits, now)
                assert read[0] == mine
                assert len(set(read)) == len(read) == min(SAMPLED + 1, 1 << bits)
                assert all(0 <= b < 1 << bits for b in read)
                assert set(read[1:]) <= set(window.pooled(mine, bits, now))
    with pytest.raises(ValueError, match="period"):
        SampledBuckets(rng, period=0.0)
    with pytest.raises(ValueError, match="sampled <= pool"):
        SampledBuckets(rng, period=1.0, sampled=5, pool=4)


@pytest.mark.parametrize("seed", range(6))
def test_a_reader_meets_at_most_one_new_bucket_a_period_and_every_bucket_as_long(seed: int) -> None:
    """The invariant that keeps a reader's keys, and their node lookups, from growing with the swarm:
    over any ``t`` seconds of reads, however many and however spaced (bursts within a period, jumps
    over many), a reader samples at most ``POOL + ceil(t / period)`` distinct buckets, never its own;
    and over a whole turn of ``2^bits - 1`` periods each other bucket is in its pool equally long.
    Drawn at random: sizes, own bucket, period, the reads' times."""
    rng = random.Random(seed)
    for _ in range(40):
        bits = rng.randrange(0, 10)
        mine = rng.randrange(1 << bits)
        period = rng.choice([0.5, 10.0, 37.0])
        window = SampledBuckets(random.Random(rng.random()), period=period)
        now = rng.uniform(-1e4, 1e4)
        reads: list[tuple[float, frozenset[int]]] = []
        for _ in range(rng.randrange(1, 200)):
            now += rng.choice([0.0, period / 7, period, rng.uniform(0, 3 * period), 50 * period])
            read = window.read(mine, bits, now)
            assert read[0] == mine and mine not in read[1:]
            reads.append((now, frozenset(read[1:])))
        for _ in range(20):
            i = rng.randrange(len(reads))
            j = rng.randrange(i, len(reads))
            met = frozenset().union(*(r for _, r in reads[i : j + 1]))
            elapsed = reads[j][0] - reads[i][0]
            assert len(met) <= POOL + math.ceil(elapsed / period), (bits, elapsed, len(met))
        others = (1 << bits) - 1
        start = rng.randrange(-1000, 1000)
        counts = dict.fromkeys((b for b in range(1 << bits) if b != mine), 0)
        for turn in range(start, start + others):
            for b in window.pooled(mine, bits, turn * period + rng.uniform(0, period * 0.999)):
                counts[b] += 1
        assert all(c == min(POOL, others) for c in counts.values()), counts


def test_the_scaled_total_is_exact_when_every_bucket_was_read_and_unbiased_when_sampled() -> None:
    assert scaled_total(10.0, [], 0) == 10.0
    assert scaled_total(10.0, [5.0], 1) == 15.0  # two buckets, both read
    rng = random.Random(5)
    bits = 6
    # each bucket's total: 64 peers' samples, their speeds 0.5x to 2x
    totals = [sum(2 ** rng.uniform(-1, 1) for _ in range(BUCKET_TARGET)) for _ in range(1 << bits)]
    estimates = []
    for reader in range(10):
        window = SampledBuckets(random.Random(reader), period=10.0)
        for turn in range((1 << bits) - 1):  # a whole turn of the window: each other bucket as long
            for _ in range(4):
                read = window.read(0, bits, 10.0 * turn + rng.uniform(0, 9.9))
                estimates.append(scaled_total(totals[0], [totals[b] for b in read[1:]], bits))
    assert abs(statistics.fmean(estimates) / sum(totals) - 1) < 0.01
    assert statistics.pstdev(estimates) / sum(totals) < 0.05  # a few percent per read at 64 a bucket


def test_ids_that_only_write_records_at_most_double_the_estimate_wherever_they_crowd() -> None:
    rng = random.Random(9)
    bits = 4
    honest = [100.0] * (1 << bits)  # the trusted samples of each bucket
    for _ in range(200):
        window = SampledBuckets(random.Random(rng.random()), period=10.0)
        read = window.read(rng.randrange(1 << bits), bits, rng.uniform(0, 1e4))
        crowd = rng.choice(read)  # k ids ground into a bucket this reader reads, claiming 2**53 each
        untrusted = [2.0**53 if b == crowd else 0.0 for b in read]
        estimate = capped_estimate((honest[read[0]], honest[1:5]), (untrusted[0], untrusted[1:]), bits)
        truth = sum(honest)
        assert truth <= estimate <= 2 * truth


def test_the_regions_of_a_step_partition_the_buckets_and_follow_from_the_index_alone() -> None:
    rng = random.Random(7)
    for _ in range(200):
        bits = rng.randrange(0, 9)
        span = rng.randrange(1, 10)
        epoch = rng.randrange(0, 10_000)
        regions: dict[int, list[int]] = {}
        for b in range(1 << bits):
            regions.setdefault(region_of(b, bits, epoch, span), []).append(b)
        size = 1 << min(span, bits)
        assert all(len(members) == size for members in regions.values()), (bits, span, epoch)
        for region, members in regions.items():
            assert region == min(members)
            for b in members:
                assert region_buckets(b, bits, epoch, span) == members
        # a region differs from its buckets only in the paired dimensions
        dims = paired_dims(epoch, bits, span)
        mask = sum(1 << d for d in dims)
        assert all((b & ~mask) == r for r, members in regions.items() for b in members)


def region_means(values: list[float], bits: int, epoch: int, span: int) -> list[float]:
    """Each bucket's value after a round of its region at ``epoch`` averaged the region's values."""
    regions = (region_buckets(b, bits, epoch, span) for b in range(len(values)))
    return [statistics.fmean(values[m] for m in region) for region in regions]


def test_averaging_each_step_within_its_regions_reaches_the_mean_of_all_buckets_after_a_turn() -> None:
    rng = random.Random(11)
    for _ in range(100):
        bits = rng.randrange(1, 9)
        span = rng.randrange(1, bits + 1)
        start = rng.randrange(0, 10_000)
        values = [rng.uniform(-1.0, 1.0) for _ in range(1 << bits)]
        mean = statistics.fmean(values)
        steps = -(-bits // span)  # ceil(bits / span)
        mixed = values
        for epoch in range(start, start + steps - 1):
            mixed = region_means(mixed, bits, epoch, span)
        if steps > 1:  # one step short of a turn, some dimension was never paired
            assert max(mixed) - min(mixed) > 1e-9, (bits, span)
        mixed = region_means(mixed, bits, start + steps - 1, span)
        assert max(abs(v - mean) for v in mixed) < 1e-9, (bits, span, start)


def test_one_region_when_the_span_covers_every_dimension_and_a_span_below_one_is_refused() -> None:
    assert region_buckets(5, 3, 17, span=3) == list(range(8))
    assert region_buckets(0, 0, 4) == [0]
    with pytest.raises(ValueError):
        paired_dims(3, 4, span=0)


def test_a_runs_regions_place_each_peer_by_its_id_alone_and_one_region_is_the_swarm() -> None:
    rng = random.Random(5)
    for _ in range(100):
        bits = rng.randrange(1, 7)
        regions_count = 1 << rng.randrange(0, bits)  # (fewer regions than buckets: the run file's rule)
        regions = Regions.of(1 << bits, regions_count)
        assert regions.split == (regions_count > 1)
        assert regions.share == pytest.approx(1 / regions_count)
        peers = [Identity.from_seed(rng.randbytes(32)).peer_id for _ in range(rng.randrange(2, 40))]
        epoch = rng.randrange(0, 1000)
        placed: dict[int, set[PeerID]] = {}
        for p in peers:
            r = regions.of_peer(p, epoch)
            bucket = bucket_of(p.digest, bits)
            assert r == (region_of(bucket, bits, epoch, regions.span) if regions.split else 0)
            assert regions.tag(p, epoch) == (f"/region-{r}" if regions.split else "")
            placed.setdefault(r, set()).add(p)
        assert len(placed) <= regions_count
        for a in peers:  # ``together`` is "in one region", and nothing else
            for b in peers:
                assert regions.together(a, b, epoch) == (
                    regions.of_peer(a, epoch) == regions.of_peer(b, epoch)
                )


@pytest.mark.parametrize("make", ["adamw", "adam", "sgd-momentum"])
def test_the_optimizer_state_made_ahead_of_a_first_step_is_the_state_that_step_starts_from(make: str) -> None:
    """A split swarm's round averages the optimizer's state too (``LocalSteps.state_tensors``), made as
    zeros where the optimizer has none yet: a first step from it lands where a fresh optimizer's does."""
    torch.manual_seed(3)
    models = [torch.nn.Linear(5, 3) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = []
    for m in models:
        if make == "adamw":
            opts.append(torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1))
        elif make == "adam":
            opts.append(torch.optim.Adam(m.parameters(), lr=0.1))
        else:
            opts.append(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    params = list(models[1].parameters())
    local = LocalSteps(opts[1], params, RunConfig().training, None, None)  # type: ignore[arg-type]
    made = local.state_tensors()
    assert len(made) > len(params)  # (the optimizer's state, made)
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), params, strict=True))  # untouched
    grads = [torch.randn_like(p) for p in params]
    for m, opt in zip(models, opts, strict=True):
        for p, g in zip(m.parameters(), grads, strict=True):
            p.grad = g.clone()
        opt.step()
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-7)
    # the same tensors, in the same order, every time (a round's schema)
    again = local.state_tensors()
    assert [t.shape for t in again] == [t.shape for t in made]
