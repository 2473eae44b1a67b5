"""The bucketed view's pure parts: the size estimate from a routing table, the buckets, the keys (one
bucket: the progress key as it is), which buckets a reader reads, and the scaled estimate with the
untrusted cap (seeded)."""

from __future__ import annotations

import random
import statistics

import pytest

from p2ptrain.training.optimizer.buckets import (
    BUCKET_TARGET,
    bucket_bits,
    bucket_of,
    buckets_to_read,
    capped_estimate,
    progress_key,
    scaled_total,
    size_estimate,
)


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
            read = buckets_to_read(mine, bits, rng)
            assert read[0] == mine
            assert len(set(read)) == len(read) == min(5, 1 << bits)
            assert all(0 <= b < 1 << bits for b in read)


def test_the_scaled_total_is_exact_when_every_bucket_was_read_and_unbiased_when_sampled() -> None:
    assert scaled_total(10.0, [], 0) == 10.0
    assert scaled_total(10.0, [5.0], 1) == 15.0  # two buckets, both read
    rng = random.Random(5)
    bits = 6
    # each bucket's total: 64 peers' samples, their speeds 0.5x to 2x
    totals = [sum(2 ** rng.uniform(-1, 1) for _ in range(BUCKET_TARGET)) for _ in range(1 << bits)]
    estimates = []
    for _ in range(400):
        read = buckets_to_read(0, bits, rng)
        estimates.append(scaled_total(totals[0], [totals[b] for b in read[1:]], bits))
    assert abs(statistics.fmean(estimates) / sum(totals) - 1) < 0.02
    assert statistics.pstdev(estimates) / sum(totals) < 0.05  # a few percent per read at 64 records a bucket


def test_ids_that_only_write_records_at_most_double_the_estimate_wherever_they_crowd() -> None:
    rng = random.Random(9)
    bits = 4
    honest = [100.0] * (1 << bits)  # the trusted samples of each bucket
    for _ in range(200):
        read = buckets_to_read(rng.randrange(1 << bits), bits, rng)
        crowd = rng.choice(read)  # k ids ground into a bucket this reader reads, claiming 2**53 each
        untrusted = [2.0**53 if b == crowd else 0.0 for b in read]
        estimate = capped_estimate((honest[read[0]], honest[1:5]), (untrusted[0], untrusted[1:]), bits)
        truth = sum(honest)
        assert truth <= estimate <= 2 * truth
