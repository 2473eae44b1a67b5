"""Matchmaking through the DHT, end to end: Nodes over the in-memory network on the virtual clock.

What is proved here: peers that call ``average`` at different moments end up in one group led by the
earliest, with exact results; more peers than the target size split into several complete groups and
nobody waits forever (the deadlock-free order); a client-only peer joins and contributes; peers with other
tensors get SchemaMismatch; too few peers get GroupTooSmall; every outcome is typed; and members
measure the bandwidth they announce, so a member on slow links reduces a smaller share.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
import trio

from p2ptrain import GroupTooSmall, Node, SchemaMismatch
from p2ptrain.averaging import AveragerConfig, RoundResult
from p2ptrain.averaging.grouping import GroupForming
from p2ptrain.averaging.matchmaking import Announcement, Quorum, ticket
from p2ptrain.averaging.protocol import SignedManifest
from p2ptrain.dht.records import RecordRefused, owned_subkey
from p2ptrain.errors import GroupFormationFailed, RoundAborted
from p2ptrain.identity import PeerID
from p2ptrain.net import LinkProfile, MemoryNetwork
from tests.harness.nodes import swarm


def tensors_of(i: int) -> list[torch.Tensor]:
    return [torch.full((1000,), float(i)), torch.arange(7, dtype=torch.float32) * (i + 1)]


async def average_all(nodes: list[Node], delays: list[float], **kw) -> list[RoundResult | Exception]:
    out: list[RoundResult | Exception] = [RuntimeError("not run")] * len(nodes)
    inputs = [tensors_of(i) for i in range(len(nodes))]

    async def one(i: int) -> None:
        await trio.sleep(delays[i])
        try:
            out[i] = await nodes[i].average(inputs[i], weight=1.0, timeout=20.0, **kw)
        except (GroupFormationFailed, SchemaMismatch) as e:
            out[i] = e

    async with trio.open_nursery() as nursery:
        for i in range(len(nodes)):
            nursery.start_soon(one, i)
    return out


async def test_staggered_peers_form_one_group_with_exact_results(autojump_clock):
    async with swarm(4, AveragerConfig(target_size=4, min_size=2, matchmaking_time=3.0)) as nodes:
        with trio.fail_after(60):
            results = await average_all(nodes, [0.0, 0.4, 0.9, 1.5])
    for i, r in enumerate(results):
        assert isinstance(r, RoundResult), f"node {i}: {r!r}"
        assert r.group_size == 4 and len(r.contributors) == 4
        assert torch.equal(r.tensors[0], torch.full((1000,), 1.5))
        assert torch.allclose(r.tensors[1], torch.arange(7, dtype=torch.float32) * 2.5)
    assert len({r.round for r in results}) == 1


async def announcements_held(node: Node) -> list[Announcement]:
    """The announcements ``node`` holds under the test's key, once the stores still under way landed."""
    await trio.sleep(5.0)
    held = node.dht.held(b"averaging/mm/default")
    return [Announcement.from_bytes(PeerID(sub[1:]), e.value) for sub, e in held.items()]


async def test_a_group_of_every_peer_that_announced_stores_no_closed_announcements(autojump_clock):
    """The key is the round's, and every peer seen under it is in the group: a closed announcement
    over each open one would be a store on every replica for nobody."""
    async with swarm(4, AveragerConfig(target_size=4, min_size=2, matchmaking_time=3.0)) as nodes:
        with trio.fail_after(60):
            results = await average_all(nodes, [0.0, 0.4, 0.9, 1.5])
            assert all(isinstance(r, RoundResult) and r.group_size == 4 for r in results), results
            held = await announcements_held(nodes[0])
    assert sorted(a.peer for a in held) == sorted(n.peer_id for n in nodes)
    assert all(a.deadline > 0 for a in held)  # (a closed one has none)


