"""A DHT node that runs out of contacts finds the swarm again (issue: home volunteers, "the node re-dials
its join address but never re-runs the DHT bootstrap"), over the in-memory network on the virtual clock.

What is proved here: a node cut off from the only peer it knew drops it from its routing table while it
keeps using the DHT; once the link is back, it bootstraps again from its join address within a few
maintenance intervals, and its lookups work. On the code before, its table stayed empty for good.
"""

from __future__ import annotations

import trio

from p2ptrain.dht import DHT, DHTConfig
from p2ptrain.net import Host, MemoryNetwork, PeerAddress
from tests.harness.identities import identity

RUN_ID = "rebootstrap"
PORT = 1000


async def start(nursery: trio.Nursery, net: MemoryNetwork, name: str, join: list[PeerAddress]) -> DHT:
    ident = identity(name)
    host = Host(ident, RUN_ID, transport=net.transport(name))
    await nursery.start(host.run, [(name, PORT)])
    dht = DHT(host, config=DHTConfig(), clock=trio.current_time, seed=len(name))
    await nursery.start(dht.run, join)
    return dht


async def test_a_node_that_ran_out_of_contacts_bootstraps_again(autojump_clock: object) -> None:
    net = MemoryNetwork(seed=3)
    with trio.fail_after(3600):
        async with trio.open_nursery() as nursery:
            p = await start(nursery, net, "p", [])
            a = await start(nursery, net, "a", [p.advertised_address()])
            await a.bootstrapped.wait()
            assert p.host.peer_id in {c.peer_id for c in a.table.contacts()}
            net.partition({"a"}, {"p"})
            while len(a.table):  # it keeps using the DHT, as the trainer's progress loop does
                with trio.move_on_after(60):
                    await a.get(b"progress")
            net.heal()
            for _ in range(10):  # a few maintenance intervals
                await trio.sleep(DHTConfig().maintenance_interval)
                if len(a.table):
                    break
            assert p.host.peer_id in {c.peer_id for c in a.table.contacts()}
            await p.store(b"k", b"v", ttl=60.0)
            assert (await a.get(b"k"))[b""].value == b"v"
            nursery.cancel_scope.cancel()
