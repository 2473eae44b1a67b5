"""``integrations.data`` outside a node: one peer reads every example of each pass, in a seeded order."""

from __future__ import annotations

import itertools

import pytest
import torch

from p2ptrain.integrations.data import shard_indices, swarm_batches


def test_alone_each_pass_reads_every_index_once_in_an_order_of_the_seed() -> None:
    first, second = (list(itertools.islice(shard_indices(50, seed=s), 100)) for s in (1, 1))
    assert first == second  # the same seed, the same order
    assert sorted(first[:50]) == sorted(first[50:]) == list(range(50))
    assert first[:50] != first[50:]  # each pass shuffled anew
    assert list(itertools.islice(shard_indices(50, seed=2), 50)) != first[:50]


def test_batches_collate_the_examples_at_those_indices() -> None:
    data = [(torch.tensor([float(i)]), i) for i in range(10)]
    batches = swarm_batches(data, shard_size=4)(123, 4)
    xs, ids = next(batches)
    assert xs.shape == (4, 1) and ids.tolist() == xs[:, 0].long().tolist()
    with pytest.raises(ValueError, match="empty"):
        swarm_batches([])
