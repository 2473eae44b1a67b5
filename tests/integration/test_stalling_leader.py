"""Leaders that cannot stall (issue 48, "one fresh key, no compute, as a leader"). Whole Nodes over the
in-memory network on the virtual clock, each on a subnet of its own (hosts named by address, so that
``subnet_of`` sees /24s); attackers on subnets of their own, with keys ground so that they win the
leader lottery of the rounds they attack (as a key generator would).

What is proved here: a leader that holds its joiners (admits all, or admits one and tells the rest the
group is full, or holds them to its deadline and then says the group was too small) stalls each honest
peer at most once per attacker subnet, however many fresh keys it brings; each stall ends within the
follower's own window + slack + grace; a deadline declared far ahead is not followed at all; and in
every round, every honest peer that the attacker's subnet failed before averages with the others,
its group formed within its matchmaking window. On the code before (leaders by earliest declared
deadline, no memory of failures), every round was lost to the attacker.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
import torch
import trio

from p2ptrain import Node, NodeConfig
from p2ptrain.averaging import AveragerConfig, RoundResult
from p2ptrain.averaging.averager import schema_digest, schema_of
from p2ptrain.averaging.grouping import JOIN_GRACE
from p2ptrain.averaging.leaders import SUSPICIONS
from p2ptrain.averaging.matchmaking import DEADLINE_SLACK, Announcement, Quorum, ticket
from p2ptrain.averaging.protocol import JOIN, JoinReq, JoinResp
from p2ptrain.errors import GroupFormationFailed, RoundAborted
from p2ptrain.identity import PeerID
from p2ptrain.net import MemoryNetwork
from p2ptrain.net.rpc import CallContext, Reply
from tests.harness.identities import identity

PORT = 3000
HONEST = 4
WINDOW = 3.0
TIMEOUT = 20.0
CFG = AveragerConfig(target_size=HONEST, min_size=2, matchmaking_time=WINDOW)
STALL = WINDOW + DEADLINE_SLACK + JOIN_GRACE + 1.0  # the longest one leader may hold a follower
MODES = ("silent", "admit-one", "too-small", "far", "ask-again")


def values(i: int) -> list[torch.Tensor]:
    return [torch.full((64,), float(i))]


DIGEST = schema_digest(schema_of(values(0)), CFG.compression, CFG.aggregation, CFG.audit)


@dataclass
class Attacker:
    """A hostile node: it announces itself under a round's key with the deadline it likes and answers
    every request for a place its own way (``mode``); it never signs a manifest."""

    node: Node
    subnet: str
    mode: str = "silent"
    deadline: float = 0.0
    victims: dict[str, PeerID] = field(default_factory=dict)
    asked: list[PeerID] = field(default_factory=list)

    async def on_join(self, ctx: CallContext, req: JoinReq) -> Reply[JoinResp]:
        self.asked.append(ctx.peer)
        if self.mode == "admit-one" and self.victims.setdefault(req.group_key, ctx.peer) != ctx.peer:
            return Reply(JoinResp(False, "the group is full"))
        if self.mode == "ask-again":  # "between states", forever: passed over after RETRY_FOR
            return Reply(JoinResp(False, "not gathering a group yet", retry=True))
        if self.mode == "too-small":  # held to its deadline, then what an honest leader says then
            await trio.sleep_until(self.deadline)
            return Reply(JoinResp(False, "only 1 of at least 2 peers joined in time"))
        await trio.sleep_forever()
        raise AssertionError  # (unreachable)

    async def announce(self, group_key: str, mode: str, deadline: float, addr: str = "") -> None:
        self.mode, self.deadline = mode, deadline
        groups = self.node.averager.groups
        me = Announcement(self.node.peer_id, addr or groups.address(reducer=True), deadline, 1e9, DIGEST)
        await groups.announce(
            groups.keys(group_key).key_of(me.peer), me, min(deadline, trio.current_time() + 60) + 5
        )


@asynccontextmanager
async def honest_swarm(
    net: MemoryNetwork, cfg: AveragerConfig = CFG
) -> AsyncIterator[tuple[list[Node], trio.Nursery]]:
    nodes: list[Node] = []
    async with trio.open_nursery() as nursery:
        for i in range(HONEST):
            nodes.append(await start(nursery, net, f"h{i}", f"198.18.{i + 1}.1", nodes, cfg))
        yield nodes, nursery
        nursery.cancel_scope.cancel()


async def start(
    nursery: trio.Nursery,
    net: MemoryNetwork,
    name: str,
    host: str,
    nodes: list[Node],
    cfg: AveragerConfig = CFG,
) -> Node:
    config = NodeConfig(
        run_id="mm",
        listen=((host, PORT),),
        join=(nodes[0].addresses[0],) if nodes else (),
        averaging=cfg,
    )
    node = Node(identity(name), config, transport=net.transport(host), clock=trio.current_time)
    node = await nursery.start(node.run)
    await node.dht.bootstrapped.wait()
    return node


def winning_name(prefix: str, key: str, honest: list[Node]) -> str:
    """A key whose lottery ticket under ``key`` beats every honest peer's (ground, as an attacker would)."""
    best = min(ticket(key, n.peer_id) for n in honest)
    return next(
        f"{prefix}-{j}" for j in range(10_000) if ticket(key, identity(f"{prefix}-{j}").peer_id) < best
    )


