"""A hostile group leader cannot downgrade a round (issue: open swarms, "a group leader downgrades the
run's defences"). Nodes over the in-memory network on the virtual clock.

What is proved here: a leader that signs a manifest with a plain mean and no audit in a run that
aggregates with a trimmed mean and audits, every partition to itself, is refused by every honest member
(the reason logged), never asked again in that matchmaking, and the honest members form their own group
whose result holds none of the leader's values. On the code before the check, they took part in its round
and applied its mean.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import trio

from p2ptrain import Node, NodeConfig
from p2ptrain.averaging import AveragerConfig, RoundPolicy, RoundResult
from p2ptrain.averaging.protocol import Manifest, SignedManifest
from p2ptrain.errors import GroupFormationFailed, RoundAborted
from p2ptrain.identity import Identity
from p2ptrain.net import MemoryNetwork
from tests.harness.identities import identity
from tests.harness.nodes import PORT, swarm

HUGE = 1e4
# Leaders go by lottery (``matchmaking.ticket``): under this group key n0 holds the smallest ticket of
# n0..n4, so the attacker leads the group.
KEY = "hostile-4"


def downgrade(m: Manifest) -> Manifest:
    """What the attacker signs: a plain mean, no audit, every partition to itself (member 0)."""
    return dataclasses.replace(
        m, aggregation="mean", audit=False, sizes=(m.total,) + (0,) * (len(m.sizes) - 1)
    )


async def test_honest_members_refuse_a_downgraded_manifest_and_average_without_its_leader(
    autojump_clock: object, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    attacker = identity("n0").peer_id
    real_sign = SignedManifest.sign.__func__  # type: ignore[attr-defined]

    def sign(cls: type[SignedManifest], who: Identity, manifest: Manifest) -> SignedManifest:
        return real_sign(cls, who, downgrade(manifest) if who.peer_id == attacker else manifest)

    monkeypatch.setattr(SignedManifest, "sign", classmethod(sign))
    cfg = AveragerConfig(
        target_size=3, min_size=2, matchmaking_time=3.0, aggregation="trimmed_mean", audit=True
    )
    out: list[RoundResult | Exception | None] = [None, None, None]
    with caplog.at_level(logging.WARNING, logger="p2ptrain.averaging.averager"):
        async with swarm(3, cfg, net=MemoryNetwork(seed=5)) as nodes:

            async def one(i: int, delay: float) -> None:
                await trio.sleep(delay)
                values = [torch.full((1000,), HUGE if i == 0 else float(i))]
                try:
                    out[i] = await nodes[i].average(values, weight=1.0, timeout=20.0, group_key=KEY)
                except GroupFormationFailed as e:
                    out[i] = e

            with trio.fail_after(120):
                async with trio.open_nursery() as nursery:
                    for i, delay in enumerate((0.0, 0.4, 0.9)):  # the attacker leads (KEY)
                        nursery.start_soon(one, i, delay)
    honest = [out[1], out[2]]
    for r in honest:
        assert isinstance(r, RoundResult), r
        assert attacker not in r.contributors and r.group_size == 2
        assert torch.equal(r.tensors[0], torch.full((1000,), 1.5))  # the two honest values, nothing else
    mine = out[0]  # nobody took part in the attacker's round: at most it averaged with itself
    assert not isinstance(mine, RoundResult) or list(mine.contributors) == [attacker], mine
    refused = [r for r in caplog.records if "breaks the run's rules" in r.getMessage()]
    assert refused and all("aggregation is 'mean'" in r.getMessage() for r in refused)
    assert len(refused) == 2  # each honest member asked it once, then never again


async def test_a_coordinator_claiming_a_billion_samples_is_left_out_of_its_own_round(
    autojump_clock: object,
) -> None:
    """The coordinator caps every member's weight at what its records make plausible, except its own: a
    hostile one claims a billion samples. Every other reducer refuses its slice (far above what they find
    plausible for it), so the decision can only leave it out: the honest members commit the mean of their
    own values, identical everywhere, without waiting for the refused slices. Or, where what the
    attacker served of its own partition already held its values (beyond every honest member's bound:
    10,000 against their 1 and 2), they refuse the round and ban it at once: either way none of its
    values is applied."""
    cfg = AveragerConfig(target_size=3, min_size=2, matchmaking_time=3.0)
    async with swarm(3, cfg, net=MemoryNetwork(seed=5)) as nodes:
        attacker = nodes[0].peer_id
        for node in nodes:
            # what everyone's records make plausible
            node.averager.follow(node.averager.config, RoundPolicy(weight_cap=lambda peer: 10.0))
        out: list[RoundResult | Exception | None] = [None, None, None]

        async def one(i: int, delay: float) -> None:
            await trio.sleep(delay)
            values = [torch.full((1000,), HUGE if i == 0 else float(i))]
            try:
                out[i] = await nodes[i].average(
                    values, weight=1e9 if i == 0 else 1.0, timeout=20.0, group_key=KEY
                )
            except (GroupFormationFailed, RoundAborted) as e:
                out[i] = e

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for i, delay in enumerate((0.0, 0.4, 0.9)):  # the attacker leads (KEY)
                    nursery.start_soon(one, i, delay)
    for i, r in enumerate(out[1:], 1):
        if isinstance(r, RoundAborted):
            assert "broke the rules" in nodes[i].averager.auditor.banned.get(attacker, ""), r
            continue
        assert isinstance(r, RoundResult), r
        assert r.group_size == 3 and attacker not in r.contributors and r.total_weight == 2.0
        assert torch.equal(r.tensors[0], torch.full((1000,), 1.5))
        # a reducer that refused a slice does not wait for it: the round ends long before the scatter
        # deadline (0.4 x the 20 s timeout), on the virtual clock
        assert r.round_seconds < 2.0, r.round_seconds


async def test_a_leader_cannot_count_its_client_only_keys_as_origins_of_their_own(
    autojump_clock: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client-only member lists no address, so no member can check the origin a leader gives it. The
    attacker leads a trimmed-mean round with two more client-only keys on its own host and signs a
    manifest that counts all three as origins of their own (no origins listed). Counted that way, three
    rows of 10,000 against two honest ones are no minority to trim: on the code before, the honest
    members committed a mean of about 6,667. Each honest reducer now takes the slices of one host from
    one origin only and refuses the others, so the result lies between the honest values."""
    attacker = identity("n0").peer_id
    real_sign = SignedManifest.sign.__func__  # type: ignore[attr-defined]

    def sign(cls: type[SignedManifest], who: Identity, manifest: Manifest) -> SignedManifest:
        forged = dataclasses.replace(manifest, origins=()) if who.peer_id == attacker else manifest
        return real_sign(cls, who, forged)

    monkeypatch.setattr(SignedManifest, "sign", classmethod(sign))
    cfg = AveragerConfig(target_size=5, min_size=5, matchmaking_time=3.0, aggregation="trimmed_mean")
    net = MemoryNetwork(seed=5)
    hosts = ["n0", "n0", "n0", "n3", "n4"]  # the attacker's host runs its two fresh keys too
    out: list[RoundResult | Exception | None] = [None] * 5
    async with trio.open_nursery() as nursery:
        nodes: list[Node] = []
        for i, host in enumerate(hosts):
            config = NodeConfig(
                run_id="mm",
                listen=((host, PORT),) if i in (0, 3, 4) else (),
                join=(nodes[0].addresses[0],) if nodes else (),
                averaging=cfg,
            )
            node = Node(identity(f"n{i}"), config, transport=net.transport(host), clock=trio.current_time)
            nodes.append(await nursery.start(node.run))

        async def one(i: int, delay: float) -> None:
            await trio.sleep(delay)
            values = [torch.full((1000,), HUGE if i < 3 else float(i))]
            try:
                out[i] = await nodes[i].average(values, weight=1.0, timeout=20.0, group_key=KEY)
            except (GroupFormationFailed, RoundAborted) as e:
                out[i] = e

        with trio.fail_after(120):
            for node in nodes:
                await node.dht.bootstrapped.wait()
            async with trio.open_nursery() as round_nursery:
                for i, delay in enumerate((0.0, 0.2, 0.2, 0.4, 0.6)):  # the attacker leads (KEY)
                    round_nursery.start_soon(one, i, delay)
        nursery.cancel_scope.cancel()
    for i in (3, 4):
        r = out[i]
        assert isinstance(r, RoundResult), r
        assert r.group_size == 5
        assert 3.0 <= r.tensors[0].min().item() <= r.tensors[0].max().item() <= 4.0, r.tensors[0][:4]
