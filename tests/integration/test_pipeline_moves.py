"""Peers moving into a pipeline stage: a joiner downloads the stage's state from its peers, verified per
chunk, and trains in step with them; a peer that left its stage's lineage downloads it again.

What is proved here (Nodes over the in-memory network on the virtual clock): the downloaded weights,
AdamW moments and step equal the stage peers' bit for bit, and after the next step every peer of the
stage, the joiner included, holds the same weights; a stage peer that lies (a coherent fake state, or
corrupt chunks under an honest manifest) never gets its state applied: the manifests are compared, a
third peer settles a disagreement, and a chunk that fails its digest is fetched from another peer and
its sender dropped; of two peers of a stage whose weights differ, exactly one finds itself off the
lineage (``transfer.behind``) and repairs itself by downloading.
"""

from __future__ import annotations

import random

import pytest
import torch
import trio

from p2ptrain import Node, NodeConfig
from p2ptrain.averaging import AveragerConfig
from p2ptrain.averaging.compression import Compression
from p2ptrain.config import parse_config
from p2ptrain.net import CallContext, Reply
from p2ptrain.pipeline.catchup import behind, download_state
from p2ptrain.pipeline.peer import PipelinePeer
from p2ptrain.pipeline.settings import PipelineSection
from p2ptrain.pipeline.trainer import PipelineTrainer, assign_at_start
from p2ptrain.pipeline.transfer import (
    STATE,
    Snapshot,
    StateReq,
    StateResp,
    chunk_digests,
    state_size,
    take_snapshot,
)
from p2ptrain.tasks import load_task
from tests.harness.identities import identity
from tests.integration.test_pipeline import (
    MODEL,
    PORT,
    SEED,
    Swarm,
    one_thread,  # noqa: F401 (its autouse fixture: one torch thread here too)
    pipeline_swarm,
    run_steps,
)

PIPELINE = PipelineSection(stages=(0, 2), micro_batch=4, compression=Compression.INT8, timeout=5.0)


async def add_joiner(swarm: Swarm, name: str) -> PipelinePeer:
    """A peer that joins the running swarm: announced as joining, serving nothing yet."""
    first = swarm.peers[0].node
    config = NodeConfig(
        run_id="pipe",
        listen=((name, PORT),),
        join=(first.addresses[0],),
        averaging=AveragerConfig(target_size=8, min_size=1, matchmaking_time=2.0),
    )
    node = Node(identity(name), config, transport=swarm.net.transport(name), clock=trio.current_time)
    await swarm.nursery.start(node.run)
    await node.dht.bootstrapped.wait()
    peer = PipelinePeer(node, PIPELINE, MODEL, seed=SEED, rng=random.Random(7))
    peer.announcing = True
    await peer.refresh()
    return peer


def size_of(peer: PipelinePeer, stage: int) -> int:
    return state_size([p for p in peer.prepare(stage).parameters() if p.requires_grad])


def adam_state(peer: PipelinePeer) -> list[torch.Tensor]:
    assert peer.optimizer is not None and peer.server is not None
    return [peer.optimizer.state[p][k] for p in peer.server.params for k in ("exp_avg", "exp_avg_sq")]


async def test_a_joiner_downloads_its_stage_and_trains_in_step_with_it(autojump_clock):
    async with pipeline_swarm(PIPELINE, [0, 1, 0, 1]) as swarm:
        with trio.fail_after(600):
            await run_steps(swarm, 2, 1, 4)
            joiner = await add_joiner(swarm, "j")
            for p in swarm.peers:
                await p.refresh()
            snapshot = await download_state(joiner, 1, size_of(joiner, 1))
            assert snapshot.step == 2 and snapshot.adam_steps == 2
            await joiner.join(1, snapshot)
            mate = swarm.peers[1]
            assert joiner.step_number == mate.step_number == 2
            assert joiner.weights_digest() == mate.weights_digest()
            for a, b in zip(adam_state(joiner), adam_state(mate), strict=True):
                assert torch.equal(a, b)
            swarm.peers.append(joiner)
            swarm.scopes.append(trio.CancelScope())
            for p in swarm.peers:
                await p.refresh()
            reports = await run_steps(swarm, 1, 1, 4)
        assert all(r.average.applied for r in reports[0])
        stage1 = [p for p in swarm.peers if p.stage.index == 1]
        assert len(stage1) == 3 and len({p.weights_digest() for p in stage1}) == 1
        # every sample of the step counted once at stage 1, the joiner's included
        assert sum(r.counted for r in reports[0] if r.stage == 1) == 5 * 4
        assert joiner.downloads == 1