async def test_more_peers_than_the_target_split_into_groups_and_nobody_hangs(autojump_clock):
    async with swarm(7, AveragerConfig(target_size=3, min_size=2, matchmaking_time=2.0)) as nodes:
        with trio.fail_after(120):
            results = await average_all(nodes, [0.1 * i for i in range(7)])
            held = await announcements_held(nodes[0])
    # Peers that saw announcers their group left out closed theirs: nobody follows them any more.
    assert any(a.deadline == 0 for a in held)
    done = [r for r in results if isinstance(r, RoundResult)]
    assert len(done) >= 6, results  # at most one peer is left without a partner
    rounds: dict[bytes, list[RoundResult]] = {}
    for r in done:
        rounds.setdefault(r.round, []).append(r)
    for members in rounds.values():
        assert 2 <= len(members) <= 3
        assert all(torch.equal(m.tensors[0], members[0].tensors[0]) for m in members)
    for r in results:
        assert isinstance(r, RoundResult | GroupFormationFailed)


async def test_client_only_peer_joins_contributes_and_reduces_nothing(autojump_clock):
    cfg = AveragerConfig(target_size=3, min_size=3, matchmaking_time=2.0)
    async with swarm(3, cfg, client_only=(2,)) as nodes:
        assert nodes[2].dht.client_only
        with trio.fail_after(60):
            results = await average_all(nodes, [0.0, 0.2, 0.3])
    for r in results:
        assert isinstance(r, RoundResult), r
        assert torch.equal(r.tensors[0], torch.full((1000,), 1.0))


async def test_too_few_peers_is_a_typed_outcome_and_tensors_are_kept(autojump_clock):
    async with swarm(2, AveragerConfig(target_size=4, min_size=3, matchmaking_time=2.0)) as nodes:
        with trio.fail_after(60):
            results = await average_all(nodes, [0.0, 0.1])
    assert all(isinstance(r, GroupTooSmall | GroupFormationFailed) for r in results), results
    assert any(isinstance(r, GroupTooSmall) for r in results)


async def test_other_tensors_get_schema_mismatch(autojump_clock):
    async with swarm(2, AveragerConfig(target_size=2, min_size=2, matchmaking_time=2.0)) as nodes:
        out: list[object] = [None, None]

        async def one(i: int, tensors: list[torch.Tensor]) -> None:
            await trio.sleep(0.1 * i)
            try:
                out[i] = await nodes[i].average(tensors, timeout=10.0, compression="fp16" if i else "none")
            except GroupFormationFailed as e:
                out[i] = e

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, 0, [torch.zeros(5)])
                nursery.start_soon(one, 1, [torch.zeros(5)])
    assert isinstance(out[1], SchemaMismatch), out
    assert isinstance(out[0], GroupTooSmall | GroupFormationFailed), out


async def test_bad_arguments_are_refused_before_any_network_traffic(autojump_clock):
    async with swarm(1, AveragerConfig(target_size=2, min_size=2)) as nodes:
        with pytest.raises(ValueError, match="weight"):
            await nodes[0].average([torch.zeros(3)], weight=float("nan"))
        with pytest.raises(ValueError, match="NaN"):
            await nodes[0].average([torch.tensor([1.0, float("inf")])])
        with pytest.raises(TypeError, match="dtype"):
            await nodes[0].average([torch.zeros(3, dtype=torch.int64)])
        with pytest.raises(ValueError, match="compression"):
            await nodes[0].average([torch.zeros(3)], compression="zip")


async def test_rounds_reuse_their_buffers(autojump_clock):
    def kept(node: Node) -> set[int]:
        return {t.data_ptr() for t in node.averager.pool.idle}

    async with swarm(3, AveragerConfig(target_size=3, min_size=3, matchmaking_time=2.0)) as nodes:
        with trio.fail_after(120):
            first = await average_all(nodes, [0.0, 0.0, 0.0])
            for node in nodes:
                await node.averager.wait_idle()
            after_first = [kept(node) for node in nodes]
            second = await average_all(nodes, [0.0, 0.0, 0.0])  # at once: the announcements must not clash
            for node in nodes:
                await node.averager.wait_idle()
            after_second = [kept(node) for node in nodes]
    for a, b in zip(first, second, strict=True):
        assert isinstance(a, RoundResult) and isinstance(b, RoundResult), (a, b)
        assert all(torch.equal(x, y) for x, y in zip(a.tensors, b.tensors, strict=True))
    # every member got its flat copy and accumulator back, and the second round used those very buffers
    assert all(len(k) == 2 for k in after_first), after_first
    assert after_second == after_first


