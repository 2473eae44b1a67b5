"""Churn in a pipeline: what a stage peer's death and restart cost the swarm, in time.

What is proved here (Nodes over the in-memory network on the virtual clock): no step waits for a peer
that is already known gone or known done. After a stage peer is killed, the survivors' next steps take
no longer than a step before the kill plus a small slack, although the dead peer is still in their
directories (a directory forgets an entry only after several refreshes without it): a step's end
waits only for the callers that heard this peer's "done" (a dead one cannot hear it). A peer that
restarts and downloads its stage's state takes its first step in the same time as the others: the
callers that were done with the step before it served say so when it tells them it is done, so it
does not wait for "done" messages that went out before it was there.
"""

from __future__ import annotations

import random

import trio

from p2ptrain import Node, NodeConfig
from p2ptrain.averaging import AveragerConfig
from p2ptrain.averaging.compression import Compression
from p2ptrain.config import parse_config
from p2ptrain.pipeline.catchup import behind, download_state
from p2ptrain.pipeline.peer import PipelinePeer
from p2ptrain.pipeline.router import Candidate
from p2ptrain.pipeline.settings import PipelineSection
from p2ptrain.pipeline.trainer import PipelineOptions, PipelineTrainer
from p2ptrain.pipeline.transfer import state_size
from p2ptrain.tasks import load_task
from tests.harness.identities import identity
from tests.integration.test_pipeline import (
    MODEL,
    PORT,
    SEED,
    Swarm,
    assert_stage_weights_identical,
    one_thread,  # noqa: F401 (its autouse fixture: one torch thread here too)
    pipeline_swarm,
    run_steps,
)

TIMEOUT = 5.0
PIPELINE = PipelineSection(stages=(0, 2), micro_batch=4, compression=Compression.INT8, timeout=TIMEOUT)
SLACK = 2.0  # virtual seconds a step after a kill may take beyond the slowest step before it


async def restart(swarm: Swarm, i: int) -> PipelinePeer:
    """Peer ``i`` comes back (the same identity and address): it announces itself joining, downloads
    its stage's state from the stage's other peer and serves it, as a restarted node does."""
    name = f"p{i}"
    config = NodeConfig(
        run_id="pipe",
        listen=((name, PORT),),
        join=(swarm.peers[0].node.addresses[0],),
        averaging=AveragerConfig(target_size=8, min_size=1, matchmaking_time=2.0),
    )
    node = Node(identity(name), config, transport=swarm.net.transport(name), clock=trio.current_time)
    scope = trio.CancelScope()

    async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            await node.run(task_status=task_status)

    await swarm.nursery.start(run)
    await node.dht.bootstrapped.wait()
    old = swarm.peers[i]
    peer = PipelinePeer(node, PIPELINE, MODEL, seed=SEED, rng=random.Random(i))
    peer.announcing = True
    await peer.refresh()
    stage = old.stage.index
    size = state_size([p for p in peer.prepare(stage).parameters() if p.requires_grad])
    snapshot = await download_state(peer, stage, size)
    await peer.join(stage, snapshot)
    swarm.nursery.start_soon(peer.keep_fresh)
    swarm.peers[i], swarm.scopes[i] = peer, scope
    swarm.dead.discard(i)
    return peer


