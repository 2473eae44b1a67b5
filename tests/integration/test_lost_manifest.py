"""A follower whose leader's answer never came still learns the group it was put in.

A leader lists a joiner in its manifest once it admitted it; the joiner learns it only from the answer
to its join call. When that answer is lost (a reply that failed on the way, a link slower than the
joiner's wait, a caller that gave up just as the group formed), the leader and the other members run a
round that lists a member who never heard of it. They waited for its slices until the scatter deadline
(0.4 of the round's timeout: 240 s in a 600 s DiLoCo run) and committed without it. In CI, with a
busy machine, two background nodes averaged that way: one committed its own tensor alone.

The invariant: a member listed in a formed group either runs the round or tells the others it left,
unless its leader cannot be reached at all. A follower whose join call ended without an answer asks
its leader once more for a group it formed with it (``avg.recall``, which never admits anybody): it runs
the manifest it gets, or declines it when its caller gave up.

Over random swarms, with random followers' answers lost in each of the three ways, every member that
was listed and still wanted to average contributes to the round, the others get the exact mean of the
members that did, and nobody waits for the scatter deadline. Fails on the code before: the lost
followers' looks failed, and the others committed without them at the scatter deadline.
"""

from __future__ import annotations

import random

import pytest
import torch
import trio

from p2ptrain.averaging import AveragerConfig, RoundResult
from p2ptrain.averaging.grouping import JOIN_GRACE, GroupForming
from p2ptrain.averaging.matchmaking import ticket
from p2ptrain.averaging.round_machine import SCATTER
from p2ptrain.net import MemoryNetwork
from tests.harness.identities import identity
from tests.harness.nodes import swarm

pytestmark = pytest.mark.timeout(120)

TIMEOUT = 30.0  # the round's: its scatter deadline (12 s) lies well past a slow answer's recall
LOSSES = ("error", "slow", "cancel")


@pytest.mark.parametrize("seed", range(6))
async def test_a_follower_whose_answer_was_lost_runs_the_round_or_leaves_it_at_once(
    autojump_clock, monkeypatch, seed
):
    rng = random.Random(seed)
    n = rng.randint(3, 5)
    cfg = AveragerConfig(target_size=n, min_size=2, matchmaking_time=2.0)
    # any follower may lose its answer; the leader, drawn by lottery (all look at once), asks nobody
    index = {identity(f"n{i}").peer_id: i for i in range(n)}  # (the swarm's names)
    leader = min(range(n), key=lambda i: ticket("default", identity(f"n{i}").peer_id))
    followers = [i for i in range(n) if i != leader]
    lost = {i: rng.choice(LOSSES) for i in rng.sample(followers, rng.randint(1, n - 1))}
    if seed % 3 == 0:  # (at least one of each way over the seeds)
        lost = {i: LOSSES[(seed // 3 + k) % 3] for k, i in enumerate(sorted(lost))}
    scopes: dict[int, trio.CancelScope] = {}
    answered: set[int] = set()
    original = GroupForming.on_join

    async def on_join(self, ctx, req):  # type: ignore[no-untyped-def]
        reply = await original(self, ctx, req)
        i = index[ctx.peer]
        if not reply.message.accepted or i not in lost or i in answered:
            return reply
        answered.add(i)  # (its first answer into a formed group is the one lost)
        if lost[i] == "error":
            raise RuntimeError("the answer failed on the way")
        if lost[i] == "cancel":
            scopes[i].cancel()  # its caller gave up just as the group formed
        await trio.sleep_forever()  # slower than the follower's wait
        return reply

    monkeypatch.setattr(GroupForming, "on_join", on_join)  # (before the nodes register it)
    async with swarm(n, cfg, net=MemoryNetwork(seed=seed)) as nodes:
        assert all(index[node.peer_id] == i for i, node in enumerate(nodes))
        inputs = [[torch.full((1000,), float(i + 1))] for i in range(n)]
        results: dict[int, RoundResult] = {}
        began = trio.current_time()

        async def one(i: int) -> None:
            with trio.CancelScope() as scopes[i]:
                results[i] = await nodes[i].averager.average(inputs[i], weight=float(i + 1), timeout=TIMEOUT)

        with trio.fail_after(TIMEOUT + 3 * JOIN_GRACE):
            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(one, i)

    assert answered == set(lost), (answered, lost)  # (each lost its answer into the one group)
    staying = sorted(i for i in range(n) if lost.get(i) != "cancel")
    assert sorted(results) == staying, (sorted(results), lost, answered)
    total = sum(float(i + 1) for i in staying)
    mean = sum(float(i + 1) ** 2 for i in staying) / total
    for i in staying:
        r = results[i]
        assert sorted(index[p] for p in r.contributors) == staying, (i, r.excluded, lost)
        assert r.total_weight == total
        assert torch.allclose(inputs[i][0], torch.full((1000,), mean))
        # nobody waited for the scatter deadline: a slow answer is recalled a grace past the deadline
        assert r.round_seconds < SCATTER * TIMEOUT - 2.0, (i, r.round_seconds, r.phases, lost)
    assert trio.current_time() - began < SCATTER * TIMEOUT + 2 * cfg.matchmaking_time + JOIN_GRACE


async def test_a_recall_hands_a_manifest_only_to_its_members_and_admits_nobody(autojump_clock):
    """``avg.recall`` is no back door: a peer that asks a gathering leader is not admitted by it, and a
    peer that the formed group does not list gets no manifest (a member gets the one it was sent)."""
    from p2ptrain.averaging.protocol import RECALL, RecallReq, SignedManifest

    cfg = AveragerConfig(target_size=3, min_size=2, matchmaking_time=3.0)
    async with swarm(3, cfg, net=MemoryNetwork(seed=7)) as nodes:
        leader = min(range(2), key=lambda i: ticket("default", nodes[i].peer_id))
        member, stranger = 1 - leader, nodes[2]
        answers = []

        async def recall(node) -> tuple[bool, bytes]:  # type: ignore[no-untyped-def]
            conn = await node.host.connect(nodes[leader].addresses[0])
            reply = await conn.call_with_body(RECALL, RecallReq("default"), timeout=5.0)
            return reply.message.accepted, bytes(reply.body)

        async def ask_while_gathering() -> None:
            await trio.sleep(1.0)  # (the leader gathers: its window is 3 s)
            answers.append(await recall(stranger))

        results: dict[int, RoundResult] = {}

        async def one(i: int) -> None:
            results[i] = await nodes[i].averager.average([torch.full((8,), float(i))], timeout=TIMEOUT)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for i in (leader, member):
                    nursery.start_soon(one, i)
                nursery.start_soon(ask_while_gathering)
            answers.append(await recall(stranger))
            answers.append(await recall(nodes[member]))
    assert not answers[0][0] and not answers[1][0], answers[:2]  # the stranger: nothing, then or after
    assert sorted(results) == sorted([leader, member])
    assert stranger.peer_id not in results[leader].contributors and len(results[leader].contributors) == 2
    ok, body = answers[2]
    assert ok and SignedManifest.verify(body, nodes[leader].peer_id).digest == results[member].round