async def test_a_tensor_sent_in_place_takes_one_buffer_reused_every_round(autojump_clock):
    """One float32 tensor is sent from where it lies, and a member reduces its own partition right
    where the mean goes: a round takes one buffer from the pool, and the next round that same one."""
    inputs = [torch.arange(10_001, dtype=torch.float32) * (i + 1) for i in range(3)]
    expected = sum(inputs) / 3

    async def average(nodes: list[Node]) -> list[torch.Tensor]:
        mine = [t.clone() for t in inputs]
        async with trio.open_nursery() as nursery:
            for node, t in zip(nodes, mine, strict=True):
                nursery.start_soon(functools.partial(node.average, [t], weight=1.0, timeout=20.0))
        for node in nodes:
            await node.averager.wait_idle()
        return mine

    async with swarm(3, AveragerConfig(target_size=3, min_size=3, matchmaking_time=2.0)) as nodes:
        with trio.fail_after(120):
            first = await average(nodes)
            after_first = [[t.data_ptr() for t in node.averager.pool.idle] for node in nodes]
            second = await average(nodes)
            after_second = [[t.data_ptr() for t in node.averager.pool.idle] for node in nodes]
    for got in first + second:
        assert torch.allclose(got, expected, rtol=0, atol=1e-3)
    assert all(torch.equal(got, first[0]) for got in first + second)
    assert all(len(k) == 1 for k in after_first), after_first
    assert after_second == after_first


async def test_a_leader_whose_group_came_out_short_steps_aside_for_the_next_look(autojump_clock, monkeypatch):
    """The invariant: a peer that led a group which came out too small does not lead its next look under
    the same key (its announcement says it only follows; it may lead again after that). Its ticket is
    the key's, so without that it was drawn again for every retry of a step, failed again, and its
    followers' suspicions made exclusions that split the step's peers between leaders (at 32 simulated
    peers: one step's group never formed in 170 s, 230 exclusions). Here the smallest ticket's first
    group lacks a peer; at the next look the next ticket leads, and the group forms with all three."""
    led: list[tuple[PeerID, bool]] = []  # (leader, whether its group formed), as each gathering ended
    lead = GroupForming._lead

    async def recording(self: GroupForming, *args: object, **kw: object) -> SignedManifest | None:
        signed = await lead(self, *args, **kw)  # type: ignore[arg-type]
        looking = self._looking
        if signed is not None or (looking is not None and looking.gathering is not None):
            led.append((self.host.identity.peer_id, signed is not None))
        return signed

    monkeypatch.setattr(GroupForming, "_lead", recording)
    async with swarm(3, AveragerConfig(target_size=3, min_size=3, matchmaking_time=2.0)) as nodes:
        order = sorted(nodes, key=lambda n: ticket("k", n.peer_id))
        with trio.fail_after(120):
            first = await average_all(order[:2], [0.0, 0.0], group_key="k")  # the third is away
            assert isinstance(first[0], GroupTooSmall), first
            assert led == [(order[0].peer_id, False)], led
            second = await average_all(order, [0.0, 0.0, 0.0], group_key="k")
    assert all(isinstance(r, RoundResult) and r.group_size == 3 for r in second), second
    assert led[1:] == [(order[1].peer_id, True)], led


