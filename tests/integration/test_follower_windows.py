"""A peer that cannot lead follows its step's leader whenever its look reads it, however late the leader's
window opened.

A peer follows only leaders whose deadline lies at most ``DEADLINE_SLACK`` past its own, so that no leader
keeps it past its own window. A follower's window opens when what every record says expects the step's
target (``training``'s rounds), earlier than the views, capped by trust, that its region's leaders go by:
at a 128-peer swarm's first step the followers of a region read its leader's announcement within their
look, the leader's deadline 5 to 7 s past theirs (theirs had passed), refused it for that alone, and
looked again after the group had formed without them. A peer that cannot lead has no window of its own to
keep: once its deadline passed it follows whom a look begun now would (``GroupForming._choose``).

The invariants tested, over random look times: (1) every follower whose look is still on when its leader
announces is in the leader's group, wherever its own deadline lies (fails on the code before: the
followers that began earliest refused the leader); (2) the look is no longer for it: with nobody to
follow, it ends at its first deadline + ``JOIN_GRACE``, as before.
"""

from __future__ import annotations

import random

import pytest
import trio

from p2ptrain import Node
from p2ptrain.averaging import AveragerConfig
from p2ptrain.averaging.grouping import JOIN_GRACE, POLL
from p2ptrain.averaging.matchmaking import DEADLINE_SLACK, LINGER, Quorum
from p2ptrain.net import MemoryNetwork
from tests.harness.nodes import assert_one_group_of_all, look_at, swarm

PEERS = 6
WINDOW = 3.0
KEY = "step-1"
CFG = AveragerConfig(target_size=PEERS, min_size=2, matchmaking_time=WINDOW)
EARLIEST = WINDOW + JOIN_GRACE - 1.5  # how long before the leader the first follower began: its look is on
# when the leader announces, and its deadline lies further before the leader's than the slack allows
assert EARLIEST - WINDOW < JOIN_GRACE and EARLIEST > DEADLINE_SLACK


def leads(node: Node) -> Quorum:
    """The quorum of a leader that counts nobody but itself (a newcomer's at a swarm's first step)."""
    return Quorum(frozenset({node.peer_id}), 1)


def follows_only(node: Node) -> Quorum:
    """The quorum of a peer that only follows (a newcomer's, or one whose capped view lags its records)."""
    return Quorum(frozenset({node.peer_id}), 1, leads=False)


@pytest.mark.parametrize("seed", range(6))
async def test_every_follower_still_looking_when_the_leader_announces_joins_it(
    seed: int, autojump_clock: object
) -> None:
    rng = random.Random(seed)
    async with swarm(PEERS, CFG, net=MemoryNetwork(seed=seed)) as nodes:
        leader = rng.randrange(PEERS)
        led_at = trio.current_time() + EARLIEST + rng.uniform(0.0, WINDOW)
        starts = {i: rng.uniform(led_at - EARLIEST, led_at + WINDOW - 1.0) for i in range(PEERS)}
        starts[leader] = led_at
        first = min((i for i in range(PEERS) if i != leader), key=lambda i: starts[i])
        starts[first] = led_at - EARLIEST
        how = {i: {"opens": starts[i], "quorum": follows_only(nodes[i])} for i in range(PEERS)}
        how[leader]["quorum"] = leads(nodes[leader])
        found, ended = await look_at(nodes, starts, how, key=KEY, limit=20 * WINDOW)
    assert_one_group_of_all(found)
    assert max(ended) <= led_at + WINDOW + LINGER + 0.5


@pytest.mark.parametrize("seed", range(3))
async def test_a_follower_nobody_leads_ends_its_look_at_its_deadlines_grace(
    seed: int, autojump_clock: object
) -> None:
    rng = random.Random(seed)
    async with swarm(PEERS, CFG, net=MemoryNetwork(seed=seed)) as nodes:
        t0 = trio.current_time()
        starts = {i: t0 + rng.uniform(0.0, 2 * WINDOW) for i in range(PEERS)}
        how = {i: {"opens": starts[i], "quorum": follows_only(nodes[i])} for i in range(PEERS)}
        found, ended = await look_at(nodes, starts, how, key=KEY, limit=20 * WINDOW)
    assert all(m is None for m in found)
    for i in range(PEERS):
        give_up = starts[i] + WINDOW + JOIN_GRACE
        assert give_up <= ended[i] <= give_up + POLL + 0.5
