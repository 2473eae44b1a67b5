"""A large group's manifest reaches every member through a few relays, whatever the relays do.

A leader answered every joiner with the signed manifest, which lists every member: ``n`` copies of
``O(n)`` bytes on one uplink (10 MB from the leader of a group of 248 in the 256-peer simulation, 46x
the median node's control bytes). Groups larger than ``RELAY_FROM`` now have the leader send it to about
``sqrt(n)`` relays, which pass it on (``grouping``, "Manifests relayed").

The invariant, over random groups with random members misbehaving as relays (withholding the manifest,
refusing, failing the call, sending garbage or another manifest signed by themselves, or answering only
after the member's wait): every member runs the leader's round (the same digest, every member a
contributor, the exact weighted mean), a hostile relay costs its members at most ``RELAY_WAIT`` plus
a recall from the leader, and the leader sends the manifest's bytes about ``sqrt(n)`` times plus once
per member whose relay failed it. On the code before (no relays) the leader sent ``n - 1`` copies, and
the byte bound fails.
"""

from __future__ import annotations

import math
import os
import random
from collections import Counter

import pytest
import torch
import trio

from p2ptrain.averaging import AveragerConfig, RoundResult, grouping
from p2ptrain.averaging.grouping import RECALL_WAIT, RELAY_WAIT, GroupForming, relay_plan
from p2ptrain.averaging.matchmaking import ticket
from p2ptrain.averaging.protocol import JoinResp, Manifest, MemberMsg, SignedManifest
from p2ptrain.net import MemoryNetwork
from p2ptrain.net.rpc import Reply
from tests.harness.identities import identity
from tests.harness.nodes import swarm

pytestmark = pytest.mark.timeout(180)

TIMEOUT = 30.0
WAYS = ("withhold", "refuse", "error", "garbage", "other", "late")


