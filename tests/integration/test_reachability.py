"""What a node tells its user to give others (issue: home volunteers behind NATs), over the in-memory
network on the virtual clock, where a node behind a NAT is one whose advertised address nobody can
dial (it announces its LAN name; it reaches out, nobody reaches in).

A joiner that no peer can dial back gives no direct address to join through, says what its peers see it
at, and gives its address through a relay (a peer it reached: see ``test_relay``); the swarm's first
peer, which has nobody to ask when it starts, asks the first peers it meets. On the code before, both
printed their advertised address as the one "others join with", and the first peer never checked at
all.
"""

from __future__ import annotations

import logging

import pytest
import trio

from p2ptrain.dht.reachability import askers as dial_back_askers
from p2ptrain.dht.routing import Contact
from p2ptrain.identity import Identity
from p2ptrain.net import MemoryNetwork, PeerAddress
from p2ptrain.node import Node, NodeConfig
from tests.harness.identities import identity

PORT = 1000


def node(net: MemoryNetwork, name: str, join: list[PeerAddress], announce: str | None = None) -> Node:
    ident = identity(name)
    config = NodeConfig(run_id="nat", listen=((name, PORT),), join=tuple(join), announce_host=announce)
    return Node(ident, config, transport=net.transport(name), clock=trio.current_time)


async def test_a_joiner_nobody_can_dial_back_gives_its_address_through_a_relay(
    autojump_clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    net = MemoryNetwork(seed=1)
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            public = node(net, "public", [])
            await nursery.start(public.run)
            home = node(net, "home", [public.addresses[0]], announce="192.168.1.2")  # its LAN address
            await nursery.start(home.run)
            assert await home.dialable_addresses() == [public.addresses[0].circuit_to(home.peer_id)]
            assert home.dht.reachable is False and home.dht.client_only
            assert home.dht.observed_host == "home"  # what the public peer sees it at
            assert "no peer can dial" in caplog.text and "peers see it at home" in caplog.text
            reachable = node(net, "other", [public.addresses[0]])
            await nursery.start(reachable.run)
            assert await reachable.dialable_addresses() == reachable.addresses
            assert reachable.dht.reachable is True
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("announce", [None, "10.0.0.7"], ids=["dialable", "behind-nat"])
async def test_the_swarms_first_peer_asks_the_first_peers_it_meets_to_dial_it_back(
    autojump_clock: object, announce: str | None
) -> None:
    net = MemoryNetwork(seed=2)
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            first = node(net, "first", [], announce=announce)
            await nursery.start(first.run)
            assert first.dht.reachable is None  # nobody to ask yet: its address comes unchecked
            assert await first.dialable_addresses() == first.addresses
            # the others paste the address that works (the first peer's real one)
            pasted = PeerAddress.for_host("first", PORT, first.peer_id)
            joiner = node(net, "joiner", [pasted])
            await nursery.start(joiner.run)
            with trio.fail_after(300):
                await first.dht.reachability_checked.wait()
            assert first.dht.reachable is (announce is None)
            assert first.dht.client_only is (announce is not None)
            relayed = [joiner.addresses[0].circuit_to(first.peer_id)]  # (the peer it met relays)
            assert await first.dialable_addresses() == (relayed if announce else first.addresses)
            nursery.cancel_scope.cancel()


async def test_a_recheck_nobody_answers_changes_nothing(autojump_clock: object) -> None:
    """Every node asks again every RECHECK_EVERY seconds; when the peers it asks are gone (nobody
    answers at all), that says nothing about its own address: a public node stays reachable."""
    net = MemoryNetwork(seed=3)
    with trio.fail_after(3600):
        async with trio.open_nursery() as nursery:
            first = node(net, "first", [])
            await nursery.start(first.run)
            joiner = node(net, "joiner", [first.addresses[0]])
            scope = trio.CancelScope()

            async def run_joiner(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
                with scope:
                    await joiner.run(task_status=task_status)
                    await trio.sleep_forever()

            await nursery.start(run_joiner)
            with trio.fail_after(300):
                await first.dht.reachability_checked.wait()
            assert first.dht.reachable is True
            gone = Contact(joiner.peer_id, joiner.addresses[0])
            net.kill("joiner")  # gone without a word: its address answers nothing any more
            scope.cancel()
            await first.dht.reachability.check([gone])  # what the re-check does with what it knows
            assert first.dht.reachable is True and not first.dht.client_only
            nursery.cancel_scope.cancel()


async def test_the_peers_asked_to_dial_back_come_from_different_subnets() -> None:
    """Ids near ours are cheap: the ids of one host must not be every peer asked (one "yes" decides,
    so one honest origin among those asked is enough)."""
    me = node(MemoryNetwork(seed=4), "me", [])
    one_host = [Identity.generate().peer_id for _ in range(5)]
    for k, peer in enumerate(one_host):
        me.dht.table.observe(Contact(peer, PeerAddress.for_host(f"198.18.7.{k + 1}", PORT, peer)), 0.0)
    honest = Identity.generate().peer_id
    me.dht.table.observe(Contact(honest, PeerAddress.for_host("198.18.9.1", PORT, honest)), 0.0)
    askers = dial_back_askers(me.dht.table, 3)
    assert len(askers) == 2 and honest in {c.peer_id for c in askers}


async def test_a_dial_back_that_a_nat_drops_is_answered_not_a_crash(
    autojump_clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    """Behind a NAT the dial-back hangs (the router drops the SYN); the asked peer answers that it got
    no answer in time. Before, its handler died of the timeout and logged an error with a traceback."""
    net = MemoryNetwork(seed=3)
    net.nat("home")
    caplog.set_level(logging.INFO, logger="p2ptrain")
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            public = node(net, "public", [])
            await nursery.start(public.run)
            home = node(net, "home", [public.addresses[0]])  # announces its real name: the dial hangs
            await nursery.start(home.run)
            with trio.fail_after(300):
                await home.dht.reachability_checked.wait()
            assert home.dht.reachable is False
            nursery.cancel_scope.cancel()
    assert "did not answer within" in caplog.text
    assert "handler for dht.dial_back failed" not in caplog.text