@pytest.mark.parametrize("who", ["a member", "the coordinator"])
async def test_a_member_that_declines_its_group_is_left_out_at_once(autojump_clock, who):
    """A member whose state moved on after its group formed declines the round: the others learn it
    from their first call to it, instead of waiting for its slices until the scatter deadline. Without
    a member, they finish without it; without the coordinator, they get its signed abort."""
    async with swarm(3, AveragerConfig(target_size=3, min_size=3, matchmaking_time=2.0)) as nodes:
        inputs = [tensors_of(i) for i in range(3)]
        signed: list[SignedManifest] = []
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for i in range(3):

                    async def form(i: int = i) -> None:
                        signed.append(await nodes[i].averager.form_group(inputs[i], timeout=20.0))

                    nursery.start_soon(form)
        assert len({s.digest for s in signed}) == 1
        order = signed[0].manifest.peers()
        gone = order[0] if who == "the coordinator" else order[1]
        stay = [i for i, n in enumerate(nodes) if n.peer_id != gone]
        quitter = next(n for n in nodes if n.peer_id == gone)
        quitter.averager.decline(signed[0])
        results: dict[int, RoundResult | RoundAborted] = {}
        began = trio.current_time()

        async def run(i: int) -> None:
            try:
                results[i] = await nodes[i].averager.run_round(signed[0], inputs[i])
            except RoundAborted as e:
                results[i] = e

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for i in stay:
                    nursery.start_soon(run, i)
        took = trio.current_time() - began
    round_wait = 10.0  # what a member that never heard of the round would make the others wait
    assert took < round_wait / 4, took
    for i in stay:
        r = results[i]
        if who == "the coordinator":
            assert isinstance(r, RoundAborted) and "coordinator left" in str(r), r
            assert torch.equal(inputs[i][0], torch.full((1000,), float(i)))  # its tensors untouched
        else:
            assert isinstance(r, RoundResult) and len(r.contributors) == 2 and gone in r.excluded, r
            mean = sum(float(j) for j in stay) / 2  # the mean of the two that stayed
            assert torch.equal(r.tensors[0], torch.full((1000,), mean))


async def test_members_measure_their_bandwidth_and_a_slow_one_reduces_less(autojump_clock):
    """n3's links run at a quarter of the others' rate. Nobody has a configured bandwidth: the first
    round splits the vector evenly (nothing measured yet); from then on every member announces what its
    rounds measured, and the leader splits the next round's vector in proportion: n3 reduces less."""
    fast, slow = 10e6, 2.5e6
    net = MemoryNetwork(seed=4)
    for i in range(3):
        net.set_link(f"n{i}", "n3", LinkProfile(bandwidth=slow))
        for j in range(i + 1, 3):
            net.set_link(f"n{i}", f"n{j}", LinkProfile(bandwidth=fast))
    numel = 1 << 22  # 4 MB slices: 4 records per flow (the in-memory links deliver whole records)
    announced: list[list[float]] = []
    shares: list[list[float]] = []
    async with swarm(4, AveragerConfig(target_size=4, min_size=4, matchmaking_time=2.0), net=net) as nodes:
        for r in range(2):
            announced.append([node.averager.bandwidth for node in nodes])
            results: list[RoundResult] = [None] * 4  # type: ignore[list-item]
            inputs = [[torch.full((numel,), float(i + r))] for i in range(4)]

            async def one(i: int) -> None:
                results[i] = await nodes[i].average(inputs[i], weight=1.0, timeout=60.0)  # noqa: B023

            with trio.fail_after(120):
                async with trio.open_nursery() as nursery:
                    for i in range(4):
                        nursery.start_soon(one, i)
            assert all(torch.equal(res.tensors[0], torch.full((numel,), 1.5 + r)) for res in results)
            shares.append([res.reduced / numel for res in results])
        status = nodes[3].status()  # what a person sees: the announced value, and each direction
    assert status["bandwidth"] == min(status["measured"].values()) > 0
    assert announced[0] == [0.0] * 4  # nothing measured yet
    assert max(shares[0]) - min(shares[0]) < 1e-5  # so even shares
    bws = announced[1]
    assert all(0 < bw <= 3 * fast for bw in bws)  # no member moves more than its links carry
    assert bws[3] <= 3 * slow and bws[3] < 0.6 * min(bws[:3])
    for share, bw in zip(shares[1], bws, strict=True):
        assert share == pytest.approx(bw / sum(bws), abs=1e-5)


