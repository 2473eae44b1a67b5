"""DiLoCo per pipeline stage: a stage's peers take inner steps alone and average their pseudo-gradients
every ``pipeline.local_steps`` steps with the stage-wise all-reduce, through DiLoCo's outer optimizer.

What is proved here (Nodes over the in-memory network on the virtual clock): between outer steps a
stage's peers hold different local weights and the same global ones; after every outer step every peer
of a stage holds the same weights, local and global; the tied embedding's two copies (stage 0's and the
last stage's) are equal, value and outer momentum, after every outer step, and when the two ends' tied
round does not apply neither copy moves; duplicated micro-batches run only on the first
inner step after an outer step (when a stage's peers agree) and find no mismatch; a run file with
``[pipeline]`` and ``training.mode = "diloco"`` builds a DiLoCo pipeline peer and its nodes train.
"""

from __future__ import annotations

import torch
import trio

from p2ptrain.averaging.compression import Compression
from p2ptrain.config import DilocoSection, parse_config
from p2ptrain.pipeline.peer import PipelinePeer
from p2ptrain.pipeline.settings import PipelineSection
from p2ptrain.pipeline.stages import tied_index
from p2ptrain.pipeline.trainer import PipelineOptions, PipelineTrainer
from p2ptrain.tasks import load_task
from tests.integration.test_pipeline import (
    Swarm,
    assert_stage_weights_identical,
    one_thread,
    pipeline_swarm,
    run_steps,
)

__all__ = ["one_thread"]  # (the fixture: tiny matrices on one thread)

H = 2


def local_digests(peers: list[PipelinePeer]) -> set[bytes]:
    out = set()
    for p in peers:
        flat = torch.cat([t.detach().reshape(-1) for t in p.stage.parameters() if t.requires_grad])
        out.add(flat.numpy().tobytes())
    return out


def tied_copies(peers: list[PipelinePeer]) -> list[torch.Tensor]:
    """Every peer's local copy of the tied embedding (stage 0's embedding, the last stage's head)."""
    return [p.stage.wte.weight if p.stage.wte is not None else p.stage.lm_head.weight for p in peers]  # type: ignore[union-attr]


def tied_outer(peer: PipelinePeer) -> tuple[torch.Tensor, torch.Tensor]:
    """A peer's global copy of the tied embedding and its outer momentum."""
    i = tied_index(peer.stage)
    assert i is not None and peer.outer is not None
    return peer.outer.global_params[i], peer.outer.momentum[i]


async def as_diloco(swarm: Swarm) -> None:
    for p in swarm.peers:
        p.diloco, p.local_steps = DilocoSection(outer_lr=0.7, outer_momentum=0.9), H
        await p.join(p.stage.index)  # (the same stage: rebuilt with its outer state)


async def test_stage_peers_hold_identical_weights_after_every_outer_step(autojump_clock):
    pipeline = PipelineSection(stages=(0, 2), micro_batch=4, compression=Compression.INT8, check_fraction=0.5)
    async with pipeline_swarm(pipeline, [0, 1, 0, 1]) as swarm:
        await as_diloco(swarm)
        with trio.fail_after(600):
            for step in range(2 * H):
                reports = (await run_steps(swarm, 1, 2, 4, data=lambda s, k, step=step: 100 * step + k))[0]
                assert all(r.given_up == 0 for r in reports)
                outer = (step + 1) % H == 0
                for stage, peers in swarm.by_stage().items():
                    assert len({p.weights_digest() for p in peers}) == 1, (step, stage)  # global weights
                    same = len(local_digests(peers)) == 1
                    assert same == outer, (step, stage, "local weights")
                    if outer:
                        assert all(r.average.members == 2 for r in reports if r.stage == stage)
                        assert all(p.optimizer is not None for p in peers)
                        assert all(p.outer is not None and p.outer.momentum for p in peers)
                        # local = global after the outer step, on every peer
                        for p in peers:
                            assert p.outer is not None
                            for g, t in zip(p.outer.global_params, p.outer.params, strict=True):
                                assert torch.equal(g, t)
                # the tied embedding: stage 0's copy and the last stage's, equal on every peer of both
                # ends after every outer step (their inner steps are their own: apart in between)
                copies = tied_copies(swarm.peers)
                assert all(torch.equal(c, copies[0]) for c in copies) == outer, (step, "tied copies")
                if outer:
                    assert all(r.tied is not None and r.tied.applied and r.tied.members == 4 for r in reports)
                    # the same value into the same outer state: global copies and momentum equal too
                    states = [tied_outer(p) for p in swarm.peers]
                    for value, momentum in states:
                        assert torch.equal(value, copies[0]) and torch.equal(momentum, states[0][1])
                    assert bool(states[0][1].abs().sum() > 0)
                else:
                    assert all(r.tied is None for r in reports)
        stats = [p.router.stats for p in swarm.peers if p.router is not None]
        assert sum(s.checks for s in stats) > 0
        assert sum(s.mismatches for s in stats) == 0


