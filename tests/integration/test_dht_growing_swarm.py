"""In a swarm that grows while every node writes and reads one key, every read holds every live record
once the joins are over.

A writer remembers its key's replicas from one lookup (``replicas``), for minutes. In a swarm that grew
while it wrote, that lookup left out the peers that joined closest to the key; readers that had met
them read those replicas and missed the writer's records until the replicas were looked up again, or
re-replicated, minutes later (128 simulated nodes joining over 32 s, each writing and reading one key
as the training swarm's progress records are: a tenth of the reads held 122 of the 128 live records,
for the whole minute after the last join; at 128 training peers, leaders that read 100 of the 128
members of their round refused the joiners that read them all). The invariant: a read begun a newcomer
check and two heartbeats after the last join holds the record of every writer whose store returned a
second before it began. Fails on the code before: 390 of 570 such reads lacked live records (31 to 33
of 38).
"""

from __future__ import annotations

import random

import pytest
import trio

from p2ptrain.dht import DHTConfig
from p2ptrain.dht.records import owned_subkey
from p2ptrain.dht.replicas import NEWCOMERS_CHECK
from p2ptrain.errors import P2PError
from tests.harness.dht import open_swarm

pytestmark = pytest.mark.timeout(300)

KEY = b"progress/growing"
HEARTBEAT = 5.0  # a record's store, as the training loop's (ttl: two of them)
READ_EVERY = 2.0
WAVE, GAP = 4, 2.0  # nodes join four at a time, 2 s apart
CONFIG = DHTConfig(k=5, replication=5)  # (past the small-swarm shortcut at this size: lookups count)


@pytest.mark.parametrize("seed", range(3))
async def test_every_read_holds_every_live_record_once_a_growing_swarm_stops_growing(
    autojump_clock: object, seed: int
) -> None:
    rng = random.Random(seed)
    n = rng.randint(36, 44)
    stores: dict[bytes, list[float]] = {}  # a writer's subkey -> when its stores returned
    reads: list[tuple[float, set[bytes]]] = []  # (when a read began, the subkeys it held)

    async def peer(node, rng: random.Random) -> None:  # type: ignore[no-untyped-def]
        subkey = owned_subkey(node.host.peer_id)
        stores[subkey] = []
        await trio.sleep(rng.uniform(0, 1))
        beat = trio.current_time()
        while True:
            if trio.current_time() >= beat:
                beat += HEARTBEAT
                try:
                    if await node.dht.store(
                        KEY, rng.randbytes(64), ttl=2 * HEARTBEAT, subkey=subkey, sign=True
                    ):
                        stores[subkey].append(trio.current_time())
                except P2PError:
                    pass
            began = trio.current_time()
            try:
                reads.append((began, set(await node.dht.get(KEY, quorum=3))))
            except P2PError:
                pass
            await trio.sleep(READ_EVERY)

    with trio.fail_after(600):
        async with open_swarm(CONFIG) as swarm, trio.open_nursery() as nursery:
            for i in range(n):
                boot = (
                    [] if not swarm.nodes else list({swarm.nodes[0].address, rng.choice(swarm.nodes).address})
                )
                node = await swarm.start(f"grow{seed}-{i}", boot)
                nursery.start_soon(peer, node, random.Random(rng.random()))
                if i % WAVE == WAVE - 1:
                    await trio.sleep(GAP)
            settled = trio.current_time() + NEWCOMERS_CHECK + 2 * HEARTBEAT
            await trio.sleep(NEWCOMERS_CHECK + 2 * HEARTBEAT + 30.0)
            nursery.cancel_scope.cancel()

    late = [(t, held) for t, held in reads if t >= settled]
    assert len(late) > 10 * n, len(late)
    short = []
    for t, held in late:
        # every writer whose store returned between a record's life and a second before the read
        live = {
            s for s, times in stores.items() if any(t - 2 * HEARTBEAT + 1.0 <= x <= t - 1.0 for x in times)
        }
        if live - held:
            short.append((round(t, 1), len(held & live), len(live)))
    assert not short, f"{len(short)} of {len(late)} reads lacked live records: {short[:8]}"