async def test_no_step_waits_for_a_killed_stage_peer_or_for_its_restart(autojump_clock):
    async with pipeline_swarm(PIPELINE, [0, 1, 0, 1]) as swarm:
        for p in swarm.peers:
            swarm.nursery.start_soon(p.keep_fresh)
        with trio.fail_after(600):
            before = await run_steps(swarm, 2, 2, 4)
            usual = max(r.seconds for step in before for r in step)
            swarm.kill(3)  # stage 1's second peer, between steps: still in everyone's directory
            after = await run_steps(swarm, 2, 2, 4)
            back = await restart(swarm, 3)
            assert back.step_number == swarm.peers[1].step_number
            for p in swarm.alive():  # (what every peer's directory refresh does within its interval)
                await p.refresh()
            rejoined = await run_steps(swarm, 2, 2, 4)
        for step in after:
            assert len(step) == 3
            assert all(r.given_up == 0 and r.average.applied for r in step)
            slowest = max(r.seconds for r in step)
            assert slowest <= usual + SLACK, f"a step after the kill took {slowest:.1f} s, {usual:.1f} before"
        for step in rejoined:
            assert len(step) == 4
            assert all(r.given_up == 0 and r.average.applied for r in step)
            assert all(r.average.members == 2 for r in step), "the restarted peer averages with its mate"
            slowest = max(r.seconds for r in step)
            assert slowest <= usual + SLACK, f"a step after the restart took {slowest:.1f} s"
            for s in (0, 1):  # every sample counted once at every stage
                assert sum(r.counted for r in step if r.stage == s) == 4 * 2 * 4
        assert_stage_weights_identical(swarm)


def forget(peer: PipelinePeer, gone: PipelinePeer) -> None:
    """``peer``'s directory loses ``gone`` (as after its entry expired, before its new one was read)."""
    peer._known.pop(gone.node.peer_id, None)
    peer.directory = [p for p in peer.directory if p.peer != gone.node.peer_id]


async def test_a_restarted_peer_its_mates_do_not_know_yet_sits_out_without_waiting(
    autojump_clock, monkeypatch
):
    async with pipeline_swarm(PIPELINE, [0, 1, 0, 1]) as swarm:
        with trio.fail_after(600):
            before = await run_steps(swarm, 1, 2, 4)
            usual = max(r.seconds for step in before for r in step)
            swarm.kill(3)
            back = await restart(swarm, 3)
            # Its mates do not know it for the whole first step: their reads of the directory miss its
            # entry meanwhile (not yet on the replicas they ask), whenever their reads fall in the step
            # (a read in flight as it restarts would bring it back after ``forget``).
            unaware = [p for p in swarm.alive() if p is not back]
            blind = [True]
            candidates = PipelinePeer.candidates

            def missing_it(self: PipelinePeer, stage: int) -> list[Candidate]:
                found = candidates(self, stage)
                if blind[0] and self in unaware:
                    return [c for c in found if c.peer != back.node.peer_id]
                return found

            monkeypatch.setattr(PipelinePeer, "candidates", missing_it)
            for p in unaware:
                forget(p, back)
            first = (await run_steps(swarm, 1, 2, 4))[0]
            blind[0] = False
            mine = next(r for r in first if r.stage == 1 and not r.average.applied)
            assert behind(back) and back.record().digest == b""
            size = state_size(back.server.params)  # type: ignore[union-attr]
            await back.join(1, await download_state(back, 1, size))
            for p in swarm.alive():
                await p.refresh()
            assert not behind(back)
            then = (await run_steps(swarm, 1, 2, 4))[0]
        assert mine.seconds <= usual + SLACK, f"the restarted peer's first step took {mine.seconds:.1f} s"
        others = [r for r in first if r is not mine]
        assert all(r.average.applied and r.given_up == 0 for r in others)
        assert all(r.average.applied and r.average.members == 2 for r in then)
        assert_stage_weights_identical(swarm)


async def test_a_stage_left_empty_is_refilled_from_a_kept_state_not_from_scratch(autojump_clock, tmp_path):
    """A peer that served a stage before it moved keeps that stage's state on its disk: when the stage
    later loses every peer and this one refills it, it restores that state (said in a warning), not the
    run's initial weights."""
    config = parse_config(
        {
            "task": {"name": "tiny-gpt", "options": {"n_layer": 4, "n_head": 2, "n_embd": 32}},
            "pipeline": {"stages": [0, 2], "micro_batch": 4, "timeout": TIMEOUT},
        }
    )
    task = load_task("tiny-gpt", {"n_layer": 4, "n_head": 2, "n_embd": 32, "max_bytes": 50_000})
    async with pipeline_swarm(PIPELINE, [0, 1, 1]) as swarm:
        with trio.fail_after(300):
            await run_steps(swarm, 2, 1, 4)
            mover = swarm.peers[2]
            trainer = PipelineTrainer(mover.node, config, task, PipelineOptions(data_dir=tmp_path))
            trainer.peer = mover  # (the swarm's peer: the trainer's rules act on it)
            trained = mover.weights_digest()
            trainer._keep(1)  # (what a move away from stage 1 does first)
            await mover.join(0)  # it moved to stage 0 (its state of it does not matter here)
            await swarm.peers[1].leave()  # stage 1's last other peer leaves for good
            swarm.kill(1)
            await trio.sleep(5 * mover.interval)  # (its entry is forgotten after 4 reads without it)
            for p in swarm.alive():
                await p.refresh()
            assert 1 in mover.empty_stages
            await trainer._download_and_join(1)
        assert mover.stage.index == 1
        assert mover.weights_digest() == trained  # the kept state, not the initial weights
        assert mover.step_number == 2


