"""A group's leader is reached through inbound slots full of the DHT's connections (``grouping``).

At 128 simulated peers with 48 inbound slots a node, 18 of a run's left-out peers formed no group: the
leader they followed refused their dial (its slots held the DHT's connections, used within
``idle_after``), or the connection closed under it, and they passed it over at once. Two rules, each
tested here: a peer that may lead expects the peers announced under its group key while it looks
(``Host.expect``: over the cap they may take an idle slot, as a round's members do, shown in
``test_connection_flood``); and a follower whose leader answers "busy", or whose connection closes
under the dial, dials it again shortly, for as long as a leader between states is asked again
(``RETRY_FOR``), before it passes it over.
"""

from __future__ import annotations

import random

import pytest
import trio

from p2ptrain.averaging import AveragerConfig
from p2ptrain.averaging.grouping import RETRY_FOR
from p2ptrain.averaging.matchmaking import Announcement
from p2ptrain.errors import ConnectionClosed, HandshakeRefused
from p2ptrain.net.address import PeerAddress
from tests.harness.identities import identity
from tests.harness.nodes import assert_one_group_of_all, look_at, swarm


@pytest.mark.parametrize("seed", range(6))
async def test_a_follower_whose_leader_is_busy_for_a_while_joins_it(autojump_clock, seed):
    """Randomized: the group's size, its leader, and for how long (up to most of ``RETRY_FOR``) each
    follower's dials of the leader hear "busy" or have their connection closed under them."""
    rng = random.Random(seed)
    n = rng.randint(3, 5)
    cfg = AveragerConfig(target_size=n, min_size=n, matchmaking_time=3.0)
    async with swarm(n, cfg) as nodes:
        leader = rng.randrange(n)
        target = str(nodes[leader].addresses[0])
        began = trio.current_time()
        refused: list[int] = []
        for i, node in enumerate(nodes):
            if i == leader:
                continue
            real, until = node.host.connect, began + rng.uniform(0.3, 0.8 * RETRY_FOR)
            how = rng.choice(["busy", "closed"])

            async def connect(addr, *a, i=i, real=real, until=until, how=how, **kw):  # type: ignore[no-untyped-def]
                text = str(addr) if isinstance(addr, PeerAddress) else addr
                if text == target and trio.current_time() < until:
                    refused.append(i)
                    if how == "busy":  # (as a node whose slots are full answers a peer it does not expect)
                        raise HandshakeRefused("busy", "too many connections; try later", by_remote=True)
                    raise ConnectionClosed(
                        "connection closed: remote closed: evicted: over 48 inbound connections"
                    )
                return await real(addr, *a, **kw)

            node.host.connect = connect  # type: ignore[method-assign]
        how_of = {i: {"lead": i == leader, "timeout": 20.0} for i in range(n)}
        found, _ = await look_at(nodes, {i: 0.0 for i in range(n)}, how_of, key=f"busy-{seed}", limit=60.0)
    assert refused, "no follower's dial of the leader was refused"
    assert_one_group_of_all(found)


@pytest.mark.parametrize("seed", range(6))
async def test_a_peer_that_may_lead_expects_the_peers_announced_under_its_key(autojump_clock, seed):
    """Randomized announcements read under a key (some client-only, without an address; some with
    another schema; this peer's own; some of peers its quorum counts), more than its group has room
    for or not: a peer that may lead expects the other announced peers with an address and its schema,
    those its quorum counts first, at most its group's room, until the given time and no longer;
    nobody else is expected (a hundred ids announced must not flood its table of expected peers)."""
    rng = random.Random(seed)
    cfg = AveragerConfig(target_size=4, min_size=2, matchmaking_time=3.0)
    async with swarm(2, cfg) as nodes:
        node = nodes[0]
        me = Announcement(node.peer_id, str(node.addresses[0]), 0.0, 1.0, b"s")
        seen = [me]
        target = rng.randint(2, 6)
        counted: set = set()
        eligible: list[tuple[bool, str]] = []  # (counted, host) of those it may expect, read order
        hosts: list[str] = []
        for k in range(rng.randint(2, 12)):
            peer = identity(f"announced-{seed}-{k}").peer_id
            kind = rng.choice(["addressed", "addressed", "addressed", "client-only", "other schema"])
            host = f"198.18.{seed}.{k + 1}"
            addr = str(PeerAddress("ip4", host, 4000, peer)) if kind != "client-only" else ""
            seen.append(Announcement(peer, addr, 0.0, 1.0, b"t" if kind == "other schema" else b"s"))
            hosts.append(host)
            if rng.random() < 0.4:
                counted.add(peer)
            if kind == "addressed":
                eligible.append((peer in counted, host))
        first = [h for c, h in eligible if c] + [h for c, h in eligible if not c]
        room = first[: target - 1]
        until = trio.current_time() + rng.uniform(1.0, 5.0)
        node.averager.groups._expect_followers(seen, me, frozenset(counted), target, until)
        inbound = node.host.inbound
        for host in hosts:
            assert inbound.expects(host) is (host in room), host
        assert not inbound.expects(node.addresses[0].host)  # (never itself)
        await trio.sleep_until(until + 0.01)
        assert not any(inbound.expects(host) for host in hosts)
