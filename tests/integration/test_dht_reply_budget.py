"""A DHT node's replies to reads are shared by origin: free ids of one subnet that read a full key as
fast as they can get at most the origin's budget of the node's uplink, and every other reader is
answered in full meanwhile.

The invariant: over any window of T seconds, the reply bytes a node sends one origin are at most the
budget's burst plus T times its rate, plus one reply; a busy answer costs a hundred bytes, and a reader
that gets one asks another replica without counting the node as failed. Randomized: per seed, 2 to 10
attacker ids on one /24 each keep 1 to 4 reads of a ~480 KB key in flight at one replica for 20 virtual
seconds (its uplink 20 MB/s), while three readers of other subnets read the key, at that replica and
through ``DHT.get``, every 2 seconds.

On the code before, the attackers drew what the victim's uplink carried (several hundred MB in the
window, 15-20x the budget), every honest read waiting behind them.
"""

from __future__ import annotations

import random

import pytest
import trio
import trio.testing

from p2ptrain.dht import DHTConfig
from p2ptrain.dht.protocol import FIND_VALUE, FindValueReq, decode_entries
from p2ptrain.dht.records import key_id
from p2ptrain.errors import RemoteCallError
from p2ptrain.net import Host
from p2ptrain.net.admission import subnet_of
from p2ptrain.net.memory import LinkProfile
from tests.harness.dht import RUN_ID, DhtNode, open_swarm
from tests.harness.identities import identity

pytestmark = pytest.mark.timeout(300)

KEY = b"a-full-key"
ENTRIES = 40
VALUE = 12_000  # bytes per entry: ~480 KB under the key
WINDOW = 20.0  # virtual seconds of attack
UPLINK = 20e6  # the victim's uplink, bytes a second


async def _flood(host: Host, victim: DhtNode, until: float, got: list[int], refused: list[int]) -> None:
    conn = await host.connect(victim.address)
    while trio.current_time() < until:
        try:
            reply = await conn.call_with_body(FIND_VALUE, FindValueReq(key_id(KEY)), timeout=30)
            got.append(len(reply.body))
        except RemoteCallError as e:
            assert e.code == "busy", e
            refused.append(1)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_free_ids_of_one_subnet_read_at_most_their_origin_s_budget(
    seed: int, autojump_clock: trio.testing.MockClock
) -> None:
    rng = random.Random(seed)
    config = DHTConfig(replication=20)
    async with open_swarm(config) as swarm:
        nodes = [await swarm.start("198.18.1.1", [])]
        for i in range(2, 6):
            nodes.append(await swarm.start(f"198.18.{i}.1", [nodes[0].address]))
        victim = nodes[1]
        swarm.net.set_access(victim.name, up=UPLINK)
        for i in range(ENTRIES):
            stored = await nodes[0].dht.store(KEY, rng.randbytes(VALUE), ttl=600, subkey=b"s%d" % i)
            assert stored >= len(nodes) - 1
        assert len(victim.dht.held(KEY)) == ENTRIES  # (a replica of the whole key)

        ids, depth = rng.randint(2, 10), rng.randint(1, 4)
        attackers = []
        for j in range(ids):
            name = f"198.18.99.{10 + j}"
            host = Host(identity(name), RUN_ID, transport=swarm.net.transport(name))
            swarm.net.set_link(name, victim.name, LinkProfile(latency=0.01))  # (a round trip a call)
            await swarm.nursery.start(host.run, [])
            attackers.append(host)
        origin = subnet_of("198.18.99.10")
        budget = victim.dht.server.replies
        got: list[int] = []
        refused: list[int] = []
        honest_direct: list[int] = []
        honest_reads: list[int] = []
        start = trio.current_time()
        until = start + WINDOW
        async with trio.open_nursery() as attack:
            for host in attackers:
                for _ in range(depth):
                    attack.start_soon(_flood, host, victim, until, got, refused)

            async def honest(reader: DhtNode) -> None:
                conn = await reader.host.connect(victim.address)
                while trio.current_time() < until:
                    with trio.fail_after(10):
                        reply = await conn.call_with_body(FIND_VALUE, FindValueReq(key_id(KEY)), timeout=10)
                    honest_direct.append(len(decode_entries(reply.body)))
                    with trio.fail_after(20):
                        honest_reads.append(len(await reader.dht.get(KEY)))
                    await trio.sleep(2.0)

            for reader in (nodes[2], nodes[3], nodes[4]):
                attack.start_soon(honest, reader)
        elapsed = trio.current_time() - start

    sent = sum(got)
    allowed = budget.burst + budget.rate * elapsed + ENTRIES * (VALUE + 200)
    assert sent <= allowed, (sent / 1e6, allowed / 1e6, ids, depth)
    assert refused, "the attackers' origin was never refused: its budget bounds nothing here"
    assert budget.tokens(origin, trio.current_time()) <= budget.burst
    assert honest_direct and all(n == ENTRIES for n in honest_direct), honest_direct
    assert honest_reads and all(n == ENTRIES for n in honest_reads), honest_reads