async def test_the_swarm_waits_for_an_empty_stage_instead_of_burning_steps(autojump_clock, caplog):
    """While a stage has no peer, nodes do not run steps whose every micro-batch is given up: they wait
    on their step, say so, and train on once the stage is served again."""
    options = {"n_layer": 4, "n_head": 2, "n_embd": 32, "block_size": 16}
    config = parse_config(
        {
            "task": {"name": "tiny-gpt", "options": options},
            "training": {"batch_size": 8},
            "pipeline": {"stages": [0, 2], "micro_batch": 4, "timeout": TIMEOUT},
        }
    )
    task = load_task("tiny-gpt", {**options, "max_bytes": 50_000})
    async with pipeline_swarm(PIPELINE, [0, 1, 0, 1]) as swarm:
        with trio.fail_after(600):
            await run_steps(swarm, 1, 1, 4)
            for i in (1, 3):  # stage 1's two peers leave
                await swarm.peers[i].leave()
                swarm.kill(i)
            await trio.sleep(5 * swarm.peers[0].interval)  # (their entries are forgotten)
            stay = [swarm.peers[0], swarm.peers[2]]
            trainers = []
            for p in stay:
                t = PipelineTrainer(p.node, config, task, PipelineOptions(max_steps=3, interval=2.0))
                t.peer = p
                trainers.append(t)
            async with trio.open_nursery() as nursery:
                for t in trainers:
                    nursery.start_soon(t._loop)
                await trio.sleep(40)
                assert all(t.step == 1 and t.waiting == [1] for t in trainers)
                assert all(p.router is not None and p.router.stats.given_up == 0 for p in stay)
                back = await restart_fresh(swarm, 3, stage=1, step=1)
                t = PipelineTrainer(back.node, config, task, PipelineOptions(max_steps=3, interval=2.0))
                t.peer = back
                trainers.append(t)
                nursery.start_soon(t._loop)
        assert all(t.step == 3 and not t.waiting for t in trainers)
        assert all(p.router is not None and p.router.stats.given_up == 0 for p in stay)
        assert "no peer serves stage 1, so no micro-batch can pass" in caplog.text


async def restart_fresh(swarm: Swarm, i: int, *, stage: int, step: int) -> PipelinePeer:
    """Peer ``i`` comes back serving ``stage`` from ``step`` with the run's initial weights (its stage had
    no peer to download from)."""
    name = f"p{i}"
    config = NodeConfig(
        run_id="pipe",
        listen=((name, PORT),),
        join=(swarm.peers[0].node.addresses[0],),
        averaging=AveragerConfig(target_size=8, min_size=1, matchmaking_time=2.0),
    )
    node = Node(identity(name), config, transport=swarm.net.transport(name), clock=trio.current_time)
    await swarm.nursery.start(node.run)
    await node.dht.bootstrapped.wait()
    peer = PipelinePeer(node, PIPELINE, MODEL, seed=SEED, rng=random.Random(i))
    peer.step_number = step
    await peer.join(stage)
    swarm.nursery.start_soon(peer.keep_fresh)
    swarm.peers[i] = peer
    swarm.dead.discard(i)
    return peer
