"""``p2ptrain.integrations.shards``: peers of a swarm read disjoint shards of one dataset, claimed in
the DHT, across restarts and joins. Real nodes on loopback TCP, in threads of their own."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from p2ptrain.config import parse_config
from p2ptrain.integrations import join_swarm
from p2ptrain.integrations.shards import SwarmShards
from p2ptrain.node import BackgroundNode

pytestmark = pytest.mark.timeout(180)

SIZE, SHARD = 100, 10
RUN = parse_config({"run": {"id": "shards"}})


def swarm(stack: ExitStack, n: int) -> list[BackgroundNode]:
    nodes = [stack.enter_context(join_swarm(RUN, listen="127.0.0.1:0"))]
    for _ in range(n - 1):
        nodes.append(
            stack.enter_context(join_swarm(RUN, listen="127.0.0.1:0", join=[str(nodes[0].addresses[0])]))
        )
    return nodes


def draw(shards: SwarmShards, it: Iterator[int], count: int) -> list[tuple[int, int]]:
    """``count`` indices, each with the pass it was read in."""
    return [(shards.pass_no, i) for i in itertools.islice(it, count)]


def test_peers_read_disjoint_shards_that_cover_the_pass_across_a_restart_and_a_join(tmp_path: Path) -> None:
    with ExitStack() as stack:
        nodes = swarm(stack, 3)
        shards = [
            SwarmShards(n, SIZE, shard_size=SHARD, state_file=tmp_path / f"{k}.json")
            for k, n in enumerate(nodes)
        ]
        iters = [iter(s) for s in shards]
        read: list[list[tuple[int, int]]] = [[], [], []]
        for _ in range(2):  # round-robin: each peer takes a shard, then reads a bit
            for k in range(3):
                read[k] += draw(shards[k], iters[k], 7)
        held = [{i // SHARD for _, i in r} for r in read]
        assert all(len(h) == 2 for h in held), held  # (7 + 7 from 10-example shards)
        assert not (held[0] & held[1] or held[0] & held[2] or held[1] & held[2]), held

        # Peer 0 restarts (same node, so the same id; its state file): it goes on in the shard it held.
        current = shards[0].shard
        shards[0] = SwarmShards(nodes[0], SIZE, shard_size=SHARD, state_file=tmp_path / "0.json")
        iters[0] = iter(shards[0])
        resumed = draw(shards[0], iters[0], 1)
        assert resumed[0][1] // SHARD == current  # (from its last save: its own examples may come again)

        # A fourth peer joins: it takes only free shards.
        nodes.append(
            stack.enter_context(join_swarm(RUN, listen="127.0.0.1:0", join=[str(nodes[0].addresses[0])]))
        )
        shards.append(SwarmShards(nodes[3], SIZE, shard_size=SHARD, state_file=tmp_path / "3.json"))
        iters.append(iter(shards[3]))
        read.append(draw(shards[3], iters[3], 1))
        assert read[3][0][1] // SHARD not in set().union(*held)
        read[0] += resumed

        # Everyone reads on until all are in the next pass: pass 0 was read once, each example by one peer.
        while any(s.pass_no == 0 for s in shards):
            for k in range(4):
                if shards[k].pass_no == 0:
                    read[k] += draw(shards[k], iters[k], 3)
    first = Counter(i for r in read for p, i in r if p == 0)
    # A restart may read again what it read after its last save (at most SAVE_EVERY examples of its own).
    assert set(first) == set(range(SIZE)), sorted(set(range(SIZE)) - set(first))
    owners: dict[int, set[int]] = {}
    for k, r in enumerate(read):
        for p, i in r:
            if p == 0:
                owners.setdefault(i // SHARD, set()).add(k)
    assert all(len(o) == 1 for o in owners.values()), owners