def corrupt(body: bytes) -> bytes:
    flipped = bytearray(body)
    flipped[len(flipped) // 2] ^= 0x40
    return bytes(flipped)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("lie", ["fake state", "corrupt chunks"])
async def test_a_lying_stage_peer_never_gets_its_state_applied(autojump_clock, lie, seed):
    async with pipeline_swarm(PIPELINE, [0, 1, 1, 1], seed=seed) as swarm:
        with trio.fail_after(600):
            await run_steps(swarm, 1, 1, 4)
            liar = swarm.peers[3]
            honest = swarm.peers[1]
            asked: list[int] = []
            real = liar.node.registry.get(STATE.name)
            assert real is not None

            async def lying(ctx: CallContext, req: StateReq) -> Reply[StateResp]:
                reply: Reply[StateResp] = await real.handler(ctx, req)
                if req.chunk >= 0:
                    asked.append(req.chunk)
                    return Reply(reply.message, corrupt(bytes(reply.body)))
                if lie == "fake state":  # a coherent fake: its manifest matches its corrupt chunks
                    snap = liar._snapshots[reply.message.step]
                    fake = corrupt(snap.body)
                    return Reply(StateResp(snap.step, snap.adam_steps, len(fake), chunk_digests(fake)))
                return reply

            liar.node.registry.replace(STATE, lying)
            joiner = await add_joiner(swarm, "j")
            joiner.rng = random.Random(seed)
            await joiner.join(0)  # (a router to record the drops in; it moves to stage 1 below)
            snapshot = await download_state(joiner, 1, size_of(joiner, 1))
        assert isinstance(snapshot, Snapshot)
        assert honest.server is not None and honest.optimizer is not None
        assert snapshot.step == honest.step_number
        assert snapshot.body == take_snapshot(snapshot.step, honest.server.params, honest.optimizer).body
        assert joiner.router is not None
        if asked:  # the liar sent a chunk: it failed its digest, and the liar was dropped
            assert liar.node.peer_id in joiner.router.stats.bans


async def test_of_two_diverged_stage_peers_exactly_one_downloads_the_others_state(autojump_clock):
    async with pipeline_swarm(PIPELINE, [0, 1, 0, 1]) as swarm:
        with trio.fail_after(600):
            await run_steps(swarm, 1, 1, 4)
            a, b = swarm.peers[1], swarm.peers[3]
            with torch.no_grad():  # b leaves the lineage (as if its average had failed alone)
                for p in b.stage.parameters():
                    p.add_(0.01)
            b._digest = b""
            for _ in range(2):
                for p in swarm.peers:
                    await p.refresh()
            verdicts = {a: behind(a), b: behind(b)}
            assert sorted(verdicts.values()) == [False, True]
            loser = a if verdicts[a] else b
            winner = b if loser is a else a
            snapshot = await download_state(loser, 1, state_size(loser.server.params))  # type: ignore[union-attr]
            await loser.join(1, snapshot)
            assert loser.weights_digest() == winner.weights_digest()
            for p in swarm.peers:
                await p.refresh()
            assert not behind(a) and not behind(b)
            reports = await run_steps(swarm, 1, 1, 4)
        assert all(r.average.applied for r in reports[0])
        assert a.weights_digest() == b.weights_digest()


async def test_a_stage_mate_on_a_later_step_means_this_peer_is_behind(autojump_clock):
    async with pipeline_swarm(PIPELINE, [0, 1, 0, 1]) as swarm:
        with trio.fail_after(120):
            a = swarm.peers[1]
            assert not behind(a)
            swarm.peers[3].step_number = 5  # (what its record says, once published)
            for _ in range(2):
                for p in swarm.peers:
                    await p.refresh()
            assert behind(a) and not behind(swarm.peers[3])


def test_a_swarm_that_starts_together_fills_every_stage_the_same_way_everywhere() -> None:
    rng = random.Random(3)
    for _ in range(200):
        n, stages = rng.randint(1, 20), rng.randint(2, 6)
        ids = [rng.randbytes(32) for _ in range(n)]
        chosen = [assign_at_start(rng.sample(ids, n), me, stages) for me in ids]  # each its own order
        counts = [chosen.count(s) for s in range(stages)]
        assert max(counts) - min(counts) <= 1  # balanced; every stage served once n >= stages
        if n >= stages:
            assert min(counts) >= 1


async def test_a_peer_behind_the_swarms_step_catches_up_and_one_claim_drags_nobody(autojump_clock):
    """The swarm's step is the median of its serving peers': a lone stage peer left behind jumps to it
    (its old step's calls would be refused everywhere); one peer claiming a far later step moves no one."""
    pipeline = PipelineSection(stages=(0, 1, 3), micro_batch=4, compression=Compression.INT8, timeout=5.0)
    config = parse_config(
        {
            "task": {
                "name": "tiny-gpt",
                "options": {"n_layer": 4, "n_head": 2, "n_embd": 32, "block_size": 16},
            },
            "pipeline": {"stages": [0, 1, 3], "micro_batch": 4},
        }
    )
    task = load_task(
        "tiny-gpt", {"n_layer": 4, "n_head": 2, "n_embd": 32, "block_size": 16, "max_bytes": 50_000}
    )
    async with pipeline_swarm(pipeline, [0, 1, 2, 0, 1]) as swarm:
        with trio.fail_after(300):
            await run_steps(swarm, 1, 1, 4)
            lone = swarm.peers[2]  # stage 2's only peer
            trainers = []
            for p in swarm.peers:
                t = PipelineTrainer(p.node, config, task)
                t.peer = p  # (the swarm's peer: the trainer's step rules on it)
                trainers.append(t)
            assert lone.server is not None
            lone.step_number = 0  # left behind a step
            lone.server.close_step()
            lone.server.open_step(0)
            swarm.peers[0].step_number = 100  # a claim far ahead
            for _ in range(2):
                for p in swarm.peers:
                    await p.refresh()
            for t in trainers:
                t.catch_up()
        assert lone.step_number == 1 and lone.server.step == 1
        assert [p.step_number for p in swarm.peers] == [100, 1, 1, 1, 1]
