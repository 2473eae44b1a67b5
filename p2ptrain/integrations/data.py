"""A dataset as a Task's batches, each peer reading shards no other peer of the swarm reads.

For the tasks ``p2ptrain node`` trains (``module:function`` returning a :class:`~p2ptrain.tasks.Task`)::

    import datasets
    from p2ptrain.integrations.data import swarm_batches

    def task(**options):
        ds = datasets.load_from_disk("my-tokenized-data").with_format("torch")
        return Task(name="mine", model=..., loss=..., batches=swarm_batches(ds, shard_size=1024))

``swarm_batches`` works with any map-style dataset (a Hugging Face ``datasets.Dataset``, a torch
``Dataset``, a list): it reads the indices :func:`shard_indices` gives, in batches, and collates them
(``torch.utils.data.default_collate`` unless told otherwise). Inside a node, those indices come from
:class:`~p2ptrain.integrations.shards.SwarmShards` over the node's DHT: shards claimed there, and this
peer's place in them kept in its data directory, so the peers' data stays disjoint across restarts and
joins. Without a node (a task tried on its own) one peer reads every shard.

The trainer draws batches in a worker thread (see ``Trainer``), so the claims' DHT calls are made in
the node's event loop while training waits for the batch, and a slow dataset never blocks the node.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..training.loop.data_swarm import CURRENT
from .shards import SwarmShards

log = logging.getLogger(__name__)


def shard_indices(size: int, *, shard_size: int = 1024, seed: int = 0) -> Iterator[int]:
    """This peer's indices into a dataset of ``size`` examples, pass after pass, endless: disjoint from
    the other peers' inside a node (see the module docstring), every index of each pass without one."""
    swarm = CURRENT.get()
    if swarm is None:
        log.info("no swarm to share the data with: this peer reads all %d examples", size)
        yield from _alone(size, seed)
        return
    state = None
    if swarm.data_dir is not None:
        state = swarm.data_dir / f"data-{size}-{shard_size}-{seed}.json"
    yield from SwarmShards(
        swarm.handle, size, shard_size=shard_size, seed=seed, state_file=state, trusted=swarm.trusted
    )


def _alone(size: int, seed: int) -> Iterator[int]:
    for pass_no in itertools.count():
        order = list(range(size))
        random.Random(hashlib.blake2b(f"{seed}/{pass_no}".encode(), digest_size=8).digest()).shuffle(order)
        yield from order


def swarm_batches(
    dataset: Sequence[Any],
    *,
    collate: Callable[[list[Any]], Any] | None = None,
    shard_size: int = 1024,
    seed: int = 0,
) -> Callable[[int, int], Iterator[Any]]:
    """A Task's ``batches(seed, batch_size)`` over ``dataset``, each peer reading its own shards.

    Each batch is ``collate`` of the examples at this peer's indices (``shard_indices``: shards claimed
    in the node's DHT, disjoint from the other peers'), ``batch_size`` at a time. The per-peer seed the
    trainer passes is not needed: the claims keep the peers apart.

    Args:
        dataset: Any map-style dataset with a length (a Hugging Face ``datasets.Dataset``, a torch
            ``Dataset``, a list).
        collate: Turns a list of examples into a batch (default ``torch.utils.data.default_collate``).
        shard_size: Examples per shard.
        seed: Orders the shards and the examples (the run's, the same on every peer).

    Returns:
        The ``batches(seed, batch_size)`` function of a [`Task`][p2ptrain.tasks.Task].

    Raises:
        ValueError: The dataset is empty.
    """
    size = len(dataset)
    if size <= 0:
        raise ValueError("the dataset is empty")
    join = collate or torch.utils.data.default_collate

    def batches(_peer_seed: int, batch_size: int) -> Iterator[Any]:
        indices = shard_indices(size, shard_size=shard_size, seed=seed)
        while True:
            yield join([dataset[i] for i in itertools.islice(indices, batch_size)])

    return batches