async def test_a_joiner_gets_the_global_weights_and_outer_momentum(autojump_clock):
    """The state a joiner downloads in a DiLoCo run is the stage's global weights and outer momentum."""
    pipeline = PipelineSection(stages=(0, 2), micro_batch=4, compression=Compression.INT8)
    async with pipeline_swarm(pipeline, [0, 1, 0, 1]) as swarm:
        await as_diloco(swarm)
        with trio.fail_after(600):
            await run_steps(swarm, H + 1, 1, 4)  # one outer step, then one inner step
            donor, other = swarm.peers[0], swarm.peers[2]
            assert donor.outer is not None
            await other.join(0, donor.state_snapshot())
        assert other.outer is not None
        assert other.weights_digest() == donor.weights_digest()
        for a, b in zip(other.outer.momentum, donor.outer.momentum, strict=True):
            assert torch.equal(a, b) and bool(a.abs().sum() > 0)
        for g, t in zip(other.outer.global_params, other.outer.params, strict=True):
            assert torch.equal(g, t)


async def test_a_pipeline_run_file_in_diloco_mode_trains(autojump_clock):
    options = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16}
    config = parse_config(
        {
            "task": {"name": "tiny-gpt", "options": options},
            "training": {"mode": "diloco", "batch_size": 8, "max_steps": 4, "warmup_steps": 0},
            "pipeline": {"stages": [0, 1], "micro_batch": 4, "local_steps": H, "timeout": 5.0},
        }
    )
    task = load_task("tiny-gpt", {**options, "max_bytes": 50_000})
    pipeline = config.pipeline
    async with pipeline_swarm(pipeline, [0, 1, 0, 1]) as swarm:
        trainers = []
        for p in swarm.peers:
            t = PipelineTrainer(p.node, config, task, PipelineOptions(interval=1.0))
            assert t.peer.diloco == config.diloco and t.peer.local_steps == H  # (the run file's)
            p.diloco, p.local_steps = t.peer.diloco, t.peer.local_steps
            t.peer = p  # (the swarm's peer, already serving its stage: the trainer's loop drives it)
            await p.join(p.stage.index)
            trainers.append(t)
        with trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                for t in trainers:
                    nursery.start_soon(t._loop)
        for t in trainers:
            assert t.step == 4 and t.loss is not None
        for stage in (0, 1):
            peers = [t.peer for t in trainers if t.peer.stage.index == stage]
            assert len(peers) == 2 and len({p.weights_digest() for p in peers}) == 1
            assert len(local_digests(peers)) == 1


async def test_an_outer_step_whose_tied_round_does_not_apply_moves_neither_copy(autojump_clock, monkeypatch):
    """When the two ends' tied round does not apply (it aborted: on every member alike), each stage
    takes its outer step on every other tensor, and neither end moves its copy of the tied embedding,
    nor its outer momentum: the copies stay equal."""
    from p2ptrain.pipeline import peer as peer_module
    from p2ptrain.pipeline.stagewise import StageAverage

    async def aborted(*args, **kwargs) -> StageAverage:
        return StageAverage(False, 0, 0.0, "aborted (test)")

    pipeline = PipelineSection(stages=(0, 2), micro_batch=4, compression=Compression.INT8)
    async with pipeline_swarm(pipeline, [0, 1, 0, 1]) as swarm:
        await as_diloco(swarm)
        with trio.fail_after(600):
            await run_steps(swarm, H, 1, 4)  # one outer step, tied
            before = [(v.clone(), m.clone()) for v, m in (tied_outer(p) for p in swarm.peers)]
            others = [p.weights_digest() for p in swarm.peers]
            monkeypatch.setattr(peer_module, "tie_ends", aborted)
            reports = (await run_steps(swarm, H, 1, 4))[-1]  # the next outer step: its tied round aborts
        assert all(r.average.applied and r.tied is not None and not r.tied.applied for r in reports)
        for p, (value, momentum), digest in zip(swarm.peers, before, others, strict=True):
            now_value, now_momentum = tied_outer(p)
            assert torch.equal(now_value, value) and torch.equal(now_momentum, momentum)
            assert p.weights_digest() != digest  # (the stage's other tensors took their outer step)
        copies = tied_copies(swarm.peers)
        assert all(torch.equal(c, copies[0]) for c in copies)
        assert_stage_weights_identical(swarm)