async def attacker(
    nursery: trio.Nursery, net: MemoryNetwork, honest: list[Node], name: str, host: str
) -> Attacker:
    node = await start(nursery, net, name, host, honest)
    a = Attacker(node, ".".join(host.split(".")[:3]) + ".0/24")
    node.host.registry.replace(JOIN, a.on_join)
    return a


@dataclass
class Outcome:
    result: RoundResult | Exception
    took: float


async def average_round(nodes: list[Node], key: str) -> list[Outcome]:
    out: list[Outcome] = [Outcome(RuntimeError("not run"), 0.0)] * len(nodes)

    async def one(i: int) -> None:
        await trio.sleep(0.1 * i)
        began = trio.current_time()
        try:
            r: RoundResult | Exception = await nodes[i].average(values(i), timeout=TIMEOUT, group_key=key)
        except (GroupFormationFailed, RoundAborted) as e:
            r = e
        out[i] = Outcome(r, trio.current_time() - began)

    with trio.fail_after(4 * TIMEOUT):
        async with trio.open_nursery() as nursery:
            for i in range(len(nodes)):
                nursery.start_soon(one, i)
    return out


def check_results(outcomes: list[Outcome], honest: list[Node]) -> None:
    """Every result averages honest peers only, exactly; every call ends within a stall + a round."""
    ids = [n.peer_id for n in honest]
    for o in outcomes:
        assert o.took <= STALL + TIMEOUT, o
        if isinstance(o.result, RoundResult):
            members = [ids.index(p) for p in o.result.contributors]
            assert set(o.result.contributors) <= set(ids) and len(members) >= 2, o.result.contributors
            assert torch.equal(o.result.tensors[0], torch.full((64,), sum(members) / len(members)))


async def test_a_silent_leader_stalls_each_peer_once_then_is_not_followed(autojump_clock: object) -> None:
    """Attack 1: one key, no compute, wins the lottery of the first round, announces under every round's
    key, admits every joiner and holds the call. In the first round every honest peer follows it and
    loses the round (within its window + slack + grace); from then on nobody follows it, and every
    round averages all honest peers within the matchmaking window. On the code before, the attacker
    announced the earliest deadline and led every round: no honest peer ever averaged (0 steps)."""
    net = MemoryNetwork(seed=7)
    async with honest_swarm(net) as (honest, nursery):
        a = await attacker(nursery, net, honest, winning_name("silent", "r0", honest), "198.18.9.1")
        for r in range(4):
            key = f"r{r}"
            await a.announce(key, "silent", trio.current_time() + 0.5)  # the earliest deadline
            outcomes = await average_round(honest, key)
            check_results(outcomes, honest)
            if r == 0:
                assert all(not isinstance(o.result, RoundResult) for o in outcomes), outcomes
                continue
            for o in outcomes:
                assert isinstance(o.result, RoundResult), o
                assert o.result.group_size == HONEST
                assert o.result.matchmaking_seconds <= WINDOW, o
        assert len(a.asked) == HONEST  # each asked it once, in the first round
        for n in honest:
            assert n.averager.groups.leaders.excluded(a.node.peer_id, a.subnet, trio.current_time())


