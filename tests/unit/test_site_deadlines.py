"""How long rank 0 of a site waits for its other ranks in a collective, by command (``Deadlines``): the
time a hung rank can hold a site. Every command is bounded; a bulk one (a checkpoint, a hash of the
state, a load, an adopted download) by the local timeout plus its rank's state at the bulk rate, so it
grows with the shards and nothing else; every other by the local timeout alone, whatever the model."""

from __future__ import annotations

import math
import random

from p2ptrain.training.site.commands import BULK, BULK_RATE, BYTES_PER_ELEMENT, Deadlines, Op


def test_every_command_is_bounded_and_only_the_bulk_ones_grow_with_the_shards() -> None:
    rng = random.Random(7)
    for _ in range(200):
        local = rng.uniform(1.0, 120.0)
        small = rng.randrange(0, 10**6)
        large = small + rng.randrange(1, 10**10)
        few, many = Deadlines(local, small), Deadlines(local, large)
        for op in Op:
            t_few, t_many = few.timeout(op), many.timeout(op)
            assert math.isfinite(t_many) and t_few >= local, (op, t_few)
            if op in BULK:
                assert t_many > t_few  # (a checkpoint of more shards may take longer)
                assert t_many >= large * BYTES_PER_ELEMENT / BULK_RATE
            else:
                assert t_few == t_many == local  # (a batch is not slower for a bigger state)


def test_a_70b_site_of_8_ranks_checkpoints_within_its_bound_and_a_batch_stays_short() -> None:
    d = Deadlines(30.0, 70_000_000_000 // 8)
    assert d.timeout(Op.TRAIN) == 30.0
    assert 3_000 < d.timeout(Op.SAVE) < 5_000  # (210 GB of shards per rank at 50 MB/s, about an hour)
