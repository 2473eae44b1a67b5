"""Pipelines over the swarm, end to end: Nodes over the in-memory network on the virtual clock, each
serving one stage of a small GPT and sending its own micro-batches through the pipeline.

What is proved here: a pipeline of 2-4 stages trains and every stage's peers end each step with
identical weights; the pipelined forward and backward give the unsplit model's gradients (to float
rounding without compression, within the int8 error with it), and its steps the unsplit, tied model's
(stage 0's embedding and the last stage's head stay one tensor); a stage peer killed in the middle of a
micro-batch costs a retry, not a step, and no sample is counted twice; a stage peer that returns garbage
(NaN, infinities, wrong shapes, wrong sizes, huge values, subtly wrong values caught by duplicated
micro-batches) is dropped and reported, in seeded random mixes.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
import torch
import trio

from p2ptrain import Node, NodeConfig
from p2ptrain.averaging import AveragerConfig
from p2ptrain.averaging.compression import Compression
from p2ptrain.net import CallContext, LinkProfile, MemoryNetwork, RpcStream
from p2ptrain.pipeline import codec
from p2ptrain.pipeline.peer import PipelinePeer
from p2ptrain.pipeline.protocol import BACKWARD, FORWARD, BackwardReq, BackwardResp, ForwardReq, ForwardResp
from p2ptrain.pipeline.settings import PipelineSection
from p2ptrain.pipeline.stages import stage_loss
from p2ptrain.pipeline.stagewise import StageAverage, tie_ends
from p2ptrain.tasks.gpt import GPT, GPTConfig
from tests.harness.identities import identity

MODEL = GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=2, n_embd=32)
SEED = 11
PORT = 3500


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: torch's threads would only contend with each other on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@dataclass
class Swarm:
    net: MemoryNetwork
    nursery: trio.Nursery
    peers: list[PipelinePeer] = field(default_factory=list)
    scopes: list[trio.CancelScope] = field(default_factory=list)
    dead: set[int] = field(default_factory=set)
    steps: dict[int, trio.CancelScope] = field(default_factory=dict)  # each peer's step in progress

    def kill(self, i: int) -> None:
        """As if peer i's process died: its connections reset, its tasks cancelled."""
        self.dead.add(i)
        self.net.kill(f"p{i}")
        self.scopes[i].cancel()
        if i in self.steps:
            self.steps[i].cancel()

    def alive(self) -> list[PipelinePeer]:
        return [p for i, p in enumerate(self.peers) if i not in self.dead]

    def by_stage(self) -> dict[int, list[PipelinePeer]]:
        out: dict[int, list[PipelinePeer]] = {}
        for p in self.alive():
            out.setdefault(p.stage.index, []).append(p)
        return out


@asynccontextmanager
async def pipeline_swarm(
    pipeline: PipelineSection, stages: list[int | None], *, seed: int = 0
) -> AsyncIterator[Swarm]:
    net = MemoryNetwork(seed=seed, default=LinkProfile(latency=0.01))
    avg = AveragerConfig(target_size=8, min_size=1, matchmaking_time=2.0)
    async with trio.open_nursery() as nursery:
        swarm = Swarm(net, nursery)
        nodes: list[Node] = []
        for i, stage in enumerate(stages):
            config = NodeConfig(
                run_id="pipe",
                listen=((f"p{i}", PORT),),
                join=(nodes[0].addresses[0],) if nodes else (),
                averaging=avg,
            )
            node = Node(identity(f"p{i}"), config, transport=net.transport(f"p{i}"), clock=trio.current_time)
            scope = trio.CancelScope()
            peer = PipelinePeer(
                node, pipeline, MODEL, seed=SEED, stage=stage, rng=random.Random(seed * 100 + i)
            )

            async def run(
                node: Node = node,
                peer: PipelinePeer = peer,
                scope: trio.CancelScope = scope,
                task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
            ) -> None:
                with scope:
                    async with trio.open_nursery() as inner:
                        await inner.start(node.run)
                        await node.dht.bootstrapped.wait()
                        await inner.start(peer.run)
                        task_status.started()

            nodes.append(node)
            await nursery.start(run)
            swarm.peers.append(peer)
            swarm.scopes.append(scope)
        for p in swarm.peers:
            await p.refresh()
        yield swarm
        nursery.cancel_scope.cancel()