async def test_a_leader_that_admits_one_and_says_full_holds_each_victim_once(autojump_clock: object) -> None:
    """Attack 2: the attacker, with a fresh key from one subnet every round (each wins the round's
    lottery), admits the first asker and tells the others the group is full. Each victim loses that one
    round; the others average without it, within their window, every round; no honest peer is held
    twice (the subnet is blamed, not only the key), so after at most one round per honest peer
    everyone averages together. On the code before, the attacker led every round (the earliest
    deadline) and held one victim in every round, to the last."""
    net = MemoryNetwork(seed=8)
    held: dict[PeerID, int] = {}
    async with honest_swarm(net) as (honest, nursery):
        for r in range(HONEST + 2):
            key = f"r{r}"
            a = await attacker(
                nursery, net, honest, winning_name(f"full{r}", key, honest), f"198.18.9.{r + 1}"
            )
            await a.announce(key, "admit-one", trio.current_time() + 0.5)
            outcomes = await average_round(honest, key)
            check_results(outcomes, honest)
            victims = set(a.victims.values())
            assert len(victims) <= 1
            for n, o in zip(honest, outcomes, strict=True):
                if n.peer_id in victims:
                    held[n.peer_id] = held.get(n.peer_id, 0) + 1
                    assert not isinstance(o.result, RoundResult), o
                else:  # told "full" at once: it averages with the others, within its window
                    assert isinstance(o.result, RoundResult), o
                    assert o.result.matchmaking_seconds <= WINDOW + 0.5, o
            if r >= HONEST:
                assert not victims and not a.asked  # every honest peer passes its subnet over
    assert all(count == 1 for count in held.values()), held


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_mixed_stalling_leaders_stall_each_peer_a_bounded_number_of_times_per_subnet(
    autojump_clock: object, seed: int
) -> None:
    """Seeded adversaries on two subnets mix the attacks round by round: a silent leader, one that
    admits one and says "full", one that holds its joiners to its deadline and then says the group was
    too small, one that declares a deadline far ahead, and one that answers "ask again" forever (it
    costs ``RETRY_FOR`` a round, no stall); each round's attacker is a fresh key of its subnet that
    wins that round's lottery, with a deadline anywhere from the earliest to the latest a follower
    takes. Invariants, every round: results hold honest peers only and exact means; every call
    ends within a stall + a round; a far deadline stalls nobody; a peer held to the end of its wait by
    an attacker excludes its subnet from then on, and one told "too small" at the deadline (what an
    honest leader says too) does so at the ``SUSPICIONS``-th time; a peer not held averages within its
    matchmaking window whenever another honest peer was free to average with it."""
    rng = random.Random(seed)
    net = MemoryNetwork(seed=seed)
    failed_by: dict[PeerID, set[str]] = {}  # honest peer -> attacker subnets that surely failed it
    suspected: dict[tuple[PeerID, str], int] = {}  # (honest peer, attacker subnet) -> holds it may excuse
    async with honest_swarm(net) as (honest, nursery):
        for r in range(10):
            key = f"mixed-{r}"
            subnet = rng.choice([9, 10])
            mode = rng.choice(MODES)
            name = winning_name(f"s{seed}-{subnet}-{r}", key, honest)
            a = await attacker(nursery, net, honest, name, f"198.18.{subnet}.{r + 1}")
            now = trio.current_time()
            deadline = now + 1000 if mode == "far" else now + rng.uniform(0.2, WINDOW + DEADLINE_SLACK)
            await a.announce(key, mode, deadline)
            outcomes = await average_round(honest, key)
            check_results(outcomes, honest)
            stalled = {
                n.peer_id
                for n, o in zip(honest, outcomes, strict=True)
                if not isinstance(o.result, RoundResult) or o.result.matchmaking_seconds > WINDOW + 0.5
            }
            held = stalled & set(a.asked)
            if mode == "far":
                assert not a.asked and not stalled, (r, outcomes)
            for n in honest:
                before = failed_by.setdefault(n.peer_id, set())
                excluded = n.averager.groups.leaders.excluded(a.node.peer_id, a.subnet, trio.current_time())
                if a.subnet in before:
                    assert n.peer_id not in a.asked, (r, mode)
                if n.peer_id in held:  # never after a sure failure; a subnet is excluded from then on
                    assert a.subnet not in before, (r, mode, before)
                    if mode == "too-small":  # what an honest leader says too: a suspicion
                        count = suspected[n.peer_id, a.subnet] = suspected.get((n.peer_id, a.subnet), 0) + 1
                        assert count <= SUSPICIONS, (r, count)
                        if count == SUSPICIONS:
                            assert excluded
                            before.add(a.subnet)
                    else:  # held to the end of its wait: surely failed
                        assert excluded
                        before.add(a.subnet)
                elif n.peer_id in stalled:  # not held: only when no other honest peer was free to average
                    assert len(set(a.asked) - held) + HONEST - len(set(a.asked)) < 2, (r, mode, outcomes)


