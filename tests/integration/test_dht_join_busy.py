"""A join refused "busy" is tried again soon, not on the backoff for join peers that are gone.

A node whose inbound slots are full answers a newcomer's hello "busy" (``net.admission``) until a slot
frees or turns over, which a full node does about once a second. The join's retries grew to 30 s apart,
the backoff meant for join peers that are down: at 128 simulated peers with 48 slots a node, the late
joiners joined up to 66 s after they started, one never within 80 s.

What is proved here, for join peers full for a random while (their slots held by peers they trained
with, which never give way, until one of those leaves): the newcomer joins within about
``upkeep.BUSY_RETRY`` of the slot freeing, however long the join peer was full.
"""

from __future__ import annotations

import random

import pytest
import trio

from p2ptrain.dht import DHTConfig
from p2ptrain.dht.upkeep import BUSY_RETRY
from p2ptrain.net import HostConfig
from tests.harness.dht import open_swarm

CONFIG = DHTConfig(k=4, replication=2)
FULL = HostConfig(max_inbound=2, reserved_inbound=0, turnover_rate=0.0, handshake_timeout=5.0)
SLACK = 1.0  # (a hello's round trips on the in-memory network, and the scheduling around the kill)


@pytest.mark.parametrize("seed", range(4))
async def test_a_join_refused_busy_joins_soon_after_a_slot_frees(autojump_clock, seed: int) -> None:
    rng = random.Random(seed)
    full_for = rng.uniform(8.0, 40.0)  # how long the join peer's slots stay full after the newcomer starts
    with trio.fail_after(300):
        async with open_swarm(CONFIG) as swarm:
            join = await swarm.start("198.18.0.1", [], host_config=FULL)
            fillers = [await swarm.start(f"198.18.{1 + i}.1", [join.address]) for i in range(2)]
            for filler in fillers:  # peers it trained with: never evicted nor turned over
                join.host.protect(filler.host.identity.peer_id)
            start = trio.current_time()
            freed: list[float] = []

            async def leave_later() -> None:
                await trio.sleep(full_for)
                freed.append(trio.current_time())
                await swarm.kill(fillers[0])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(leave_later)
                newcomer = await swarm.start("198.18.9.1", [join.address])
                joined = trio.current_time()
            assert freed, f"joined {joined - start:.1f} s in, while every slot was still held"
            assert newcomer.dht.bootstrapped.is_set()
            late = joined - freed[0]
            assert late <= BUSY_RETRY * 1.2 + SLACK, (
                f"full for {full_for:.1f} s: joined {late:.1f} s after a slot freed"
            )
