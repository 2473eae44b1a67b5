"""A restarted node finds its swarm through the peers it knew, when its join address is gone (issue: home
volunteers, "the DHT re-bootstraps from the join addresses and from a persisted cache of recently seen
peers"). Nodes over the in-memory network on the virtual clock.

What is proved here: peers A and B joined through P. P leaves for good; A restarts at a new address with
its join address (P's, dead) and its data directory. It finds B through the peer cache it wrote before,
within a few DHT maintenance intervals. Without the cache, A's only way in was P's address: it stayed
alone (the same test without it fails).
"""

from __future__ import annotations

from pathlib import Path

import trio

from p2ptrain.dht import DHTConfig
from p2ptrain.net import MemoryNetwork, PeerAddress
from p2ptrain.node import Node, NodeConfig
from tests.harness.identities import identity

PORT = 1000


def node(
    net: MemoryNetwork, name: str, join: list[PeerAddress], cache: Path | None = None, at: str | None = None
) -> Node:
    """Node ``name``, listening at host ``at`` (default: its name)."""
    ident = identity(name)
    at = at or name
    config = NodeConfig(run_id="cache", listen=((at, PORT),), join=tuple(join), peer_cache=cache)
    return Node(ident, config, transport=net.transport(at), clock=trio.current_time)


async def test_a_restarted_node_finds_its_swarm_through_the_peers_it_knew(
    autojump_clock: object, tmp_path: Path
) -> None:
    net = MemoryNetwork(seed=4)
    cache = tmp_path / "a" / "peers.json"
    with trio.fail_after(3600):
        async with trio.open_nursery() as nursery:
            p_scope, a_scope = trio.CancelScope(), trio.CancelScope()

            async def run(n: Node, scope: trio.CancelScope, task_status=trio.TASK_STATUS_IGNORED) -> None:
                with scope:
                    await n.run(task_status=task_status)
                    await trio.sleep_forever()

            p = node(net, "p", [])
            await nursery.start(run, p, p_scope)
            join = [p.addresses[0]]
            a = node(net, "a", join, cache)
            b = node(net, "b", join)
            await nursery.start(run, a, a_scope)
            await nursery.start(run, b, trio.CancelScope())
            while b.peer_id not in a.dht.table:  # noqa: ASYNC110  (virtual time)
                await trio.sleep(1.0)
            a_scope.cancel()  # A stops (it saves what it knew) ...
            p_scope.cancel()  # ... and P leaves for good
            net.kill("p")
            await trio.sleep(1.0)
            assert cache.exists()

            # the same id, data directory and join address, at a new address (a home router's new IP):
            # B cannot find it where it knew it
            again = node(net, "a", join, cache, at="a-new")
            await nursery.start(run, again, trio.CancelScope())
            for _ in range(10):  # a few maintenance intervals
                await trio.sleep(DHTConfig().maintenance_interval)
                if b.peer_id in again.dht.table:
                    break
            assert b.peer_id in again.dht.table
            nursery.cancel_scope.cancel()