@pytest.mark.parametrize("seed", range(10))
async def test_every_member_runs_the_leaders_round_whatever_its_relay_does(autojump_clock, monkeypatch, seed):
    rng = random.Random(seed)
    n = rng.randint(8, 12)
    # (the rule at a size the suite runs; on the code before, which has no relays, the bound below fails)
    monkeypatch.setattr(grouping, "RELAY_FROM", rng.randint(3, 6), raising=False)
    cfg = AveragerConfig(target_size=n, min_size=n, matchmaking_time=2.0)
    index = {identity(f"n{i}").peer_id: i for i in range(n)}
    leader = min(range(n), key=lambda i: ticket("default", identity(f"n{i}").peer_id))
    hostile = {i: rng.choice(WAYS) for i in range(n) if i != leader and rng.random() < 0.6}
    asked: dict[int, int] = {}  # hostile relay -> relay asks it got
    original = GroupForming.on_recall

    async def on_recall(self, ctx, req):  # type: ignore[no-untyped-def]
        me = index[self.host.identity.peer_id]
        if not req.digest or me not in hostile:
            return await original(self, ctx, req)
        asked[me] = asked.get(me, 0) + 1
        way = hostile[me]
        if way == "withhold":
            await trio.sleep_forever()
        if way == "refuse":
            return Reply(JoinResp(False, "no"))
        if way == "error":
            raise RuntimeError("the relay fails the call")
        if way == "garbage":
            return Reply(JoinResp(True), b"\x00" * 300)
        if way == "other":  # a well-formed manifest listing the caller, signed by the relay itself
            forged = Manifest(
                round_id=bytes(16),
                group_key=req.group_key,
                members=(
                    MemberMsg(self.host.identity.peer_id.digest, "x:1"),
                    MemberMsg(ctx.peer.digest, "y:1"),
                ),
                sizes=(1, 0),
            )
            return Reply(JoinResp(True), SignedManifest.sign(self.host.identity, forged).envelope)
        reply = await original(self, ctx, req)  # "late": the genuine copy, after the member's wait
        await trio.sleep(RELAY_WAIT + 0.5)
        return reply

    monkeypatch.setattr(GroupForming, "on_recall", on_recall)  # (before the nodes register it)
    signed_here: dict[bytes, tuple[Manifest, int]] = {}  # the leader's: digest -> manifest, envelope bytes
    sign = SignedManifest.sign.__func__  # type: ignore[attr-defined]

    def signing(cls, who, manifest):  # type: ignore[no-untyped-def]
        signed = sign(cls, who, manifest)
        if who.peer_id == identity(f"n{leader}").peer_id:
            signed_here[signed.digest] = (manifest, len(signed.envelope))
        return signed

    monkeypatch.setattr(SignedManifest, "sign", classmethod(signing))
    async with swarm(n, cfg, net=MemoryNetwork(seed=seed)) as nodes:
        inputs = [[torch.full((500,), float(i + 1))] for i in range(n)]
        results: dict[int, RoundResult] = {}
        before = nodes[leader].host.sent_by_method().get("avg.join", 0)
        began = trio.current_time()

        async def one(i: int) -> None:
            results[i] = await nodes[i].averager.average(inputs[i], weight=float(i + 1), timeout=TIMEOUT)

        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(one, i)
        took = trio.current_time() - began
        join_bytes = nodes[leader].host.sent_by_method().get("avg.join", 0) - before
        recall_bytes = nodes[leader].host.sent_by_method().get("avg.recall", 0)

    assert sorted(results) == list(range(n))
    digests = {r.round for r in results.values()}
    assert len(digests) == 1, digests  # one round, the leader's
    total = sum(float(i + 1) for i in range(n))
    mean = sum(float(i + 1) ** 2 for i in range(n)) / total
    for i, r in results.items():
        assert sorted(index[p] for p in r.contributors) == list(range(n)), (i, r.excluded, hostile)
        assert torch.allclose(inputs[i][0], torch.full((500,), mean))
    # the manifest's copies the leader sent: one to each relay in the join's answers, and one to each
    # member whose relay failed it (every ask of a hostile relay), when it asked the leader again
    manifest, size = signed_here[digests.pop()]
    plan = relay_plan(manifest)
    relays = len(set(plan.values()))
    assert relays == math.isqrt(n - 1) + 1
    # every hostile relay was asked by each member it serves (and fell back to the leader), no other
    order = [index[p] for p in manifest.peers()]
    served = Counter(order[r] for r in plan.values())
    assert asked == {i: k for i, k in served.items() if i in hostile}, (asked, served, hostile)
    failed = sum(asked.values())
    assert join_bytes < relays * (size + 300) + (n - 1 - relays) * 300, (join_bytes, size, n, relays)
    assert recall_bytes <= failed * (size + 300), (recall_bytes, failed, size)
    # a hostile relay costs at most its wait and a recall from the leader (the round itself is quick)
    assert took < cfg.matchmaking_time + grouping.JOIN_GRACE + RELAY_WAIT + RECALL_WAIT, took


async def test_a_relay_ask_for_a_manifest_nobody_is_bringing_is_answered_at_once(autojump_clock):
    """A relay waits for its own copy of a manifest only while a look of its own runs (its copy is on
    its way in the answer to its join): a free id that asks an idle node for made-up digests gets a
    refusal at once, and holds none of its handlers for ``RELAY_HOLD``."""
    from p2ptrain.averaging.grouping import RELAY_HOLD
    from p2ptrain.averaging.protocol import RECALL, RecallReq

    cfg = AveragerConfig(target_size=2, min_size=2, matchmaking_time=2.0)
    async with swarm(2, cfg, net=MemoryNetwork(seed=3)) as nodes:
        conn = await nodes[1].host.connect(nodes[0].addresses[0])
        for _ in range(5):
            began = trio.current_time()
            reply = await conn.call_with_body(RECALL, RecallReq("default", os.urandom(16)), timeout=5.0)
            assert not reply.message.accepted and not bytes(reply.body)
            assert trio.current_time() - began < RELAY_HOLD / 4
