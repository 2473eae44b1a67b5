"""The matchmaking window opens when the step's target is expected, not when each look began.

A training peer begins to look for its step's group up to a batch before the step's target (its
batches end when they end: 0.5 to 2 s each in the scale simulator), and whoever began first held the
smallest window: the lottery's leader, if it began first, formed at its own deadline, and the peers
whose looks began after that deadline were left out of the step's group (at 64 simulated peers the
looks of one step began over 8 s). With ``opens`` (the time a peer's view expects the target) every
peer of the step announces about one deadline, a window after the target, however early it began.

The invariant tested, over random start times within a window before the target and half a window
after it: every peer ends in the one group, formed within a window of the target. The same starts
without ``opens`` leave the last peers out (the cause, shown on the same code).
"""

from __future__ import annotations

import random

import pytest
import torch
import trio

from p2ptrain import Node, NodeConfig
from p2ptrain.averaging import AveragerConfig
from p2ptrain.averaging.protocol import SignedManifest
from p2ptrain.errors import GroupFormationFailed
from p2ptrain.net import MemoryNetwork
from tests.harness.identities import identity
from tests.harness.nodes import assert_one_group_of_all

PEERS = 6
WINDOW = 3.0
PORT = 3100
CFG = AveragerConfig(target_size=PEERS, min_size=2, matchmaking_time=WINDOW)


async def start(nursery: trio.Nursery, net: MemoryNetwork, i: int, first: Node | None) -> Node:
    host = f"198.18.{i + 1}.1"
    config = NodeConfig(
        run_id="window",
        listen=((host, PORT),),
        join=(first.addresses[0],) if first is not None else (),
        averaging=CFG,
    )
    node = Node(identity(f"w{i}"), config, transport=net.transport(host), clock=trio.current_time)
    node = await nursery.start(node.run)
    await node.dht.bootstrapped.wait()
    return node


async def look(
    seed: int, aligned: bool, late: tuple[float, float] = (0.1, 0.5)
) -> tuple[list[SignedManifest | None], float, float]:
    """Each peer looks for the group of one key, beginning at a random time around the target (the
    last ``late`` windows after it); returns what each found, the target time and the last formation
    time."""
    rng = random.Random(seed)
    net = MemoryNetwork(seed=seed)
    found: list[SignedManifest | None] = [None] * PEERS
    formed_at = [0.0]
    async with trio.open_nursery() as nursery:
        nodes: list[Node] = []
        for i in range(PEERS):
            nodes.append(await start(nursery, net, i, nodes[0] if nodes else None))
        target = trio.current_time() + 2 * WINDOW
        # one look begins nearly a window early, one up to half a window late, the rest between
        offsets = [-rng.uniform(0.8, 0.95) * WINDOW, rng.uniform(*late) * WINDOW]
        offsets += [rng.uniform(offsets[0], offsets[1]) for _ in range(PEERS - 2)]
        rng.shuffle(offsets)

        async def one(i: int) -> None:
            await trio.sleep_until(target + offsets[i])
            try:
                found[i] = await nodes[i].averager.form_group(
                    [torch.zeros(8)],
                    group_key="step-1",
                    opens=target if aligned else None,
                )
                formed_at[0] = max(formed_at[0], trio.current_time())
            except GroupFormationFailed:
                pass

        with trio.fail_after(10 * WINDOW):
            async with trio.open_nursery() as looks:
                for i in range(PEERS):
                    looks.start_soon(one, i)
        nursery.cancel_scope.cancel()
    return found, target, formed_at[0]


@pytest.mark.parametrize("seed", range(4))
async def test_every_peer_of_a_step_is_in_its_group_when_the_window_opens_at_the_target(
    seed: int, autojump_clock: object
) -> None:
    found, target, formed = await look(seed, aligned=True)
    assert_one_group_of_all(found)
    assert formed <= target + WINDOW + 1.0


async def test_without_it_a_look_that_began_a_window_late_misses_the_first_leaders_group(
    autojump_clock: object,
) -> None:
    """The cause, on the same code: windows from each look's own start leave the late peers out of
    a group that formed at the first leader's deadline, in at least one of the draws above, with the
    last look a little later than above (1.2 to 1.5 windows after the target): a leader that the peers
    still join keeps gathering for a while past its deadline (``matchmaking``, "The group's closing"),
    which took in the late looks of the draws above."""
    left_out = 0
    for seed in range(4):
        found, _, _ = await look(seed, aligned=False, late=(1.2, 1.5))
        left_out += sum(m is None or len(m.manifest.members) < PEERS for m in found)
    assert left_out > 0