def batches(seed: int, n: int, b: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        data = torch.randint(0, MODEL.vocab_size, (b, MODEL.block_size + 1), generator=g)
        out.append((data[:, :-1], data[:, 1:]))
    return out


async def run_steps(
    swarm: Swarm, steps: int, per_peer: int, b: int, *, data: Callable[[int, int], int] | None = None
):
    reports = []
    for step in range(steps):
        peers = swarm.alive()
        out = [None] * len(peers)

        async def one(k: int, p: PipelinePeer, step: int = step, out: list = out) -> None:
            seed = data(step, k) if data else 1000 * step + k
            with trio.CancelScope() as scope:  # (cancelled if the peer is killed: its process died)
                swarm.steps[swarm.peers.index(p)] = scope
                out[k] = await p.step(batches(seed, per_peer, b))  # type: ignore[call-overload]

        async with trio.open_nursery() as nursery:
            for k, p in enumerate(peers):
                nursery.start_soon(one, k, p)
        reports.append([r for r in out if r is not None])
    return reports


def assert_stage_weights_identical(swarm: Swarm) -> None:
    for stage, peers in swarm.by_stage().items():
        digests = {p.weights_digest() for p in peers}
        assert len(digests) == 1, f"stage {stage}'s peers hold different weights"


@pytest.mark.parametrize(
    ("bounds", "stages"), [((0, 2), [0, 1, 0, 1]), ((0, 1, 2, 3), [0, 1, 2, 3, 0, 1, 2, 3])]
)
async def test_a_pipeline_trains_and_every_stage_peer_holds_the_same_weights(autojump_clock, bounds, stages):
    pipeline = PipelineSection(stages=bounds, micro_batch=4, compression=Compression.INT8)
    async with pipeline_swarm(pipeline, stages) as swarm:
        with trio.fail_after(600):
            # the same data every step: the loss must fall
            reports = await run_steps(swarm, 3, 2, 4, data=lambda step, k: k)
        total = len(stages) * 2 * 4
        for step in reports:
            assert all(r.average.applied for r in step)
            assert all(r.given_up == 0 for r in step)
            for s in range(len(bounds)):  # every sample counted once at every stage
                assert sum(r.counted for r in step if r.stage == s) == total
        assert_stage_weights_identical(swarm)
        losses = [sum(sum(r.losses) for r in step) / sum(len(r.losses) for r in step) for step in reports]
        assert losses[-1] < losses[0] - 0.05, losses


@pytest.mark.parametrize("mode", [Compression.NONE, Compression.INT8])
async def test_the_pipelined_gradients_are_the_unsplit_models(autojump_clock, mode):
    pipeline = PipelineSection(stages=(0, 1, 3), micro_batch=4, compression=mode)
    data = batches(5, 3, 4)
    async with pipeline_swarm(pipeline, [0, 1, 2]) as swarm:
        caller = swarm.peers[1]
        assert caller.router is not None
        with trio.fail_after(60):
            for x, y in data:
                result = await caller.router.run(0, x, y)
                assert result.loss is not None and all(result.committed)
        means = {p.stage.index: p.server.close_step() for p in swarm.peers if p.server is not None}
    torch.manual_seed(SEED)
    full = GPT(MODEL)
    x = torch.cat([d[0] for d in data])
    y = torch.cat([d[1] for d in data])
    stage_loss(full(x), y).backward()
    exact = mode is Compression.NONE
    tol = {"rtol": 1e-5, "atol": 1e-6} if exact else {"rtol": 0.05, "atol": 2e-3}
    for stage, (grads, counted) in means.items():
        assert counted == 12
        peer = next(p for p in swarm.peers if p.stage.index == stage)
        names = [n for n, _ in peer.stage.named_parameters()]
        for name, g in zip(names, grads, strict=True):
            if name.startswith("blocks."):
                i = int(name.split(".")[1]) + peer.stage.first_layer
                ref = full.get_parameter(f"blocks.{i}." + name.split(".", 2)[2]).grad
            elif name in ("lm_head.weight", "wte.weight"):
                continue  # (untied: their sum is the tied weight's gradient, checked below)
            else:
                ref = full.get_parameter(name).grad
            assert ref is not None
            torch.testing.assert_close(g, ref, **tol, msg=f"stage {stage} {name}")

    def grad_of(stage: int, name: str) -> torch.Tensor:
        peer = next(p for p in swarm.peers if p.stage.index == stage)
        names = [n for n, _ in peer.stage.named_parameters()]
        return means[stage][0][names.index(name)]

    wte = grad_of(0, "wte.weight") + grad_of(2, "lm_head.weight")  # the embedding + the untied head
    assert full.wte.weight.grad is not None
    torch.testing.assert_close(wte, full.wte.weight.grad, **tol)


async def test_a_pipeline_trains_the_tied_unsplit_model(autojump_clock):
    """Stage 0's embedding and the last stage's head stay one tensor (both ends apply the sum of their
    gradients every step), so the pipeline's steps are the unsplit, tied model's: the same weights, to
    float rounding, after two steps (two copies trained apart part at once: by about lr per step)."""
    pipeline = PipelineSection(stages=(0, 2), micro_batch=4, compression=Compression.NONE)
    async with pipeline_swarm(pipeline, [0, 1, 0, 1]) as swarm:
        with trio.fail_after(300):
            reports = await run_steps(swarm, 2, 2, 4)
        for step in reports:
            assert all(r.tied is not None and r.tied.applied for r in step), [r.tied for r in step]
        assert_stage_weights_identical(swarm)
        first, last = (swarm.by_stage()[s][0].stage for s in (0, 1))
        assert first.wte is not None and last.lm_head is not None
        assert torch.equal(first.wte.weight, last.lm_head.weight)
        lr = swarm.peers[0].lr
    torch.manual_seed(SEED)
    full = GPT(MODEL)
    opt = torch.optim.AdamW(full.parameters(), lr=lr, weight_decay=0.0)
    for step in range(2):
        data = [b for k in range(4) for b in batches(1000 * step + k, 2, 4)]
        x, y = torch.cat([d[0] for d in data]), torch.cat([d[1] for d in data])
        stage_loss(full(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for stage in (first, last):
        for name, p in stage.named_parameters():
            if name.startswith("blocks."):
                i = int(name.split(".")[1]) + stage.first_layer
                name = f"blocks.{i}." + name.split(".", 2)[2]
            ref = full.wte.weight if name == "lm_head.weight" else full.get_parameter(name)
            torch.testing.assert_close(p, ref, rtol=0, atol=2e-5, msg=name)


async def test_the_tied_round_sums_gradients_of_different_sizes_and_skips_together(autojump_clock):
    """The head's gradient is far larger than the embedding's (~60x measured): brought as they are, the
    round's reducers refused each other's slices and banned honest peers. Scaled, the round sums them
    on every member; a member whose stage skips the step makes every member skip."""
    pipeline = PipelineSection(stages=(0, 2), micro_batch=4, compression=Compression.NONE)
    g = torch.Generator().manual_seed(3)
    first = torch.randn(64, 32, generator=g) * 1e-3
    first[5:] = 0  # (an embedding's gradient: rows of the tokens seen only)
    last = torch.randn(64, 32, generator=g) * 0.1
    async with pipeline_swarm(pipeline, [0, 1, 0, 1]) as swarm:
        ids = [p.node.identity.peer_id for p in swarm.peers]
        groups = [{ids[0], ids[2]}, {ids[1], ids[3]}, {ids[0], ids[2]}, {ids[1], ids[3]}]
        for step, skipping in ((0, None), (1, 3)):
            grads = [(first if i % 2 == 0 else last).clone() for i in range(4)]
            out: list[StageAverage | None] = [None] * 4

            async def one(i: int, step: int, grads: list, out: list, skipping: int | None) -> None:
                out[i] = await tie_ends(
                    swarm.peers[i].node.averager,
                    step,
                    grads[i],
                    group=groups[i],
                    steps=i != skipping,
                    members=4,
                    timeout=30.0,
                )

            with trio.fail_after(120):
                async with trio.open_nursery() as nursery:
                    for i in range(4):
                        nursery.start_soon(one, i, step, grads, out, skipping)
            assert all(r is not None and r.applied == (skipping is None) for r in out), out
            if skipping is None:
                for t in grads:
                    torch.testing.assert_close(t, first + last, rtol=1e-5, atol=1e-8)


async def test_a_stage_peer_killed_mid_micro_batch_costs_a_retry_not_a_step(autojump_clock):
    pipeline = PipelineSection(stages=(0, 1, 3), micro_batch=4, compression=Compression.INT8, timeout=5.0)
    # stage 1 has two peers: p1 dies during its first backward
    async with pipeline_swarm(pipeline, [0, 1, 2, 1]) as swarm:
        victim = swarm.peers[1]
        assert victim.server is not None
        stalled = trio.Event()

        async def die_in_backward(phase: str) -> None:
            if phase == "backward":
                stalled.set()
                await trio.sleep_forever()

        victim.server.fault = die_in_backward

        async def killer() -> None:
            await stalled.wait()
            await trio.sleep(0.5)
            swarm.kill(1)

        swarm.nursery.start_soon(killer)
        with trio.fail_after(300):
            reports = await run_steps(swarm, 2, 2, 4)
    assert 1 in swarm.dead
    first = reports[0]
    assert all(r.given_up == 0 for r in first), "no micro-batch was lost"
    assert sum(r.retries for r in first) >= 1
    assert len(first) == 3  # the victim's own step died with it
    for s in range(3):
        counted = sum(r.counted for r in first if r.stage == s)
        # every sample the survivors sent counted once at each stage, never twice (the victim's own
        # micro-batches may have been counted at some stages before it died: at most once as well)
        assert 3 * 2 * 4 <= counted <= 4 * 2 * 4, (s, counted)
    assert all(r.average.applied for step in reports for r in step)
    assert_stage_weights_identical(swarm)


def hostile_forward(peer: PipelinePeer, kind: str, rng: random.Random) -> None:
    """Make ``peer``'s stage server answer forwards with garbage of ``kind``."""
    server = peer.server
    assert server is not None
    mode = server.pipeline.compression

    async def bad(ctx: CallContext, req: ForwardReq, stream: RpcStream) -> ForwardResp:
        body = await stream.receive_all(1 << 24)
        resp, out = await server.local_forward(ctx.peer, req, body)
        t = codec.decode_tensor(out, mode, tuple(resp.shape), 1e30, "own")
        shape = tuple(resp.shape)
        if kind == "nan":  # the first value (raw) or the first block's scale (int8) is NaN
            b = bytearray(bytes(out))
            b[:4] = torch.tensor([float("nan")]).numpy().tobytes()
            data = bytes(b)
        elif kind == "shape":
            shape = (*shape[:-1], shape[-1] + 1)
            data = bytes(out)
        elif kind == "size":
            data = bytes(out)[: -1 - rng.randrange(8)]
        elif kind == "huge":
            data = bytes(codec.encode_tensor(t * 1e7, mode))
        else:  # "subtle": finite, in bounds, the right shape: only a duplicate catches it
            data = bytes(codec.encode_tensor(t + 0.5 * t.std() * torch.randn_like(t), mode))
        await stream.send(data)
        await stream.send_eof()
        return ForwardResp(shape, resp.loss)

    peer.node.registry.replace(FORWARD, bad)


@pytest.mark.parametrize("seed", [0, 2, 4])  # every kind of garbage, alone or with another
async def test_stage_peers_that_return_garbage_are_dropped_and_reported(autojump_clock, seed):
    rng = random.Random(seed)
    kinds = ["nan", "shape", "size", "huge", "subtle"]
    # 3 stages, three peers each for stages 0 and 1: a third peer settles a duplicate's mismatch
    stages = [0, 1, 2, 0, 1, 2, 0, 1]
    pipeline = PipelineSection(
        stages=(0, 1, 3), micro_batch=4, compression=Compression.INT8, check_fraction=1.0, timeout=5.0
    )
    async with pipeline_swarm(pipeline, stages, seed=seed) as swarm:
        # one or two hostile peers, in stages 0 or 1 (never the only honest peer of a stage)
        hostile = {rng.choice([3, 6]): rng.choice(kinds)}
        if rng.random() < 0.5:
            hostile[rng.choice([4, 7])] = rng.choice(kinds)
        for i, kind in hostile.items():
            hostile_forward(swarm.peers[i], kind, rng)
        with trio.fail_after(300):
            reports = await run_steps(swarm, 2, 1, 4)
        bad_ids = {swarm.peers[i].node.identity.peer_id for i in hostile}
        banned_by = {}
        for i, p in enumerate(swarm.peers):
            assert p.router is not None
            bans = set(p.router.stats.bans)
            assert not bans - bad_ids, f"peer {i} dropped an honest peer: {p.router.stats.bans}"
            for b in bans:
                banned_by.setdefault(b, []).append(i)
        assert set(banned_by) == bad_ids, (hostile, banned_by)
        for step in reports:
            assert all(r.average.applied for r in step)
            assert sum(r.given_up for r in step) == 0
        # the honest peers of every stage hold identical weights (the hostile ones average honestly)
        assert_stage_weights_identical(swarm)


async def test_a_stage_whose_last_peer_left_is_said_out_loud_and_costs_no_hang(autojump_clock, caplog):
    pipeline = PipelineSection(stages=(0, 2), micro_batch=4, compression=Compression.INT8, timeout=5.0)
    async with pipeline_swarm(pipeline, [0, 1, 0]) as swarm:
        swarm.kill(1)  # stage 1's only peer
        with trio.fail_after(300):
            await trio.sleep(60)  # its directory entry expires; the others' refreshes notice
            assert all(p.empty_stages == [1] for p in swarm.alive())
            reports = await run_steps(swarm, 1, 1, 4)
    assert "no peer serves stage 1" in caplog.text
    step = reports[0]
    assert len(step) == 2 and all(r.given_up == 1 and not r.losses for r in step)
    assert all(r.average.applied and r.counted == 0 for r in step)  # nothing passed: nothing counted
    assert_stage_weights_identical(swarm)


async def test_a_stage_peer_whose_backward_lies_subtly_is_caught_by_duplication(autojump_clock):
    # 3 stages, stage 1 has three peers: p4 answers forwards honestly and backwards with noise
    pipeline = PipelineSection(
        stages=(0, 1, 3), micro_batch=4, compression=Compression.INT8, check_fraction=1.0, timeout=5.0
    )
    async with pipeline_swarm(pipeline, [0, 1, 2, 1, 1]) as swarm:
        liar = swarm.peers[4]
        server = liar.server
        assert server is not None

        async def bad(ctx: CallContext, req: BackwardReq, stream: RpcStream) -> BackwardResp:
            body = await stream.receive_all(1 << 24)
            resp, out = await server.local_backward(ctx.peer, req, body)
            t = codec.decode_tensor(out, Compression.INT8, tuple(resp.shape), 1e30, "own")
            await stream.send(codec.encode_tensor(t + 0.5 * t.std() * torch.randn_like(t), Compression.INT8))
            await stream.send_eof()
            return resp

        liar.node.registry.replace(BACKWARD, bad)
        with trio.fail_after(300):
            reports = await run_steps(swarm, 2, 2, 4)
        routers = [p.router for i, p in enumerate(swarm.peers) if i != 4]
        assert all(r is not None for r in routers)
        assert any(liar.node.identity.peer_id in r.stats.bans for r in routers if r is not None)
        assert all(set(r.stats.bans) <= {liar.node.identity.peer_id} for r in routers if r is not None)
        assert all(r.average.applied for step in reports for r in step)
        assert_stage_weights_identical(swarm)