async def test_a_known_peer_that_leads_alone_does_not_hold_the_other_groups_to_their_deadline(
    autojump_clock: object,
) -> None:
    """A training run counts every known peer of the step in its groups' target, the attacker too (it
    publishes progress like the others). Once every honest peer stopped following it, the attacker
    (smallest ticket of every round) leads a group nobody joins, and no group could ever be full: each
    waited for its leader's deadline, a matchmaking window per step for as long as the attacker stays
    (half the peers told "full" in attack 2 slowed down this way). A known peer that may lead with a
    smaller ticket never joins a leader, so the leader does not wait for it: after the round in which
    everyone was held once, the honest group forms as soon as the four are in."""
    net = MemoryNetwork(seed=9)
    keys = [f"known-{r}" for r in range(3)]
    async with honest_swarm(net) as (honest, nursery):
        best = {k: min(ticket(k, n.peer_id) for n in honest) for k in keys}
        name = next(
            f"known-{j}"
            for j in range(100_000)
            if all(ticket(k, identity(f"known-{j}").peer_id) < best[k] for k in keys)
        )
        a = await attacker(nursery, net, honest, name, "198.18.9.1")
        quorum = Quorum(frozenset([*(n.peer_id for n in honest), a.node.peer_id]), 3)
        for r, key in enumerate(keys):
            await a.announce(key, "silent", trio.current_time() + WINDOW)
            took: list[float] = [0.0] * HONEST
            out: list[RoundResult | Exception] = [RuntimeError("not run")] * HONEST

            async def one(i: int) -> None:
                await trio.sleep(0.1 * i)
                began = trio.current_time()
                try:
                    signed = await honest[i].averager.form_group(
                        values(i),
                        timeout=TIMEOUT,
                        group_key=key,  # noqa: B023
                        target_size=HONEST + 1,
                        min_size=3,
                        quorum=quorum,
                    )
                    took[i] = trio.current_time() - began  # noqa: B023
                    out[i] = await honest[i].averager.run_round(signed, values(i))  # noqa: B023
                except (GroupFormationFailed, RoundAborted) as e:
                    took[i] = trio.current_time() - began  # noqa: B023
                    out[i] = e  # noqa: B023

            with trio.fail_after(4 * TIMEOUT):
                async with trio.open_nursery() as round_nursery:
                    for i in range(HONEST):
                        round_nursery.start_soon(one, i)
            if r == 0:  # everyone followed it, and was held
                assert all(not isinstance(o, RoundResult) for o in out), out
                continue
            for o in out:
                assert isinstance(o, RoundResult) and o.group_size == HONEST, o
                assert torch.equal(o.tensors[0], torch.full((64,), 1.5))
            assert max(took) < WINDOW / 2, took  # (before: each waited for its leader's deadline)


async def test_a_coordinator_that_never_starts_its_round_is_not_followed_again(
    autojump_clock: object,
) -> None:
    """A leader that delivers a valid manifest and then never runs the round it coordinates: its
    members' round aborts (its decision never came), which an honest coordinator that died does too:
    a suspicion. At the ``SUSPICIONS``-th, the members stop following it: in the next round they form
    their group without it and average."""
    net = MemoryNetwork(seed=11)
    async with honest_swarm(net) as (nodes, _):
        ids = [n.peer_id for n in nodes]

        def winner(key: str) -> int:
            return min(range(HONEST), key=lambda i: ticket(key, ids[i]))

        rounds = SUSPICIONS + 1
        j = next(j for j in range(100_000) if len({winner(f"c{j}-{r}") for r in range(rounds)}) == 1)
        keys = [f"c{j}-{r}" for r in range(rounds)]
        lead = winner(keys[0])  # it wins every lottery
        out: dict[int, list[RoundResult | Exception]] = {i: [] for i in range(HONEST)}

        async def one(i: int, key: str, first: bool) -> None:
            await trio.sleep(0.1 * i)
            try:
                signed = await nodes[i].averager.form_group(values(i), timeout=8.0, group_key=key)
                if first and i == lead:
                    return  # it never starts the rounds it coordinates
                out[i].append(await nodes[i].averager.run_round(signed, values(i)))
            except (GroupFormationFailed, RoundAborted) as e:
                out[i].append(e)

        for r, key in enumerate(keys):
            first = r < SUSPICIONS
            with trio.fail_after(4 * TIMEOUT):
                async with trio.open_nursery() as nursery:
                    for i in range(HONEST):
                        nursery.start_soon(one, i, key, first)
        others = [i for i in range(HONEST) if i != lead]
        for i in others:
            *failed, second_round = out[i]
            assert all(isinstance(f, RoundAborted) for f in failed) and len(failed) == SUSPICIONS, failed
            why = nodes[i].averager.groups.leaders.excluded(ids[lead], "", trio.current_time())
            assert "decision never came" in why, why
            assert isinstance(second_round, RoundResult) and set(second_round.contributors) == {
                ids[j] for j in others
            }, second_round
            assert torch.equal(second_round.tensors[0], torch.full((64,), sum(others) / len(others)))
