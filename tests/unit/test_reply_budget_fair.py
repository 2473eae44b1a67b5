"""A node's DHT replies in all, shared max-min among origins (``net.slots.ReplyBudget``'s ``total``).

The invariant: an origin asking for less than the node's total over the origins asking is never refused
for the node's sake, and the node sends about twice its total at most however many origins ask. Before,
the budget was per origin alone: k origins (a /24 each) drew k megabytes a second from any node, more
than a home uplink, and the node served every one of them.

Randomized: a node-wide total, 2 to 40 origins (more than it serves at 1 MB/s each) asking for big
replies as fast as they are answered, and one origin asking for less than half its fair share once a
second; two virtual minutes each seed.
"""

from __future__ import annotations

import heapq
import math
import random

import pytest

from p2ptrain.errors import CallRefused
from p2ptrain.net.slots import POOL_SECONDS, ReplyBudget

SECONDS = 120.0


@pytest.mark.parametrize("seed", range(12))
def test_origins_share_the_nodes_replies_and_a_light_one_is_never_refused(seed: int) -> None:
    rng = random.Random(seed)
    total = rng.uniform(0.3e6, 3e6)
    budget = ReplyBudget(rate=1e6, burst=8e6, total=lambda: total)
    k = rng.randint(math.ceil(3 * total / 1e6) + 1, 40)  # more than the node's total at 1 MB/s each
    asks: list[tuple[float, str, float, float]] = []  # (when, origin, reply bytes, seconds between)
    for i in range(k):
        size = rng.choice([256e3, 512e3, 768e3])
        asks.append((rng.uniform(0, 0.1), f"10.{i}.0.0/24", size, rng.uniform(0.02, 0.25)))
    light = total / (k + 1) * rng.uniform(0.1, 0.5)  # bytes a second, under half its fair share
    asks.append((rng.uniform(0, 1), "198.18.7.0/24", light, 1.0))
    heapq.heapify(asks)
    sent = {"node": 0.0, "light": 0.0}
    refused_light = 0
    while asks:
        now, origin, size, every = heapq.heappop(asks)
        if now > SECONDS:
            continue
        try:
            budget.check(origin, now)
        except CallRefused:
            if origin.startswith("198.18"):
                refused_light += 1
        else:
            budget.charge(origin, int(size), now)
            sent["node"] += size
            if origin.startswith("198.18"):
                sent["light"] += size
        heapq.heappush(asks, (now + every, origin, size, every))
    assert refused_light == 0, (seed, k, total)
    assert sent["light"] >= light * (SECONDS - 2), (seed, sent)
    # at most about twice the total (plus the bucket and a reply overdrawn per origin); and the node
    # does serve: its total at least, while origins ask for more
    bound = 2 * total * SECONDS + POOL_SECONDS * total + (k + 1) * 768e3
    assert sent["node"] <= bound, (seed, k, total, sent["node"] / SECONDS)
    assert sent["node"] >= 0.9 * total * SECONDS, (seed, k, total, sent["node"] / SECONDS)
