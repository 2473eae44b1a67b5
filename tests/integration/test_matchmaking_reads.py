"""Every looker's reads of a step's matchmaking key ask the key's replicas directly, from the first.

Each step's group key is new, and every peer looking for the step's group reads it from its first look.
The reads asked the replicas directly only once this node knew them (its own announcement's store, or
the lookup a training run starts ahead); a first read before that was a lookup of the value, which ends
at the key's closest replicas, and each of those sent the whole value, every announcement, to every
looker at once. At 256 simulated peers the node closest to step 1's key sent 17.2 MB of
``dht.find_value`` in the step, 23.7x the median node's control bytes. The announcements are a key
others write (``DHT.get(..., written=True)``): even the first read looks the replicas up and asks them,
the first ask spread over them, as a run's progress keys are read.

The invariant, over random swarms larger than the DHT's ``k`` looking at once under a fresh key: no
read of the key is a lookup of its value once its replicas hold the announcements a read's quorum
needs (before that, a read confirms what it found by a lookup, as for any key nobody wrote yet), and
the group forms with every looker. On the code before, most lookers' first read was such a lookup,
with the replicas full.
"""

from __future__ import annotations

import random

import pytest
import torch
import trio

from p2ptrain.averaging import AveragerConfig
from p2ptrain.dht import DHTConfig, key_id
from p2ptrain.net import MemoryNetwork
from tests.harness.nodes import swarm

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("seed", range(3))
async def test_no_read_of_a_fresh_matchmaking_key_is_a_lookup_of_its_value(autojump_clock, seed):
    rng = random.Random(seed)
    n = rng.randint(9, 12)
    cfg = AveragerConfig(target_size=n, min_size=n, matchmaking_time=3.0)
    # (more nodes than the DHT's k: no small-swarm shortcut, not every node a replica)
    dht = DHTConfig(k=4, replication=3, get_quorum=2)
    async with swarm(n, cfg, net=MemoryNetwork(seed=seed), dht=dht) as nodes:
        await trio.sleep(10.0)  # (the routing tables settle)
        group_key = f"step-{rng.randrange(1 << 30)}"
        kid = key_id(nodes[0].averager.groups.keys(group_key).keys[0])
        value_lookups: list[tuple[str, int]] = []  # (who, the most announcements a replica held then)
        for node in nodes:
            lookup, name = node.dht.reader.lookup, node.peer_id.short()

            async def counting(target: bytes, _lookup=lookup, _name=name, **kw: object):  # type: ignore[no-untyped-def]
                if target == kid and kw.get("value"):
                    now = trio.current_time()
                    most = max(len(nd.dht.reader._records.get(kid, now)) for nd in nodes)
                    value_lookups.append((_name, most))
                return await _lookup(target, **kw)

            node.dht.reader.lookup = counting  # type: ignore[method-assign]
        results = {}

        async def one(i: int) -> None:
            await trio.sleep(rng.uniform(0.0, 0.5))
            results[i] = await nodes[i].averager.average(
                [torch.full((64,), float(i))], group_key=group_key, timeout=30.0
            )

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(one, i)
    # (a read whose replicas hold too few announcements for its quorum confirms the key by a lookup: the
    # first lookers', before the announcements landed; such a lookup brings nearly nothing)
    assert all(most < 3 for _, most in value_lookups), value_lookups
    assert all(len(r.contributors) == n for r in results.values()), [
        len(r.contributors) for r in results.values()
    ]