async def test_a_member_never_averages_with_a_peer_it_banned(autojump_clock):
    """n1 banned n3 (its audit convicted it) but the leader n0 has not heard yet and admits n3: n1
    declines that group rather than put its slices into a round with n3, and the others learn it at
    once and finish without n1."""
    async with swarm(4, AveragerConfig(target_size=4, min_size=2, matchmaking_time=3.0)) as nodes:
        liar = nodes[3].peer_id
        nodes[1].averager.auditor.ban(liar, "reducer of partition 0 in round 00: a test verdict")
        with trio.fail_after(60):
            results = await average_all(nodes, [0.0, 0.4, 0.9, 1.5])
    r1 = results[1]
    assert not (isinstance(r1, RoundResult) and liar in r1.contributors), r1
    others = [r for i, r in enumerate(results) if i != 1]
    assert all(isinstance(r, RoundResult) for r in others), others
    for r in others:
        assert isinstance(r, RoundResult)
        assert nodes[1].peer_id not in r.contributors and len(r.contributors) == 3, r
        mean = (0.0 + 2.0 + 3.0) / 3  # the mean of the three that averaged
        assert torch.allclose(r.tensors[0], torch.full((1000,), mean))


async def test_nobody_announces_readiness_in_another_peers_name(autojump_clock):
    """A matchmaking announcement names its peer by its subkey. That subkey was the peer's bare digest,
    which anyone may write under (signed by anyone): a stranger's announcement with a later expiry
    replaced the victim's on the replicas, and every peer read the victim at the stranger's address.
    Now it is the victim's owned subkey (only its signature writes there), and entries under a bare
    digest are ignored."""
    async with swarm(4, AveragerConfig()) as nodes:
        reader, victim, stranger = nodes[0], nodes[1], nodes[2]
        spread = reader.averager.groups.keys("named")
        key = spread.key_of(victim.peer_id)
        now = trio.current_time()
        mine = Announcement(victim.peer_id, victim.averager.address(), now + 5.0, 1.0, b"s" * 16)
        await victim.averager.groups.announce(key, mine, now + 30.0)
        forged = Announcement(victim.peer_id, stranger.averager.address(), now + 1.0, 1e9, b"s" * 16)
        for subkey in (victim.peer_id.digest, owned_subkey(victim.peer_id)):
            try:
                await stranger.dht.store(key, forged.to_bytes(), ttl=60.0, subkey=subkey, sign=True)
            except RecordRefused:
                pass  # (its own node refuses to sign an entry under another's owned subkey)
        seen = [a for a in await reader.averager.groups.announcements(spread) if a.peer == victim.peer_id]
        assert seen == [mine]


@pytest.mark.parametrize("late", [0.6, 1.2, 1.8, 2.3])
async def test_a_leader_filled_by_a_stranger_follows_a_smaller_leader_that_can_form(autojump_clock, late):
    """Two peers that must average together (each one's quorum: both of them) and a stranger neither
    counts. The one later in the lottery's order starts leading first, and the stranger fills its group
    (its target: 2) without meeting its quorum; the smaller one starts ``late`` seconds into that window
    and leads. The invariant: a leader whose group cannot form yet (short of its quorum) follows a
    smaller leader it sees, as any leader not yet ready does; on the code before, a full group never
    did, so both led alone to their deadlines and no group formed (in a 3-peer DiLoCo swarm, where the
    joiner is the stranger, a step took a whole window each time, about 1 run in 3)."""
    key = f"filled-{late}"
    async with swarm(3, AveragerConfig(target_size=3, min_size=2, matchmaking_time=3.0)) as nodes:
        small, large = sorted(nodes[:2], key=lambda n: ticket(key, n.peer_id))
        stranger = nodes[2]
        both = Quorum(frozenset({small.peer_id, large.peer_id}), 2)
        got: dict[str, SignedManifest | Exception] = {}

        async def form(name: str, node: Node, delay: float, **kw) -> None:
            await trio.sleep(delay)
            try:
                got[name] = await node.averager.form_group(tensors_of(0), timeout=20.0, group_key=key, **kw)
            except GroupFormationFailed as e:
                got[name] = e

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(form, "large", large, 0.0, target_size=2, quorum=both))
                nursery.start_soon(functools.partial(form, "stranger", stranger, 0.1, lead=False))
                nursery.start_soon(functools.partial(form, "small", small, late, target_size=3, quorum=both))
    formed = {k: v for k, v in got.items() if isinstance(v, SignedManifest)}
    assert {"small", "large"} <= formed.keys(), got
    assert formed["small"].digest == formed["large"].digest
    assert formed["small"].manifest.peers()[0] == small.peer_id  # led by the smaller ticket


async def test_a_peer_whose_window_ended_while_it_followed_never_leads_a_group(autojump_clock, monkeypatch):
    """A leader holds its followers to its deadline and then refuses them (its group too small): their
    own windows may have ended meanwhile. The invariant: a peer leads a group only within its own
    window. On the code before, a follower refused past its deadline led a group at once, which closed
    with nobody ("only 1 of at least 17 peers joined in time"), while the leaders that announced since
    lay past its deadline, too far to follow: at 32 simulated peers the step's peers split into dozens
    of such groups and the swarm took one step in 50 s. Now it looks again anew (the caller's retry)."""
    led: list[tuple[float, float]] = []  # (when a peer began leading, its deadline)
    lead = GroupForming._lead

    async def leading(self, looking, *args, **kw):  # type: ignore[no-untyped-def]
        led.append((self.clock(), looking.me.deadline))
        return await lead(self, looking, *args, **kw)

    monkeypatch.setattr(GroupForming, "_lead", leading)
    key = "window"
    cfg = AveragerConfig(target_size=4, min_size=4, matchmaking_time=3.0)
    async with swarm(3, cfg) as nodes:
        ordered = sorted(nodes, key=lambda n: ticket(key, n.peer_id))
        got: list[object] = []

        async def form(node: Node, delay: float) -> None:
            await trio.sleep(delay)
            try:
                got.append(await node.averager.form_group(tensors_of(0), timeout=20.0, group_key=key))
            except GroupFormationFailed as e:
                got.append(e)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                # the smallest last: the others follow it from its start on, and it refuses them at
                # its deadline, a second past theirs
                for node, delay in zip(ordered, (1.0, 0.0, 0.1), strict=True):
                    nursery.start_soon(form, node, delay)
    assert all(isinstance(g, GroupFormationFailed) for g in got), got  # (4 needed, 3 there)
    assert led and all(at < deadline for at, deadline in led), led


@pytest.mark.parametrize("seed", range(6))
async def test_a_peer_that_finds_a_gathering_leader_in_its_window_joins_it_however_slow_its_own_store(
    autojump_clock, monkeypatch, seed
):
    """The invariant: a peer that starts looking while a leader it may follow gathers, with the time to
    read the announcements and ask for a place left in that leader's window, is in that leader's group,
    however long its own announcement takes to reach the key's replicas. A store reaches every replica
    of a key that is new each step (a lookup, then the farthest replica's round trip): 1.2 s at the
    median and 1.8 s at p90 at 32 simulated peers, out of a 3-second window. On the code before, a peer
    that could lead awaited its own store before it read the others': the peers that started in the
    second half of the first leader's window reached it after it had formed, and at 32 simulated peers
    each step's group formed at its deadline without the last fifth of the peers (89% of the live peers
    in each committed round over four seeds; 97.7% after). Here every store takes ``slow`` seconds more
    (its replicas far away), the smallest ticket starts first, and the others start at random moments
    once its announcement is in, with at least half a second of its window left."""
    rng = random.Random(seed)
    n, window, slow = rng.randint(3, 6), 3.0, rng.uniform(1.0, 1.6)
    announce = GroupForming.announce

    async def far_replicas(self: GroupForming, *args: object, **kw: object) -> None:
        await trio.sleep(slow)
        await announce(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(GroupForming, "announce", far_replicas)
    key = f"slow-{seed}"
    async with swarm(n, AveragerConfig(target_size=n, min_size=2, matchmaking_time=window)) as nodes:
        ordered = sorted(nodes, key=lambda node: ticket(key, node.peer_id))
        delays = [0.0] + [rng.uniform(slow + 0.05, window - 0.5) for _ in ordered[1:]]
        with trio.fail_after(60):
            results = await average_all(ordered, delays, group_key=key)
    assert all(isinstance(r, RoundResult) for r in results), (delays, slow, results)
    assert {r.round for r in results if isinstance(r, RoundResult)} == {results[0].round}  # type: ignore[union-attr]
    assert all(r.group_size == n for r in results if isinstance(r, RoundResult)), results
